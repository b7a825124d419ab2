"""The compiled decode step of continuous batching (the manager's compile=True): a step whose rows all decode one
token runs as one torch.compile'd forward, compiled once per row bucket.

- Rows are padded to a power of two (the bucket), so a step of 5 rows and one of 7 share the code for 8. Padding
  rows write their key and value to a scratch block of their own and their logits are dropped.
- The step reads no Python number that changes between steps: tokens, positions, cache slots and block tables
  are tensors; the block table's width (which grows with the longest row) is a dynamic dimension, read only by
  decodekit::paged_attention, so longer contexts do not recompile.
- Steps with prompt chunks run eagerly (their shapes change with every chunk), and so does everything the
  compiled path cannot take: a model off the CPU or without decodekit's C++ kernels, or a step that does not
  compile (logged once on the `decodekit` logger, then eager for good).

Measured on the default model (docs/performance.md): 1.20x the eager throughput at 4 concurrent requests, 1.15x
at 32; a bucket takes about 20 s to compile on 2 CPU threads, so a server calls warm_up() before taking requests.
"""

from __future__ import annotations

import logging

import torch

from ..models import native
from ..models.quantize import many_rows_route
from .paged import DecodeRows, PagedBatch, PagedCache, Segment

logger = logging.getLogger("decodekit")

MIN_WIDTH = 2  # a dynamic dimension of size 1 would be specialised by the compiler


def bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length()


class CompiledDecode:
    """Decode steps of the rows of a PagedCache through compiled forwards, one per row bucket.

    `options`: compile_config (torch.compile's mode/fullgraph/dynamic/backend/options), as for generate()."""

    def __init__(self, model, cache: PagedCache, options: dict | None, max_length: int):
        self.model, self.cache = model, cache
        self.options = {"fullgraph": True, "dynamic": False, **(options or {})}
        self.buckets: set[int] = set()  # the row buckets this manager's steps ran in (warm-up's included)
        self.broken: str | None = None
        self.scratch = cache.allocator.allocate(1)[0]  # where padding rows write; never read by a real row
        model.rotary.ensure(max_length, model.device, model.dtype)  # the compiled code cannot grow it
        if model.device.type == "cpu" and getattr(model, "quantization", None) == "int8":
            many_rows_route()  # measured here, outside any trace (which cannot time anything), as FusedStep does

    def usable(self) -> bool:
        keys = self.cache.keys[0]
        return (self.broken is None and keys.device.type == "cpu" and keys.dtype == self.model.dtype
                and keys.dtype in (torch.float32, torch.bfloat16) and native.ready(keys))

    def __call__(self, tokens: list[int], tables: list[list[int]], positions: list[int]) -> torch.Tensor | None:
        """Logits [rows, V] of one decode step (row i: token tokens[i] at positions[i] of the row whose blocks
        are tables[i]), or None when this step cannot run compiled (the caller runs it eagerly)."""
        if not self.usable():
            return None
        rows, size = len(tokens), bucket(len(tokens))
        pad = size - rows
        width = max(MIN_WIDTH, max(len(t) for t in tables))
        bs, device = self.cache.block_size, self.cache.keys[0].device
        table = torch.full((size, width), self.scratch, dtype=torch.long)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t)
        ids = torch.tensor([tokens + [0] * pad], dtype=torch.long, device=device)
        position = torch.tensor(positions + [0] * pad, dtype=torch.long)
        slots = table[torch.arange(size), position // bs] * bs + position % bs
        torch._dynamo.mark_dynamic(table, 1)
        try:
            logits = self._step(size)(ids, position, slots, table, self.cache.keys, self.cache.values)
        except torch._dynamo.exc.TorchDynamoException as error:
            self.broken = str(error).splitlines()[0]
            logger.info("continuous batching: the compiled decode step did not compile (%s); steps run eagerly",
                        self.broken)
            return None
        return logits[:rows]

    def warm_up(self, max_rows: int) -> list[int]:
        """Compiles the step of every bucket up to `max_rows` rows now, each with one step of padding rows on the
        scratch block, instead of at the first real step of each size; returns the buckets ([] where steps
        cannot run compiled)."""
        sizes = [1 << i for i in range(bucket(max_rows).bit_length())]
        with torch.inference_mode():  # as the manager's steps run: the compiled code is specialised to it
            # One eager forward first, as a prefill would: the model's first call prepares what the traced code
            # reads (packed weights, loaded kernels) and cannot be traced itself.
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.cache.keys[0].device)
            batch = PagedBatch(self.cache, [[self.scratch]], [Segment(0, 1, 0, 0)])
            self.model(ids, position_ids=batch.position_ids, past_key_values=batch, use_cache=True)
            for size in sizes:
                if self([0] * size, [[self.scratch]] * size, [0] * size) is None:
                    return []
        return sizes

    def _step(self, size: int):
        # Kept on the model, like generate()'s fused steps: a later manager with a cache of the same shape
        # (another generate_batch call, say) reuses what an earlier one compiled. The step's guards check its
        # arguments only (fused.argument_guards_only), so the pools' shape is part of the key.
        steps = self.model.__dict__.setdefault("_paged_decode_steps", {})
        pool = self.cache.keys[0]
        key = (size, self.cache.block_size, tuple(pool.shape), pool.dtype, repr(sorted(self.options.items())))
        step = steps.get(key)
        if step is None:
            from ..plugins.fused import compile_own

            model, bs = self.model, self.cache.block_size

            def decode(ids, positions, slots, tables, keys, values):
                rows = DecodeRows(keys, values, slots, tables, positions, bs)
                return model(ids, position_ids=positions[None], past_key_values=rows, use_cache=True).logits[0]

            step = steps[key] = compile_own(decode, self.options)
            logger.info("continuous batching: compiling the decode step for %d rows", size)
        self.buckets.add(size)
        return step
