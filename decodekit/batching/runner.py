"""What runs the model for a scheduler step: the tokens of many requests in one forward over the paged cache
(decodekit's own models), or, for any other model, one forward per request over a cache of its own.

A step is a list of `Work`: a chunk of a request's prompt (prefill, its first row only: the other rows share the
prompt's blocks afterwards) or one token for each of a request's rows (decode). `forward` returns, per request
whose step ends at a next token, the logits of its rows [rows, V].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.fused_loop import supports_step
from ..families.cache import new_cache
from .paged import PagedBatch, PagedCache, Segment
from .request import Request
from ..core.transfer import to_device
from ..kernels.step_host import StepHost
from ..kernels.packed import pack_linears


@dataclass
class Work:
    request: Request
    start: int = 0  # prefill: prompt tokens start:end; decode: start == end == 0
    end: int = 0

    @property
    def prefill(self) -> bool:
        return self.end > self.start

    @property
    def tokens(self) -> int:
        return self.end - self.start if self.prefill else self.request.rows

    @property
    def ends_prompt(self) -> bool:
        return self.prefill and self.end == self.request.prompt_length


def supports_paged(model) -> bool:
    """Whether `model` declares a paged step (decodekit's Llama family does)."""
    return supports_step(model, "paged")


class PagedRunner:
    """Every step's tokens in one forward of the model over a PagedCache (batching/paged.py)."""

    paged = True

    def __init__(
        self, model, num_blocks: int, block_size: int, compile_options: dict | None = None, attention: str = "auto"
    ):
        """compile_options: None for eager steps, else compile_config (a dict, maybe empty): steps whose rows
        all decode then run compiled (batching/compiled.py), attending by `attention` (compiled.ATTENTION)."""
        self.model = model
        self.weights = getattr(model, "module", model)  # the module whose weight layout the steps run on
        self.cache = PagedCache(model, num_blocks, block_size)
        self.compiled = None
        self.compiled_ready = True  # False: steps run eagerly until warm_up compiles (a server that listens first)
        self.compiled_layout = None  # whether the weights were packed when the step compiled (kernels.pack_linears)
        if compile_options is not None:
            from .compiled import CompiledDecode

            self.compiled = CompiledDecode(
                model, self.cache, compile_options, model.config.max_position_embeddings, attention
            )

    @property
    def total_blocks(self) -> int:
        """Blocks requests can hold: the cache's, less the compiled step's scratch block for its padding rows."""
        return self.cache.allocator.num_blocks - (self.compiled is not None)

    @property
    def free_blocks(self) -> int:
        return self.cache.allocator.free_blocks

    def warm_up(self, max_rows: int, compile: bool = True) -> list[int]:
        """The cache's memory taken now, and with compiled steps the step compiled (CompiledDecode.warm_up); with
        `compile` False, steps run eagerly until a later warm_up compiles."""
        self.cache.commit()
        self.compiled_ready = compile
        if self.compiled is None or not compile:
            return []
        with StepHost.of(self.weights).lock:  # compiled on the layout in force, which no other thread changes meanwhile
            self.on_compiled_layout()
            return self.compiled.warm_up(max_rows)

    def on_compiled_layout(self) -> bool:
        """Whether the model's weights are in the layout the compiled step was (or, at its first use, will be)
        compiled on; the caller holds the model's layout lock. An eager forward would decide the layout here too."""
        layout = pack_linears(self.weights)
        if self.compiled_layout is None:
            self.compiled_layout = layout
        return layout == self.compiled_layout

    def _row_blocks(self, prompt_length: int, max_length: int) -> tuple[int, int]:
        """(blocks of one row up to max_length, of those the prompt's full blocks, which the rows share)."""
        return self.cache.blocks_for(max_length), prompt_length // self.cache.block_size

    def blocks_needed(self, rows: int, prompt_length: int, max_length: int) -> int:
        """Blocks a request holds from admission to its end: every row's positions up to max_length, the prompt's
        full blocks counted once."""
        per_row, shared = self._row_blocks(prompt_length, max_length)
        return per_row + (rows - 1) * (per_row - shared)

    def admit(self, request: Request) -> bool:
        """Reserves the request's blocks; False (nothing taken) if too few are free now."""
        if self.blocks_needed(request.rows, request.prompt_length, request.max_length) > self.free_blocks:
            return False
        alloc = self.cache.allocator
        per_row, shared = self._row_blocks(request.prompt_length, request.max_length)
        first = alloc.allocate(per_row)
        request.tables = [first]
        for _ in range(request.rows - 1):
            alloc.share(first[:shared])
            request.tables.append(first[:shared] + alloc.allocate(per_row - shared))
        return True

    def release(self, request: Request) -> None:
        for table in request.tables:
            self.cache.allocator.free(table)
        request.tables = []
        if self.compiled is not None:  # its blocks go to others: its rows kept on the device are not used again
            self.compiled.forget_rows(request.id)

    def forward(self, works: list[Work]) -> dict[str, torch.Tensor]:
        # Every input token is on the host (prompts, and each row's last token: Request.tokens): one copy to the
        # device for the step.
        tables, segments, ids, keep, owners = [], [], [], [], []
        for work in works:
            r = work.request
            if work.prefill:
                segments.append(Segment(len(ids), len(ids) + work.tokens, len(tables), work.start))
                tables.append(r.tables[0])
                ids += r.prompt[work.start : work.end]
                if work.ends_prompt:
                    keep.append(len(ids) - 1)
                    owners.append((r.id, 1))
                continue
            position = r.length - 1
            for row in range(r.rows):
                segments.append(Segment(len(ids), len(ids) + 1, len(tables), position))
                tables.append(r.tables[row])
                keep.append(len(ids))
                ids.append(r.tokens[row][-1])
            owners.append((r.id, r.rows))
        ids = to_device(ids, torch.long, self.model.device)
        logits = None
        if self.compiled is not None and self.compiled_ready and not any(work.prefill for work in works):
            rows = tuple((work.request.id, work.request.rows) for work in works)
            # The compiled step runs on the layout it was compiled on. Where another thread's compiled call holds the
            # model's layout (a method on the same model), or left another one in force, this step runs eagerly on
            # what is there rather than wait for that call, step while the layout changes, or compile again.
            with StepHost.of(self.weights).if_free() as free:
                if free and self.on_compiled_layout():
                    logits = self.compiled(ids, tables, [s.first for s in segments], rows)
        if logits is None:
            batch = PagedBatch(self.cache, tables, segments)
            out = self.model(
                ids[None],
                position_ids=batch.position_ids,
                past_key_values=batch,
                use_cache=True,
                logits_to_keep=torch.tensor(keep, dtype=torch.long),
            )
            logits = out.logits[0]
        result, at = {}, 0
        for request_id, rows in owners:
            result[request_id] = logits[at : at + rows]
            at += rows
        for work in works:
            if work.ends_prompt:
                self._share_prompt(work.request)
                result[work.request.id] = result[work.request.id].expand(work.request.rows, -1)
        return result

    def _share_prompt(self, request: Request) -> None:
        """After the prompt's prefill: every other row gets its own copy of the prompt's last, partly filled block."""
        bs = self.cache.block_size
        if request.prompt_length % bs:
            last = request.prompt_length // bs
            for table in request.tables[1:]:
                self.cache.copy_block(request.tables[0][last], table[last])


class CacheRunner:
    """For a model without a paged path (a wrapped transformers model): a cache of its own per request (its rows
    as one batch) and one forward per request and step; the scheduling is the same, the steps are not shared."""

    paged = False

    def __init__(self, model, max_running: int):
        self.model = model
        self.total_blocks = max_running  # one "block" per running request
        self.free_blocks = max_running
        self.caches: dict[str, object] = {}

    def blocks_needed(self, rows: int, prompt_length: int, max_length: int) -> int:
        return 1

    def warm_up(self, max_rows: int) -> list[int]:
        return []  # each request's cache is made when it is admitted

    def admit(self, request: Request) -> bool:
        if self.free_blocks < 1:
            return False
        self.free_blocks -= 1
        self.caches[request.id] = new_cache(self.model, "dynamic", request.rows, request.max_length)
        return True

    def release(self, request: Request) -> None:
        if self.caches.pop(request.id, None) is not None:
            self.free_blocks += 1

    def forward(self, works: list[Work]) -> dict[str, torch.Tensor]:
        result = {}
        for work in works:
            r = work.request
            start, end = (work.start, work.end) if work.prefill else (r.length - 1, r.length)
            ids = to_device([row[start:end] for row in r.tokens], torch.long, self.model.device)
            out = self.model(ids, past_key_values=self.caches[r.id], use_cache=True)
            if not work.prefill or work.ends_prompt:
                result[r.id] = out.logits[:, -1, :]
        return result
