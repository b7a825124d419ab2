"""The samplers local-LLM users reach for in llama.cpp, koboldcpp and text-generation-webui, as decodekit
processors and selectors: top-n-sigma, XTC, DRY, dynamic temperature, quadratic smoothing, mirostat 1 and 2.

Each follows llama.cpp's own code (src/llama-sampling.cpp), on a full-vocabulary score tensor where llama.cpp
shrinks a candidate list: a token llama.cpp drops is -inf here, and statistics llama.cpp takes over its remaining
candidates are taken over the finite scores. Quadratic smoothing is text-generation-webui's (llama.cpp has none),
per row. Random draws (XTC's coin, mirostat's sample) are hashed uniforms of (seed key, position, row), as the
sampling selector's: one seed, one text, and nothing stateful in the step but mirostat's mu.
"""

from __future__ import annotations

import functools
import math

import torch

from .selectors import draw_key, mix32, race
from .processors import Processor

NEG_INF = -float("inf")


def _uniform(key: torch.Tensor, position: int, rows: int, salt: int) -> torch.Tensor:
    """A uniform in (0, 1) per row from (key, position, row, salt): XTC's coin, reproducible with a seed."""
    row = torch.arange(rows, device=key.device, dtype=torch.int32)
    bits = mix32(mix32(key + position * 0x1E3779B9 + row * 0x05EBCA6B) ^ salt)
    return (((bits >> 9) & 0x7FFFFF) * 2 + 1).float() * 2.0**-24


class TopNSigmaLogitsWarper(Processor):
    """Keeps the tokens whose score is at least max - n * std (both over the finite scores of the row); the rest
    become -inf. `n` > 0 (<= 0: off, as llama.cpp's -1). The kept set is the same before or after a temperature."""

    stage = "samplers"
    score_only = True

    def __init__(self, n: float):
        self.n = float(n)

    def __call__(self, input_ids, scores):
        if self.n <= 0 or scores.shape[-1] <= 1:
            return scores
        finite = torch.isfinite(scores)
        count = finite.sum(-1, keepdim=True).clamp(min=1)
        values = torch.where(finite, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))
        mean = values.sum(-1, keepdim=True) / count
        variance = (torch.where(finite, scores - mean, torch.zeros_like(scores)) ** 2).sum(-1, keepdim=True) / count
        top = torch.where(finite, scores, torch.full_like(scores, NEG_INF)).amax(-1, keepdim=True)
        return scores.masked_fill(scores < top - self.n * variance.sqrt(), NEG_INF)


class XTCLogitsWarper(Processor):
    """Exclude top choices: with `probability` (in [0, 1]), every token whose probability is at least `threshold`
    (in [0, 0.5]; above 0.5: off, as llama.cpp) is removed except the least likely of them, when two or more are;
    so a likely but unsurprising token gives way to its runner-up. The coin is a hashed uniform of (key, position,
    row): `key` comes from the call's seed. Not score-only: the coin needs the position, which a fused step does not
    give its processors, so compile=True runs XTC's calls eagerly (the same tokens)."""

    stage = "samplers"
    score_only = False

    def __init__(self, probability: float, threshold: float, key: torch.Tensor, min_keep: int = 1):
        self.probability, self.threshold, self.key, self.min_keep = float(probability), float(threshold), key, min_keep

    def __call__(self, input_ids, scores):
        if self.probability <= 0 or self.threshold > 0.5 or scores.shape[-1] < 2:
            return scores
        coin = _uniform(self.key.to(scores.device), input_ids.shape[-1], scores.shape[0], 0x58544321)
        applies = coin <= self.probability
        probs = scores.softmax(-1)
        above = probs >= self.threshold
        count = above.sum(-1, keepdim=True)
        # The least likely of the tokens above the threshold stays: drop the others when there are two or more.
        least = torch.where(above, probs, torch.full_like(probs, 2.0)).amin(-1, keepdim=True)
        candidates = torch.isfinite(scores).sum(-1, keepdim=True)
        drop = above & (probs > least) & (count >= 2) & (candidates - (count - 1) >= self.min_keep) & applies[:, None]
        return scores.masked_fill(drop, NEG_INF)


