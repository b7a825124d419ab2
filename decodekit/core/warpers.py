"""The sampling warpers: processors that shape the distribution a token is drawn from (temperature, top-k, top-p,
min-p, typical, top-h, epsilon, eta) and the two that clean or normalise scores, each on core.processors' Processor
base, declaring what it can do, and taking transformers' constructor arguments under transformers' names."""

from __future__ import annotations

import math

import torch

from .processors import NEG_INF, Processor, check_setting, tokens_to_keep


class TemperatureLogitsWarper(Processor):
    """Divides scores by `temperature` (> 0). Below 1 sharpens the distribution, above 1 flattens it."""

    score_only = True
    stage = "samplers"

    def __init__(self, temperature: float):
        check_setting(
            "temperature",
            temperature,
            isinstance(temperature, (int, float)) and temperature > 0,
            "expected a number > 0",
        )
        self.temperature = float(temperature)

    def __call__(self, input_ids, scores):
        return scores / self.temperature


def top_values(scores: torch.Tensor, m: int, chunk: int = 32) -> torch.Tensor:
    """The `m` highest scores of each row [B, m], highest first: torch.topk(scores, m).values, exactly.

    A partial sort of a long row runs on one core. Instead, the rows are cut into
    chunks of `chunk`, and the m chunks with the highest maxima hold the m highest scores (a chunk with a
    higher maximum than the chunk of the m-th score has a score above it, and there are fewer than m of
    those), so only m * chunk scores are partially sorted: less than half the time, and a cheap step when compiled.
    """
    B, V = scores.shape
    m = min(m, V)
    if V < 4 * m * chunk:
        return torch.topk(scores, m, dim=-1).values
    if V % chunk:
        scores = torch.nn.functional.pad(scores, (0, -V % chunk), value=NEG_INF)
    chunks = scores.view(B, -1, chunk)
    best = torch.topk(chunks.amax(dim=-1), m, dim=-1).indices
    picked = torch.gather(chunks, 1, best[..., None].expand(B, m, chunk))
    return torch.topk(picked.reshape(B, -1), m, dim=-1).values


