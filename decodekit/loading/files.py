"""Where a model's files come from: a local directory as it is, or a Hub repository's files fetched with
huggingface_hub; the checks of the names and choices that say which."""

from __future__ import annotations

import os
from pathlib import Path

from ..facade import BACKENDS

# What a model load needs from a Hub repository; custom_generate/ is fetched separately, and only on request.
MODEL_FILE_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "custom_generate/**",  # fetched, never run without trust_remote_code
]


def check_model_name(name_or_path) -> None:
    """ValueError naming the argument for what no directory, file or Hub repo id can be."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ValueError(
            f"pretrained_model_name_or_path={name_or_path!r} is invalid; expected a model directory, a "
            "GGUF file or a Hub repo id 'org/name'."
        )
    if len(str(name_or_path)) > 4096:
        raise ValueError(
            f"pretrained_model_name_or_path is {len(str(name_or_path))} characters long, longer than any "
            "path or Hub repo id (at most 4096)."
        )


def resolve_model_dir(
    name_or_path: str | os.PathLike,
    revision: str | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    allow_patterns: list[str] | None = None,
) -> Path:
    """A local directory as is, or a Hub repo id downloaded (or found in the cache) with huggingface_hub."""
    check_model_name(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"{name!r} is not a model directory, and not a Hub repo id of the form 'org/name'.")
    from huggingface_hub import snapshot_download

    from ..hub_loader.reach import hub_download

    with hub_download(name):
        return Path(
            snapshot_download(
                repo_id=name,
                revision=revision,
                allow_patterns=allow_patterns or MODEL_FILE_PATTERNS,
                local_files_only=local_files_only,
                token=token,
            )
        )


def check_backend(backend) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"backend={backend!r} is invalid; expected one of {list(BACKENDS)} or None (native where "
            "decodekit has the architecture, transformers otherwise)."
        )
