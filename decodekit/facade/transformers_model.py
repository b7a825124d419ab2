"""What the facade needs to know of a transformers model: whether an object is one, whether it can generate, the
generation config it carries and the caches transformers lays out for it. transformers is imported only here, and
only when such a model is handed over."""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

import torch

from ..core.config import GenerationConfig, accepted_fields

logger = logging.getLogger("decodekit")

TRANSFORMERS_EXTRA = "pip install 'decodekit[transformers]'"


def require_transformers():
    """The transformers module, or ImportError naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise ImportError(
            f"This needs transformers, which is not installed; install it with:\n    {TRANSFORMERS_EXTRA}"
        ) from None
    return transformers


def installed() -> bool:
    """Whether transformers can be imported (found, not imported: importing it takes seconds)."""
    from importlib.util import find_spec

    try:
        return find_spec("transformers") is not None
    except (ImportError, ValueError):  # a finder that refuses it, a broken install
        return False


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
        logger.info(
            "cache_implementation=%r of the generation config is read as the cache the model's config describes",
            implementation,
        )
        fields.pop("cache_implementation")
    return GenerationConfig(**fields)


def to_transformers_config(gc: GenerationConfig, keep_own: bool = False):
    """transformers' GenerationConfig with every field of `gc` transformers has (a config object such as a
    watermark's as its dict; models and tensors, which no config file holds, are left out). `keep_own`: decodekit's
    other fields (a plugin's) ride along as plain attributes, so a method that reads them, or hands the config back
    to decodekit's generate(), still finds them."""
    from transformers import GenerationConfig as TransformersConfig

    theirs = set(TransformersConfig().to_dict())
    fields, own = {}, {}
    for name, value in gc.to_dict().items():
        if isinstance(value, (torch.Tensor, torch.nn.Module)):
            continue
        if name in theirs:
            fields[name] = value.to_dict() if callable(getattr(value, "to_dict", None)) else value
        elif keep_own and value is not None:
            own[name] = value
    converted = TransformersConfig(**fields)
    for name, value in own.items():
        setattr(converted, name, value)
    return converted


def holds_recurrent_state(model) -> bool:
    """Whether a layer of `model` sets up recurrent state of its own (`_setup_cache`, RecurrentGemma's)."""
    return any(hasattr(module, "_setup_cache") for module in model.modules())


def cache_keyword(model) -> str:
    """The keyword `model`'s forward (or a function of transformers) takes its cache by: past_key_values, or
    cache (every model from transformers 5.24 on; past_key_values still works there, deprecated) or cache_params
    (Mamba and FalconMamba up to 5.23). decodekit's loops always pass past_key_values and the facade renames it."""
    import inspect

    parameters = inspect.signature(getattr(model, "forward", model)).parameters
    if "past_key_values" in parameters:
        return "past_key_values"
    return next((name for name in ("cache", "cache_params") if name in parameters), "past_key_values")


def takes_cache(model) -> bool:
    """Whether `model`'s forward takes a cache at all (OpenAI GPT's does not: it is run on the whole sequence each
    step, as transformers' generate() runs it)."""
    import inspect

    parameters = inspect.signature(getattr(model, "forward", model)).parameters
    return any(name in parameters for name in ("past_key_values", "cache", "cache_params"))


# Models whose generation transformers feeds through inputs of their own making (prepare_inputs_for_generation), not
# the sequence as it is: decodekit's loops cannot run them and say so, rather than fail deep inside their forward.
OWN_GENERATION_INPUTS = {
    "xlm": "transformers generates with XLM by appending a mask token to the whole sequence at every step",
    "cpmant": "CPM-Ant prepends its prompt-type tokens inside its forward and keeps a cache of its own layout",
}


def refuse_own_generation_inputs(model) -> None:
    """ValueError for a model of OWN_GENERATION_INPUTS, saying why and what runs it."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind in OWN_GENERATION_INPUTS:
        raise ValueError(
            f"{type(model).__name__} ({kind}) cannot run under decodekit's decoding loops: "
            f"{OWN_GENERATION_INPUTS[kind]}. Run it with transformers' own generate()."
        )


# Models that multiply their hidden states by the 2D padding mask (state-space layers, no attention): transformers'
# generate() hands them the mask only while they read the prompt; after it a step's mask would be read as the
# step's own (and has the wrong length).
MASK_ON_PROMPT_ONLY = frozenset({"mamba", "mamba2", "falcon_mamba"})


def masks_prompt_only(model) -> bool:
    """Whether `model` is one of MASK_ON_PROMPT_ONLY."""
    return getattr(model.config, "model_type", None) in MASK_ON_PROMPT_ONLY


def forward_arguments(model, keyword: str, prompt_only_mask: bool, args: tuple, kwargs: dict) -> None:
    """decodekit's call of a transformers model made as transformers' generate() makes it: a static cache's 4D
    mask, the cache under the keyword the forward takes, no padding mask for a state-space model's steps."""
    if not prompt_only_mask:  # (a state-space model has no attention to mask)
        static_cache_mask(model, args, kwargs)
    if keyword != "past_key_values" and "past_key_values" in kwargs:
        kwargs[keyword] = kwargs.pop("past_key_values")
    if prompt_only_mask and kwargs.get(keyword) is not None and kwargs.get("attention_mask") is not None:
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is not None and kwargs["attention_mask"].shape[-1] > ids.shape[-1]:
            kwargs["attention_mask"] = None


@functools.cache
def _mask_cache_keyword(function) -> str:
    return cache_keyword(function)


def static_cache_mask(model, args: tuple, kwargs: dict) -> None:
    """With a static (compileable) transformers cache, the 2D padding mask in `kwargs` becomes the mask the model's
    create_masks_for_generate makes of it, as transformers' generate() does before each forward: a 4D mask over the
    cache's whole length, or what a model overrides it with (BLOOM's ALiBi reads a 2D mask padded to that length)."""
    cache, mask = kwargs.get("past_key_values"), kwargs.get("attention_mask")
    if mask is None or mask.ndim != 2 or not getattr(cache, "is_compileable", False) or not hasattr(cache, "layers"):
        return
    from transformers.masking_utils import create_masks_for_generate

    ids = args[0] if args else kwargs.get("input_ids")
    make = getattr(model, "create_masks_for_generate", create_masks_for_generate)
    # (renamed cache in transformers 5.24, as the forwards' argument; read once per function, not every step)
    named = {_mask_cache_keyword(getattr(make, "__func__", make)): cache}
    kwargs["attention_mask"] = make(
        config=model.config,
        attention_mask=mask,
        **named,
        inputs_embeds=torch.empty((*ids.shape, 0), dtype=model.dtype, device=ids.device),
        position_ids=kwargs.get("position_ids"),
    )


def make_cache(model, kind: str, max_length: int):
    """A transformers Cache laid out as `model`'s config asks (sliding-window and hybrid layers included), or None
    for a model that keeps a cache of its own kind (state-space models)."""
    from transformers import DynamicCache, StaticCache

    if not model._supports_default_dynamic_cache() or not takes_cache(model):
        return None
    config = model.config.get_text_config(decoder=True)
    if kind == "static" and "local" in (getattr(config, "attention_layers", None) or ()):
        # GPT-Neo's local-attention layers are not laid out by StaticCache (no layer_types): transformers' own
        # static output differs from its dynamic one there. A dynamic cache gives the model's real output.
        logger.info(
            "cache_implementation='static': %s has local-attention layers a static cache does not lay out; "
            "a dynamic cache is used",
            type(model).__name__,
        )
        kind = "dynamic"
    if kind == "static":
        return StaticCache(config=config, max_cache_len=max_length)
    return DynamicCache(config=config)
