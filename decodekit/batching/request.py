"""One request of continuous batching: its prompt, its own generation config and decoding method (the pipeline
generate() would build for it alone), its rows' tokens so far, and what it returns.

A request is prepared exactly as generate() prepares one prompt (the same config merge, validation, plugin
hooks and pipeline), so its result equals that prompt run alone through generate(). Strategies whose loop owns
several rows or the whole loop are refused here, before the request is queued.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..core.config import GenerationConfig, is_int
from ..core.generate import call_config, check_prompt_ids, prepare_call
from ..core.selectors import drawn_as
from ..core.pipeline import Pipeline, build_pipeline, last_position_logits
from .sampler import Together, together_key


class RequestStatus(str, enum.Enum):
    PENDING = "pending"  # queued, no cache blocks yet
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


DONE = (RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED)


@dataclass
class GenerationOutput:
    """A request's result (or, while streaming, its state so far).

    `generated_tokens`: the tokens after the prompt of its first row; `sequences`: every row's (more than one
    with num_return_sequences), EOS included where a row stopped on it, no padding after. `finish_reason`:
    "stop" (EOS or a stopping criterion), "length" (max_new_tokens / max_length), else None. `logprobs`: with
    logprobs=True, the log-probability of each generated token of the first row under the scores it was chosen
    from; `top_logprobs`: with top_logprobs=N as well, each of those steps' N most likely (token, log-probability),
    most likely first. `error`: why a failed request failed."""

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int]
    sequences: list[list[int]]
    status: RequestStatus
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    created_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None

    def is_finished(self) -> bool:
        return self.status in DONE


_ids = itertools.count()


def new_request_id() -> str:
    return f"req_{next(_ids)}"


# Fields decodekit's continuous batching takes besides the generation config (the rest of generate()'s arguments).
REQUEST_ARGUMENTS = (
    "custom_generate",
    "trust_remote_code",
    "seed",
    "logits_processor",
    "stopping_criteria",
    "tokenizer",
    "logprobs",
    "top_logprobs",
    "observer",
)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass(eq=False)  # identity: requests are found in lists by being the same one
class Request:
    """A request's state. Its tokens are kept on the host (`tokens`: every row's, prompt included), where the runner
    reads a step's inputs and output() the result without a device read; `sequences`, the same on the model's device
    as generate()'s input_ids, is made up to date only where a step of the request's own reads it
    (sampler.own_step)."""

    id: str
    prompt: list[int]
    config: GenerationConfig
    pipeline: Pipeline
    max_length: int
    streaming: bool
    logprobs: bool
    top_logprobs: int
    device: torch.device
    tokens: list[list[int]]  # per row: the prompt and the tokens chosen so far
    unfinished: list[bool]  # per row
    pad: int
    status: RequestStatus = RequestStatus.PENDING
    prefilled: int = 0  # prompt tokens in the cache (row 0)
    tables: list[list[int]] = field(default_factory=list)  # block table per row
    token_logprobs: list[float] = field(default_factory=list)
    token_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    error: str | None = None
    method: str | None = None  # the label of the request's custom_generate method, which its errors name
    stopped_by_length: bool = False
    created_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished_time: float | None = None
    # Told each step what its logits processors did (core.processors.observe_processors), then (None, the logits, the
    # scores the token was chosen from): the playground's explanation of a step, under the server's limits.
    observer: Callable[[str | None, torch.Tensor, torch.Tensor], None] | None = None
    # What its next token is chosen with where it is chosen together with other requests' (batching/sampler.py); None
    # where the request's own step chooses it (sampler.own_step).
    together: Together | None = None
    race_key: int | None = None  # the sampling selector's key, read once, where `together` holds and it samples
    _sequences: torch.Tensor | None = None  # the device copy of `tokens`, as far as the last own step made it

    @classmethod
    def of(cls, device, request_id, prompt, gc, pipeline, max_length, streaming, extras, method) -> Request:
        """A fresh request of gc.num_return_sequences rows, each the prompt, unfinished."""
        rows = gc.num_return_sequences
        request = cls(
            id=request_id,
            prompt=prompt,
            config=gc,
            pipeline=pipeline,
            max_length=max_length,
            streaming=streaming,
            logprobs=extras.get("logprobs", False),
            top_logprobs=extras.get("top_logprobs", 0),
            device=torch.device(device),
            tokens=[list(prompt) for _ in range(rows)],
            unfinished=[True] * rows,
            pad=gc.pad_token_id if gc.pad_token_id is not None else 0,
            method=method,
            observer=extras.get("observer"),
        )
        request.together = together_key(request)
        if request.together is not None and drawn_as(pipeline.selector) == "race":
            request.race_key = int(pipeline.selector.key)
        return request

    @property
    def rows(self) -> int:
        return len(self.tokens)

    @property
    def length(self) -> int:
        """Tokens of each row so far, prompt included."""
        return len(self.tokens[0])

    @property
    def prompt_length(self) -> int:
        return len(self.prompt)

    @property
    def sequences(self) -> torch.Tensor:
        """Every row's tokens [rows, length] on the model's device (generate()'s input_ids), copied from `tokens`
        where the device copy is behind."""
        have = 0 if self._sequences is None else self._sequences.shape[1]
        if have < self.length:
            new = torch.tensor([row[have:] for row in self.tokens], dtype=torch.long, device=self.device)
            self._sequences = new if self._sequences is None else torch.cat((self._sequences, new), dim=-1)
        return self._sequences

    def take(self, chosen) -> None:
        """Records the step's choice (batching/sampler.py's Chosen): each row's new token, the log-probabilities asked
        for, and which rows go on; where the shared pass chose it (one row, stopping declared as a length, EOS ids
        and stop strings: `together`), whether it ends there is decided here, on the host."""
        if self.logprobs:
            self.token_logprobs.append(chosen.logprob)
            if self.top_logprobs:
                self.token_top_logprobs.append(chosen.top)
        self._add(chosen.tokens)
        if chosen.sequences is not None:
            self._sequences = chosen.sequences
        self._going(chosen.going if chosen.going is not None else [not self._ends_together()])

    def _ends_together(self) -> bool:
        together, token = self.together, self.tokens[0][-1]
        return (
            token in together.eos
            or self.length >= together.length
            or any(c.ends_row(self.tokens[0]) for c in together.texts)
        )

    def _add(self, tokens: list[int]) -> None:
        for row, token in zip(self.tokens, tokens):
            row.append(token)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def _going(self, unfinished: list[bool]) -> None:
        self.unfinished = unfinished
        if not any(unfinished):
            self.stopped_by_length = self.length >= self.max_length and not self._ended_on_eos()
            self.status = RequestStatus.FINISHED

    def _ended_on_eos(self) -> bool:
        eos = self.config.eos_token_ids
        return bool(eos) and self.tokens[0][-1] in eos

    def output(self) -> GenerationOutput:
        rows = [trim_after_end(row[self.prompt_length :], self.config.eos_token_ids) for row in self.tokens]
        reason = None
        if self.status == RequestStatus.FINISHED:
            reason = "length" if self.stopped_by_length else "stop"
        return GenerationOutput(
            request_id=self.id,
            prompt_ids=list(self.prompt),
            generated_tokens=rows[0],
            sequences=rows,
            status=self.status,
            finish_reason=reason,
            error=self.error,
            logprobs=self.token_logprobs[: len(rows[0])] if self.logprobs else None,
            top_logprobs=self.token_top_logprobs[: len(rows[0])] if self.logprobs and self.top_logprobs else None,
            created_time=self.created_time,
            first_token_time=self.first_token_time,
            finished_time=self.finished_time,
        )


def trim_after_end(row: list[int], eos: list[int]) -> list[int]:
    """A row's generated tokens up to and including its first EOS (the padding generate() adds after it dropped)."""
    for i, token in enumerate(row):
        if token in eos:
            return row[: i + 1]
    return row