class DynamicTemperatureLogitsWarper(Processor):
    """llama.cpp's extended temperature: with `range` > 0, the temperature is min + (max - min) * H^exponent, where
    min = max(0, temperature - range), max = temperature + range and H the row's entropy over its finite scores
    divided by the log of their count; otherwise plain `temperature`. A temperature <= 0 keeps the best token
    alone. `exponent` > 0. llama.cpp divides by the log of its candidate list's size instead, which also counts
    the -inf entries top-n-sigma leaves in it (the tokens top-k, top-p, min-p and XTC drop leave the list): the
    two agree unless top-n-sigma ran before, where counting the finite scores is what the entropy means."""

    stage = "samplers"
    score_only = True

    def __init__(self, temperature: float, range: float = 0.0, exponent: float = 1.0):
        self.temperature, self.range, self.exponent = float(temperature), float(range), float(exponent)

    def __call__(self, input_ids, scores):
        if self.range <= 0:
            return _temperature(scores, torch.full((scores.shape[0], 1), self.temperature, device=scores.device))
        finite = torch.isfinite(scores)
        count = finite.sum(-1, keepdim=True)
        probs = scores.softmax(-1)
        entropy = (
            -(probs * probs.clamp(min=1e-45).log()).where(probs > 0, torch.zeros_like(probs)).sum(-1, keepdim=True)
        )
        normalized = entropy / count.clamp(min=2).float().log()
        low, high = max(0.0, self.temperature - self.range), self.temperature + self.range
        temperature = low + (high - low) * normalized.pow(self.exponent)
        out = _temperature(scores, temperature)
        return torch.where(count <= 1, scores, out)


