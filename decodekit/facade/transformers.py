"""What the facade needs to know of a transformers model: whether an object is one, whether it can generate, the
generation config it carries and the caches transformers lays out for it. transformers is imported only here, and
only when such a model is handed over."""

from __future__ import annotations

import logging
import sys
from typing import Any

from ..core.config import GenerationConfig, accepted_fields

logger = logging.getLogger("decodekit")

TRANSFORMERS_EXTRA = "pip install 'decodekit[transformers]'"


def require_transformers():
    """The transformers module, or ImportError naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"This needs transformers, which is not installed; install it with:\n    {TRANSFORMERS_EXTRA}") from None
    return transformers


def is_transformers_model(obj: Any) -> bool:
    """Whether `obj` is a transformers PreTrainedModel (without importing transformers when it is not loaded)."""
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(obj, PreTrainedModel)


def check_causal_lm(model: Any) -> None:
    """ValueError unless the transformers `model` is a decoder-only model with a language-modelling head."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model; decodekit generates with decoder-only models only "
            "(causal LMs such as GPT2LMHeadModel, LlamaForCausalLM)."
        )
    if not model.can_generate() or model.get_output_embeddings() is None:
        raise ValueError(
            f"{type(model).__name__} is not a causal language model (it has no language-modelling head); load the "
            "model with transformers.AutoModelForCausalLM."
        )


def generation_config_from(hf_generation_config, model_config) -> GenerationConfig:
    """A decodekit GenerationConfig from a transformers GenerationConfig (or None): every field decodekit knows
    that it sets (eos/pad/bos, sampling defaults, max_length), with `model_config`'s special tokens where it has
    none."""
    known = accepted_fields()
    hf = hf_generation_config.to_dict() if hf_generation_config is not None else {}
    fields = {k: v for k, v in hf.items() if k in known and v is not None}
    text_config = model_config.get_text_config(decoder=True)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if name not in fields and getattr(text_config, name, None) is not None:
            fields[name] = getattr(text_config, name)
    implementation = fields.get("cache_implementation")
    if implementation not in (None, "static", "dynamic"):
        # transformers' layouts (hybrid, sliding_window) are what DynamicCache(config) builds from the config.
        logger.info("cache_implementation=%r of the generation config is read as the cache the model's "
                    "config describes", implementation)
        fields.pop("cache_implementation")
    return GenerationConfig(**fields)


def make_cache(model, kind: str, max_length: int):
    """A transformers Cache laid out as `model`'s config asks (sliding-window and hybrid layers included), or None
    for a model that keeps a cache of its own kind (state-space models)."""
    from transformers import DynamicCache, StaticCache

    if not model._supports_default_dynamic_cache():
        return None
    config = model.config.get_text_config(decoder=True)
    if kind == "static":
        return StaticCache(config=config, max_cache_len=max_length)
    return DynamicCache(config=config)
