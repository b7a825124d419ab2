"""Beam search (num_beams > 1), beam sampling (with do_sample=True) and diverse beam search (num_beam_groups > 1).

The search follows transformers' semantics, so results match it on the same weights:
- every step keeps the `max(2, 1 + n_eos) * num_beams` best continuations of all beams of a prompt; those
  that hit a stopping criterion become finished hypotheses (only if among the top `num_beams`), scored
  sum(logprobs) / generated_length ** length_penalty; the best unfinished `num_beams` keep running;
- `early_stopping`: True stops a prompt once it has num_beams finished hypotheses; False stops when a
  heuristic says no running beam can beat the worst finished one; "never" stops only when no running
  beam can in principle do better (using max_length when length_penalty > 0);
- with groups, each group of num_beams / num_beam_groups beams is its own search, and a token already
  chosen at this step by an earlier group costs `diversity_penalty` per use (Hamming diversity).
The cache is reordered through the cache hook point's `reorder`, and the logits processors see the
running beams' sequences, as in the core loop.

With compile=True (and processors that read only the scores) every step after the first is one compiled
function (FusedBeams, on fused.py's machinery): cache reorder, forward, log-softmax, processors and the
search's update, with the search state as tensors. The host reads "still searching" every SYNC_EVERY steps;
steps after the search ended leave the state as it was, so the result equals the eager loop's.
"""

from __future__ import annotations

import torch

from ..families.cache import reorder_rows
from ..core.config import is_int
from ..core.generate import forward_accepts, token_positions
from ..core.outputs import GenerateBeamOutput
from ..core.selectors import draw_key, race_noise
from ..core.transfer import to_device
from ..registry import hookimpl
from ..core.fused_loop import (
    FusedLoop,
    SYNC_EVERY,
    eos_blocks,
    eos_tensor,
    host_block,
    host_masks,
    min_length_of,
    processors_key,
    step_logits,
    step_processors,
)

NEG = -1.0e9


@hookimpl
def decodekit_config_fields():
    return {
        "num_beams": 1,
        "length_penalty": 1.0,
        "early_stopping": False,
        "num_beam_groups": 1,
        "diversity_penalty": 0.0,
    }


@hookimpl
def decodekit_validate_config(generation_config):
    gc = generation_config
    nb, groups = gc.num_beams, gc.num_beam_groups
    bad = gc.invalid

    if not is_int(nb) or nb < 1:
        raise bad("num_beams", "expected an integer >= 1")
    if not is_int(groups) or groups < 1:
        raise bad("num_beam_groups", "expected an integer >= 1")
    if nb > 1 and gc.number("num_return_sequences", 1) > nb:
        raise bad("num_return_sequences", f"beam search returns at most num_beams={nb} sequences per prompt")
    if nb % groups:
        raise bad("num_beam_groups", f"num_beams={nb} must be divisible by num_beam_groups")
    if groups > 1 and gc.do_sample is True:
        raise bad("num_beam_groups", "diverse beam search is deterministic; it cannot be combined with do_sample=True")
    if not (
        isinstance(gc.early_stopping, bool) or (isinstance(gc.early_stopping, str) and gc.early_stopping == "never")
    ):
        raise bad("early_stopping", "expected True, False or 'never'")
    if gc.number("length_penalty", None) is None or abs(gc.length_penalty) > MAX_LENGTH_PENALTY:
        raise bad(
            "length_penalty",
            f"expected a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}] (> 0 favours "
            "longer sequences, < 0 shorter ones)",
        )
    if gc.number("diversity_penalty", -1) < 0:
        raise bad("diversity_penalty", "expected a number >= 0")
    if groups > 1 and gc.diversity_penalty == 0:
        raise bad("diversity_penalty", "num_beam_groups > 1 needs diversity_penalty > 0 to make the groups differ")