def _temperature(scores: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """scores / temperature per row; a row whose temperature is <= 0 keeps its best token alone (greedy)."""
    greedy = temperature <= 0
    best = scores.argmax(-1, keepdim=True)
    only_best = torch.full_like(scores, NEG_INF).scatter(-1, best, scores.gather(-1, best))
    return torch.where(greedy, only_best, scores / torch.where(greedy, torch.ones_like(temperature), temperature))


class QuadraticSmoothingLogitsWarper(Processor):
    """Quadratic sampling (text-generation-webui's smoothing): each finite score s becomes
    max - k * f * (s - max)^2 + c * f * (s - max)^3 with f = `smoothing_factor` (> 0), k = (3 - curve) / 2 and
    c = (curve - 1) / 2 for `smoothing_curve` (1: purely quadratic). The row's maximum is taken per row."""

    stage = "samplers"
    score_only = True

    def __init__(self, smoothing_factor: float, smoothing_curve: float = 1.0):
        self.factor, self.curve = float(smoothing_factor), float(smoothing_curve)

    def __call__(self, input_ids, scores):
        top = scores.amax(-1, keepdim=True)
        diff = scores - top
        k, c = (3 - self.curve) / 2, (self.curve - 1) / 2
        # The factor multiplies each power before its coefficient, and a zero coefficient's term is left out: with a
        # huge factor a term overflows to inf, and 0 * inf (curve 1's cubic, the top token's) would be NaN. Where the
        # two terms overflow with opposite signs the token is out of reach: -inf.
        # The factor is held to what the scores' dtype holds (1e308 is inf in float32, and inf * 0 is NaN too).
        largest = torch.finfo(scores.dtype).max
        factor = min(self.factor, largest)
        smoothed = top - k * (factor * diff**2) if k else top.expand_as(scores)
        if c:
            smoothed = smoothed + c * (factor * diff**3)
        smoothed = smoothed.nan_to_num(nan=float("-inf"), posinf=largest, neginf=float("-inf"))
        return torch.where(torch.isfinite(scores), smoothed, scores)


class DRYLogitsProcessor:
    """DRY, don't repeat yourself: the token that would extend a sequence already seen in the last
    `penalty_last_n` tokens (-1: the whole context, `context_size`) is penalised by
    multiplier * base^(match length - allowed_length) (capped where it would overflow a float), when the match is
    at least `allowed_length` long. A sequence breaker (its tokens, from `breakers` as llama.cpp tokenizes them,
    see dry_breaker_sequences) ends the text a repeat may reach back into, and a token that is a breaker on its own
    is never penalised. Reads input_ids (the prompt counts, as llama.cpp's server feeds it), so not score-only."""

    stage = "samplers"

    def __init__(
        self,
        multiplier: float,
        base: float,
        allowed_length: int,
        penalty_last_n: int,
        context_size: int,
        breakers: dict[int, list[tuple[int, ...]]],
    ):
        self.multiplier, self.base, self.allowed = float(multiplier), float(base), int(allowed_length)
        self.last_n = context_size if penalty_last_n == -1 else max(penalty_last_n, 0)
        self.context_size, self.breakers = context_size, breakers
        self.max_exponent = int(88.7228391 / math.log(self.base)) if self.base > 1.000001 else 0

    def __call__(self, input_ids, scores):
        if self.multiplier == 0 or self.base < 1 or self.last_n == 0:
            return scores
        rows, ids, values = [], [], []
        for row, tokens in enumerate(input_ids.tolist()):
            for token, penalty in self.row_penalties(tokens).items():
                rows.append(row)
                ids.append(token)
                values.append(penalty)
        if not ids:
            return scores
        penalty = torch.zeros_like(scores)
        penalty[torch.tensor(rows, device=scores.device), torch.tensor(ids, device=scores.device)] = torch.tensor(
            values, dtype=scores.dtype, device=scores.device
        )
        return scores - penalty

    def row_penalties(self, tokens: list[int]) -> dict[int, float]:
        """{token: penalty} for one row, following llama.cpp's four steps."""
        n = min(len(tokens), self.last_n, self.context_size)
        if n <= self.allowed:
            return {}
        recent = tokens[len(tokens) - n :]
        back = recent[::-1]  # back[i] is llama.cpp's last_tokens.rat(i)
        # 1. The nearest sequence breaker limits how far back a repeat may reach.
        limit = n
        for i, token in enumerate(back):
            tails = self.breakers.get(token)
            if not tails:
                continue
            longest = -1
            for tail in tails:
                if longest < len(tail) <= i and all(tail[o] == back[i - o - 1] for o in range(len(tail))):
                    longest = len(tail)
            if longest >= 0:
                limit = i - longest
                break
        if limit < self.allowed:
            return {}
        # 2. For each position, how long a suffix of the text ends there (the Z-algorithm, reversed).
        counts = [0] * n
        last, lt, rt = n - 1, 0, 0
        for k in range(1, n):
            if k > rt:
                m = 0
                while m + k < n and back[m] == back[m + k]:
                    m += 1
                counts[last - k] = min(m, limit)
                if m > 0:
                    lt, rt = k, k + m - 1
            else:
                p, right = k - lt, rt - k + 1
                if counts[last - p] < right:
                    counts[last - k] = min(counts[last - p], limit)
                else:
                    i = rt + 1
                    while i < n and back[i] == back[i - k]:
                        i += 1
                    counts[last - k] = min(i - k, limit)
                    lt, rt = k, i - 1
        # 3. The token after each repeat would extend it: the longest repeat each such token extends.
        longest: dict[int, int] = {}
        for i in range(n - 1):
            if counts[i] >= self.allowed:
                token = back[n - 2 - i]
                longest[token] = max(longest.get(token, 0), counts[i])
        # 4. The penalties, none for a token that is a sequence breaker on its own.
        out = {}
        for token, length in longest.items():
            if any(len(tail) == 0 for tail in self.breakers.get(token, ())):
                continue
            exponent = length - self.allowed
            if self.max_exponent > 0:
                exponent = min(exponent, self.max_exponent)
            out[token] = self.multiplier * self.base**exponent
        return out


class DryBreakers:
    """DRY's sequence breakers as llama.cpp builds them, {head token: [tail token sequences]}, found per token as a
    row's context meets it (a Mapping's get): every token whose text holds a breaker is a breaker head on its own
    (empty tail); a token whose text ends with the start of a breaker heads the rest of it, tokenized (at most
    `max_tail` tokens). Breakers are cut to `max_chars`.

    Built for the whole vocabulary up front, 64 breakers of 40 characters took 3.6 s and ~50 MB a request, before
    any token (a client that left had paid it all the same). Here the work follows the context: each distinct
    token it holds is checked once against the breakers, and each breaker's rest is tokenized once."""

    def __init__(self, tokenizer, breakers: tuple[str, ...], max_chars: int = 40, max_tail: int = 20):
        self.tokenizer, self.max_tail = tokenizer, max_tail
        self.breakers = tuple(dict.fromkeys(b[:max_chars] for b in breakers if b))
        self._heads: dict[int, tuple[tuple[int, ...], ...]] = {}
        self._rests: dict[str, tuple[int, ...]] = {}

    def __bool__(self) -> bool:
        return bool(self.breakers)

    def get(self, token: int, default=None):
        tails = self._heads.get(token)
        if tails is None:
            tails = self._heads[token] = self._tails_of(token)
        return tails or default

    def _tails_of(self, token: int) -> tuple[tuple[int, ...], ...]:
        if not self.breakers:
            return ()
        words = _vocabulary_words(self.tokenizer)
        word = words[token] if 0 <= token < len(words) else ""
        tails: list[tuple[int, ...]] = []
        for breaker in self.breakers:
            if breaker in word:
                if () not in tails:
                    tails.append(())
                continue
            at = word.find(breaker[0])
            while at != -1:
                rest = len(word) - at  # the word ends with breaker[:rest]?
                if rest < len(breaker) and word[at:] == breaker[:rest]:
                    tail = self._rest(breaker[rest:])
                    if tail not in tails:
                        tails.append(tail)
                at = word.find(breaker[0], at + 1)
        return tuple(tails)

    def _rest(self, text: str) -> tuple[int, ...]:
        tail = self._rests.get(text)
        if tail is None:
            tail = self._rests[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False)[: self.max_tail])
        return tail


