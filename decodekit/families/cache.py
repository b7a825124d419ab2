"""KV caches: the cache hook point's protocol and the two built-in implementations.

A cache holds, per layer, keys and values of shape [batch, kv_heads, seq, head_dim]. The model calls
`update(key, value, layer_idx)` once per layer per forward and attends over what it returns. Decoders
call `get_seq_length`, `crop` (speculative decoding drops rejected tokens) and `reorder` (beam search).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Cache(Protocol):
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key/value [B, H, T, D] for one layer; return all keys/values of that layer so far."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """How many positions are cached."""

    def crop(self, max_length: int) -> None:
        """Keep only the first `max_length` positions (a negative value drops that many from the end)."""

    def reorder(self, indices: torch.Tensor) -> None:
        """Select batch rows: row i becomes old row indices[i]."""


def reorder_rows(cache, indices: torch.Tensor) -> None:
    """Row i of the cache becomes old row indices[i], on a decodekit cache (`reorder`) or a transformers
    `Cache` (`reorder_cache`): decoders call this, so both kinds go through the cache hook point."""
    if hasattr(cache, "reorder"):
        cache.reorder(indices)
    else:
        cache.reorder_cache(indices)


def cached_length(cache) -> int:
    """How many positions `cache` holds. transformers' caches of a state-space model (Mamba) hold recurrent states
    only and refuse get_seq_length(); a fresh one holds nothing (0), and one that has read tokens cannot say how
    many: a ValueError says so."""
    try:
        return cache.get_seq_length()
    except ValueError:
        if not recurrent(cache):
            raise
        written = any(
            any(getattr(layer, name, {}).values())
            for layer in cache.layers
            for name in ("is_conv_states_initialized", "is_recurrent_states_initialized")
        )
        if written:
            raise ValueError(
                "past_key_values holds a state-space model's recurrent states, which do not record how "
                "many tokens they have read: pass a fresh cache (or none) with the whole prompt."
            ) from None
        return 0


def recurrent(cache) -> bool:
    """Whether `cache` (a transformers Cache) has layers of recurrent state (Mamba, Jamba, RecurrentGemma's
    linear-attention layers): they cannot be rolled back once they have read a token."""
    return any("LinearAttention" in type(layer).__name__ for layer in getattr(cache, "layers", ()))


def record_past(cache) -> None:
    """Makes `cache` keep what it would drop (a sliding window's old positions), so crop_to can roll it back:
    transformers' caches drop them unless asked (activate_past_recording); decodekit's keep everything."""
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()


def crop_to(cache, length: int) -> None:
    """Keep the first `length` positions, on a decodekit cache (`crop(max_length)`) or a transformers `Cache`,
    whose `crop` takes the (negative) number of positions to drop."""
    if hasattr(cache, "reorder"):
        cache.crop(length)
        return
    # Layer by layer: a self-speculative draft writes only the first layers, so layers can differ in length (the
    # cache's own crop would drop the same count from each); a sliding-window layer takes only counts to drop. A
    # linear-attention layer (convolution states, recorded since record_past) knows no length of its own: it read what
    # the cache's attention layers read, and drops as many (speculative decoding refuses early exit on such caches).
    layers = getattr(cache, "layers", None) or [cache]
    whole = cache.get_seq_length() - length if any(not hasattr(layer, "get_seq_length") for layer in layers) else 0
    for layer in layers:
        drop = layer.get_seq_length() - length if hasattr(layer, "get_seq_length") else whole
        if drop > 0:
            layer.crop(-drop)


def rolls_back(cache) -> bool | None:
    """Whether crop_to can roll `cache` back past tokens it read: True for decodekit's caches and attention-only
    transformers caches; for one with linear-attention layers, what transformers says once they have read tokens
    (`is_croppable`: convolution states alone can be, recurrent states cannot), None before (it cannot tell yet)."""
    if not recurrent(cache):
        return True
    read = any(
        any(getattr(layer, name, {}).values())
        for layer in cache.layers
        for name in ("is_conv_states_initialized", "is_recurrent_states_initialized")
    )
    return bool(getattr(cache, "is_croppable", False)) if read else None


def new_cache(model, kind: str, batch_size: int, max_length: int):
    """A cache of `kind` ("static" or "dynamic") for `model`: the model's own kind where its library lays out its
    caches (`model.makes_caches`: transformers' Cache for a transformers model, through `model.make_cache`), else
    decodekit's. A static cache needs num_hidden_layers, num_key_value_heads and head_dim in the config; without
    them it is dynamic."""
    if getattr(model, "makes_caches", False):
        return model.make_cache(kind, batch_size, max_length)
    config = model.config
    if kind == "static" and all(hasattr(config, f) for f in ("num_hidden_layers", "num_key_value_heads", "head_dim")):
        return StaticCache.for_model(model, batch_size, max_length)
    return DynamicCache()


def grows(cache) -> bool:
    """Whether `cache` is a dynamic cache (decodekit's or transformers', or a subclass of either), whose batch
    size may change (contrastive search expands it)."""
    return any(c.__name__ == "DynamicCache" for c in type(cache).__mro__)


def _crop_target(current: int, max_length: int) -> int:
    if not isinstance(max_length, int):
        raise TypeError(f"crop(max_length) takes an int, got {type(max_length).__name__}.")
    return max(0, current + max_length) if max_length < 0 else min(current, max_length)


class DynamicCache:
    """Grows by concatenation. Any batch size and length; the default when a model is called directly."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key, value, layer_idx):
        if layer_idx == len(self.keys):
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys[layer_idx] = torch.cat((self.keys[layer_idx], key), dim=-2)
            self.values[layer_idx] = torch.cat((self.values[layer_idx], value), dim=-2)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[-2] if layer_idx < len(self.keys) else 0

    def crop(self, max_length: int) -> None:
        keep = _crop_target(self.get_seq_length(), max_length)
        self.keys = [k[..., :keep, :] for k in self.keys]
        self.values = [v[..., :keep, :] for v in self.values]

    def reorder(self, indices: torch.Tensor) -> None:
        self.keys = [k.index_select(0, indices.to(k.device)) for k in self.keys]
        self.values = [v.index_select(0, indices.to(v.device)) for v in self.values]

    def __len__(self) -> int:
        return len(self.keys)


class StaticCache:
    """Preallocated buffers of a fixed shape [B, H, max_cache_len, D] per layer, written in place.

    No allocation per token, and the shapes a compiled step needs. `update` returns a view of the
    filled part only, so attention never reads the empty tail.

    After `share_rows()`, `reorder` copies nothing: `rows` [B, max_cache_len] says which row's buffers
    hold each row's entry at each slot, and reorder permutes it. Compiled beam search uses this under
    the C++ layer stack, which reads through `rows`: copying every layer's buffers had taken about a
    third of the int8 default model's beam step.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_cache_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_cache_len < 1:
            raise ValueError(f"StaticCache max_cache_len must be >= 1, got {max_cache_len}.")
        shape = (batch_size, num_kv_heads, max_cache_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_layers
        self.max_cache_len = max_cache_len
        self.rows: torch.Tensor | None = None

    @classmethod
    def for_model(cls, model, batch_size: int, max_cache_len: int) -> "StaticCache":
        c = model.config
        return cls(
            c.num_hidden_layers,
            batch_size,
            c.num_key_value_heads,
            c.head_dim,
            max_cache_len,
            dtype=model.dtype,
            device=model.device,
        )

    def update(self, key, value, layer_idx):
        start = self.lengths[layer_idx]
        end = start + key.shape[-2]
        if end > self.max_cache_len:
            raise ValueError(
                f"StaticCache is full: {end} positions needed, max_cache_len is {self.max_cache_len}. "
                "Allocate it with a larger max_cache_len."
            )
        self.keys[layer_idx][:, :, start:end] = key
        self.values[layer_idx][:, :, start:end] = value
        self.lengths[layer_idx] = end
        if self.rows is not None:
            self.claim(torch.arange(start, end, device=self.rows.device))
            return self._shared(self.keys[layer_idx], end), self._shared(self.values[layer_idx], end)
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def write(self, key, value, layer_idx, slots: torch.Tensor):
        """The fixed-shape path of a compiled step: write at the slot indices `slots` [T] (a tensor, so
        no Python number changes between steps) and return the whole buffers; the caller masks the rest.
        With shared rows the caller claims the slots first (claim), once for all layers."""
        self.keys[layer_idx].index_copy_(2, slots, key)
        self.values[layer_idx].index_copy_(2, slots, value)
        if self.rows is not None:
            return self._shared(self.keys[layer_idx]), self._shared(self.values[layer_idx])
        return self.keys[layer_idx], self.values[layer_idx]

    def share_rows(self) -> None:
        """From now on, reorder by bookkeeping (see the class docstring); each row's slots start as its own."""
        B = self.keys[0].shape[0]
        self.rows = torch.arange(B, device=self.keys[0].device)[:, None].repeat(1, self.max_cache_len)

    def claim(self, slots: torch.Tensor) -> None:
        """With shared rows: every row writes its own entries at `slots` [T] (a tensor of slot indices)."""
        B = self.rows.shape[0]
        own = torch.arange(B, device=self.rows.device)[:, None].expand(B, slots.shape[0])
        self.rows.index_copy_(1, slots, own.contiguous())

    def _shared(self, buffer: torch.Tensor, end: int | None = None) -> torch.Tensor:
        """buffer [B, H, L, D] as each row sees it: entry (b, s) from row rows[b, s]; the first `end` slots."""
        rows = self.rows[:, :end]
        B, H, _, D = buffer.shape
        index = rows[:, None, :, None].expand(B, H, rows.shape[1], D)
        return buffer[:, :, : rows.shape[1]].gather(0, index)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    def crop(self, max_length: int) -> None:
        # Stale entries past the new length are never read: update() returns only the filled part.
        self.lengths = [_crop_target(n, max_length) for n in self.lengths]

    def reorder(self, indices: torch.Tensor) -> None:
        if self.rows is not None:
            self.rows.copy_(self.rows.index_select(0, indices.to(self.rows.device)))
            return
        for buffers in (self.keys, self.values):
            for b in buffers:
                b.copy_(b.index_select(0, indices.to(b.device)))

    def __len__(self) -> int:
        return len(self.keys)
