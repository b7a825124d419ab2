"""Logits processors: the logits hook point.

One protocol: a processor is a callable `(input_ids [B, T], scores [B, V]) -> scores [B, V]`. It returns
new scores and leaves the ones it was given as they were (as transformers' processors do: a caller may keep them).
Removed tokens get -inf, or the `filter_value` a warper was made with. Each class below does one thing and takes
transformers' constructor arguments under transformers' names.

What a processor can do beyond that is declared on it, as transformers' processors declare theirs for continuous
batching: the class attributes of `Processor` (below), which the compiled step, beam search and generate() read
through `declares`. A processor that declares nothing (transformers' own, a plain function) runs eagerly, on the
host, every step, which is always correct.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable, Iterable, Protocol, Sequence, runtime_checkable

import torch

from ..registry.manager import PluginError, described, guarded, isolated, plugin_failure, returned

NEG_INF = -math.inf


@runtime_checkable
class LogitsProcessor(Protocol):
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor: ...


class Processor:
    """The capabilities a logits processor may declare (class attributes; every one False unless declared):

    score_only  it reads the scores only, never input_ids: a compiled step (compile=True) runs it inside the step.
    host_mask   its effect is `step_mask(input_ids) -> bool [B, V]` (what may come next), computed on the host from
                the sequence so far: a compiled step and beam search's take that mask as an input (structured output).
    finishes    `finish(result)` is called with generate()'s result (structured output reports rows cut off before
                their grammar allowed an end).
    stage       the stage of the pipeline it belongs to (STAGES; "penalties" for one that declares none).
    blocks_eos_until
                an int: its whole effect is banning its `eos` token ids until the sequence is that long (min_length):
                a compiled step applies it as an EOS mask that changes with the length, not as code.

    What identifies a processor's effect (processor_key), for reuse of a compiled step and for running one pass
    over several requests' rows in continuous batching: two processors with equal keys must behave the same, so a
    key names behaviour, never just a name. decodekit's own classes are keyed by class and settings where every
    setting is plain (numbers, strings, tuples of them); a class of another package that defines its own `key()`
    is keyed by its class object and that key; anything else (a plugin's class on the default key, a class made
    inside a hook that reads a closure, a setting that is a tensor or an object, a plain function, transformers'
    processors) by identity: it is never shared with another request or reused by another call.
    """

    score_only: bool = False
    host_mask: bool = False
    finishes: bool = False
    stage: str = "penalties"  # where in the pipeline it runs: one of STAGES

    def step_mask(self, input_ids: torch.LongTensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} declares host_mask and must define step_mask(input_ids)")

    def finish(self, result) -> None:
        pass

    def key(self) -> tuple | None:
        """Class and settings, where every setting is plain; None (keyed by identity) otherwise."""
        settings = vars(self)
        if not all(_plain(v) for v in settings.values()):
            return None
        return (type(self).__module__, type(self).__qualname__, tuple(sorted(settings.items())))


PLAIN = (type(None), bool, int, float, str, torch.dtype)


def _plain(value) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_plain(v) for v in value)
    return isinstance(value, PLAIN)


def _own(cls) -> bool:
    return cls.__module__ == "decodekit" or cls.__module__.startswith("decodekit.")


def processor_key(processor) -> tuple:
    """What identifies `processor`'s effect (see Processor): equal keys behave the same. Objects kept by identity
    stay alive as long as what holds their key (a compiled step closes over its pipeline), so an id is not reused
    meanwhile."""
    cls = type(processor)
    key = getattr(processor, "key", None)
    declared = getattr(cls, "key", None)
    if not callable(key) or (declared is Processor.key and not _own(cls)):
        return ("object", id(processor))
    value = key()
    if value is None:
        return ("object", id(processor))
    return tuple(value) if _own(cls) else (cls, *value)


CAPABILITIES = ("score_only", "host_mask", "finishes")

# The stages of a call's logits pipeline, in the order they run (docs/plugins.md has what each is for). A processor
# declares its stage (`stage`, a class or instance attribute); one that declares none (an outside plugin's, one passed
# to generate(), transformers' own) runs in DEFAULT_STAGE, after decodekit's penalties and before the sampling warpers,
# where transformers' generate() puts the processors a caller passes. Within a stage, processors run in the order of
# their plugins' registration (the built-ins, installed packages, run-time registrations, the call's method), then
# those passed to generate(), each plugin's in the order it listed them.
STAGES = (
    "guidance",  # rewrites the scores from another run of the model: classifier-free guidance
    "constraints",  # masks what may come next: structured output's grammar
    "penalties",  # transformers' logits processors, in its order: biases, penalties, bans, forced tokens
    "samplers",  # shapes the sampling distribution: transformers' warpers (WARPER_ORDER) or llama.cpp's chain
    "post",  # reads the shaped distribution: watermarks
    "final",  # the last word on the scores: renormalize_logits
)
DEFAULT_STAGE = "penalties"


def stage_of(processor) -> str:
    """The stage `processor` declares (DEFAULT_STAGE where it declares none); ValueError naming the stages for any
    other value."""
    stage = getattr(processor, "stage", DEFAULT_STAGE)
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} of {type(processor).__name__} is invalid; the stages are {STAGES}.")
    return stage


def declares(processor, capability: str) -> bool:
    """Whether `processor` declares `capability` (one of CAPABILITIES, see Processor); a processor that is not a
    Processor declares one by the same class attribute."""
    if capability not in CAPABILITIES:
        raise ValueError(f"capability={capability!r} is invalid; it is one of {CAPABILITIES}.")
    return getattr(processor, capability, False) is True


# Set by observe_processors: called as observer(description, scores before, scores after) for each processor an eager
# call applies in this context (the serve playground's view of what each processor changed); None otherwise.
_observer: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "decodekit_processor_observer", default=None
)


@contextlib.contextmanager
def observe_processors(observer: Callable[[str, torch.Tensor, torch.Tensor], None]):
    """Inside the block, every eager LogitsProcessorList call in this context (thread, task) calls `observer` after
    each processor with its description ("the logits processor X of plugin 'y'") and copies of the scores it was
    given and returned."""
    token = _observer.set(observer)
    try:
        yield
    finally:
        _observer.reset(token)


class LogitsProcessorList(list):
    """Applies its processors in order.

    Each processor may be tagged with the plugin that contributed it (`extend_from`). Every eager call checks every
    processor's output (a tensor of the scores' shape, dtype and device: attribute checks, no synchronisation) and
    raises PluginError naming the processor, its plugin and the position if one is wrong; an exception inside a
    processor gets a note naming them too. Either way an installed or run-time plugin is then disabled for the
    process (the registry's on_failure), so the next generate() runs without it. A compiled step's trace only
    applies the processors.
    """

    def __init__(self, *args):
        super().__init__(*args)
        self.owners: dict[int, str] = {}
        # Eager calls only: after each processor of a plugin that a failure disables, the rows it left unusable
        # (a mask, no synchronisation), so check_scores can name and disable the processor that banned every token.
        self.left_unusable: list[tuple[object, torch.Tensor]] = []

    def extend_from(self, owner: str, processors) -> None:
        processors = list(processors)
        self.extend(processors)
        self.owners.update((id(p), owner) for p in processors)

    def owner_of(self, processor) -> str | None:
        return getattr(self, "owners", {}).get(id(processor))

    def describe(self, processor) -> str:
        return described("logits processor", processor, self.owner_of(processor))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if torch.compiler.is_compiling():
            for processor in self:
                scores = processor(input_ids, scores)
            return scores
        observer = _observer.get()
        position = input_ids.shape[-1]
        self.left_unusable = []
        for processor in self:
            given = scores
            before = scores.clone() if observer is not None else None  # a processor may write in place
            owner = self.owner_of(processor)
            scores = guarded(
                "logits processor",
                owner,
                processor,
                lambda: processor(input_ids, given),
                lambda out: self._check_output(processor, given, out, position),
                position,
            )
            if isolated(owner):
                self.left_unusable.append((processor, unusable_rows(scores)))
            if observer is not None:
                observer(self.describe(processor), before, scores.clone())
        return scores

    def blame_unusable(self, bad: torch.Tensor) -> object | None:
        """The first processor of an isolated plugin that left one of the `bad` rows unusable (see left_unusable)."""
        for processor, unusable in getattr(self, "left_unusable", ()):
            if bool((unusable & bad).any()):
                return processor
        return None

    def _check_output(self, processor, given: torch.Tensor, out, position: int) -> None:
        shape, dtype, device = tuple(given.shape), given.dtype, given.device
        if isinstance(out, torch.Tensor) and tuple(out.shape) == shape and out.dtype == dtype and out.device == device:
            return
        raise PluginError(
            f"{self.describe(processor)} returned {returned(out)} at position {position}; a processor returns the "
            f"scores it was given, rewritten: a {dtype} tensor [batch, vocab] = {list(shape)} on {device}."
        )


def unusable_rows(scores: torch.Tensor) -> torch.BoolTensor:
    """The rows [B] of `scores` [B, V] no token can be chosen from: a NaN, or -inf for every token."""
    # One pass: a row's maximum is NaN where the row holds one (amax propagates NaN) and -inf only where every score
    # is; four passes of isnan/any/isneginf/all weighed on every continuous-batching step (docs/performance.md).
    top = scores.amax(-1)
    return top.isnan() | (top == float("-inf"))


def log_probs(scores: torch.Tensor) -> torch.Tensor:
    """log_softmax of `scores` [..., V] over the vocabulary, where a +inf score (a processor forcing a token) means
    certainty: the +inf tokens share the probability (log 1/k: 0.0 for one), every other token -inf. log_softmax
    alone gives NaN for every token of such a row. No synchronisation: the same code for every row."""
    from .selectors import probabilities  # the same rule for the race's probabilities

    forced = (scores == math.inf).any(-1, keepdim=True)
    return torch.where(forced, probabilities(scores).log(), torch.log_softmax(scores, dim=-1))


def check_scores(
    processors: LogitsProcessorList, scores: torch.Tensor, unfinished: torch.Tensor, position: int
) -> None:
    """Raises where a running row's scores are NaN or -inf for every token: any selector would then pick token 0 (or
    garbage) silently. One reduction over the scores and one synchronisation a step; eager loops only."""
    bad = unusable_rows(scores) & unfinished
    if not bool(bad.any()):
        return
    row = int(bad.nonzero()[0, 0])
    what = "NaN" if bool(scores[row].isnan().any()) else "-inf for every token"
    if not len(processors):
        raise RuntimeError(
            f"the model's logits are {what} in row {row} at position {position}: check the weights and "
            "the dtype (float16 overflows on some models; try bfloat16 or float32)."
        )
    culprit = processors.blame_unusable(bad) if isinstance(processors, LogitsProcessorList) else None
    if culprit is not None:  # a plugin's processor did it: that plugin is disabled, as when it raises
        error = PluginError(
            f"{processors.describe(culprit)} left the scores {what} in row {row} at position "
            f"{position}; no token can be chosen from them. A processor that bans tokens must leave "
            "at least one allowed."
        )
        raise plugin_failure(error, processors.owner_of(culprit), "a logits processor", processors.describe(culprit))
    raise PluginError(
        f"the scores are {what} in row {row} at position {position} after the logits processors "
        f"{[processors.describe(p) for p in processors]}; no token can be chosen from them. A processor "
        "that bans tokens must leave at least one allowed."
    )


def _check(name: str, value, ok: bool, accepted: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid; {accepted}.")


def _keep_at_least(min_tokens_to_keep) -> int:
    _check(
        "min_tokens_to_keep",
        min_tokens_to_keep,
        isinstance(min_tokens_to_keep, int) and min_tokens_to_keep >= 1,
        "expected an integer >= 1",
    )
    return min_tokens_to_keep


def _token_list(token_ids) -> list[int]:
    """An int, a list of ints or a tensor of them (transformers passes eos ids as a tensor) as a list of ints."""
    if isinstance(token_ids, torch.Tensor):
        return [int(t) for t in token_ids.reshape(-1).tolist()]
    return [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]


class TemperatureLogitsWarper(Processor):
    """Divides scores by `temperature` (> 0). Below 1 sharpens the distribution, above 1 flattens it."""

    score_only = True
    stage = "samplers"

    def __init__(self, temperature: float):
        _check(
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
        _check(
            "top_k",
            top_k,
            isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1,
            "expected an integer >= 1",
        )
        self.top_k = max(top_k, _keep_at_least(min_tokens_to_keep))
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
        _check(
            "top_p",
            top_p,
            isinstance(top_p, (int, float)) and 0 <= top_p <= 1,
            "expected a number in [0, 1] (0 keeps only min_tokens_to_keep tokens)",
        )
        self.top_p = float(top_p)
        self.min_tokens_to_keep = _keep_at_least(min_tokens_to_keep)
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
        _check("min_p", min_p, isinstance(min_p, (int, float)) and 0 <= min_p <= 1, "expected a number in [0, 1]")
        self.min_p = float(min_p)
        self.min_tokens_to_keep = _keep_at_least(min_tokens_to_keep)
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
        _check("typical_p", mass, isinstance(mass, (int, float)) and 0 < mass <= 1, "expected a number in (0, 1]")
        self.mass = float(mass)
        self.min_tokens_to_keep = _keep_at_least(min_tokens_to_keep)
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
        _check(
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
        _check(
            "epsilon_cutoff",
            epsilon,
            isinstance(epsilon, (int, float)) and 0 < epsilon < 1,
            "expected a number in (0, 1)",
        )
        self.epsilon, self.min_tokens_to_keep = float(epsilon), _keep_at_least(min_tokens_to_keep)
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
        _check(
            "eta_cutoff", epsilon, isinstance(epsilon, (int, float)) and 0 < epsilon < 1, "expected a number in (0, 1)"
        )
        self.eta, self.min_tokens_to_keep = float(epsilon), _keep_at_least(min_tokens_to_keep)
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


class ExponentialDecayLengthPenalty:
    """After `start` generated tokens (of a prompt of `input_ids_seq_length`), raises the EOS scores by
    |score| * (factor ** steps_past_start - 1), so EOS grows likelier without a hard cutoff.
    `exponential_decay_length_penalty` = (start: int >= 0, factor: number > 0)."""

    def __init__(self, exponential_decay_length_penalty, eos_token_id, input_ids_seq_length: int):
        start, self.factor = exponential_decay_length_penalty
        self.start = start + input_ids_seq_length
        self.eos = _token_list(eos_token_id)

    def __call__(self, input_ids, scores):
        past = input_ids.shape[1] - self.start
        if past <= 0:
            return scores
        eos = scores[:, self.eos]
        boost = (eos.abs() * (self.factor**past - 1)).masked_fill(~torch.isfinite(eos), 0.0)
        scores = scores.clone()  # the caller's scores stay as they were, as in transformers
        scores[:, self.eos] = eos + boost
        return scores


class SuppressTokensAtBeginLogitsProcessor:
    """Sets the scores of `begin_suppress_tokens` to -inf at the first generated position only (the
    sequence is `begin_index` tokens long)."""

    def __init__(self, begin_suppress_tokens: Sequence[int], begin_index: int, device="cpu"):
        self.tokens = torch.tensor(_token_list(begin_suppress_tokens), dtype=torch.long, device=device)
        self.begin_index = begin_index

    def set_begin_index(self, begin_index: int) -> None:
        self.begin_index = begin_index

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] != self.begin_index:
            return scores
        return scores.index_fill(-1, self.tokens.to(scores.device), NEG_INF)


class PrefixConstrainedLogitsProcessor:
    """Allows only the tokens `prefix_allowed_tokens_fn(batch_id, sequence)` returns for each row: row r
    belongs to prompt r // num_beams (its beams), as in transformers. An empty list is an error."""

    def __init__(self, prefix_allowed_tokens_fn, num_beams: int = 1):
        self.fn, self.rows_per_prompt = prefix_allowed_tokens_fn, num_beams

    def __call__(self, input_ids, scores):
        allowed = torch.full_like(scores, NEG_INF)
        for row, sequence in enumerate(input_ids):
            returned = self.fn(row // self.rows_per_prompt, sequence)
            try:
                tokens = [int(t) for t in returned]
            except (TypeError, ValueError):
                raise TypeError(
                    f"prefix_allowed_tokens_fn returned {returned!r} for prompt {row // self.rows_per_prompt};"
                    " it must return a list of the token ids allowed next."
                ) from None
            if not tokens:
                raise ValueError(
                    f"prefix_allowed_tokens_fn returned no allowed token for prompt {row // self.rows_per_prompt} "
                    f"after {sequence.tolist()}; it must return at least one token id."
                )
            allowed[row, tokens] = 0
        return scores + allowed


class RepetitionPenaltyLogitsProcessor:
    """Penalises every token already in the sequence (prompt included): positive scores are divided by
    `penalty` (> 0), negative ones multiplied, so a penalty above 1 always makes a repeat less likely.

    `prompt_ignore_length`: the leading positions not counted: an int for every row, or a tensor [batch] of one
    per row (generate() passes each row's left padding, so a pad id is never penalised); None counts everything.
    Token ids past the scores' vocabulary (an embedding larger than the head) are skipped."""

    def __init__(self, penalty: float, prompt_ignore_length: int | torch.Tensor | None = None):
        _check(
            "repetition_penalty", penalty, isinstance(penalty, (int, float)) and penalty > 0, "expected a number > 0"
        )
        ignore = prompt_ignore_length
        _check(
            "prompt_ignore_length",
            ignore,
            ignore is None
            or (isinstance(ignore, int) and ignore >= 0)
            or (isinstance(ignore, torch.Tensor) and ignore.dim() == 1),
            "expected None, an integer >= 0 or a 1-D tensor of one per row",
        )
        self.penalty, self.prompt_ignore_length = float(penalty), ignore

    def __call__(self, input_ids, scores):
        vocab = scores.shape[-1]
        ignore = self.prompt_ignore_length
        if isinstance(ignore, int):
            input_ids = input_ids[:, ignore:]
        elif isinstance(ignore, torch.Tensor):
            if ignore.shape[0] != input_ids.shape[0]:
                raise ValueError(
                    f"prompt_ignore_length has {ignore.shape[0]} rows and input_ids {input_ids.shape[0]}; "
                    "expected one per row."
                )
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            input_ids = input_ids.masked_fill(positions < ignore.to(input_ids.device)[:, None], vocab)
        # One spare column takes the ids to skip (ignored positions, ids past the vocabulary), dropped afterwards.
        padded = torch.nn.functional.pad(scores, (0, 1))
        return _penalised(padded, input_ids.clamp(max=vocab), self.penalty)[:, :vocab]


def _penalised(scores: torch.Tensor, ids: torch.LongTensor, penalty: float) -> torch.Tensor:
    """`scores` with those of `ids` divided by `penalty` where positive and multiplied where negative."""
    seen = scores.gather(-1, ids)
    return scores.scatter(-1, ids, torch.where(seen < 0, seen * penalty, seen / penalty))


class EncoderRepetitionPenaltyLogitsProcessor:
    """Makes the tokens of `encoder_input_ids` [batch, length] (the source an encoder-decoder model reads) likelier
    to be copied: the hallucination penalty. Positive scores are multiplied by `penalty` (> 0), negative ones
    divided, the inverse of RepetitionPenaltyLogitsProcessor."""

    def __init__(self, penalty: float, encoder_input_ids: torch.LongTensor):
        _check(
            "encoder_repetition_penalty",
            penalty,
            isinstance(penalty, (int, float)) and penalty > 0,
            "expected a number > 0",
        )
        self.penalty, self.encoder_input_ids = 1 / float(penalty), encoder_input_ids

    def __call__(self, input_ids, scores):
        return _penalised(scores, self.encoder_input_ids.to(scores.device), self.penalty)


class FrequencyPresencePenaltyLogitsProcessor:
    """OpenAI's penalties, on the tokens generated so far (the prompt's are not counted): subtracts
    count * frequency_penalty + (count > 0) * presence_penalty from each token's score. Both in [-2, 2]; negative
    values encourage repeats. `prompt_length`: where the generated tokens start in input_ids."""

    def __init__(self, frequency_penalty: float, presence_penalty: float, prompt_length: int):
        for name, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
            _check(
                name,
                value,
                isinstance(value, (int, float)) and not isinstance(value, bool) and -2 <= value <= 2,
                "expected a number in [-2, 2]",
            )
        self.frequency, self.presence, self.prompt_length = (
            float(frequency_penalty),
            float(presence_penalty),
            prompt_length,
        )

    def __call__(self, input_ids, scores):
        generated = input_ids[:, self.prompt_length :]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add(-1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def _ngram_continuations(tokens: list[int], n: int) -> dict[tuple[int, ...], set[int]]:
    table: dict[tuple[int, ...], set[int]] = {}
    for i in range(len(tokens) - n + 1):
        table.setdefault(tuple(tokens[i : i + n - 1]), set()).add(tokens[i + n - 1])
    return table


class NoRepeatNGramLogitsProcessor:
    """Bans any token that would complete an n-gram of size `ngram_size` (>= 1) already in the sequence."""

    def __init__(self, ngram_size: int):
        _check(
            "no_repeat_ngram_size",
            ngram_size,
            isinstance(ngram_size, int) and ngram_size >= 1,
            "expected an integer >= 1",
        )
        self.n = ngram_size

    def __call__(self, input_ids, scores):
        return _ban_repeats(input_ids, scores, self.n, lambda row, tokens: _ngram_continuations(tokens, self.n))


def _ban_repeats(input_ids, scores, n: int, table_of) -> torch.Tensor:
    """`scores` with -inf for each row's tokens that follow its last n - 1 tokens in `table_of(row, tokens)` (an
    n-gram continuation table); the caller's scores stay as they were."""
    if input_ids.shape[1] + 1 < n:
        return scores
    processed = scores
    for row, tokens in enumerate(input_ids.tolist()):
        prefix = tuple(tokens[len(tokens) - n + 1 :]) if n > 1 else ()
        banned = table_of(row, tokens).get(prefix, ())
        if banned:
            processed = scores.clone() if processed is scores else processed
            processed[row, list(banned)] = NEG_INF
    return processed


def _ends_with(input_ids: torch.LongTensor, prefix: Sequence[int]) -> torch.BoolTensor:
    """Per row: does the sequence end with `prefix`? (An empty prefix always matches.)"""
    if not prefix:
        return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    if len(prefix) > input_ids.shape[1]:
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    tail = input_ids[:, -len(prefix) :]
    return (tail == torch.tensor(prefix, device=input_ids.device)).all(dim=-1)


class EncoderNoRepeatNGramLogitsProcessor:
    """Bans any token that would repeat an n-gram of size `encoder_ngram_size` (>= 1) of `encoder_input_ids`
    [batch or 1, length] (an encoder-decoder model's source) in the generated sequence."""

    def __init__(self, encoder_ngram_size: int, encoder_input_ids: torch.LongTensor):
        _check(
            "encoder_no_repeat_ngram_size",
            encoder_ngram_size,
            isinstance(encoder_ngram_size, int) and encoder_ngram_size >= 1,
            "expected an integer >= 1",
        )
        if encoder_input_ids.dim() == 1:
            encoder_input_ids = encoder_input_ids[None]
        self.n = encoder_ngram_size
        self.tables = [_ngram_continuations(row, self.n) for row in encoder_input_ids.tolist()]

    def __call__(self, input_ids, scores):
        per_table = max(input_ids.shape[0] // len(self.tables), 1)  # beams of one source share its table
        return _ban_repeats(
            input_ids, scores, self.n, lambda row, tokens: self.tables[min(row // per_table, len(self.tables) - 1)]
        )


class SequenceBiasLogitsProcessor:
    """Adds a bias to the last token of each given sequence when the text so far ends with the rest of it.

    `sequence_bias`: {(token, ...): bias} or [[[token, ...], bias], ...]. A one-token sequence is always biased.
    """

    def __init__(self, sequence_bias):
        items = sequence_bias.items() if isinstance(sequence_bias, dict) else sequence_bias
        self.biases = [(tuple(int(t) for t in seq), float(b)) for seq, b in items]
        _check("sequence_bias", sequence_bias, all(len(s) > 0 for s, _ in self.biases), "sequences must be non-empty")

    def __call__(self, input_ids, scores):
        bias = torch.zeros_like(scores)
        for seq, b in self.biases:
            match = _ends_with(input_ids, seq[:-1])
            bias[:, seq[-1]] += match.to(scores.dtype) * b
        return scores + bias


class NoBadWordsLogitsProcessor:
    """Never generates any of `bad_words_ids` (a list of token-id lists): a sequence's last token is banned
    when the text ends with the rest of it. EOS ids are never banned, as the reference does."""

    def __init__(self, bad_words_ids: Iterable[Sequence[int]], eos_token_id: int | Sequence[int] | None = None):
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        self.words = [tuple(w) for w in bad_words_ids if not (len(w) == 1 and w[0] in eos)]
        _check("bad_words_ids", bad_words_ids, all(len(w) > 0 for w in self.words), "token lists must be non-empty")

    def __call__(self, input_ids, scores):
        if self.words:
            scores = scores.clone()  # the caller's scores stay as they were, as in transformers
        for word in self.words:
            match = _ends_with(input_ids, word[:-1])
            scores[:, word[-1]] = torch.where(match, NEG_INF, scores[:, word[-1]])
        return scores


class SuppressTokensLogitsProcessor(Processor):
    """Sets the scores of `suppress_tokens` to -inf at every step."""

    score_only = True

    def __init__(self, suppress_tokens: Sequence[int], device="cpu"):
        self.token_ids = tuple(_token_list(suppress_tokens))
        self.tokens = torch.tensor(self.token_ids, dtype=torch.long, device=device)

    def key(self) -> tuple:
        return (type(self).__qualname__, self.token_ids)

    def __call__(self, input_ids, scores):
        return scores.index_fill(-1, self.tokens.to(scores.device), NEG_INF)


class MinLengthLogitsProcessor:
    """Forbids EOS until the sequence (prompt included) is `min_length` tokens long."""

    def __init__(self, min_length: int, eos_token_id, device="cpu"):
        _check("min_length", min_length, isinstance(min_length, int) and min_length >= 0, "expected an integer >= 0")
        self.min_length = min_length
        self.eos = _token_list(eos_token_id)

    @property
    def blocks_eos_until(self) -> int:
        return self.min_length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] < self.min_length:
            scores = scores.clone()  # the caller's scores stay as they were, as in transformers
            scores[:, self.eos] = NEG_INF
        return scores


class MinNewTokensLengthLogitsProcessor(MinLengthLogitsProcessor):
    """Forbids EOS until `min_new_tokens` tokens have been generated after a prompt of `prompt_length_to_skip`."""

    def __init__(self, prompt_length_to_skip: int, min_new_tokens: int, eos_token_id, device="cpu"):
        _check(
            "min_new_tokens",
            min_new_tokens,
            isinstance(min_new_tokens, int) and min_new_tokens >= 0,
            "expected an integer >= 0",
        )
        super().__init__(prompt_length_to_skip + min_new_tokens, eos_token_id)
        self.prompt_length_to_skip, self.min_new_tokens = prompt_length_to_skip, min_new_tokens


def _force(scores: torch.FloatTensor, token_ids: Sequence[int]) -> torch.FloatTensor:
    forced = torch.full_like(scores, NEG_INF)
    forced[:, list(token_ids)] = 0
    return forced


class ForcedBOSTokenLogitsProcessor:
    """Makes `bos_token_id` the token after a sequence of one token (a decoder start token), as transformers does;
    after a longer prompt it does nothing."""

    def __init__(self, bos_token_id: int):
        self.bos = bos_token_id

    def __call__(self, input_ids, scores):
        return _force(scores, [self.bos]) if input_ids.shape[1] == 1 else scores


class ForcedEOSTokenLogitsProcessor:
    """Forces an EOS token as the last token when the sequence reaches `max_length`."""

    def __init__(self, max_length: int, eos_token_id, device="cpu"):
        self.max_length = max_length
        self.eos = _token_list(eos_token_id)

    def __call__(self, input_ids, scores):
        return _force(scores, self.eos) if input_ids.shape[1] == self.max_length - 1 else scores