def dry_breaker_sequences(
    tokenizer, breakers: tuple[str, ...], max_chars: int = 40, max_tail: int = 20
) -> dict[int, list[tuple[int, ...]]]:
    """The whole table of DryBreakers as a dict, every token of the vocabulary looked at (what llama.cpp builds at
    the start; DryBreakers finds the same entries for the tokens a context holds)."""
    table = DryBreakers(tokenizer, breakers, max_chars, max_tail)
    if not table:
        return {}
    return {token: list(tails) for token in range(len(_vocabulary_words(tokenizer))) if (tails := table.get(token))}


@functools.lru_cache(maxsize=4)
def _vocabulary_words(tokenizer) -> tuple[str, ...]:
    """Each token of `tokenizer` decoded alone: once per tokenizer, not per set of breakers."""
    return tuple(tokenizer.decode([i]) for i in range(len(tokenizer)))


def mirostat_keep(version: int, probs: torch.Tensor, mu: torch.Tensor, vocab: int, m: int = 100) -> torch.Tensor:
    """Which of each row's tokens mirostat keeps, `probs` [rows, V] sorted descending and `mu` [rows]: version 2
    the tokens whose surprise (-log2 p) is at most mu (at least one); version 1 the top k its Zipf estimate implies,
    k = ((s - 1) 2^mu / (1 - V^-(s - 1)))^(1/s) with s fitted on the `m` most likely tokens."""
    if version == 2:
        keep = -probs.log2() <= mu[:, None]
        keep[:, 0] = True  # at least one, as llama.cpp
        return keep
    top = min(m - 1, probs.shape[-1] - 1)
    i = torch.arange(top, device=probs.device, dtype=torch.float32)
    t = torch.log((i + 2) / (i + 1))
    b = torch.log(probs[:, :top] / probs[:, 1 : top + 1])
    s = (t * b).sum(-1) / (t * t).sum()
    epsilon = s - 1
    k = ((epsilon * torch.pow(2.0, mu)) / (1 - torch.pow(float(vocab), -epsilon))).pow(1 / s)
    k = torch.nan_to_num(k, nan=1.0, posinf=float(probs.shape[-1])).floor().clamp(min=1)
    return torch.arange(probs.shape[-1], device=probs.device)[None, :] < k[:, None]


