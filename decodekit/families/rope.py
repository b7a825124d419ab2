"""Rotary position embeddings: the inverse frequencies for each supported `rope_type`, and a cos/sin table."""

from __future__ import annotations

import math

import torch

from ..kernels import elementwise

ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2], position scale) for the rope parameters of a config.

    `linear` divides positions by `factor`; `llama3` rescales the low and middle frequencies as
    Llama 3.1 does, leaving the high ones alone.
    """
    rope_type = rope["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"Unsupported rope_type {rope_type!r} in config.json; decodekit supports {list(ROPE_TYPES)}.")
    theta = float(rope["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    position_scale = 1.0
    if rope_type == "linear":
        position_scale = 1.0 / float(rope["factor"])
    elif rope_type == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq, position_scale


class RotaryTable:
    """A cos/sin table indexed by position, grown on demand (so long prompts need no config change)."""

    def __init__(self, head_dim: int, rope: dict, initial_length: int = 4096):
        self.inv_freq, self.position_scale = inverse_frequencies(head_dim, rope)
        self.cos = self.sin = torch.empty(0)
        # Built on the CPU explicitly: models are constructed under torch.device("meta") when loading.
        self._build(initial_length, torch.device("cpu"), torch.float32)

    def _build(self, length: int, device: torch.device, dtype: torch.dtype) -> None:
        positions = torch.arange(length, dtype=torch.float32, device="cpu") * self.position_scale
        freqs = torch.outer(positions, self.inv_freq.to("cpu"))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def ensure(self, length: int, device: torch.device, dtype: torch.dtype) -> None:
        """Build the table for positions < length on device/dtype now (a compiled step cannot grow it)."""
        if self.cos.device != device or self.cos.dtype != dtype or self.cos.shape[0] < length:
            self._build(max(length, self.cos.shape[0]), device, dtype)

    def lookup(
        self, position_ids: torch.Tensor, dtype: torch.dtype, checked: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B, 1, T, head_dim] for position_ids [B, T].

        checked=False skips growing the table (which reads the largest position on the host); the
        compiled step uses it after ensure().
        """
        if checked:
            needed = int(position_ids.max()) + 1 if position_ids.numel() else 0
            self.ensure(needed, position_ids.device, dtype)
        return self.cos[position_ids].unsqueeze(1), self.sin[position_ids].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    fused = elementwise.rotary(x, cos, sin)  # a prompt on CPU: one pass (kernels/elementwise.py)
    if fused is not None:
        return fused
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
