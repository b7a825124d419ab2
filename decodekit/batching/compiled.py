"""The compiled decode step of continuous batching (the manager's compile=True): a step whose rows all decode one
token runs as one torch.compile'd forward, compiled once for every row count.

- The number of rows is a dynamic dimension, so a step of 5 rows and one of 27 run the same code, each on its
  own rows only. A step of one row runs as two (the compiler specialises a dimension of size 1), the second a
  padding row that writes its key and value to a scratch block of its own and whose logits are dropped.
  Compiling per power-of-two bucket instead cost a compile per bucket and, at 17 rows, the products of 32.
- The step reads no Python number that changes between steps: tokens, positions, cache slots and block tables
  are tensors; the block table's width (which grows with the longest row) is a dynamic dimension too, read only
  by decodekit::paged_attention, so longer contexts do not recompile.
- Attention goes through decodekit's C++ paged kernel on the CPU where it is built, else through torch operations
  (paged.decode_attention: the rows' blocks gathered, one SDPA call), which run on any device: on CUDA the step is
  compiled with mode="reduce-overhead" (core.compile.step_options) and replayed as CUDA graphs, one per row-count
  bucket (powers of two) and block-table width bucket, the rows and the table padded up to them. The manager's
  paged_attention="flex" takes flex attention instead (batching/flex.py: the blocks read in place by one fused
  kernel); ATTENTION says what each choice runs.
- Steps with prompt chunks run eagerly (their shapes change with every chunk), and so does a step that does not
  compile (logged once on the `decodekit` logger, then eager for good).

Measured on the default model (docs/performance.md); the step takes tens of seconds to compile on 2 CPU threads, so
a server calls warm_up() before taking requests.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from .. import kernels
from ..core.compile import compile_own, replays_graphs, step_options
from .paged import ROUTES, DecodeRows, PagedBatch, PagedCache, Segment, slots_of
from ..core.transfer import to_device

logger = logging.getLogger("decodekit")

MIN_SIZE = 2  # of a dynamic dimension: one of size 1 would be specialised by the compiler


def bucket(n: int) -> int:
    """The power of two a dimension of `n` (at least MIN_SIZE) is padded up to where each size replays a graph of its
    own."""
    return max(MIN_SIZE, 1 << (n - 1).bit_length())


def mark_step_dynamic(ids, position, slots, table) -> None:
    """The step's sizes that change from step to step (its rows: ids' dim 1 and the other inputs' dim 0; its
    block-table width) are marked maybe dynamic: traced as symbols, the rows' unified into one, and specialised only
    where the traced code needs a fixed value. Marked strictly dynamic, any guard the trace made on them was a
    violated constraint and every step ran eagerly, as seen on CUDA twice: four row symbols found equal, then the
    rows found equal to 16 (a CPU-only branch that read the rows before the device); the CPU's torch here unified and
    widened instead, so only the marks themselves are tested here."""
    torch._dynamo.maybe_mark_dynamic(ids, 1)
    torch._dynamo.maybe_mark_dynamic(table, 1)
    for tensor in (position, slots, table):
        torch._dynamo.maybe_mark_dynamic(tensor, 0)


# The manager's paged_attention: "auto" or one of the routes themselves (paged.ROUTES), one vocabulary for both.
ATTENTION = ("auto", *ROUTES)


def attention_route(choice: str, model, keys, options: dict, block_size: int) -> str:
    """The route (paged.ROUTES) of a compiled step's attention for the manager's paged_attention `choice`: "auto" is
    decodekit's C++ kernel where it can serve (kernels.paged_step_ready), else "gathered" (decode_attention); a route
    is taken as asked. ValueError where the kernel or flex cannot run."""
    if choice == "auto":
        return "kernel" if kernels.paged_step_ready(model, keys) else "gathered"
    if choice == "kernel" and not kernels.paged_step_ready(model, keys):
        raise ValueError(
            f"paged_attention='kernel' cannot run here: decodekit's C++ paged kernel takes a float32 or bfloat16 cache "
            f"in the model's dtype on the CPU with the kernels built (here a {str(keys.dtype).removeprefix('torch.')} "
            f"cache on {keys.device}). Use 'auto' or 'gathered'."
        )
    if choice == "flex":
        from .flex import KEY_TILES, available, key_tile

        missing = available()
        if missing is not None:
            raise ValueError(f"paged_attention='flex' cannot run here: {missing}. Use 'auto' or 'gathered'.")
        if keys.device.type == "cuda" and key_tile(block_size) is None:
            raise ValueError(
                f"paged_attention='flex' takes a block_size that one of the fused kernel's key tiles "
                f"({', '.join(map(str, KEY_TILES))}) divides; got block_size={block_size}."
            )
        if keys.device.type == "cpu" and options.get("backend", "inductor") == "inductor":
            # Seen with torch 2.13: a step whose mask reads the tables built in the step came out wrong through
            # inductor's CPU flex template (right eagerly and with the mask built outside the compiled code).
            raise ValueError(
                "paged_attention='flex' is for compiled steps on a GPU: inductor's CPU flex template gives wrong "
                "attention for the paged mask. On the CPU use 'auto' (decodekit's kernel) or 'gathered'."
            )
    return choice


class KeptRows(NamedTuple):
    """A compiled step's rows as later steps reuse them: where each request row is (its (request id, row) -> its
    index in `table`), the block table and positions on the device, the positions as the host gave them, and what a
    step adds to each (1 a real row, 0 a padding row)."""

    places: dict
    table: torch.Tensor
    position: torch.Tensor
    positions: list
    advance: torch.Tensor


class CompiledDecode:
    """Decode steps of the rows of a PagedCache through one compiled forward, whatever their number.

    `options`: compile_config (torch.compile's mode/fullgraph/dynamic/backend/options), as for generate();
    `attention`: one of ATTENTION (the manager's paged_attention)."""

    def __init__(self, model, cache: PagedCache, options: dict | None, max_length: int, attention: str = "auto"):
        self.model, self.cache = model, cache
        keys = cache.keys[0]
        self.options = step_options(options, keys.device)
        self.route = attention_route(attention, model, keys, self.options, cache.block_size)
        if self.route == "flex":
            # Flex attention weighs a partial block's unseen slots by 0, and 0 times the NaN that uninitialised memory
            # may hold is NaN: the pools start at zeros.
            cache.commit()
        self.graphs = keys.device.type == "cuda" and replays_graphs(self.options)
        self.steps = 0  # decode steps this manager ran compiled (warm-up's included)
        self.host = kernels.StepHost.of(model)
        self._key: tuple | None = None
        self._kept: KeptRows | None = None  # the previous step's rows on the device (_rows_state)
        self.scratch = cache.allocator.allocate(1)[0]  # where padding rows write; never read by a real row
        model.rotary.ensure(max_length, model.device, model.dtype)  # the compiled code cannot grow it
        if self.graphs:
            # The step writes the pools in place: CUDA-graph trees replay a graph that mutates its inputs only where
            # those inputs keep their addresses, which the pools do for the manager's life (as transformers marks
            # its StaticCache's tensors).
            for pool in (*cache.keys, *cache.values):
                torch._dynamo.mark_static_address(pool)
        if self.route == "gathered" and attention == "auto":
            logger.info(
                "continuous batching: compiled decode steps attend through torch operations (decode_attention): "
                "decodekit's C++ paged kernel takes a float32 or bfloat16 cache on the CPU with the kernels built "
                "(here a %s cache on %s)",
                str(keys.dtype).removeprefix("torch."),
                keys.device,
            )

    @property
    def key(self) -> tuple:
        """What decides this manager's compiled code: its step is kept by the model's StepHost under it, so a later
        manager with a cache of the same shape (another generate_batch call, say) reuses what an earlier one
        compiled. The step's guards check its arguments only (core.compile.argument_guards_only), so the pools'
        shape is part of the key. Made once per route (every step asks for it)."""
        if self._key is None or self._key[4] != self.route:
            pool = self.cache.keys[0]
            options = repr(sorted(self.options.items()))
            self._key = (self.cache.block_size, tuple(pool.shape), pool.dtype, pool.device, self.route, options)
        return self._key

    @property
    def broken(self) -> str | None:
        """Why this manager's compiled step failed (its steps then run eagerly), or None."""
        return self.host.failure("paged decode", self.key)

    def usable(self) -> bool:
        return self.broken is None

    def __call__(self, tokens, tables: list[list[int]], positions: list[int], rows_key=None) -> torch.Tensor | None:
        """Logits [rows, V] of one decode step (row i: token tokens[i] at positions[i] of the row whose blocks
        are tables[i]; `tokens` a tensor on the cache's device or a list), or None when this step cannot run
        compiled (the caller runs it eagerly). `rows_key` names the step's rows (the same requests, in the same
        order, as the previous step): then the block table kept on the device from that step is used again and the
        positions advanced there, where each row is one position further on, instead of both being rebuilt from
        lists and copied."""
        if not self.usable():
            return None
        rows = len(tokens)
        size = bucket(rows) if self.graphs else max(MIN_SIZE, rows)
        pad = size - rows
        kernels.settle_routes(self.model, size)  # before the step is traced for this many rows
        device = self.cache.keys[0].device
        ids = torch.as_tensor(tokens, dtype=torch.long, device=device)
        ids = torch.cat((ids, ids.new_zeros(pad)))[None] if pad else ids[None]
        table, position = self._rows_state(
            tables, positions, rows_key, size, "cpu" if self.route == "kernel" else device
        )
        slots = slots_of(table, torch.arange(size, device=table.device), position, self.cache.block_size)
        mark_step_dynamic(ids, position, slots, table)
        try:
            step = self._step()
            if self.graphs:
                torch.compiler.cudagraph_mark_step_begin()
            logits = step(ids, position, slots, table, self.cache.keys, self.cache.values)
        except Exception as error:  # not only dynamo's: inductor raises AssertionErrors and the like
            if self.route == "flex":
                # The fused route has more of torch's compiler under it than the gathered one: where it fails, the
                # step stays compiled over gathered blocks (the step is run again whole: what it wrote before it
                # failed is written again, the same values at the same slots).
                logger.warning(
                    "continuous batching: the compiled decode step through flex attention failed (%s: %s); it "
                    "attends through gathered blocks from now on",
                    type(error).__name__,
                    (str(error).splitlines() or [""])[0],
                )
                self.route = "gathered"
                return self(tokens, tables, positions, rows_key)
            # The eager step that follows raises again where the fault is the step's inputs, and fails only the
            # requests concerned; a compiled graph that raised once is not run again.
            what = "continuous batching: the compiled decode step failed; steps run eagerly"
            self.host.failed("paged decode", self.key, error, what, redo=True)
            return None
        # A graph's outputs live in its memory, which the next replay overwrites: the step's logits are copied out.
        return logits[:rows].clone() if self.graphs else logits[:rows]

    def forget_rows(self, request_id: str) -> None:
        """A request ended: its rows are not carried into later steps (its blocks go to others; its id may come
        again)."""
        if self._kept is not None:
            places = {place: at for place, at in self._kept.places.items() if place[0] != request_id}
            self._kept = self._kept._replace(places=places)

    def _rows_state(self, tables, positions, rows_key, size: int, device):
        """The step's block table [size, width] and positions [size] on `device` (decode_attention indexes on the
        cache's device; the C++ kernel reads them on the CPU). A request's table does not change while it runs, so
        the rows of the previous step are carried on the device: the same rows in the same order, each one position
        on, reuse its tensors with the positions advanced there; otherwise the rows still here are gathered by index
        beside those that joined, built from their lists (the index, the joined rows and the positions are copied).
        Rebuilt whole where the table's width changes (the longest row came or went: decode_attention's work
        follows the width). Padding rows write at position 0 of the scratch block and stay there. `rows_key`:
        ((request id, rows) per request, in the step's order), None for rows nobody asks for again (warm-up)."""
        kept, rows = self._kept, len(tables)
        width = max(MIN_SIZE, max(len(t) for t in tables))
        width = bucket(width) if self.graphs else width
        places = [(rid, j) for rid, n in rows_key for j in range(n)] if rows_key is not None else None
        if places is not None and kept is not None and kept.table.shape[1] == width:
            at = [kept.places.get(place) for place in places]
            same = at == list(range(rows)) and kept.table.shape[0] == size
            if same and all(kept.positions[a] + 1 == p for a, p in zip(at, positions)):
                state = kept._replace(position=kept.position + kept.advance, positions=positions)
            else:
                state = self._gathered(kept, places, at, tables, positions, size, width, device)
            self._kept = state
            return state.table, state.position
        pad = size - rows
        table = to_device(
            [t + [self.scratch] * (width - len(t)) for t in tables] + [[self.scratch] * width] * pad, torch.long, device
        )
        position = to_device(positions + [0] * pad, torch.long, device)
        advance = to_device([1] * rows + [0] * pad, torch.long, device)
        places = dict(zip(places, range(rows))) if places is not None else None
        self._kept = KeptRows(places, table, position, positions, advance) if places is not None else None
        return table, position

    def _gathered(self, kept, places, at, tables, positions, size, width, device) -> KeptRows:
        """The step's table from the kept rows (`at`: each row's index there, None for a row that joined) and the
        joined rows' lists, by one index; its positions from the host (a step with prompt chunks may have moved the
        kept rows on since)."""
        joined = [i for i, a in enumerate(at) if a is None]
        base = kept.table.shape[0]
        scratch = base + len(joined)
        fresh = [tables[i] + [self.scratch] * (width - len(tables[i])) for i in joined] + [[self.scratch] * width]
        slot = {i: base + k for k, i in enumerate(joined)}
        index = to_device(
            [slot[i] if a is None else a for i, a in enumerate(at)] + [scratch] * (size - len(at)), torch.long, device
        )
        table = torch.cat((kept.table, to_device(fresh, torch.long, device))).index_select(0, index)
        position = to_device(positions + [0] * (size - len(at)), torch.long, device)
        return KeptRows(dict(zip(places, range(len(places)))), table, position, positions, (index != scratch).long())

    def warm_up(self, max_rows: int) -> list[int]:
        """Compiles the step now instead of at the first decode step, and runs it at one row and at `max_rows`
        rows (padding rows on the scratch block), the two ends of what the manager's steps take, and at the top
        of each product route class below `max_rows` (kernels.linear.ROW_CLASSES: the traced code differs on
        either side); returns those row counts ([] where steps cannot run compiled)."""
        sizes = sorted({1, max_rows, *(most for most, _ in kernels.linear.ROW_CLASSES if most < max_rows)})
        if self.graphs:  # a graph per row bucket, each recorded now rather than at a request's step
            sizes = sorted({min(bucket(n), bucket(max_rows)) for n in range(1, max_rows + 1)})
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

    def _step(self):
        model, bs, route = self.model, self.cache.block_size, self.route

        def make():
            def decode(ids, positions, slots, tables, keys, values):
                rows = DecodeRows(keys, values, slots, tables, positions, bs, route=route)
                return model(ids, position_ids=positions[None], past_key_values=rows, use_cache=True).logits[0]

            logger.info("continuous batching: compiling the decode step")
            return compile_own(decode, self.options)

        step = self.host.step("paged decode", self.key, make, limit=None)
        self.steps += 1
        return step