class MirostatSelector:
    """Mirostat (version 1 or 2): samples a token whose surprise (-log2 p) tracks the target `tau`, with learning
    rate `eta`; mu starts at 2 * tau and is kept per row across steps (mirostat_keep says which tokens a step
    keeps; `vocab`: the vocabulary size, for version 1). Scores reach it after the temperature
    (DynamicTemperatureLogitsWarper), as llama.cpp's chain puts `temp` before mirostat; the draw is the
    exponential race with a key from the call's seed."""

    def __init__(self, version: int, tau: float, eta: float, vocab: int, generator=None, m: int = 100):
        self.version, self.tau, self.eta, self.vocab, self.m = version, float(tau), float(eta), vocab, m
        self.key = draw_key(generator)
        self.mu: torch.Tensor | None = None

    def __call__(self, input_ids, scores):
        tokens, chosen_p = self.apply(input_ids, scores)
        self.accept(chosen_p)
        return tokens

    def apply(self, input_ids, scores) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tokens drawn [B], the probability each had under what mirostat kept [B]); the state is unchanged."""
        mu = self._mu(scores)
        probs, order = scores.softmax(-1).sort(-1, descending=True)
        kept = torch.where(mirostat_keep(self.version, probs, mu, self.vocab, self.m), probs, torch.zeros_like(probs))
        kept = kept / kept.sum(-1, keepdim=True)
        index = race(kept.log(), self.key.to(scores.device), input_ids.shape[-1])
        return order.gather(-1, index[:, None])[:, 0], kept.gather(-1, index[:, None])[:, 0]

    def accept(self, chosen_p: torch.Tensor) -> None:
        """mu follows the surprise of the tokens drawn, as llama.cpp's sampler does on accept."""
        self.mu = self._mu(chosen_p[:, None]) - self.eta * (-chosen_p.log2() - self.tau)

    def reset(self) -> None:
        """Back to mu = 2 * tau for every row, as a new call starts."""
        self.mu = None

    def _mu(self, scores: torch.Tensor) -> torch.Tensor:
        B = scores.shape[0]
        if self.mu is None or self.mu.shape[0] != B:
            return torch.full((B,), 2 * self.tau, dtype=torch.float32, device=scores.device)
        return self.mu


class MirostatLogitsProcessor:
    """Mirostat for beam sampling, where the beam step draws the tokens: each row's scores are cut to the tokens
    mirostat keeps (-inf elsewhere), so the beams sample from mirostat's renormalized distribution. Its state
    follows each beam through reordering: kept per sequence (its tokens), a row's mu being its parent sequence's,
    updated with the surprise of the token the beam appended under the distribution it was drawn from."""

    stage = "samplers"

    def __init__(self, version: int, tau: float, eta: float, vocab: int, m: int = 100):
        self.version, self.tau, self.eta, self.vocab, self.m = version, float(tau), float(eta), vocab, m
        self.states: dict[tuple[int, ...], tuple[float, dict[int, float]]] = {}  # sequence -> (mu, kept probs)

    def __call__(self, input_ids, scores):
        rows = input_ids.tolist()
        mu = torch.tensor([self.mu_of(sequence) for sequence in rows], dtype=torch.float32, device=scores.device)
        probs, order = scores.softmax(-1).sort(-1, descending=True)
        keep_sorted = mirostat_keep(self.version, probs, mu, self.vocab, self.m)
        self.accept(rows, mu, order, torch.where(keep_sorted, probs, torch.zeros_like(probs)), keep_sorted)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        return scores.masked_fill(~keep, NEG_INF)

    def mu_of(self, sequence: list[int]) -> float:
        """A beam's mu: its parent sequence's, moved by the surprise of the token it appended (2 * tau at first)."""
        mu, kept = self.states.get(tuple(sequence[:-1]), (2 * self.tau, None))
        p = kept.get(sequence[-1]) if kept is not None else None
        return mu - self.eta * (-math.log2(p) - self.tau) if p else mu

    def accept(self, rows, mu, order, kept, keep_sorted) -> None:
        """Each row's mu and kept distribution, for the beams that extend it at the next step: the last step's
        sequences are the only parents the next one can have."""
        kept = kept / kept.sum(-1, keepdim=True)
        states = {}
        for row, sequence in enumerate(rows):
            count = int(keep_sorted[row].sum())
            states[tuple(sequence)] = (
                float(mu[row]),
                dict(zip(order[row, :count].tolist(), kept[row, :count].tolist())),
            )
        self.states = states

    def reset(self) -> None:
        self.states = {}


def chain_active(gc) -> bool:
    """Whether a call runs llama.cpp's sampler chain (any of its samplers on, or an order given) instead of
    transformers' warpers: plugins/llamacpp_samplers.py builds the chain, plugins/processors.py steps aside."""
    return bool(
        gc.number("top_n_sigma", -1) > 0
        or gc.number("xtc_probability", 0) > 0
        or gc.number("dry_multiplier", 0) > 0
        or gc.number("dynatemp_range", 0) > 0
        or gc.number("smoothing_factor", 0) > 0
        or gc.mirostat in (1, 2)
        or gc.samplers is not None
    )
