"""Choosing the next tokens of a continuous-batching step, one way: choose(requests, logits, race). The requests that
can share a pass have their next token chosen in one pass over their stacked logits, read back to the host in one
transfer, the step's only synchronisation with the device for them (sample_together); every other request is a group
of one, its own step (own_step), as generate() runs that prompt alone. Either way a request gets a Chosen, which it
records (Request.take).

A request takes part where its step needs nothing of its own (together_key): one row, logits processors that all
declare score_only (temperature, top-k, top-p, min-p, ...: each row's scores rewritten from that row alone), the
built-in greedy or sampling selector, stopping criteria that all declare where they stop (a length, EOS ids, stop
strings: decided on the host from the tokens) and no observer; its logprobs come from the same pass. Requests whose
processors have equal keys (the same classes and settings) have them applied once, to their rows together, and each
row is raced with the noise its request draws alone (selectors.race_rows), so a request gets the tokens its own step
(own_step) would give. That own step runs every other request, and every request of a pass where a processor
fails or some row's scores are unusable (NaN, -inf everywhere): the own step then says which processor or weight did
it. That is the one fallback: whatever the shared pass cannot do, the requests' own steps do.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from ..core.processors import check_scores, log_probs, observe_processors, unusable_rows
from ..core.selectors import drawn_as, race_rows
from ..registry.manager import failures_fail_the_request_alone
from ..core.transfer import to_device


class Together(NamedTuple):
    """What a request's next token is chosen with in the one pass: its processors' keys (requests with equal keys
    share one call of them), the length it stops at, its EOS ids, its stop-string criteria (ends_row, on the
    host)."""

    keys: tuple
    length: int
    eos: frozenset
    texts: tuple


def together_key(request) -> Together | None:
    """The Together of a request whose next token can be chosen with others' (see the module), else None."""
    p = request.pipeline
    if request.rows != 1 or request.observer is not None:
        return None
    if drawn_as(p.selector) not in ("argmax", "race"):
        return None
    declared = p.capabilities
    if not all(d.score_only for d in declared):
        return None
    length, eos, texts = request.max_length, set(), []
    for criterion in p.stopping:
        at, tokens = getattr(criterion, "ends_at_length", None), getattr(criterion, "ends_at_tokens", None)
        if getattr(criterion, "ends_at_strings", None):
            texts.append(criterion)  # stop strings: ends_row(tokens) on the host
        elif at is None and tokens is None:
            return None  # decided from something else (time, a plugin's rule): the request's own step
        length = min(length, at) if at is not None else length
        eos |= set(tokens or ())
    keys = tuple(d.key for d in declared)
    return Together(keys, length, frozenset(eos), tuple(texts))


class Chosen(NamedTuple):
    """A request's next tokens as its step chose them, one per row, with the log-probability and the most likely
    tokens' of its first row where the request asked for them (logprobs, top_logprobs); which rows go on (None: the
    request decides on the host from what it declares, `together`); and its sequences on the device with the new
    tokens (an own step's, kept so the next one copies nothing)."""

    tokens: list[int]
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    going: list[bool] | None = None
    sequences: torch.Tensor | None = None

    @property
    def token(self) -> int:
        return self.tokens[0]


class ReadBack:
    """What a step reads back to the host, in one transfer: tensors added by name, read back as lists by name (in
    float64, where token ids are exact)."""

    def __init__(self):
        self._parts: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._parts[name] = tensor.reshape(-1)

    def read(self) -> dict[str, list[float]]:
        host = torch.cat([part.double() for part in self._parts.values()]).tolist()
        out, at = {}, 0
        for name, part in self._parts.items():
            out[name] = host[at : at + part.numel()]
            at += part.numel()
        return out


def choose(requests: list, logits: dict[str, torch.Tensor], race) -> dict[str, Chosen | BaseException]:
    """{request id: its Chosen} for every request of `requests` with logits: those that take part chosen together
    (sample_together), every other one, and every one of a pass that could not be made, by its own step (own_step).
    A request whose own step raises gets the exception instead: it fails alone. `race`: selectors.race_rows or its
    compiled form (an exception of that one reaches the caller, which runs the step again with the eager race)."""
    together = sample_together(requests, logits, race)
    out: dict[str, Chosen | BaseException] = {}
    for request in requests:
        if request.id not in logits:
            continue
        if request.id in together:
            out[request.id] = together[request.id]
            continue
        try:
            with failures_fail_the_request_alone():
                out[request.id] = own_step(request, logits[request.id])
        except BaseException as error:  # the request's own code: SystemExit and the like end it alone
            out[request.id] = error
    return out