@hookimpl
def decodekit_decoding_loop(generation_config):
    return BeamSearch() if generation_config.num_beams > 1 else None


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [items, beams, ...] -> t[i, index[i, j], ...]."""
    expanded = index.view(*index.shape, *([1] * (t.dim() - 2))).expand(*index.shape, *t.shape[2:])
    return t.gather(1, expanded)


def _at(t: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    """t [items, beams, length] at sequence index `cur` (a 0-d tensor): [items, beams]."""
    return t.index_select(2, cur.view(1)).squeeze(2)


MAX_LENGTH_PENALTY = 30  # length ** 30 is a float64 number for any length up to 10**10


def _penalty(length: torch.Tensor, length_penalty: float) -> torch.Tensor:
    """length ** length_penalty, computed in float64 and rounded once, as Python computes it."""
    return (length.double() ** length_penalty).float()


class _Search:
    """The state of `items` independent searches of `beams` beams each (one per prompt, or per prompt and group).

    Every field is a tensor of fixed shape (sequences are `length` long, filled with a pad token), so the
    fused step carries the state as its arguments. `T0` (the prompt length) and the `cur` of a step are
    0-d tensors for the same reason.
    """

    FIELDS = (
        "running",
        "sequences",
        "running_scores",
        "scores",
        "finished",
        "improvable",
        "hits",
        "running_indices",
        "indices",
    )

    def __init__(self, beams: int, keep: int, T0: torch.Tensor, fields):
        self.beams, self.keep, self.T0 = beams, keep, T0
        for name, value in zip(self.FIELDS, fields, strict=True):
            setattr(self, name, value)
        self.top_mask = torch.arange(keep, device=T0.device) < beams

    @classmethod
    def start(cls, ids: torch.Tensor, items: int, beams: int, length: int, fill: int, keep: int) -> "_Search":
        T0 = ids.shape[1]
        dev = ids.device
        running = torch.full((items, beams, length), fill, dtype=torch.long, device=dev)
        running[:, :, :T0] = ids.view(items, beams, T0)
        running_scores = torch.zeros(items, beams, device=dev)
        running_scores[:, 1:] = NEG  # all beams start identical: only the first may expand
        # Where each token's beam came from (its row at the step before), by sequence index; -1 in the prompt.
        running_indices = torch.full((items, beams, length), -1, dtype=torch.long, device=dev)
        return cls(
            beams,
            keep,
            torch.tensor(T0, device=dev),
            (
                running,
                running.clone(),
                running_scores,
                torch.full((items, beams), NEG, device=dev),
                torch.zeros(items, beams, dtype=torch.bool, device=dev),
                torch.ones(items, 1, dtype=torch.bool, device=dev),
                torch.zeros(items, keep, dtype=torch.bool, device=dev),
                running_indices,
                running_indices.clone(),
            ),
        )

    def fields(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def step(self, logp, cur, row_of_beam, hits_of, gc, max_length, noise=None):
        """One step writing sequence index `cur` (0-d tensor) from log-probs [items, beams, V].

        row_of_beam [items, beams]: the flat row ids of the beams; hits_of(candidates [items, keep, length],
        tokens [items, keep]) -> bool [items, keep]: which candidates stop; noise: Exponential(1) noise
        [items, beams * V] for beam sampling, None for beam search. No state tensor is written in place.
        """
        items, beams, V = logp.shape
        acc = (logp + self.running_scores[:, :, None]).view(items, beams * V)
        if noise is not None:
            # `keep` continuations sampled without replacement from softmax(acc): Gumbel top-k, Gumbel = -log(E).
            idx = (acc - noise.log()).topk(self.keep, dim=-1).indices
            top = acc.gather(1, idx)
        else:
            top, idx = acc.topk(self.keep, dim=-1)
        src, tokens = idx // V, idx % V
        at = cur.view(1)
        cand = _gather(self.running, src).index_copy(2, at, tokens[:, :, None])
        cand_indices = _gather(self.running_indices, src).index_copy(2, at, row_of_beam.gather(1, src)[:, :, None])
        self.hits = hits_of(cand, tokens)

        alive = top + self.hits.float() * NEG
        nxt = alive.topk(beams, dim=-1).indices
        self.running, self.running_scores = _gather(cand, nxt), alive.gather(1, nxt)
        self.running_indices = _gather(cand_indices, nxt)

        done_now = self.hits & self.top_mask[None, :]
        final = top / _penalty(cur + 1 - self.T0, gc.length_penalty)
        final = final + (self.finished.all(-1, keepdim=True) & (gc.early_stopping is True)).float() * NEG
        final = final + (~self.improvable).float() * NEG + (~done_now).float() * NEG
        merged = torch.cat((self.scores, final), dim=1)
        best = merged.topk(beams, dim=-1).indices
        self.sequences = _gather(torch.cat((self.sequences, cand), dim=1), best)
        self.scores = merged.gather(1, best)
        self.indices = _gather(torch.cat((self.indices, cand_indices), dim=1), best)
        self.finished = torch.cat((self.finished, done_now), dim=1).gather(1, best)

        length = (max_length if gc.early_stopping == "never" and gc.length_penalty > 0 else cur + 1) - self.T0
        best_running = self.running_scores[:, :1] / _penalty(length, gc.length_penalty)
        worst_final = torch.where(
            self.finished, self.scores.min(dim=1, keepdim=True).values, self.scores.new_full((), NEG)
        )
        self.improvable = self.improvable & (best_running > worst_final).any(dim=-1, keepdim=True)

    def searching(self, gc) -> torch.Tensor:
        """Whether any search goes on, as a 0-d bool tensor (the fused step keeps it on the device)."""
        closed = self.finished.all() & (gc.early_stopping is True)
        return self.improvable.any() & ~closed & ~self.hits.all()


class _Plan:
    """The layout of a beam search over `rows` rows: B prompts, G groups of gs beams each, `keep` candidates
    per search. Searches are indexed (prompt, group); group g of prompt b holds flat rows b*nb + g*gs ... + gs - 1."""

    def __init__(self, rows: int, gc, device):
        self.nb, self.G = gc.num_beams, gc.num_beam_groups
        self.gs = self.nb // self.G
        self.rows, self.B = rows, rows // self.nb
        self.keep = max(2, 1 + len(gc.eos_token_ids)) * self.gs
        self.flat_rows = torch.arange(rows, device=device).view(self.B * self.G, self.gs)

    def start(self, input_ids, gc, length: int) -> _Search:
        # transformers' fill, kept exactly: a pad id of 0 counts as unset there, so finished beams end in EOS.
        eos = gc.eos_token_ids
        fill = (gc.pad_token_id or eos[0]) if eos else (gc.pad_token_id if gc.pad_token_id is not None else -1)
        return _Search.start(input_ids, self.B * self.G, self.gs, length, fill, self.keep)

    def advance(self, search, logp, cur, hits_of, gc, max_length, noise_key=None):
        """One step of every search from the processed log-probs [rows, V] (noise_key: beam sampling)."""
        logp = logp.view(self.B, self.G, self.gs, -1)
        if self.G == 1:
            items, V = self.B, logp.shape[-1]
            noise = race_noise(noise_key, cur, items, self.gs * V) if noise_key is not None else None
            search.step(logp.view(self.B, self.gs, -1), cur, self.flat_rows, hits_of, gc, max_length, noise)
        else:
            self._diverse_step(search, logp, cur, hits_of, gc, max_length)

    def _diverse_step(self, search, logp, cur, hits_of, gc, max_length):
        """Groups in order; each pays diversity_penalty for every use of a token by earlier groups this step."""
        B, G, gs, V = logp.shape
        used = torch.zeros(B, V, device=logp.device)
        groups = []
        for g in range(G):
            part = _Search(gs, search.keep, search.T0, (t.view(B, G, *t.shape[1:])[:, g] for t in search.fields()))
            penalised = logp[:, g] - gc.diversity_penalty * used[:, None, :]
            part.step(penalised, cur, self.flat_rows.view(B, G, -1)[:, g], hits_of, gc, max_length)
            chosen = _at(part.running, cur)
            used = used.scatter_add(1, chosen, torch.ones_like(chosen, dtype=used.dtype))
            groups.append(part)
        for name in _Search.FIELDS:
            setattr(search, name, torch.stack([getattr(part, name) for part in groups], dim=1).flatten(0, 1))

    def output(self, search, gc, cache, scores_out, logits_out):
        B, G, gs, T0 = self.B, self.G, self.gs, int(search.T0)
        n = gc.num_return_sequences
        seqs = search.sequences.view(B, G * gs, -1)
        scores = search.scores.view(B, G * gs)
        indices = search.indices.view(B, G * gs, -1)
        if G > 1:  # pool the groups' hypotheses, best first
            order = scores.argsort(dim=1, descending=True)
            seqs, scores, indices = _gather(seqs, order), scores.gather(1, order), _gather(indices, order)
        seqs = seqs[:, :n].reshape(B * n, -1)
        scores = scores[:, :n].reshape(B * n)
        indices = indices[:, :n].reshape(B * n, -1)
        generated = int((indices >= 0).sum(dim=1).max())
        seqs, indices = seqs[:, : T0 + generated], indices[:, T0 : T0 + generated]
        if not gc.return_dict_in_generate:
            return seqs
        return GenerateBeamOutput(
            sequences=seqs,
            sequences_scores=scores if gc.output_scores else None,
            scores=tuple(scores_out) if scores_out is not None else None,
            logits=tuple(logits_out) if logits_out is not None else None,
            beam_indices=indices,
            past_key_values=cache,
        )


def _stopping_hits(stopping, cur: int):
    """hits_of for _Search.step from the pipeline's stopping criteria, which read the sequences so far."""

    def hits_of(cand, tokens):
        items, keep, _ = cand.shape
        return stopping(cand[:, :, : cur + 1].reshape(items * keep, cur + 1), None).view(items, keep)

    return hits_of