class TopKLogitsWarper(Processor):
    """Keeps the `top_k` (>= 1) highest scores, at least `min_tokens_to_keep`; ties at the boundary are all kept.
    The others get `filter_value` (-inf)."""

    score_only = True
    stage = "samplers"

    def __init__(self, top_k: int, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        check_setting(
            "top_k",
            top_k,
            isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1,
            "expected an integer >= 1",
        )
        self.top_k = max(top_k, tokens_to_keep(min_tokens_to_keep))
        self.filter_value = filter_value

    def __call__(self, input_ids, scores):
        kth = top_values(scores, self.top_k)[..., -1:]
        return scores.masked_fill(scores < kth, self.filter_value)


def _nucleus_threshold(ascending: torch.Tensor, top_p: float, min_tokens_to_keep: int) -> torch.Tensor:
    """The lowest score kept by nucleus sampling [B, 1], from scores sorted in ascending order."""
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    # Ascending order: the low tail whose mass is at most 1 - top_p goes.
    keep = cumulative > (1 - top_p)
    keep[..., -min_tokens_to_keep:] = True
    return torch.where(keep, ascending, float("inf")).amin(dim=-1, keepdim=True)


class TopPLogitsWarper(Processor):
    """Nucleus sampling: keeps the smallest set of top tokens whose probability sums to at least `top_p` (0, 1].

    Tokens tied with the smallest score of that set are all kept (a sort would pick among them
    arbitrarily); keeping by a score threshold also spares a scatter over the vocabulary, which
    inductor compiles into a kernel four times slower than the threshold's.
    """

    score_only = True
    stage = "samplers"

    def __init__(self, top_p: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        check_setting(
            "top_p",
            top_p,
            isinstance(top_p, (int, float)) and 0 <= top_p <= 1,
            "expected a number in [0, 1] (0 keeps only min_tokens_to_keep tokens)",
        )
        self.top_p = float(top_p)
        self.min_tokens_to_keep = tokens_to_keep(min_tokens_to_keep)
        self.filter_value = filter_value

    def __call__(self, input_ids, scores):
        threshold = _nucleus_threshold(torch.sort(scores, dim=-1).values, self.top_p, self.min_tokens_to_keep)
        return scores.masked_fill(scores < threshold, self.filter_value)


class TopKTopPLogitsWarper(Processor):
    """Top-k, then nucleus sampling over what is left: TopKLogitsWarper(`top_k`) followed by
    TopPLogitsWarper(`top_p`), with one partial sort of the top 2 * top_k scores instead of a partial sort
    and a sort of the whole vocabulary.

    The result is the same unless more than `top_k` scores tie with the k-th highest (a tie the top 2k
    scores cannot all hold).
    """

    score_only = True
    stage = "samplers"

    def __init__(self, top_k: int, top_p: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        self.top_k = TopKLogitsWarper(top_k, min_tokens_to_keep=min_tokens_to_keep).top_k
        self.top_p = TopPLogitsWarper(top_p, min_tokens_to_keep=min_tokens_to_keep).top_p
        self.min_tokens_to_keep, self.filter_value = min_tokens_to_keep, filter_value

    def __call__(self, input_ids, scores):
        k = min(self.top_k, scores.shape[-1])
        top = top_values(scores, 2 * k)
        # Outside the top k, a score has no mass, so the nucleus threshold is at or above the k-th score.
        ascending = top.masked_fill(top < top[..., k - 1 : k], NEG_INF).flip(-1)
        threshold = _nucleus_threshold(ascending, self.top_p, self.min_tokens_to_keep)
        return scores.masked_fill(scores < threshold, self.filter_value)


class MinPLogitsWarper(Processor):
    """Keeps tokens whose probability is at least `min_p` [0, 1] times the most likely token's, at least
    `min_tokens_to_keep`; the others get `filter_value` (-inf)."""

    score_only = True
    stage = "samplers"

    def __init__(self, min_p: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        check_setting(
            "min_p", min_p, isinstance(min_p, (int, float)) and 0 <= min_p <= 1, "expected a number in [0, 1]"
        )
        self.min_p = float(min_p)
        self.min_tokens_to_keep = tokens_to_keep(min_tokens_to_keep)
        self.filter_value = filter_value

    def __call__(self, input_ids, scores):
        probs = scores.softmax(dim=-1)
        threshold = self.min_p * probs.amax(dim=-1, keepdim=True)
        remove = probs < threshold
        if self.min_tokens_to_keep > 1:
            top = torch.topk(probs, self.min_tokens_to_keep, dim=-1).indices
            remove.scatter_(-1, top, False)
        return scores.masked_fill(remove, self.filter_value)


class TypicalLogitsWarper(Processor):
    """Locally typical sampling: keeps the tokens whose surprisal is closest to the entropy, up to probability
    `mass` (typical_p, in (0, 1]), at least `min_tokens_to_keep`; the others get `filter_value` (-inf)."""

    score_only = True
    stage = "samplers"

    def __init__(self, mass: float = 0.9, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        check_setting(
            "typical_p", mass, isinstance(mass, (int, float)) and 0 < mass <= 1, "expected a number in (0, 1]"
        )
        self.mass = float(mass)
        self.min_tokens_to_keep = tokens_to_keep(min_tokens_to_keep)
        self.filter_value = filter_value

    def __call__(self, input_ids, scores):
        logp = scores.log_softmax(dim=-1)
        entropy = -(logp.exp() * logp).nansum(dim=-1, keepdim=True)
        distance = (-logp - entropy).abs()
        sorted_distance, order = torch.sort(distance, dim=-1)
        cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (cumulative < self.mass).sum(dim=-1, keepdim=True).clamp(max=scores.shape[-1] - 1)
        remove = sorted_distance > sorted_distance.gather(-1, last)
        remove[..., : self.min_tokens_to_keep] = False
        return scores.masked_fill(remove.scatter(-1, order, remove), self.filter_value)


class TopHLogitsWarper(Processor):
    """Top-H sampling (arXiv 2509.02510): among the 100 most likely tokens, keeps the most likely ones while their
    summed entropy terms -p log p stay within `top_h` (0, 1] times the entropy of those 100 (the most likely token
    always stays); the others get `filter_value` (-inf)."""

    score_only = True
    stage = "samplers"
    candidates = 100  # transformers' cap on the tokens considered

    def __init__(self, top_h: float, filter_value: float = NEG_INF):
        check_setting(
            "top_h",
            top_h,
            isinstance(top_h, (int, float)) and not isinstance(top_h, bool) and 0 < top_h <= 1,
            "expected a number in (0, 1]",
        )
        self.top_h, self.filter_value = float(top_h), filter_value

    def __call__(self, input_ids, scores):
        top, index = torch.topk(scores, min(self.candidates, scores.shape[-1]), dim=-1)
        logp = top.log_softmax(dim=-1)
        terms = -(logp.exp() * logp).nan_to_num()  # a -inf candidate adds nothing
        budget = terms.sum(dim=-1, keepdim=True) * self.top_h
        chosen = terms.cumsum(dim=-1) <= budget
        chosen[:, 0] = True
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, index, chosen)
        return scores.masked_fill(~keep, self.filter_value)


def _keep_top(remove: torch.Tensor, scores: torch.Tensor, n: int) -> torch.Tensor:
    """`remove` with the `n` highest-scoring tokens of each row kept whatever it said."""
    if n < 1:
        return remove
    top = torch.topk(scores, min(n, scores.shape[-1]), dim=-1).indices
    return remove.scatter(-1, top, False)


class EpsilonLogitsWarper(Processor):
    """Epsilon sampling: gives `filter_value` (-inf) to tokens whose probability is below `epsilon` in (0, 1),
    keeping at least `min_tokens_to_keep` (the most likely ones)."""

    score_only = True
    stage = "samplers"

    def __init__(self, epsilon: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        check_setting(
            "epsilon_cutoff",
            epsilon,
            isinstance(epsilon, (int, float)) and 0 < epsilon < 1,
            "expected a number in (0, 1)",
        )
        self.epsilon, self.min_tokens_to_keep = float(epsilon), tokens_to_keep(min_tokens_to_keep)
        self.filter_value = filter_value

    def __call__(self, input_ids, scores):
        remove = scores.softmax(dim=-1) < self.epsilon
        return scores.masked_fill(_keep_top(remove, scores, self.min_tokens_to_keep), self.filter_value)


class EtaLogitsWarper(Processor):
    """Eta sampling: epsilon sampling whose cutoff adapts to the entropy H of each row,
    min(eta, sqrt(eta) * exp(-H)) with eta = `epsilon` (eta_cutoff) in (0, 1); keeps at least `min_tokens_to_keep`
    tokens, the others get `filter_value` (-inf). `device` is accepted for transformers' signature."""

    score_only = True
    stage = "samplers"

    def __init__(self, epsilon: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1, device="cpu"):
        check_setting(
            "eta_cutoff", epsilon, isinstance(epsilon, (int, float)) and 0 < epsilon < 1, "expected a number in (0, 1)"
        )
        self.eta, self.min_tokens_to_keep = float(epsilon), tokens_to_keep(min_tokens_to_keep)
        self.filter_value = filter_value

    def __call__(self, input_ids, scores):
        logp = scores.log_softmax(dim=-1)
        probs = logp.exp()
        entropy = -(probs * logp).nan_to_num().sum(dim=-1, keepdim=True)  # 0 * -inf counts as 0
        cutoff = torch.clamp(math.sqrt(self.eta) * torch.exp(-entropy), max=self.eta)
        return scores.masked_fill(_keep_top(probs < cutoff, scores, self.min_tokens_to_keep), self.filter_value)


class InfNanRemoveLogitsProcessor(Processor):
    """Replaces nan scores with 0 and +-inf with the dtype's largest and smallest finite values
    (remove_invalid_values=True), so a model that emits them cannot stop generation."""

    score_only = True

    def __call__(self, input_ids, scores):
        info = torch.finfo(scores.dtype)
        return torch.nan_to_num(scores, nan=0.0, posinf=info.max, neginf=info.min)


class LogitNormalization(Processor):
    """Log-softmax of the scores (renormalize_logits=True): after the other processors, scores are
    log-probabilities again."""

    score_only = True
    stage = "final"

    def __call__(self, input_ids, scores):
        return scores.log_softmax(dim=-1)
