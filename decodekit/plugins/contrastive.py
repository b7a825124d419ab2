"""Contrastive search (penalty_alpha > 0 with top_k > 1).

Each step the top_k most likely tokens are all tried: one forward pass with the cache expanded top_k
times gives each candidate's last-layer hidden state. A candidate scores
(1 - penalty_alpha) * p(token) - penalty_alpha * max cosine similarity to the hidden states so far,
so a token that would make the text repeat itself loses. The winner's cache row, hidden state and
next logits are kept. Uses a dynamic cache, since its batch dimension changes.
"""

from __future__ import annotations

import torch

from ..families.cache import grows, new_cache, reorder_rows
from ..core.config import is_number
from ..core.generate import mask_positions
from ..core.outputs import loop_result
from ..core.rows import Rows
from ..registry import hookimpl


@hookimpl
def decodekit_config_fields():
    # low_memory: transformers scores contrastive search's top_k candidates one at a time when set; decodekit
    # scores them in one batch either way (the same tokens), so it is accepted and changes nothing.
    return {"penalty_alpha": None, "low_memory": None}


@hookimpl
def decodekit_validate_config(generation_config, context):
    gc = generation_config
    if not (gc.low_memory is None or isinstance(gc.low_memory, bool)):  # (a tensor's `in` would be ambiguous)
        raise gc.invalid("low_memory", "expected True, False or None")
    alpha = gc.penalty_alpha
    if alpha is None:
        return
    if not is_number(alpha) or not 0 <= alpha <= 1:
        raise gc.invalid("penalty_alpha", "expected a number in [0, 1]")
    if alpha > 0 and getattr(context.model, "holds_recurrent_state", False):
        raise ValueError(
            f"contrastive search scores top_k candidates as extra rows of the batch, and "
            f"{type(context.model.module).__name__} keeps its recurrent state in its own layers, sized "
            "for the call's batch: use greedy decoding, sampling or beam search."
        )
    if alpha > 0 and gc.number("top_k", 0) <= 1:
        raise ValueError(
            f"generation config: penalty_alpha={alpha} needs top_k > 1 (the number of candidates to compare), "
            f"got top_k={gc.top_k!r}; e.g. penalty_alpha=0.6, top_k=4."
        )
    vocab = getattr(getattr(context.model, "config", None), "vocab_size", None)
    if alpha > 0 and vocab is not None and gc.top_k > vocab:
        raise gc.invalid(
            "top_k", f"contrastive search runs top_k candidates each step; expected at most the vocabulary, {vocab}"
        )
    if alpha > 0 and (gc.do_sample or gc.number("num_beams", 1) > 1):
        raise ValueError(
            "penalty_alpha (contrastive search) is deterministic; it cannot be combined with do_sample or num_beams > 1."
        )


@hookimpl
def decodekit_decoding_loop(generation_config):
    gc = generation_config
    return ContrastiveSearch() if gc.penalty_alpha is not None and gc.penalty_alpha > 0 and gc.top_k > 1 else None


def degeneration_penalty(
    context: torch.Tensor, candidates: torch.Tensor, context_mask: torch.Tensor | None
) -> torch.Tensor:
    """max over context positions of cos(context [N, T, H], candidate [N, H]); padding positions never count."""
    cos = torch.einsum("nth,nh->nt", F_normalize(context), F_normalize(candidates))
    if context_mask is not None:
        cos = cos.masked_fill(context_mask == 0, -1.0)
    return cos.max(dim=-1).values


def F_normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


class ContrastiveSearch:
    def rows_per_prompt(self, gc) -> int:
        return 1

    def __call__(self, model, input_ids, attention_mask, pipeline, gc, streamer, context):
        k, alpha = gc.top_k, float(gc.penalty_alpha)
        B = input_ids.shape[0]
        cache = pipeline.cache if grows(pipeline.cache) else new_cache(model, "dynamic", B, context.max_length)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        positions = mask_positions(mask)
        scores_out = [] if gc.output_scores else None
        progress = Rows(input_ids, gc, streamer)
        out = model(
            input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        hidden = out.hidden_states[-1]  # [B, T, H]
        next_logits = out.logits[:, -1, :].float()
        while True:
            scores = pipeline.processors(input_ids, next_logits)
            if scores_out is not None:
                scores_out.append(scores.clone())
            top_probs, top_ids = scores.softmax(dim=-1).topk(k, dim=-1)  # [B, k]
            expand = torch.arange(B, device=input_ids.device).repeat_interleave(k)
            reorder_rows(cache, expand)
            mask_k = torch.cat((mask[expand], mask.new_ones(B * k, 1)), dim=-1)
            pos_k = positions[expand, -1:] + 1
            out_k = model(
                top_ids.reshape(B * k, 1),
                attention_mask=mask_k,
                position_ids=pos_k,
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=True,
            )
            cand_hidden = out_k.hidden_states[-1][:, -1, :]  # [B*k, H]
            penalty = degeneration_penalty(hidden[expand], cand_hidden, mask[expand]).view(B, k)
            choice = ((1 - alpha) * top_probs - alpha * penalty).argmax(dim=-1)  # [B]
            rows = torch.arange(B, device=input_ids.device) * k + choice
            reorder_rows(cache, rows)
            next_tokens = progress.chosen(top_ids.gather(1, choice[:, None])[:, 0])
            input_ids = torch.cat((input_ids, next_tokens[:, None]), dim=-1)
            mask = torch.cat((mask, mask.new_ones(B, 1)), dim=-1)
            positions = torch.cat((positions, positions[:, -1:] + 1), dim=-1)
            hidden = torch.cat((hidden, cand_hidden[rows][:, None, :]), dim=1)
            next_logits = out_k.logits[rows, -1, :].float()
            if not progress.advance(next_tokens, pipeline.stopping(input_ids, scores)):
                break
        progress.end()
        return loop_result(gc, input_ids, cache, scores_out)
