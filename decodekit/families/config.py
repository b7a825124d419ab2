"""The model configuration: the fields of a Hugging Face `config.json` that the Llama family needs.

Every key of config.json stays readable as an attribute (`model.config.pad_token_id`), because Hub
code written for transformers reads them; the fields below are the ones this package interprets.
"""

from __future__ import annotations

from typing import Any

# model_type -> what that family adds to plain Llama. Qwen2 always has q/k/v bias; Qwen3 normalises q and k.
SUPPORTED_MODEL_TYPES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}

_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_parameters": None,
    "max_position_embeddings": 2048,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "use_sliding_window": None,
    "max_window_layers": None,
    "layer_types": None,
    "hidden_act": "silu",
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    # What code written for transformers asks of any config: decodekit's families are decoder-only and cache.
    "is_encoder_decoder": False,
    "use_cache": True,
}


class ModelConfig:
    """Attribute access over a config.json dictionary, with the Llama-family defaults filled in."""

    def __init__(self, **fields: Any):
        model_type = fields.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"Unsupported model_type {model_type!r} in config.json; decodekit supports "
                f"{sorted(SUPPORTED_MODEL_TYPES)}."
            )
        merged = dict(_DEFAULTS)
        merged.update(fields)
        if merged["num_key_value_heads"] is None:
            merged["num_key_value_heads"] = merged["num_attention_heads"]
        if merged["head_dim"] is None:
            merged["head_dim"] = merged["hidden_size"] // merged["num_attention_heads"]
        if merged["hidden_act"] != "silu":
            raise ValueError(f"Unsupported hidden_act {merged['hidden_act']!r}; decodekit supports 'silu'.")
        self.__dict__.update(merged)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> "ModelConfig":
        """The config of the text model: this one (transformers' configs of multimodal models return a part)."""
        return self

    def __repr__(self) -> str:
        return f"ModelConfig({self.model_type}, layers={self.num_hidden_layers}, hidden={self.hidden_size})"

    # --- derived properties, one place for each rule --------------------------------------------------

    @property
    def qkv_bias(self) -> bool:
        return bool(self.attention_bias or SUPPORTED_MODEL_TYPES[self.model_type].get("qkv_bias"))

    @property
    def o_bias(self) -> bool:
        # Llama's attention_bias covers o_proj too; Qwen2's built-in bias does not.
        return bool(self.attention_bias)

    @property
    def qk_norm(self) -> bool:
        return bool(SUPPORTED_MODEL_TYPES[self.model_type].get("qk_norm"))

    def rope(self) -> dict[str, Any]:
        """The rotary embedding parameters, from `rope_parameters` (transformers 5) or the older fields."""
        params = dict(self.rope_parameters or self.rope_scaling or {})
        params.setdefault("rope_theta", self.rope_theta)
        params["rope_type"] = params.get("rope_type", params.get("type", "default"))
        return params

    def sliding_window_for_layer(self, layer: int) -> int | None:
        """The attention window of one layer, or None for full attention."""
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        if self.model_type == "mistral":
            return self.sliding_window
        if self.model_type in ("qwen2", "qwen3") and self.use_sliding_window:
            # Qwen: the layers from max_window_layers on use the window.
            start = self.max_window_layers if self.max_window_layers is not None else 0
            return self.sliding_window if layer >= start else None
        return None
