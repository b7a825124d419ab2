"""Logits processors: the logits hook point's framework. The processor classes are in warpers.py (the sampling
warpers) and penalties.py (penalties, bans, biases, forced tokens), each on the Processor base below.

One protocol: a processor is a callable `(input_ids [B, T], scores [B, V]) -> scores [B, V]`. It returns
new scores and leaves the ones it was given as they were (as transformers' processors do: a caller may keep them).
Removed tokens get -inf, or the `filter_value` a warper was made with. Each class does one thing and takes
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
from typing import Callable, NamedTuple, Protocol, runtime_checkable

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


class Capabilities(NamedTuple):
    """What a processor declares (Processor), read one way (capabilities): the CAPABILITIES flags, its stage, the
    length it bans its `eos` ids until where that is its whole effect (blocks_eos_until), and its key."""

    score_only: bool
    host_mask: bool
    finishes: bool
    stage: str
    blocks_eos_until: int | None
    eos: frozenset
    key: tuple


def capabilities(processor) -> Capabilities:
    """`processor`'s declarations, each read as `declares` reads a flag: an attribute of the object (its class's or
    its own). The fused step, continuous batching's shared pass, beam search and the pipeline read these records
    (Pipeline.capabilities), never the attributes themselves."""
    blocks = getattr(processor, "blocks_eos_until", None)
    eos = frozenset(getattr(processor, "eos", ()) or ()) if blocks is not None else frozenset()
    flags = (declares(processor, capability) for capability in CAPABILITIES)
    return Capabilities(*flags, stage_of(processor), blocks, eos, processor_key(processor))


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


# The checks the processor classes (warpers.py, penalties.py) make of their settings: a ValueError naming the setting,
# its value and what is accepted.


def check_setting(name: str, value, ok: bool, accepted: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid; {accepted}.")


def tokens_to_keep(min_tokens_to_keep) -> int:
    check_setting(
        "min_tokens_to_keep",
        min_tokens_to_keep,
        isinstance(min_tokens_to_keep, int) and min_tokens_to_keep >= 1,
        "expected an integer >= 1",
    )
    return min_tokens_to_keep


def token_ids(ids) -> list[int]:
    """An int, a list of ints or a tensor of them (transformers passes eos ids as a tensor) as a list of ints."""
    if isinstance(ids, torch.Tensor):
        return [int(t) for t in ids.reshape(-1).tolist()]
    return [int(ids)] if isinstance(ids, int) else [int(t) for t in ids]
