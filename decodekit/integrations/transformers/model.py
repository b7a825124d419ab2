"""decodekit's generate() on a transformers causal LM: `wrap(model)`.

The wrapper holds the user's model and changes nothing in it: the forward, weights, device placement
(device_map included) and quantization are the model's own. What the wrapper adds is decodekit's
GenerationMixin, a decodekit GenerationConfig made from the model's, and caches made as transformers
`Cache` objects (dynamic by default, as transformers' generate does; static on request), so every hook
point and built-in strategy runs on any architecture transformers implements.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...batching.mixin import ContinuousMixin
from ...core.config import GenerationConfig, accepted_fields
from ...core.generate import GenerationMixin
from ...models.loading import TRANSFORMERS_EXTRA

logger = logging.getLogger("decodekit")


def require_transformers():
    """The transformers module, or ImportError naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"This needs transformers, which is not installed; install it with:\n    {TRANSFORMERS_EXTRA}") from None
    return transformers


def is_transformers_model(obj: Any) -> bool:
    """Whether `obj` is a transformers PreTrainedModel (without importing transformers when it is not loaded)."""
    import sys

    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(obj, PreTrainedModel)


def check_causal_lm(model: Any) -> None:
    """TypeError/ValueError unless `model` is a decoder-only transformers model with a language-modelling head."""
    transformers = require_transformers()
    if isinstance(model, TransformersModel):
        return
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(
            f"wrap() takes a transformers causal LM (a PreTrainedModel, e.g. from transformers.AutoModelForCausalLM), "
            f"got {type(model).__name__}."
        )
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


class TransformersModel(GenerationMixin, ContinuousMixin):
    """A transformers causal LM with decodekit's generate(). Made by `wrap(model)`.

    Calling it calls the model; any attribute not defined here (`model.lm_head`, `model.config`, ...) is the
    model's, so Hub code written for transformers models reads what it expects. `.model` is the original.
    """

    def __init__(self, model):
        check_causal_lm(model)
        self.__dict__["model"] = model
        self.config = model.config
        self.generation_config = generation_config_from(getattr(model, "generation_config", None), model.config)
        self.name_or_path = getattr(model, "name_or_path", type(model).__name__)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str):
        # Only called for names not found on the wrapper: the model's own attributes and methods. Before __init__
        # has run (copy, pickle) there is no model yet, and the name is simply missing.
        model = self.__dict__.get("model")
        if model is None:
            raise AttributeError(name)
        return getattr(model, name)

    def __repr__(self) -> str:
        return f"TransformersModel({type(self.model).__name__}, {self.name_or_path!r})"

    @property
    def forward(self):
        return self.model.forward  # its signature tells the loop which inputs the model takes (logits_to_keep)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def make_cache(self, kind: str, batch_size: int, max_length: int):
        """The cache the hook point gives this model: a transformers Cache laid out as the model's config asks
        (sliding-window and hybrid layers included), or None for a model that keeps a cache of its own kind."""
        from transformers import DynamicCache, StaticCache

        if not self.model._supports_default_dynamic_cache():
            return None
        config = self.config.get_text_config(decoder=True)
        if kind == "static":
            return StaticCache(config=config, max_cache_len=max_length)
        return DynamicCache(config=config)

    def generate(self, *args, assistant_model=None, **kwargs):
        # A transformers assistant is wrapped too, so speculative decoding gets its caches from the same place.
        if assistant_model is not None:
            kwargs["assistant_model"] = wrap(assistant_model) if is_transformers_model(assistant_model) else assistant_model
        return super().generate(*args, **kwargs)

    generate.__doc__ = GenerationMixin.generate.__doc__


def wrap(model) -> TransformersModel:
    """decodekit's generate() on a transformers causal LM, which stays as it is (weights shared, not copied).

    `model`: a decoder-only transformers PreTrainedModel with a language-modelling head, on any device and
    dtype, quantized or spread with device_map. Returns a TransformersModel; wrapping one again returns it.
    """
    if isinstance(model, TransformersModel):
        return model
    return TransformersModel(model)
