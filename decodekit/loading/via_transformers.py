"""Loading through transformers: the models and tokenizers decodekit does not build natively.

decodekit.AutoModelForCausalLM and AutoTokenizer decide the backend (pretrained.py); this module does the
transformers side, so that the Hub download, the dtype rules and the trust gate for a
repository's custom_generate/ are the same whichever backend loads the weights.
"""

from __future__ import annotations

import logging
import os

import torch

from ..facade.transformers_model import require_transformers

logger = logging.getLogger("decodekit")


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype,
    device,
    revision=None,
    token=None,
    local_files_only: bool = False,
    gguf_file: str | None = None,
    trust_remote_code=None,
    **transformers_kwargs,
):
    """A transformers AutoModelForCausalLM, in eval mode. `transformers_kwargs` (device_map, quantization_config,
    attn_implementation, ...) go to transformers' from_pretrained. `trust_remote_code` also lets a repository's
    own modeling code run, as it does in transformers."""
    transformers = require_transformers()
    options = dict(
        revision=revision,
        token=token,
        local_files_only=local_files_only,
        dtype=dtype,
        trust_remote_code=bool(trust_remote_code),
        **transformers_kwargs,
    )
    if gguf_file is not None:
        options["gguf_file"] = gguf_file
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(name_or_path), **options)
    except ValueError as error:
        raise ValueError(f"transformers cannot load {str(name_or_path)!r} as a causal LM: {error}") from error
    if device is not None and "device_map" not in transformers_kwargs:
        model = model.to(device)
    return model.eval()


def load_tokenizer(
    name_or_path: str | os.PathLike,
    *,
    revision=None,
    token=None,
    local_files_only: bool = False,
    gguf_file: str | None = None,
    padding_side: str = "left",
    **transformers_kwargs,
):
    """transformers' AutoTokenizer for `name_or_path`, padding on the left as decoder-only generation needs."""
    transformers = require_transformers()
    options = dict(revision=revision, token=token, local_files_only=local_files_only, **transformers_kwargs)
    if gguf_file is not None:
        options["gguf_file"] = gguf_file
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(name_or_path), **options)
    tokenizer.padding_side = padding_side
    return tokenizer