class BeamSearch:
    """The decoding loop for num_beams > 1."""

    def rows_per_prompt(self, gc) -> int:
        return gc.num_beams

    def __call__(self, model, input_ids, attention_mask, pipeline, gc, streamer, context):
        if streamer is not None:
            raise ValueError("streamer is not supported with beam search (num_beams > 1): beams change until the end.")
        if gc.compile or gc.compile_config is not None:
            return FusedBeams(self)(model, input_ids, attention_mask, pipeline, gc, streamer, context)
        return self.eager(model, input_ids, attention_mask, pipeline, gc, streamer, context)

    def eager(self, model, input_ids, attention_mask, pipeline, gc, streamer, context):
        max_length = context.max_length
        rows, T0 = input_ids.shape
        plan = _Plan(rows, gc, input_ids.device)
        search = plan.start(input_ids, gc, max_length)
        noise_key = draw_key(context.generator).to(input_ids.device) if gc.do_sample else None
        cache = pipeline.cache
        extra = {"logits_to_keep": 1} if forward_accepts(model, "logits_to_keep") else {}
        every = token_positions(model, input_ids, attention_mask)
        positions = every[:, -1:] if every is not None else None
        scores_out = [] if gc.output_scores else None
        logits_out = [] if gc.output_logits else None

        out = model(
            input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=cache is not None,
            position_ids=every,
            **extra,
        )
        cur = T0
        while True:
            logits = out.logits[:, -1, :].float()
            flat = search.running[:, :, :cur].reshape(rows, cur)
            logp = pipeline.processors(flat, torch.log_softmax(logits, dim=-1))
            if logits_out is not None:
                logits_out.append(logits.clone())
            if scores_out is not None:
                scores_out.append(logp.clone())
            cur_t = torch.tensor(cur, device=input_ids.device)
            plan.advance(search, logp, cur_t, _stopping_hits(pipeline.stopping, cur), gc, max_length, noise_key)
            source = _at(search.running_indices, cur_t).reshape(-1)
            cur += 1
            if not bool(search.searching(gc)) or cur >= max_length:
                break
            if cache is not None:
                reorder_rows(cache, source)
            if attention_mask is not None:
                attention_mask = torch.cat((attention_mask[source], attention_mask.new_ones(rows, 1)), dim=-1)
            if positions is not None:
                positions = positions[source] + 1
            step_ids = search.running[:, :, :cur].reshape(rows, cur)
            if cache is not None:
                step_ids = step_ids[:, -1:]
            out = model(
                step_ids,
                attention_mask=attention_mask,
                past_key_values=cache,
                use_cache=cache is not None,
                position_ids=positions if cache is not None else token_positions(model, step_ids, attention_mask),
                **extra,
            )
        return plan.output(search, gc, cache, scores_out, logits_out)