def prompt_list(model, input_ids) -> list[int]:
    """The prompt as a list of token ids, checked: a non-empty list (or 1-D tensor) of ids inside the vocabulary."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1 or input_ids.is_floating_point():
            raise ValueError(
                f"input_ids must be one prompt: a list of token ids or a 1-D integer tensor, got a tensor of "
                f"shape {tuple(input_ids.shape)} and dtype {input_ids.dtype}."
            )
        input_ids = input_ids.tolist()
    if not isinstance(input_ids, (list, tuple)) or not all(is_int(t) for t in input_ids):
        raise ValueError(
            f"input_ids must be a list of token ids (ints), got {type(input_ids).__name__}"
            + (
                f" holding {type(next(t for t in input_ids if not is_int(t))).__name__}"
                if isinstance(input_ids, (list, tuple))
                else ""
            )
            + "."
        )
    check_prompt_ids(model, input_ids)
    return [int(t) for t in input_ids]


def check_context(model, prompt_length: int, max_length: int) -> None:
    """ValueError unless prompt + new tokens fit the model's context (max_position_embeddings): a batch's steps
    (paged or compiled) have no position past it, and one request past it would fail every request it shares a
    step with."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if is_int(context) and max_length > context:
        raise ValueError(
            f"The prompt has {prompt_length} tokens and generation may go on to {max_length} positions "
            f"(max_new_tokens {max_length - prompt_length}), past the model's context of {context} positions "
            f"(max_position_embeddings). Shorten the prompt or lower max_new_tokens to at most {context - prompt_length}."
            if prompt_length < context
            else f"The prompt has {prompt_length} tokens, the model's context is {context} positions "
            "(max_position_embeddings): shorten the prompt."
        )


