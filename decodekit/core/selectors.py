"""Token selectors: the selection hook point.

One protocol: a selector is a callable `(input_ids [B, T], scores [B, V]) -> next_tokens [B]`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class TokenSelector(Protocol):
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.LongTensor: ...


class GreedySelector:
    """The highest-scoring token."""

    def __call__(self, input_ids, scores):
        return scores.argmax(dim=-1)


def race_noise(shape, device, generator: torch.Generator | None = None) -> torch.Tensor:
    """Exponential(1) noise E = -log(U) for the exponential race argmax(p / E). Every sampler draws through
    here, so the compiled step, speculative decoding and the plain sampler use the generator identically."""
    return torch.empty(shape, device=device).uniform_(generator=generator).log_().neg_()


class SamplingSelector:
    """A token drawn from softmax(scores).

    Uses the exponential race: argmax(p / E) with E ~ Exponential(1) picks token i with probability
    p_i, like torch.multinomial, but without its host synchronisation on CUDA, so it can live inside
    a compiled step. `generator` makes the draw reproducible.

    E is drawn as -log(U), U ~ Uniform[0, 1): on CPU four times faster than Tensor.exponential_
    (0.2 ms against 0.8 ms for a 49k vocabulary). U = 0 gives E = inf and a zero entry, which is harmless.
    """

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, input_ids, scores):
        probs = scores.softmax(dim=-1)
        return (probs / race_noise(probs.shape, probs.device, self.generator)).argmax(dim=-1)
