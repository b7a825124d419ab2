"""Reading a GGUF file: the model config, the (dequantized) weights under Hugging Face names, and the tokenizer.

llama.cpp's converter permutes the rows of the q and k projections of `llama` models so its rotary
kernel can rotate adjacent pairs; the Hugging Face layout rotates halves. `_unpermute` undoes it.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF architecture -> config.json model_type. llama.cpp writes Mistral models as `llama`.
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def architecture(path: str | Path) -> tuple[str | None, bool]:
    """(the file's general.architecture, whether decodekit reads it natively), from the same parsed file the
    model and tokenizer then read (open_gguf), so choosing a backend costs no second parse."""
    model = open_gguf(path)
    return model.arch, model.native


def open_gguf(path: str | Path) -> "GGUFModel":
    """A GGUFModel, reused while the file is unchanged: the model and its tokenizer read the same file,
    and parsing the metadata of a large vocabulary takes seconds."""
    p = Path(path).resolve()
    stat = p.stat() if p.is_file() else None
    return _open_cached(p, stat.st_mtime_ns if stat else None, stat.st_size if stat else None)


@lru_cache(maxsize=2)
def _open_cached(path: Path, mtime_ns, size) -> "GGUFModel":
    return GGUFModel(path)


class GGUFModel:
    """Everything decodekit reads from one GGUF file."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        self.reader = GGUFReader(str(self.path))
        self.arch = _field(self.reader, "general.architecture")
        self.native = self.arch in _ARCHITECTURES

    def config(self) -> dict[str, Any]:
        if not self.native:
            raise ValueError(
                f"Unsupported GGUF architecture {self.arch!r} in {self.path.name}; decodekit reads {sorted(_ARCHITECTURES)}."
            )
        r, a = self.reader, self.arch
        heads = int(_field(r, f"{a}.attention.head_count"))
        hidden = int(_field(r, f"{a}.embedding_length"))
        names = {t.name for t in r.tensors}
        tokens = _field(r, "tokenizer.ggml.tokens") or []
        cfg = {
            "model_type": _ARCHITECTURES[a],
            "vocab_size": int(_field(r, f"{a}.vocab_size", len(tokens))),
            "hidden_size": hidden,
            "intermediate_size": int(_field(r, f"{a}.feed_forward_length")),
            "num_hidden_layers": int(_field(r, f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(_field(r, f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(_field(r, f"{a}.attention.key_length", hidden // heads)),
            "rms_norm_eps": float(_field(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(_field(r, f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(_field(r, f"{a}.context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
            "pad_token_id": _field(r, "tokenizer.ggml.padding_token_id"),
        }
        window = _field(r, f"{a}.attention.sliding_window")
        if window:
            cfg["model_type"], cfg["sliding_window"] = "mistral", int(window)
        return cfg

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights, dequantized to float32, under Hugging Face parameter names."""
        from gguf.quants import dequantize

        cfg = self.config()
        out: dict[str, torch.Tensor] = {}
        for t in self.reader.tensors:
            w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
            stem, _, kind = t.name.rpartition(".")
            if stem == "token_embd":
                name = "model.embed_tokens"
            elif stem == "output_norm":
                name = "model.norm"
            elif stem == "output":
                name = "lm_head"
            elif stem.startswith("blk."):
                _, layer, part = stem.split(".", 2)
                if part not in _TENSOR_NAMES:
                    raise ValueError(f"Unexpected tensor {t.name!r} in {self.path.name}.")
                if self.arch == "llama" and part in ("attn_q", "attn_k"):
                    w = _unpermute(w, cfg["num_attention_heads"] if part == "attn_q" else cfg["num_key_value_heads"])
                name = f"model.layers.{layer}.{_TENSOR_NAMES[part]}"
            else:
                raise ValueError(f"Unexpected tensor {t.name!r} in {self.path.name}.")
            out[f"{name}.{kind}"] = torch.from_numpy(np.array(w, dtype=np.float32))
        return out

    def tokenizer_fields(self) -> dict[str, Any]:
        r = self.reader
        return {
            "model": _field(r, "tokenizer.ggml.model"),
            "pre": _field(r, "tokenizer.ggml.pre"),
            "tokens": _field(r, "tokenizer.ggml.tokens"),
            "token_type": _field(r, "tokenizer.ggml.token_type"),
            "merges": _field(r, "tokenizer.ggml.merges"),
            "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
            "unk_token_id": _field(r, "tokenizer.ggml.unknown_token_id"),
            "pad_token_id": _field(r, "tokenizer.ggml.padding_token_id"),
            "add_bos_token": _field(r, "tokenizer.ggml.add_bos_token", False),
            "add_eos_token": _field(r, "tokenizer.ggml.add_eos_token", False),
            "chat_template": _field(r, "tokenizer.chat_template"),
        }