def check_logprobs(logprobs, top) -> None:
    """ValueError for a logprobs that is not a bool, or a top_logprobs outside [0, MAX_TOP_LOGPROBS] or without it."""
    if not isinstance(logprobs, bool):
        raise ValueError(f"logprobs={logprobs!r} is invalid; expected True or False.")
    if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS or (top and not logprobs):
        raise ValueError(
            f"top_logprobs={top!r} is invalid; expected an integer in [0, {MAX_TOP_LOGPROBS}], with logprobs=True."
        )


def refuse_unbatchable(call) -> None:
    """ValueError for what continuous batching cannot run: a decoding loop that does not declare one token per row
    and step (hookspecs), and outputs other than token ids and logprobs."""
    if call.loop is not None and getattr(call.loop, "one_token_per_row", False) is not True:
        raise ValueError(
            f"Continuous batching runs one token per row and step; the decoding loop of plugin {call.loop_owner!r} "
            "(beam search, contrastive search, assisted or self-speculative decoding, prompt lookup, DoLa or a "
            "method's own loop) cannot share the step with other requests. Run it with generate()."
        )
    for name in ("output_hidden_states", "output_attentions", "return_dict_in_generate"):
        if getattr(call.config, name, False):
            raise ValueError(
                f"{name}=True is not available with continuous batching (its results are token ids, "
                "and logprobs=True); use generate()."
            )


def prepare_request(
    model,
    input_ids,
    generation_config: GenerationConfig | None,
    request_id: str,
    streaming: bool,
    options: dict[str, Any],
    methods,
    fits=None,
) -> Request:
    """A Request for one prompt, prepared as generate() prepares a call (ValueError for anything invalid).

    `options`: generation config fields and REQUEST_ARGUMENTS; `methods`: loads custom_generate specs once
    (the manager's MethodCache); `fits(rows, prompt_length, max_length)`: raises ValueError where the request
    could never be admitted, called before any hook runs or anything the request's size decides is allocated."""
    options = dict(options)
    extras = {k: options.pop(k) for k in REQUEST_ARGUMENTS if k in options}
    prompt = prompt_list(model, input_ids)
    method = methods.get(extras.get("custom_generate"), extras.get("trust_remote_code"))
    logprobs, top = extras.get("logprobs", False), extras.get("top_logprobs", 0)
    with method.registered() if method is not None else contextlib.nullcontext():
        gc, model_kwargs = call_config(model, generation_config, options)
        if model_kwargs:
            raise ValueError(f"add_request() takes the prompt as input_ids only; got {sorted(model_kwargs)} as well.")
        rows = gc.num_return_sequences

        def admissible(max_length: int) -> None:  # before any plugin runs, nothing allocated for the request's size
            check_context(model, len(prompt), max_length)
            if fits is not None:
                fits(rows, len(prompt), max_length)
            check_logprobs(logprobs, top)

        call = prepare_call(
            model,
            gc,
            prompt_length=len(prompt),
            batch_size=rows,
            device=model.device,
            seed=extras.get("seed"),
            tokenizer=extras.get("tokenizer"),
            before_hooks=admissible,
        )
        refuse_unbatchable(call)
        # The batch's paged cache (or the runner's) serves every request: none is made for the request alone.
        pipeline = build_pipeline(
            gc, call.context, extras.get("logits_processor"), extras.get("stopping_criteria"), make_cache=False
        )
    if pipeline.next_token_logits is not last_position_logits:
        raise ValueError(
            "This configuration reads next-token logits another way (a plugin's decodekit_next_token_logits, "
            "e.g. DoLa); continuous batching reads the last position's logits only."
        )
    label = method.method.source.label if method is not None else None
    return Request.of(model.device, request_id, prompt, gc, pipeline, call.max_length, streaming, extras, label)