class FusedBeams(FusedLoop):
    """Beam search with compile=True: the eager first step after the prefill, then one compiled step per token.

    The step takes the search state, reorders the static cache by where the chosen beams came from, runs
    the model on the beams' last tokens and applies the search update. Beams of one prompt share its
    attention mask and positions, so those need no reordering. Once the search has ended the step returns
    the state unchanged (torch.where on a device flag), so the steps run before the host reads the flag
    change nothing.
    """

    takes_host_masks = True

    def __init__(self, beams: BeamSearch):
        self.beams = beams

    def eager(self, model, input_ids, attention_mask, pipeline, gc, streamer, context):
        return self.beams.eager(model, input_ids, attention_mask, pipeline, gc, streamer, context)

    def kind(self, pipeline, gc) -> tuple:
        G = gc.num_beam_groups
        name = f"{'beam sampling' if gc.do_sample else 'beam search'}, {gc.num_beams} beams" + (
            f" in {G} groups" if G > 1 else ""
        )
        settings = (gc.length_penalty, gc.early_stopping, gc.diversity_penalty, len(gc.eos_token_ids))
        masked = bool(host_masks(pipeline))  # eos_block is then [rows, V], not [V]
        return (name, settings, processors_key(pipeline), masked)

    def make_step(self, model, cache, pipeline, gc):
        procs = step_processors(pipeline)
        plan = _Plan(cache.keys[0].shape[0], gc, model.device)
        if model.runs_native_layers(plan.rows, cache):
            # reorder() then permutes a [rows, slots] index instead of copying every layer's buffers. Not for
            # the Python layers: inductor fuses the gather through the index into their attention kernels, which
            # then run several times slower than after a copy (docs/performance.md).
            cache.share_rows()

        def step(state, go, cur, positions, slots, mask, eos_block, noise_key, max_length, prompt_length, eos_ids):
            search = _Search(plan.gs, plan.keep, prompt_length, state)
            rows = plan.rows
            # The beams chosen at the last step continue from the cache rows they came from.
            source = torch.where(go, _at(search.running_indices, slots).reshape(rows), plan.flat_rows.view(rows))
            cache.reorder(source)
            tokens = _at(search.running, slots).reshape(rows, 1)
            logits = step_logits(model, tokens, mask, positions, cache, slots)
            logp = torch.log_softmax(logits, dim=-1) + eos_block
            for p in procs:
                logp = p(tokens, logp)

            def hits_of(cand, chosen):
                return torch.isin(chosen, eos_ids) | (cur + 1 >= max_length)

            plan.advance(search, logp, cur, hits_of, gc, max_length, noise_key)
            state = tuple(torch.where(go, new, old) for new, old in zip(search.fields(), state, strict=True))
            return state, go & search.searching(gc), logp

        return step

    def _first_step(
        self, model, cache, input_ids, attention_mask, pipeline, gc, plan, noise_key, scores_out, max_length
    ):
        """Prefill and the first step, run eagerly as in the eager loop (the prompt's length varies): the search after
        it, the step's log-probabilities, and the step's key mask and positions."""
        T0 = input_ids.shape[1]
        search = plan.start(input_ids, gc, cache.max_cache_len)
        logits, mask, positions = self.prefill(model, cache, input_ids, attention_mask)
        logp = pipeline.processors(input_ids, torch.log_softmax(logits, dim=-1))
        if scores_out is not None:
            scores_out.append(logp)
        at = torch.tensor(T0, device=input_ids.device)
        plan.advance(search, logp, at, _stopping_hits(pipeline.stopping, T0), gc, max_length, noise_key)
        return search, logp, mask, positions

    def run(self, model, fused, input_ids, attention_mask, pipeline, gc, streamer, context):
        rows, T0 = input_ids.shape
        dev = input_ids.device
        cache = fused.cache
        max_length = context.max_length
        plan = _Plan(rows, gc, dev)
        noise_key = draw_key(context.generator).to(dev) if gc.do_sample else None
        scores_out = [] if gc.output_scores else None
        search, logp, mask, positions = self._first_step(
            model, cache, input_ids, attention_mask, pipeline, gc, plan, noise_key, scores_out, max_length
        )
        go = search.searching(gc)
        searching = [go]  # before each compiled step: whether it was a real one
        state = search.fields()
        eos_ids = eos_tensor(gc, dev)
        no_block, block = eos_blocks(logp.shape[-1], gc.eos_token_ids, dev)
        min_length = min_length_of(pipeline)
        lengths = torch.tensor(max_length, device=dev), torch.tensor(T0, device=dev)
        host = host_masks(pipeline)
        cur = T0 + 1
        # The step's length and cache slot advance on the device (as FusedTokens' slot does: no copy from the host
        # that would wait for the step before)
        cur_t, slots = to_device([T0, T0 - 1], torch.long, dev)
        while cur < max_length:
            if (cur - T0) % SYNC_EVERY == 0 and not bool(go):
                break
            slot = cur - 1
            mask[:, slot] = 1
            positions = positions + 1
            cur_t, slots = cur_t + 1, slots + 1
            eos_block = block if cur < min_length else no_block
            if host:  # the running beams' sequences, in the rows the step computes (state[0]: running)
                eos_block = eos_block + host_block(host, state[0][:, :, :cur].reshape(rows, cur), eos_block.shape[-1])
            state, go, logp = fused(
                state,
                go,
                cur_t,
                positions,
                slots[None],
                mask,
                eos_block,
                noise_key,
                *lengths,
                eos_ids,
            )
            searching.append(go)
            if scores_out is not None:
                scores_out.append(logp.clone())
            cur += 1
        # The eager loop's steps: the first, and each compiled one that began while the search went on.
        steps = int(torch.stack(searching[:-1]).sum()) + 1 if len(searching) > 1 else 1
        cache.lengths = [T0 + steps - 1] * len(cache.lengths)
        final = _Search(plan.gs, plan.keep, search.T0, state)
        return plan.output(final, gc, cache, scores_out[:steps] if scores_out is not None else None, None)
