"""DoLa, decoding by contrasting layers (dola_layers="low", "high" or a list of layer indices).

Each step, the final layer's logits are contrasted with those of an earlier ("premature") layer read
through the lm_head: among the candidate layers the one whose next-token distribution is furthest
from the final one (Jensen-Shannon divergence, averaged over the batch) is chosen, and the logits
become log p_final - log p_premature over the tokens within a factor 0.1 of the final layer's most
likely token (the others are ruled out). Greedy or sampling then runs on those logits, with every
processor; repetition_penalty=1.2 is recommended.

Candidate layers (hidden_states index; 0 is the embedding output, skipped with tied embeddings):
"low" takes every second layer of the lower half, "high" of the upper half (the 20 nearest layers
for models deeper than 40); a list is used as given.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from ..registry import hookimpl

logger = logging.getLogger("decodekit")

RELATIVE_TOP = 0.1


@hookimpl
def decodekit_config_fields():
    return {"dola_layers": None}


def candidate_layers(dola_layers, num_layers: int, tied: bool) -> list[int]:
    start = 2 if tied else 0
    if dola_layers == "low":
        if start == num_layers // 2:
            return [start]
        return list(range(start, num_layers // 2, 2)) if num_layers <= 40 else list(range(start, 20, 2))
    if dola_layers == "high":
        return (
            list(range(num_layers // 2, num_layers, 2))
            if num_layers <= 40
            else list(range(num_layers - 20, num_layers, 2))
        )
    return [int(i) for i in dola_layers]


@hookimpl
def decodekit_validate_config(generation_config, context):
    layers = generation_config.dola_layers
    if layers is None:
        return
    config = getattr(context.model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    if n is None:
        raise ValueError("dola_layers needs a model with config.num_hidden_layers and hidden states.")
    if isinstance(layers, str):
        if layers not in ("low", "high"):
            raise generation_config.invalid("dola_layers", "expected 'low', 'high' or a list of layer indices")
    elif (
        not isinstance(layers, (list, tuple))
        or not layers
        or not all(isinstance(i, int) and 0 <= i < n for i in layers)
    ):
        raise generation_config.invalid(
            "dola_layers",
            f"a list of layer indices must be non-empty, each in [0, {n}) for this {n}-layer model "
            "(0 is the embedding output)",
        )
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if isinstance(layers, str) and not candidate_layers(layers, n, tied):
        raise generation_config.invalid(
            "dola_layers",
            f"'{layers}' picks no layer of this {n}-layer model"
            + (" (with tied embeddings the first two are skipped)" if tied else "")
            + f"; pass a list of layer indices in [0, {n})",
        )
    if generation_config.number("num_beams", 1) > 1:
        raise ValueError("dola_layers is not supported with beam search (num_beams > 1).")
    if generation_config.number("repetition_penalty", 1.0) < 1.2:
        logger.warning("DoLa works best with repetition_penalty=1.2 (now %s).", generation_config.repetition_penalty)


@hookimpl
def decodekit_next_token_logits(generation_config, context):
    if generation_config.dola_layers is None:
        return None
    config = context.model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return DoLaLogits(context.model, candidate_layers(generation_config.dola_layers, config.num_hidden_layers, tied))


def relative_top_filter(final: torch.Tensor, base: torch.Tensor):
    """Log-softmaxes both; tokens below RELATIVE_TOP x the final layer's top probability get -inf (final)
    and -1e-3 (base), so they cannot win and do not distort the contrast."""
    final, base = final.log_softmax(dim=-1), base.log_softmax(dim=-1)
    threshold = final.max(dim=-1, keepdim=True).values + math.log(RELATIVE_TOP)
    drop = final < threshold
    return final.masked_fill(drop, -math.inf), base.masked_fill(drop, -1e-3)


def contrast(final: torch.Tensor, premature: dict[int, torch.Tensor]) -> torch.Tensor:
    layers = list(premature)
    if len(layers) == 1:
        chosen = layers[0]
    else:
        stacked = torch.stack([premature[i] for i in layers])  # [L, B, V]
        mixture = 0.5 * (F.softmax(final, dim=-1)[None] + F.softmax(stacked, dim=-1))
        kl_final = F.kl_div(F.log_softmax(final, dim=-1)[None], mixture, reduction="none").mean(-1)
        kl_early = F.kl_div(F.log_softmax(stacked, dim=-1), mixture, reduction="none").mean(-1)
        js = (0.5 * (kl_final + kl_early)).mean(-1)  # [L], averaged over the batch as the reference does
        chosen = layers[int(js.argmax())]
    final, base = relative_top_filter(final, premature[chosen])
    return final - base


class DoLaLogits:
    needs_hidden_states = True

    def __init__(self, model, layers: list[int]):
        self.lm_head = model.get_output_embeddings()
        self.layers = layers

    def __call__(self, output) -> torch.Tensor:
        final = output.logits[:, -1, :].float()
        premature = {i: self.lm_head(output.hidden_states[i][:, -1, :]).float() for i in self.layers}
        return contrast(final, premature)
