"""Token selectors: the selection hook point.

One protocol: a selector is a callable `(input_ids [B, T], scores [B, V]) -> next_tokens [B]`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..registry.manager import PluginError, described, guarded


@runtime_checkable
class TokenSelector(Protocol):
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.LongTensor: ...


class Selector:
    """The capability a token selector may declare:

    traceable  its choice is a tensor function of the scores and its own fixed state (no host reads, nothing that
               changes per step): a compiled step (compile=True) runs it inside the step (given the step's last tokens
               as input_ids), and its output is not checked every step. Declared by the
               class itself (`selector_declares` reads the class's own attribute), so a subclass that changes
               __call__ is not taken for traceable unless it says so again.
    draws      "argmax" (the highest score) or "race" (race() over the scores with its `key`): what it chooses is
               exactly that, which the fused step and continuous batching compute themselves, many rows at once.
               Read from the class itself, as traceable is.
    """

    traceable: bool = False
    draws: str | None = None


def drawn_as(selector) -> str | None:
    """What `selector`'s class declares it draws ("argmax", "race"), or None."""
    return vars(type(selector)).get("draws")


def selector_declares(selector, capability: str) -> bool:
    if capability != "traceable":
        raise ValueError(f"capability={capability!r} is invalid; a selector declares 'traceable'.")
    return vars(type(selector)).get(capability) is True


class GreedySelector(Selector):
    """The highest-scoring token."""

    traceable = True
    draws = "argmax"

    def __call__(self, input_ids, scores):
        return scores.argmax(dim=-1)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int32 tensors: a bijection in which every output bit depends on every input
    bit (xorshift-multiply with hash-prospector's constants). The shifts are masked to act as unsigned
    shifts; the products wrap modulo 2**32, as torch's int32 arithmetic does in eager and compiled code.
    int32 rather than int64 because AVX2 has no int64 multiply (the int64 form was slower: docs/performance.md)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x21F0AAAD
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * 0x735A2D97
    return x ^ ((x >> 15) & 0x1FFFF)


def race_noise(key: torch.Tensor, position, rows: int, vocab: int) -> torch.Tensor:
    """Exponential(1) noise [rows, vocab] for the exponential race: E = -log(U), with U a hash of (key,
    position, row, token) instead of a draw from a generator.

    `key` is an int32 tensor drawn once per generate call (SamplingSelector draws it), and `position` the
    length of the sequence the token extends (an int or an int tensor). Being a pure function made of
    tensor ops, the noise is computed inside the compiled step, fused with the softmax and the argmax and
    spread over the threads, and the eager sampler computes the same uniforms (the log may differ in its
    last bit, as the softmax does): one seed, one text, compiled or not, unless two candidates tie to
    1e-7. Drawing from a torch.Generator instead runs on one core and outside the step, and cost about three times
    what the hash adds to the step's softmax and argmax (docs/performance.md).
    U = (2m + 1) / 2**24 for the hash's top 23 bits m: exact in float32, never 0 or 1.
    """
    device = key.device
    position = torch.as_tensor(position, dtype=torch.int32, device=device)
    return row_noise(key, position, torch.arange(rows, device=device, dtype=torch.int32)[:, None], vocab)


def row_noise(key: torch.Tensor, position: torch.Tensor, row: torch.Tensor, vocab: int) -> torch.Tensor:
    """race_noise's noise for int32 `key`, `position` and `row` that broadcast to [rows, 1]: rows of different
    calls (each its own key and position) in one computation, each equal to what its call draws alone."""
    token = torch.arange(vocab, device=key.device, dtype=torch.int32)
    stream = mix32(key + position * 0x1E3779B9 + row * 0x05EBCA6B)  # one per (row, position)
    bits = mix32(stream ^ token)
    uniform = (((bits >> 9) & 0x7FFFFF) * 2 + 1).float() * 2.0**-24
    return uniform.log().neg()


def draw_key(generator: torch.Generator | None = None) -> torch.Tensor:
    """A race_noise key from `generator` (or torch's global generator): reproducible with a seed."""
    device = generator.device if generator is not None else None
    return torch.randint(-(2**31), 2**31, (), generator=generator, device=device, dtype=torch.int32)


class SamplingSelector(Selector):
    """A token drawn from softmax(scores).

    Uses the exponential race: argmax(p / E) with E ~ Exponential(1) picks token i with probability
    p_i, like torch.multinomial, but without its host synchronisation on CUDA, so it can live inside
    a compiled step. E comes from race_noise with a key drawn from `generator` when the selector is made,
    so generate(seed=...) reproduces a text, and the compiled step draws the same tokens.
    """

    traceable = True
    draws = "race"

    def __init__(self, generator: torch.Generator | None = None):
        self.key = draw_key(generator)

    def __call__(self, input_ids, scores):
        return race(scores, self.key.to(scores.device), input_ids.shape[1])


def race_rows(scores: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The exponential race of rows of different calls: row i of `scores` [R, V] drawn with keys[i] at
    positions[i] (int32, [R, 1]), as race() draws the first row of its call. Continuous batching's requests."""
    noise = row_noise(keys, positions, torch.zeros_like(positions), scores.shape[-1])
    return (probabilities(scores) / noise).argmax(dim=-1)


def race(scores: torch.Tensor, key: torch.Tensor, position) -> torch.Tensor:
    """The exponential race over softmax(scores) [B, V] with race_noise(key, position): the sampled tokens [B]."""
    noise = race_noise(key, position, scores.shape[0], scores.shape[-1])
    return (probabilities(scores) / noise).argmax(dim=-1)


def probabilities(scores: torch.Tensor) -> torch.Tensor:
    """softmax(scores) over the vocabulary, where a +inf score (a processor forcing a token) means certainty: the
    +inf tokens share the probability (softmax alone gives NaN there, and the race then drew token 0). Exactly
    softmax where no score is +inf."""
    forced = scores == float("inf")
    count = forced.sum(-1, keepdim=True)
    return torch.where(count > 0, forced / count.clamp(min=1), scores.softmax(dim=-1))


class CheckedSelector:
    """A plugin's selector whose outputs are checked at every eager step: one integer token id per row, on the
    scores' device, inside the vocabulary. A wrong one, or an exception, raises PluginError naming the plugin and the
    position (instead of a broadcast that would give every row one row's token, or an IndexError deep inside the
    next forward), and an installed or run-time plugin is disabled for the process (the registry's on_failure)."""

    def __init__(self, selector, owner: str):
        self.selector, self.owner = selector, owner

    def __getattr__(self, name):  # loops and the fused step read the selector's own attributes (key, ...)
        return getattr(self.selector, name)

    def __call__(self, input_ids, scores):
        position = input_ids.shape[-1]
        check = None if torch.compiler.is_compiling() else lambda tokens: self._check(tokens, scores, position)
        return guarded(
            "token selector", self.owner, type(self.selector), lambda: self.selector(input_ids, scores), check, position
        )

    def _check(self, tokens, scores, position: int) -> None:
        B, V = scores.shape
        name = described("token selector", type(self.selector), self.owner)
        ok = (
            isinstance(tokens, torch.Tensor)
            and tuple(tokens.shape) == (B,)
            and not tokens.is_floating_point()
            and not tokens.is_complex()
            and tokens.dtype != torch.bool
            and tokens.device == scores.device
        )
        if not ok:
            got = (
                f"{type(tokens).__name__} of shape {tuple(tokens.shape)}, dtype {tokens.dtype}, on {tokens.device}"
                if isinstance(tokens, torch.Tensor)
                else type(tokens).__name__
            )
            raise PluginError(
                f"{name} returned {got} at position {position}; a selector returns one integer token id "
                f"per row, a tensor [{B}] on {scores.device}."
            )
        if bool(((tokens < 0) | (tokens >= V)).any()):
            raise PluginError(
                f"{name} returned token ids {tokens.tolist()} at position {position}, outside the vocabulary [0, {V})."
            )


def checked_selector(selector, owner: str | None):
    """A traceable selector as it is (the fused step and batching read its declaration); any other wrapped in
    CheckedSelector."""
    if selector_declares(selector, "traceable"):
        return selector
    return CheckedSelector(selector, owner or "?")
