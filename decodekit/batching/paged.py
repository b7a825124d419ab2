"""The paged KV cache of continuous batching: fixed-size blocks, a block table per request row, blocks freed when
a request ends and reused by the next.

Each layer's keys and values are one pool [blocks * block_size, kv_heads, head_dim]: position j of a row whose
block table is `table` lives in slot table[j // block_size] * block_size + j % block_size. A forward over the
tokens of many requests at once (prefill chunks and one-token decode steps side by side) gets a `PagedBatch` as
its `past_key_values`: the model's attention writes the new keys and values at their slots and attends through
the tables (llama.Attention), with decodekit's C++ kernel where it is loaded and gathered SDPA where not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..families.llama import visible
from ..kernels import native
from ..kernels.attention import prompt_attention
from ..core.transfer import to_device


class OutOfBlocks(Exception):
    """Fewer free blocks than asked for; the scheduler waits for running requests to free theirs."""


class BlockAllocator:
    """Block numbers with reference counts: a row of a request shares its prompt's full blocks with the other rows."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: low numbers first

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks asked, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free.append(b)


class PagedCache:
    """The pools of every layer and their allocator, for `model` (a config with num_hidden_layers,
    num_key_value_heads and head_dim)."""

    def __init__(self, model, num_blocks: int, block_size: int):
        c = model.config
        shape = (num_blocks * block_size, c.num_key_value_heads, c.head_dim)
        # Uninitialised: a slot is read only after it is written, and untouched pages take no memory.
        self.keys = [torch.empty(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_hidden_layers)]
        self.values = [torch.empty(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_hidden_layers)]
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def commit(self) -> None:
        """Writes every pool once, so that the memory is taken now and no step pays the first write to a page
        (the kernel's page faults: about 0.25 s per GiB on the 2-core bench machine, spread over the steps that
        reach new blocks)."""
        for pool in (*self.keys, *self.values):
            pool.zero_()

    def copy_block(self, source: int, target: int) -> None:
        """Block `target` becomes a copy of block `source` in every layer (a row's own copy of a shared last block)."""
        bs = self.block_size
        for pool in (*self.keys, *self.values):
            pool[target * bs : (target + 1) * bs] = pool[source * bs : (source + 1) * bs]


