"""Reading a GGUF file: the model config, the weights under Hugging Face names (dequantized, or kept in the file's
blocks), and the tokenizer.

llama.cpp's converter permutes the rows of the q and k projections of `llama` models so its rotary
kernel can rotate adjacent pairs; the Hugging Face layout rotates halves. `_unpermute` undoes it.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("decodekit")

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


@dataclass
class BlockWeight:
    """A weight matrix kept in blocks (kernels/blocks.py): `data` [out, stored] in its layout, `in_features` wide."""

    data: torch.Tensor
    in_features: int

    @property
    def layout(self) -> str:
        from ..kernels.blocks import layout_of

        return layout_of(self.data)


_FUSED_GROUPS = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up"}


def kept_layouts(kept_types: dict[str, str]) -> dict[str, str]:
    """{tensor name: layout} of a file's tensors kept in blocks ({name: GGUF type}): their type's layout, but q8 for
    every part of a fused q/k/v or gate/up whose parts have both (pretrained._rows stacks them as q8 blocks)."""
    from ..kernels.blocks import KEPT_TYPES

    layouts = {name: KEPT_TYPES[kind] for name, kind in kept_types.items()}
    groups: dict[tuple[str, str], list[str]] = {}
    for name in layouts:
        layer, _, part = name.removesuffix(".weight").removeprefix("blk.").partition(".")
        if name.startswith("blk.") and part in _FUSED_GROUPS:
            groups.setdefault((layer, _FUSED_GROUPS[part]), []).append(name)
    for names in groups.values():
        if len({layouts[n] for n in names}) > 1:
            layouts.update(dict.fromkeys(names, "q8"))
    return layouts


def _rounded_again(kept_types: dict[str, str]) -> list[str]:
    """What of a file's kept tensors ({name: type}) is rounded again rather than converted exactly: the REQUANTIZED
    types, and q4 types other than Q4_0 held as q8 blocks (kept_layouts)."""
    from ..kernels.blocks import KEPT_TYPES, REQUANTIZED

    layouts = kept_layouts(kept_types)
    out = {kind for kind in kept_types.values() if kind in REQUANTIZED}
    moved = {kind for name, kind in kept_types.items() if KEPT_TYPES[kind] != layouts[name] and kind != "Q4_0"}
    return sorted(out) + [f"{kind} fused with q8 parts" for kind in sorted(moved)]


def _field(header, key: str, default: Any = None) -> Any:
    return header.fields.get(key, default)


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
        from .gguf_header import GGUFHeader

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        self.header = GGUFHeader(self.path)
        self.arch = _field(self.header, "general.architecture")
        self.native = self.arch in _ARCHITECTURES
        self._tokenizer = self._read_tokenizer_fields()

    def config(self) -> dict[str, Any]:
        if not self.native:
            raise ValueError(
                f"Unsupported GGUF architecture {self.arch!r} in {self.path.name}; decodekit reads {sorted(_ARCHITECTURES)}."
            )
        r, a = self.header, self.arch
        heads = int(_field(r, f"{a}.attention.head_count"))
        hidden = int(_field(r, f"{a}.embedding_length"))
        names = {t.name for t in r.tensors}
        tokens = self._tokenizer["tokens"] or []
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

    def state_dict(self, keep_blocks: bool = False) -> dict[str, torch.Tensor | BlockWeight]:
        """The weights under Hugging Face parameter names, read one tensor at a time: dequantized to float32, or with
        `keep_blocks` the matrices of a type kernels/blocks.py keeps (blocks.KEPT_TYPES) as BlockWeights, in about
        the file's bytes; a matrix of another type is dequantized. Log lines name the types dequantized and those
        rounded again."""
        from gguf.quants import dequantize

        from ..kernels import blocks

        cfg = self.config()
        out: dict[str, torch.Tensor | BlockWeight] = {}
        dequantized: set[str] = set()
        kept_types: dict[str, str] = {}  # tensor name -> type, of the tensors kept in blocks
        for t in self.header.tensors:
            shape = [int(d) for d in reversed(t.shape)]
            kept = keep_blocks and len(shape) == 2 and t.tensor_type.name in blocks.KEPT_TYPES
            if kept:
                kept_types[t.name] = t.tensor_type.name
                w = np.asarray(t.data).reshape(shape[0], -1)  # rows of blocks, not yet copied out of the file's map
            else:
                w = dequantize(t.data, t.tensor_type).reshape(shape)
                if keep_blocks and len(shape) == 2:
                    dequantized.add(t.tensor_type.name)
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
            if kept:
                layout, rows = blocks.from_gguf(w, t.tensor_type.name)
                out[f"{name}.{kind}"] = BlockWeight(blocks.as_stored(rows, layout), shape[1])
            else:
                out[f"{name}.{kind}"] = torch.from_numpy(np.array(w, dtype=np.float32))
            self._release_pages(int(t.data_offset), int(t.n_bytes))  # copied: the file's pages are not needed
        rounded = _rounded_again(kept_types)
        if rounded:
            logger.info(
                "%s: %s rounded again as q8 blocks, each weight within half a q8 step of the file's (dtype='float32' "
                "loads them exactly)", self.path.name, ", ".join(sorted(rounded)),
            )  # fmt: skip
        if dequantized:
            logger.info(
                "%s: matrices of type %s are dequantized to float32 (kept in blocks: %s)",
                self.path.name, ", ".join(sorted(dequantized)), ", ".join(sorted(blocks.KEPT_TYPES)),
            )  # fmt: skip
        return out

    def _release_pages(self, start: int, length: int) -> None:
        """Drops the pages of bytes [start, start + length) of the file that reading a tensor brought into the
        process's resident memory (the tensor is a copy now; a later read of the map faults them in again from the
        file), so that a load holds the model's bytes and one tensor of the file's, not the model's and the file's."""
        mapped = self.header.map
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        mapped.madvise(mmap.MADV_DONTNEED, first, min(start + length, len(mapped)) - first)

    def tokenizer_fields(self) -> dict[str, Any]:
        return dict(self._tokenizer)

    def _read_tokenizer_fields(self) -> dict[str, Any]:
        r = self.header
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
