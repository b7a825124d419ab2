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
"""

from __future__ import annotations

import torch

from ..core.generate import _forward_accepts
from ..core.outputs import GenerateBeamOutput
from ..registry import hookimpl

NEG = -1.0e9


@hookimpl
def decodekit_config_fields():
    return {"num_beams": 1, "length_penalty": 1.0, "early_stopping": False, "num_beam_groups": 1, "diversity_penalty": 0.0}


@hookimpl
def decodekit_validate_config(generation_config):
    gc = generation_config
    nb, groups = gc.num_beams, gc.num_beam_groups
    bad = gc.invalid

    if not isinstance(nb, int) or isinstance(nb, bool) or nb < 1:
        raise bad("num_beams", "expected an integer >= 1")
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise bad("num_beam_groups", "expected an integer >= 1")
    if nb > 1 and gc.num_return_sequences > nb:
        raise bad("num_return_sequences", f"beam search returns at most num_beams={nb} sequences per prompt")
    if nb % groups:
        raise bad("num_beam_groups", f"num_beams={nb} must be divisible by num_beam_groups")
    if groups > 1 and gc.do_sample:
        raise bad("num_beam_groups", "diverse beam search is deterministic; it cannot be combined with do_sample=True")
    if gc.early_stopping not in (True, False, "never"):
        raise bad("early_stopping", "expected True, False or 'never'")
    if not isinstance(gc.length_penalty, (int, float)) or isinstance(gc.length_penalty, bool):
        raise bad("length_penalty", "expected a number (> 0 favours longer sequences, < 0 shorter ones)")
    if not isinstance(gc.diversity_penalty, (int, float)) or gc.diversity_penalty < 0:
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


class _Search:
    """The state of `items` independent searches of `beams` beams each (one per prompt, or per prompt and group)."""

    def __init__(self, ids: torch.Tensor, items: int, beams: int, max_length: int, fill: int, keep: int):
        T0 = ids.shape[1]
        dev = ids.device
        self.beams, self.keep, self.T0 = beams, keep, T0
        self.running = torch.full((items, beams, max_length), fill, dtype=torch.long, device=dev)
        self.running[:, :, :T0] = ids.view(items, beams, T0)
        self.sequences = self.running.clone()
        self.running_scores = torch.zeros(items, beams, device=dev)
        self.running_scores[:, 1:] = NEG  # all beams start identical: only the first may expand
        self.scores = torch.full((items, beams), NEG, device=dev)
        self.finished = torch.zeros(items, beams, dtype=torch.bool, device=dev)
        self.improvable = torch.ones(items, 1, dtype=torch.bool, device=dev)
        self.hits = torch.zeros(items, keep, dtype=torch.bool, device=dev)
        self.running_indices = torch.full((items, beams, max_length - T0), -1, dtype=torch.long, device=dev)
        self.indices = self.running_indices.clone()
        self.top_mask = torch.arange(keep, device=dev) < beams

    def step(self, logp, cur, row_of_beam, stopping, gc, max_length, generator=None):
        """One step from log-probs [items, beams, V]; row_of_beam [items, beams] are the flat row ids of the beams."""
        items, beams, V = logp.shape
        acc = (logp + self.running_scores[:, :, None]).view(items, beams * V)
        if gc.do_sample:
            # Sampling `keep` continuations without replacement from softmax(acc): Gumbel top-k.
            u = torch.rand(acc.shape, generator=generator, device=acc.device).clamp_(min=1e-20)
            idx = (acc - torch.log(-torch.log(u))).topk(self.keep, dim=-1).indices
            top = acc.gather(1, idx)
        else:
            top, idx = acc.topk(self.keep, dim=-1)
        src, tokens = idx // V, idx % V
        cand = _gather(self.running, src)
        cand[:, :, cur] = tokens
        cand_indices = _gather(self.running_indices, src)
        cand_indices[:, :, cur - self.T0] = row_of_beam.gather(1, src)
        self.hits = stopping(cand[:, :, : cur + 1].reshape(items * self.keep, cur + 1), None).view(items, self.keep)

        alive = top + self.hits.float() * NEG
        nxt = alive.topk(beams, dim=-1).indices
        self.running, self.running_scores = _gather(cand, nxt), alive.gather(1, nxt)
        self.running_indices = _gather(cand_indices, nxt)

        done_now = self.hits & self.top_mask[None, :]
        final = top / ((cur + 1 - self.T0) ** gc.length_penalty)
        final = final + (self.finished.all(-1, keepdim=True) & (gc.early_stopping is True)).float() * NEG
        final = final + (~self.improvable).float() * NEG + (~done_now).float() * NEG
        merged = torch.cat((self.scores, final), dim=1)
        best = merged.topk(beams, dim=-1).indices
        self.sequences = _gather(torch.cat((self.sequences, cand), dim=1), best)
        self.scores = merged.gather(1, best)
        self.indices = _gather(torch.cat((self.indices, cand_indices), dim=1), best)
        self.finished = torch.cat((self.finished, done_now), dim=1).gather(1, best)

        length = (max_length if gc.early_stopping == "never" and gc.length_penalty > 0 else cur + 1) - self.T0
        best_running = self.running_scores[:, :1] / (length ** gc.length_penalty)
        worst_final = torch.where(self.finished, self.scores.min(dim=1, keepdim=True).values, self.scores.new_full((), NEG))
        self.improvable = self.improvable & (best_running > worst_final).any(dim=-1, keepdim=True)

    def unfinished(self, gc) -> bool:
        open_beams = not (bool(self.finished.all()) and gc.early_stopping is True)
        return bool(self.improvable.any()) and open_beams and not bool(self.hits.all())


class BeamSearch:
    """The decoding loop for num_beams > 1."""

    def rows_per_prompt(self, gc) -> int:
        return gc.num_beams

    def __call__(self, model, input_ids, attention_mask, pipeline, gc, streamer, context):
        if streamer is not None:
            raise ValueError("streamer is not supported with beam search (num_beams > 1): beams change until the end.")
        nb, G = gc.num_beams, gc.num_beam_groups
        gs = nb // G
        rows, T0 = input_ids.shape
        B = rows // nb
        eos = gc.eos_token_ids
        keep = max(2, 1 + len(eos)) * gs
        fill = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
        max_length = context.max_length
        # Searches are indexed (prompt, group); group g of prompt b holds flat rows b*nb + g*gs ... + gs - 1.
        search = _Search(input_ids, B * G, gs, max_length, fill, keep)
        flat_rows = torch.arange(rows, device=input_ids.device).view(B * G, gs)
        cache = pipeline.cache
        extra = {"logits_to_keep": 1} if _forward_accepts(model, "logits_to_keep") else {}
        positions = attention_mask.sum(-1, keepdim=True) - 1 if attention_mask is not None else None
        scores_out = [] if gc.output_scores else None
        logits_out = [] if gc.output_logits else None

        out = model(input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=cache is not None, **extra)
        cur = T0
        while True:
            logits = out.logits[:, -1, :].float()
            flat = search.running[:, :, :cur].reshape(rows, cur)
            logp = pipeline.processors(flat, torch.log_softmax(logits, dim=-1))
            if logits_out is not None:
                logits_out.append(logits.clone())
            if scores_out is not None:
                scores_out.append(logp.clone())
            logp = logp.view(B, G, gs, -1)
            if G == 1:
                search.step(logp.view(B, gs, -1), cur, flat_rows, pipeline.stopping, gc, max_length, context.generator)
            else:
                self._diverse_step(search, logp, cur, flat_rows, pipeline.stopping, gc, max_length)
            source = search.running_indices[:, :, cur - T0].reshape(-1)
            cur += 1
            if not search.unfinished(gc) or cur >= max_length:
                break
            if cache is not None:
                cache.reorder(source)
            if attention_mask is not None:
                attention_mask = torch.cat((attention_mask[source], attention_mask.new_ones(rows, 1)), dim=-1)
                positions = positions[source] + 1
            step_ids = search.running[:, :, :cur].reshape(rows, cur)
            if cache is not None:
                step_ids = step_ids[:, -1:]
            out = model(step_ids, attention_mask=attention_mask, position_ids=positions if cache is not None else None,
                        past_key_values=cache, use_cache=cache is not None, **extra)
        return self._output(search, gc, B, G, gs, T0, cache, scores_out, logits_out)

    @staticmethod
    def _diverse_step(search, logp, cur, flat_rows, stopping, gc, max_length):
        """Groups in order; each pays diversity_penalty for every use of a token by earlier groups this step."""
        B, G, gs, V = logp.shape
        used = torch.zeros(B, V, device=logp.device)
        groups = [_Slice(search, B, G, g) for g in range(G)]
        for g, part in enumerate(groups):
            penalised = logp[:, g] - gc.diversity_penalty * used[:, None, :]
            part.search.step(penalised, cur, part.rows(flat_rows), stopping, gc, max_length)
            part.write_back()
            chosen = part.search.running[:, :, cur]
            used.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=used.dtype))

    @staticmethod
    def _output(search, gc, B, G, gs, T0, cache, scores_out, logits_out):
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
        seqs, indices = seqs[:, : T0 + generated], indices[:, :generated]
        if not gc.return_dict_in_generate:
            return seqs
        return GenerateBeamOutput(
            sequences=seqs, sequences_scores=scores if gc.output_scores else None,
            scores=tuple(scores_out) if scores_out is not None else None,
            logits=tuple(logits_out) if logits_out is not None else None,
            beam_indices=indices, past_key_values=cache,
        )


class _Slice:
    """One group's searches as a _Search of their own (views are copied back after the step)."""

    FIELDS = ("running", "sequences", "running_scores", "scores", "finished", "improvable", "hits",
              "running_indices", "indices")

    def __init__(self, search, B, G, g):
        self.parent, self.B, self.G, self.g = search, B, G, g
        self.search = object.__new__(_Search)
        self.search.beams, self.search.keep, self.search.T0 = search.beams, search.keep, search.T0
        self.search.top_mask = search.top_mask
        for name in self.FIELDS:
            t = getattr(search, name)
            setattr(self.search, name, t.view(B, G, *t.shape[1:])[:, g].clone())

    def rows(self, flat_rows):
        return flat_rows.view(self.B, self.G, -1)[:, self.g]

    def write_back(self):
        for name in self.FIELDS:
            t = getattr(self.parent, name)
            t.view(self.B, self.G, *t.shape[1:])[:, self.g] = getattr(self.search, name)