def slots_of(tables: torch.Tensor, rows, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The pool slots of `positions` of table rows `rows` (a tensor, or one row's index), as the module's docstring
    maps them."""
    return tables[rows, positions // block_size] * block_size + positions % block_size


@dataclass
class Segment:
    """Tokens start:end of a batch: consecutive positions first.. of the request row `row` of the tables."""

    start: int
    end: int
    row: int
    first: int


def decode_attention(tokens, k, v, keys, values, slots, tables, owner, positions, block_size: int, window):
    """Decode rows' attention in torch operations alone (any device; what the compiled step runs where decodekit's
    C++ kernel does not, CUDA first): each token's key and value written at its slot, then its query [N, H, D]
    attends positions 0..position of its row (within `window`) through the row's block table, gathered whole.
    Returns [N, H, D]. The gather reads every block of the table's width, so the step's cost follows its longest
    row, as one SDPA call over all rows needs. `window` 0 or None: none (the kernel's 0)."""
    keys.index_copy_(0, slots, k)
    values.index_copy_(0, slots, v)
    rows = tables.index_select(0, owner)  # [N, width]
    offsets = torch.arange(block_size, device=rows.device)
    gathered = (rows[:, :, None] * block_size + offsets).flatten(1)  # [N, width * block_size]
    span = torch.arange(gathered.shape[1], device=rows.device)
    seen = visible(positions[:, None], span[None, :], window or None)  # [N, L]
    # The slots a row does not see are zeroed as they are gathered: they hold what the pool's uninitialised memory or
    # another row left there, and a NaN among them reaches SDPA's output through its masked weight (0 * NaN).
    hidden = ~seen[:, :, None, None]
    key_rows = keys[gathered].masked_fill(hidden, 0).transpose(1, 2).to(tokens.dtype)  # [N, KV, L, D]
    value_rows = values[gathered].masked_fill(hidden, 0).transpose(1, 2).to(tokens.dtype)
    mask = seen[:, None, None, :]  # [N, 1, 1, L]
    out = F.scaled_dot_product_attention(
        tokens[:, :, None, :], key_rows, value_rows, attn_mask=mask, enable_gqa=key_rows.shape[1] != tokens.shape[1]
    )
    return out[:, :, 0, :]


ROUTES = ("kernel", "gathered", "flex")  # how decode rows attend: DecodeRows' `route`


def route_attention(route: str):
    """The function behind a decode-rows attention route (each takes decode_attention's arguments): decodekit's C++
    kernel (the CPU's, reading each row's blocks in place), decode_attention (torch operations over the rows'
    gathered blocks, any device), or flex attention (one fused kernel reading the blocks in place; compiled steps
    only, batching/flex.py)."""
    if route == "kernel":
        return torch.ops.decodekit.paged_attention
    if route == "flex":
        from .flex import flex_decode_attention

        return flex_decode_attention
    if route == "gathered":
        return decode_attention
    raise ValueError(f"route={route!r} is invalid; expected one of {', '.join(ROUTES)}.")


class DecodeRows:
    """Attention for tokens that each decode one row (tensor-only, so the compiler can trace it; PagedBatch uses it
    for its decode rows): each token's key and value written at its slot, and its attention through its row's block
    table by the `route` of ROUTES (route_attention). `owner` [N]: each token's row of `tables` (default: token i,
    row i)."""

    paged = True

    def __init__(self, keys, values, slots, tables, positions, block_size: int, owner=None, route: str = "kernel"):
        self.keys, self.values, self.slots, self.tables = keys, values, slots, tables
        self.positions, self.block_size, self.route = positions, block_size, route
        self.owner = torch.arange(positions.shape[0], device=positions.device) if owner is None else owner
        self._masks = {}  # the flex route's block mask by window: made at the first layer, read by every layer

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def attend(self, q, k, v, layer_idx: int, window: int | None, int8: bool = False) -> torch.Tensor:
        """q [1, H, N, D], k, v [1, KV, N, D] -> [1, H, N, D]. `int8` as PagedBatch.attend takes it (decode rows have
        no prompt attention to choose)."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        tokens = q[0].transpose(0, 1).contiguous()  # [N, H, D]
        k, v = k[0].transpose(0, 1).to(keys.dtype), v[0].transpose(0, 1).to(values.dtype)
        window = window or 0
        extra = {}
        if self.route == "flex":
            from .flex import paged_block_mask

            if window not in self._masks:
                pool_blocks = keys.shape[0] // self.block_size
                self._masks[window] = paged_block_mask(
                    self.tables, self.owner, self.positions, self.block_size, pool_blocks, window
                )
            extra["mask"] = self._masks[window]
        out = route_attention(self.route)(
            tokens,
            k,
            v,
            keys,
            values,
            self.slots,
            self.tables,
            self.owner,
            self.positions,
            self.block_size,
            window,
            **extra,
        )
        return out.transpose(0, 1)[None]


class DeviceIndex(NamedTuple):
    """A PagedBatch's index tensors on the cache's device, for attention in torch operations: the tables, each token's
    row and position, the single-token segments' tokens, and each prompt chunk's slots of its row's positions
    0..end."""

    tables: torch.Tensor
    owner: torch.Tensor
    positions: torch.Tensor
    singles: torch.Tensor
    chunk_slots: list


class PagedBatch:
    """The `past_key_values` of one forward over the tokens of several request rows, flattened into one
    sequence [1, N]: which table row each token belongs to (`owner`), its position, and the slot its key and
    value are written to."""

    paged = True  # what llama.Attention and the model's forward look for

    def __init__(self, cache: PagedCache, tables: list[list[int]], segments: list[Segment]):
        self.cache = cache
        self.segments = segments
        width = max(len(t) for t in tables)
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        owner, positions = [], []
        for s in segments:
            owner += [s.row] * (s.end - s.start)
            positions += range(s.first, s.first + s.end - s.start)
        self.owner = torch.tensor(owner, dtype=torch.long)
        self.positions = torch.tensor(positions, dtype=torch.long)
        bs = cache.block_size
        self.slots = slots_of(self.tables, self.owner, self.positions, bs)
        self.chunks = [s for s in segments if s.end - s.start > 1]
        self.singles = [s.start for s in segments if s.end - s.start == 1]
        self._chunk_tokens = torch.tensor([i for s in self.chunks for i in range(s.start, s.end)], dtype=torch.long)
        self._single_tokens = torch.tensor(self.singles, dtype=torch.long)
        # What every layer's attention reads, on the cache's device once for the forward rather than once a layer
        # (on a GPU each copy waits for the work queued before it).
        device = cache.keys[0].device
        self.position_ids = to_device(self.positions, torch.long, device)[None]
        self._slots = to_device(self.slots, torch.long, device)
        self._on_device: DeviceIndex | None = None

    def on_device(self) -> DeviceIndex:
        """The batch's index tensors on the cache's device, made at the first layer's attention for every layer."""
        if self._on_device is None:
            device, bs = self._slots.device, self.cache.block_size
            self._on_device = DeviceIndex(
                to_device(self.tables, torch.long, device),
                to_device(self.owner, torch.long, device),
                self.position_ids[0],
                to_device(self._single_tokens, torch.long, device),
                [
                    to_device(
                        slots_of(self.tables, s.row, torch.arange(s.first + s.end - s.start), bs), torch.long, device
                    )
                    for s in self.chunks
                ],
            )
        return self._on_device

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are given per token (position_ids); nothing is read from the cache's length

    def attend(self, q, k, v, layer_idx: int, window: int | None, int8: bool = False) -> torch.Tensor:
        """Writes k, v [1, KV, N, D] at the tokens' slots and returns the attention of q [1, H, N, D] over each
        token's request row, [1, H, N, D] (`int8`: the model's weights are, which its prompt chunks' attention route
        is chosen for: attention.prompt_attention_route).

        One-token segments (decode rows) go through decodekit::paged_attention, which reads each row's blocks
        in place; prompt chunks through SDPA over their row's gathered keys and values, whose fused kernel
        beats a per-query loop once a chunk has more than a few tokens (the gather is one copy per chunk)."""
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        native_ok = q.device.type == "cpu" and q.dtype == keys.dtype in native.LAYER_DTYPES and native.ready(q)
        if native_ok and not self.chunks:  # decode rows only: the common step
            return DecodeRows(
                self.cache.keys,
                self.cache.values,
                self.slots,
                self.tables,
                self.positions,
                self.cache.block_size,
                self.owner,
            ).attend(q, k, v, layer_idx, window)
        tokens = q[0].transpose(0, 1)  # [N, H, D]
        k, v = k[0].transpose(0, 1).to(keys.dtype), v[0].transpose(0, 1).to(values.dtype)  # [N, KV, D]
        if not native_ok:
            return self._attend_in_torch(tokens, k, v, keys, values, window, int8).transpose(0, 1)[None]
        out = torch.empty_like(tokens)
        chunk_at = self._chunk_tokens  # the C++ kernel's route: on the CPU
        keys.index_copy_(0, self._slots[chunk_at], k[chunk_at])
        values.index_copy_(0, self._slots[chunk_at], v[chunk_at])
        self.gathered_attention(tokens, keys, values, window, out, int8)
        if len(self.singles):
            at = self._single_tokens
            out[at] = torch.ops.decodekit.paged_attention(
                tokens[at].contiguous(),
                k[at],
                v[at],
                keys,
                values,
                self.slots[at],
                self.tables,
                self.owner[at],
                self.positions[at],
                self.cache.block_size,
                window or 0,
            )
        return out.transpose(0, 1)[None]

    def _attend_in_torch(self, tokens, k, v, keys, values, window, int8) -> torch.Tensor:
        """attend's route where decodekit's kernel cannot serve, [N, H, D]: every token's key and value written, each
        prompt chunk's attention over its row gathered, and the single-token rows' (decode rows beside the chunks)
        in one decode_attention call for them all."""
        keys.index_copy_(0, self._slots, k)
        values.index_copy_(0, self._slots, v)
        out = self.gathered_attention(tokens, keys, values, window, None, int8)
        if len(self.singles):
            at = self.on_device()
            singles = at.singles
            out[singles] = decode_attention(
                tokens[singles],
                k[singles],
                v[singles],
                keys,
                values,
                self._slots[singles],
                at.tables,
                at.owner[singles],
                at.positions[singles],
                self.cache.block_size,
                window,
            )
        return out

    def gathered_attention(self, tokens, keys, values, window, out=None, int8=False) -> torch.Tensor:
        """Attention through SDPA for the prompt chunks, one at a time over its row's gathered keys and values
        (written already); fills `out` [N, H, D] at their tokens."""
        out = torch.empty_like(tokens) if out is None else out
        for i, s in enumerate(self.chunks):
            length = s.first + s.end - s.start
            slots = self.on_device().chunk_slots[i]
            # Gathered as [L, KV, D] (whole rows, far faster than [KV, L, D] from the transposed pool) and
            # passed as a [1, KV, L, D] view: the kernel and SDPA read rows at a stride.
            k = keys.index_select(0, slots).transpose(0, 1)[None].to(tokens.dtype)
            v = values.index_select(0, slots).transpose(0, 1)[None].to(tokens.dtype)
            y = prompt_attention(tokens[s.start : s.end].transpose(0, 1), k[0], v[0], window, int8)
            if y is not None:  # decodekit's kernel, where it measured faster than SDPA here
                out[s.start : s.end] = y.transpose(0, 1)
                continue
            q = tokens[s.start : s.end].transpose(0, 1)[None]  # [1, H, t, D]
            q_pos = torch.arange(s.first, length, device=keys.device)[:, None]
            mask = visible(q_pos, torch.arange(length, device=keys.device)[None, :], window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
            out[s.start : s.end] = y[0].transpose(0, 1)
        return out
