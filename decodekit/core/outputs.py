"""Output objects: attribute, key and index access, as transformers' ModelOutput offers (Hub code uses all three)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..families.outputs import CausalLMOutput, ModelOutput  # noqa: F401  (re-exported: generate() outputs build on them)


@dataclass
class GenerateOutput(ModelOutput):
    """generate() with return_dict_in_generate=True.

    `scores`: one [B, V] tensor per generated token, after the logits processors (output_scores=True).
    `logits`: the same, before processing (output_logits=True).
    `hidden_states` / `attentions`: per generated token, the model's tuple of per-layer tensors of the forward that
    produced it (the first holds the whole prompt), as transformers (output_hidden_states / output_attentions=True).
    `constraint_complete`: with structured output (json_schema=, regex=, ...), whether each row ended where the
    constraint allows an end (False: cut off by max_new_tokens, the output is partial).
    """

    sequences: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    hidden_states: tuple[tuple[torch.Tensor, ...], ...] | None = None
    attentions: tuple[tuple[torch.Tensor, ...], ...] | None = None
    past_key_values: Any = None
    constraint_complete: torch.Tensor | None = None


def loop_result(
    generation_config, sequences, past_key_values, scores=None, logits=None, hidden_states=None, attentions=None
):
    """What a decoding loop returns: the sequences, or a GenerateOutput with return_dict_in_generate.
    The per-step lists are what the loop gathered, or None where not asked for."""
    if not generation_config.return_dict_in_generate:
        return sequences

    def steps(gathered):
        return None if gathered is None else tuple(gathered)

    return GenerateOutput(
        sequences=sequences,
        scores=steps(scores),
        logits=steps(logits),
        hidden_states=steps(hidden_states),
        attentions=steps(attentions),
        past_key_values=past_key_values,
    )


@dataclass
class GenerateBeamOutput(ModelOutput):
    """generate() with num_beams > 1 and return_dict_in_generate=True.

    `sequences_scores`: each returned sequence's final score (output_scores=True). `scores`: per step, the
    processed log-probabilities of every running beam [B * num_beams, V]. `beam_indices`: for each
    returned sequence and generated position, the row of `scores` it came from (-1 past its end).
    """

    sequences: torch.Tensor | None = None
    sequences_scores: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    beam_indices: torch.Tensor | None = None
    past_key_values: Any = None
    constraint_complete: torch.Tensor | None = None