def own_step(request, logits: torch.Tensor) -> Chosen:
    """One step of generate()'s loop on `request`'s rows alone, given their next-token logits [rows, V]: processors,
    selector, stopping; the new tokens, which rows go on and the asked log-probabilities read back in one transfer."""
    p = request.pipeline
    sequences = request.sequences
    scores = logits.float()
    if scores.shape[0] > 1 and scores.stride(0) == 0:
        # A new request's rows share its prompt's logits (an expanded view): a processor may write into the scores it
        # is given, so each row gets its own.
        scores = scores.contiguous()
    unfinished = to_device(request.unfinished, torch.bool, scores.device)
    observed = observe_processors(request.observer) if request.observer is not None else contextlib.nullcontext()
    with observed:
        scores = p.processors(sequences, scores)
    check_scores(p.processors, scores, unfinished, sequences.shape[1])
    # A plugin's selector is checked every step (selectors.CheckedSelector): an id outside the vocabulary would fail
    # the next shared forward for every request in it, or read out of bounds in a compiled step.
    chosen = p.selector(sequences, scores)
    if request.observer is not None:
        request.observer(None, logits.float(), scores)
    tokens = torch.where(unfinished, chosen, request.pad)
    sequences = torch.cat((sequences, tokens[:, None]), dim=-1)
    unfinished = unfinished & ~p.stopping(sequences, scores)
    back = ReadBack()
    back.add("tokens", tokens)
    back.add("going", unfinished)
    if request.logprobs:
        logp = log_probs(scores[0])
        back.add("logprob", logp[chosen[0]])
        if request.top_logprobs:
            values, ids = logp.topk(request.top_logprobs)
            back.add("top values", values)
            back.add("top ids", ids)
    host = back.read()
    step = Chosen([int(t) for t in host["tokens"]], going=[bool(g) for g in host["going"]], sequences=sequences)
    if request.logprobs:
        top = list(zip(map(int, host["top ids"]), host["top values"])) if request.top_logprobs else None
        step = step._replace(logprob=host["logprob"][0], top=top)
    return step


def sample_together(requests: list, logits: dict[str, torch.Tensor], race) -> dict[str, Chosen]:
    """{request id: its next token} for the requests of `requests` with logits that take part (together_key), or {}
    where none does, or where a row's scores are unusable. `race`: selectors.race_rows or its compiled form."""
    rows = [r for r in requests if r.together is not None and r.id in logits]
    if not rows:
        return {}
    scores = torch.cat([logits[r.id] for r in rows]).float()
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        if len(r.pipeline.processors):
            groups.setdefault(r.together.keys, []).append(i)
    try:
        with failures_fail_the_request_alone():
            for members in groups.values():
                scores = _processed(rows, members, scores)
    except Exception:  # a processor that fails on these rows fails in the step of each request it belongs to
        return {}
    tokens = scores.argmax(-1)
    sampled = [i for i, r in enumerate(rows) if r.race_key is not None]
    if sampled:
        at = to_device(sampled, torch.long, scores.device)
        keys = to_device([rows[i].race_key for i in sampled], torch.int32, scores.device)
        positions = to_device([[rows[i].length] for i in sampled], torch.int32, scores.device)
        if len(sampled) == 1:  # raced as two equal rows: the compiled race, warmed up from two, would specialise to one
            at, keys, positions = at.expand(2), keys.expand(2), positions.expand(2, 1)
        tokens[at] = race(scores[at], keys[:, None], positions)
    back = ReadBack()
    back.add("tokens", tokens)
    back.add("unusable", unusable_rows(scores))
    asked = [i for i, r in enumerate(rows) if r.logprobs]
    top = max((rows[i].top_logprobs for i in asked), default=0)
    if asked:
        at = to_device(asked, torch.long, scores.device)
        logp = log_probs(scores[at])
        back.add("logprobs", logp.gather(1, tokens[at, None])[:, 0])
        if top:
            values, ids = logp.topk(top)  # [asked, top]: request j's at j * top
            back.add("top values", values)
            back.add("top ids", ids)
    host = back.read()
    if any(host["unusable"]):
        return {}
    chosen = {r.id: Chosen([int(token)]) for r, token in zip(rows, host["tokens"])}
    for j, i in enumerate(asked):
        r, first = rows[i], j * top
        best = None
        if r.top_logprobs:
            ids, values = (
                host["top ids"][first : first + r.top_logprobs],
                host["top values"][first : first + r.top_logprobs],
            )
            best = [(int(t), v) for t, v in zip(ids, values)]
        chosen[r.id] = chosen[r.id]._replace(logprob=host["logprobs"][j], top=best)
    return chosen


def _processed(rows: list, members: list[int], scores: torch.Tensor) -> torch.Tensor:
    """`scores` with the processors of the requests rows[members] (equal keys: each member's would do the same)
    applied to their rows."""
    processors = rows[members[0]].pipeline.processors
    # Score-only processors never read the ids: these stand for the rows' sequences in shape only.
    ids = torch.zeros((), dtype=torch.long, device=scores.device).expand(len(members), rows[members[0]].length)
    if len(members) == len(rows):
        return processors(ids, scores)
    at = to_device(members, torch.long, scores.device)
    scores[at] = processors(ids, scores[at])
    return scores


# Elements of a [rows, V] float32 pass that stay in one core's cache (512 KiB: within the L2 of the CPUs decodekit
# runs on).
CACHED_ELEMENTS = 1 << 17


def race_in_parts(scores: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """race_rows over a few rows at a time, for the eager race on the CPU: each of its dozen elementwise passes then
    works in a core's cache instead of streaming [rows, V] temporaries through memory (faster than all rows at once
    or one at a time: docs/performance.md). Compiled, the race is one fused pass and takes every row at once."""
    step = max(1, CACHED_ELEMENTS // scores.shape[-1])
    if scores.shape[0] <= step:
        return race_rows(scores, keys, positions)
    parts = range(0, scores.shape[0], step)
    return torch.cat([race_rows(scores[i : i + step], keys[i : i + step], positions[i : i + step]) for i in parts])
