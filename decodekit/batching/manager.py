"""ContinuousBatchingManager: requests added at any time, each with its own generation config and decoding
method, stepped together in one thread, and generate_batch over it (what decodekit.facade.Model gives every
decodekit model).

    with model.init_continuous_batching(max_new_tokens=64) as manager:
        rid = manager.add_request(prompt_ids, do_sample=True, seed=3)
        result = manager.get_result(rid, timeout=60)     # GenerationOutput

A request is validated when it is added (ValueError, in the caller's thread), limits first: one that could
never fit the model's context or the cache is refused before anything its size decides is allocated. A full
queue raises QueueFull. A request that fails later fails alone: whatever its own code raises (a plugin's
processor or selector, SystemExit and KeyboardInterrupt included; a real Ctrl-C still stops the loop), a token
outside the vocabulary, or a forward that fails only with it in the step, ends it with status FAILED and the
error, and the others go on.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Iterator

import torch

from ..core.config import is_int
from ..core.limits import available_bytes, bytes_per_position
from ..core.selectors import race_rows
from ..core.compile import compile_own
from ..registry.manager import failures_fail_the_request_alone
from ..sizes import human_size
from .compiled import ATTENTION
from .outputs import RequestOutputs
from .request import DONE, GenerationOutput, Request, RequestStatus, new_request_id, prepare_request
from .runner import CacheRunner, PagedRunner, supports_paged
from .sampler import choose, race_in_parts
from .scheduler import Scheduler

logger = logging.getLogger("decodekit")

# The manager's own options; any other keyword of init_continuous_batching() is a generation config field.
MANAGER_OPTIONS = (
    "max_queue_size",
    "block_size",
    "max_cache_bytes",
    "max_batch_tokens",
    "max_running",
    "min_prefill",
    "paged_attention",
)

DEFAULT_CACHE_BYTES = 2 * 1024**3


class QueueFull(RuntimeError):
    """The manager's queue of requests not yet running is at max_queue_size."""


class MethodCache:
    """custom_generate of a request: a hook-only method, loaded once through the trust gate and registered while
    the request's pipeline is built. `allowed`: {name: LoadedMethod} a server loaded at start; with it, requests
    may name only those (never load code of their own choosing)."""

    def __init__(self, allowed: dict[str, Any] | None = None):
        self.allowed = allowed
        self.loaded: dict[tuple, Any] = {}
        self.lock = threading.Lock()

    def get(self, spec, trust):
        if spec is None:
            return None
        from ..hub_loader.method import LoadedMethod, load_method, registered_for_call

        if isinstance(spec, LoadedMethod):
            method = spec
        elif self.allowed is not None:
            if spec not in self.allowed:
                raise ValueError(
                    f"custom_generate={spec!r} is not one of the methods allowed here: {sorted(self.allowed)}."
                )
            method = self.allowed[spec]
        elif isinstance(spec, (str, os.PathLike)):
            with self.lock:
                key = (os.fspath(spec), trust)
                if key not in self.loaded:
                    self.loaded[key] = load_method(spec, trust)
                method = self.loaded[key]
        else:
            raise ValueError(
                f"custom_generate={spec!r} is invalid for continuous batching; it accepts a Hub repo id or "
                "a local directory holding a hook-only method (a callable owns the whole loop)."
            )
        if method.generate is not None:
            raise ValueError(
                f"custom_generate {method.source.label!r} replaces the whole decoding loop; continuous "
                "batching runs hook-only methods (processors, a selector, stopping criteria). Use generate()."
            )
        return _Registered(method, registered_for_call)


class _Registered:
    def __init__(self, method, registered_for_call):
        self.method, self._registered = method, registered_for_call

    def registered(self):
        return self._registered(self.method)


STEP_FIELDS = ("compile", "compile_config")


def step_compile_options(model, generation_config) -> dict | None:
    """The batch's step is compiled when the manager's own generation config (its requests' defaults) says
    compile=True: its compile_config then, else None. A request's own compile field cannot change a step that
    other requests share."""
    gc = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    if not getattr(gc, "compile", False):
        return None
    from ..core.compile import check_compile_config

    check_compile_config(gc)  # now, not at each request: every request would fail on it
    return dict(gc.compile_config or {})


def check_sizes(max_queue_size, block_size, max_batch_tokens, max_running, min_prefill, paged_attention) -> None:
    """The manager's sizes and its paged_attention, checked: a ValueError naming the argument and what it takes."""
    for name, value, low in (
        ("max_queue_size", max_queue_size, 0),
        ("block_size", block_size, 1),
        ("max_batch_tokens", max_batch_tokens, 1),
        ("max_running", max_running, 1),
        ("min_prefill", min_prefill, 1),
    ):
        if not is_int(value) or value < low:
            raise ValueError(f"{name}={value!r} is invalid; expected an integer >= {low}.")
    if paged_attention not in ATTENTION:
        raise ValueError(f"paged_attention={paged_attention!r} is invalid; expected one of {', '.join(ATTENTION)}.")


def _settle(done: Future, work: Callable[[], Any], stopping: bool) -> None:
    """`done` given work()'s result or exception (a RuntimeError where the manager is stopping: nothing runs)."""
    if stopping:
        done.set_exception(RuntimeError("the batching manager is stopping"))
        return
    try:
        done.set_result(work())
    except BaseException as error:  # the caller's work: its Future holds what it raised
        done.set_exception(error)


class ContinuousBatchingManager:
    """Schedules requests over one model; its steps run in run() or, after start(), in a background thread.

    `generation_config`: the defaults every request starts from (else the model's); `block_size`: positions per
    cache block; `max_cache_bytes`: the paged cache's size (default: see default_cache_bytes); `max_batch_tokens`:
    tokens per step (decode rows plus prefill chunks); `min_prefill`: prefill tokens a step takes even when decode
    rows fill the budget; `max_running`: requests in the cache at once; `max_queue_size`: requests waiting beyond
    those (0: no limit); `paged_attention`: how compiled decode steps attend over the paged cache, "auto" (decodekit's
    C++ kernel on the CPU, else the rows' blocks gathered for one SDPA call), "gathered" or "flex" (flex attention
    reading the blocks in place, for GPUs; batching/flex.py); `methods`: a MethodCache.
    """

    def __init__(
        self,
        model,
        generation_config=None,
        max_queue_size: int = 0,
        block_size: int = 16,
        max_cache_bytes: int | None = None,
        max_batch_tokens: int = 512,
        max_running: int = 64,
        min_prefill: int = 32,
        paged_attention: str = "auto",
        methods: MethodCache | None = None,
    ):
        check_sizes(max_queue_size, block_size, max_batch_tokens, max_running, min_prefill, paged_attention)
        self.model = model
        self.generation_config = generation_config
        self.max_queue_size = max_queue_size
        self.methods = methods or MethodCache()
        compile_options = step_compile_options(model, generation_config)
        if compile_options is None and paged_attention != "auto":
            raise ValueError(
                f"paged_attention={paged_attention!r} chooses the compiled decode step's attention; pass compile=True "
                "(eager steps attend through decodekit's kernel on the CPU, else through gathered blocks)."
            )
        self.runner = make_runner(model, block_size, max_cache_bytes, max_running, compile_options, paged_attention)
        self.scheduler = Scheduler(self.runner, max_batch_tokens, max_running, min_prefill)
        # Sampling many requests' rows at once: eagerly, the race's noise takes about fifteen passes over [rows, V];
        # compiled, one.
        # Every guard kept: with the steps' filter (argument_guards_only, which knows none of race_rows' argument
        # names) a graph specialised to one sampled row was replayed for several and inductor raised.
        self._eager_race = race_in_parts if model.device.type == "cpu" else race_rows
        self._compiled_race = (
            None if compile_options is None else compile_own(race_rows, {"dynamic": True}, guard_filter=None)
        )
        self._race = self._compiled_race or self._eager_race
        self._compile_later: tuple[Callable[[], bool], Callable | None] | None = None
        self._cv = threading.Condition()
        self._incoming: list[Request] = []
        self._between: list[tuple[Callable[[], Any], Future]] = []  # work for the stepping thread (between_steps)
        self._cancels: set[str] = set()
        self._discard: set[str] = set()  # cancelled by a client that went away: nobody collects the result
        self.counts = {s.value: 0 for s in DONE}  # requests ended, by status
        self._active: set[str] = set()  # added, not yet published as done
        # Every request's outputs, from add_request until its reader has them all (request_id_iter, get_result).
        self._outputs: dict[str, RequestOutputs] = {}
        self._finished: deque[str] = deque()  # ended requests that get_result hands out, in the order they ended
        self._thread: threading.Thread | None = None
        self._owner: threading.Thread | None = None  # the thread running the steps
        self._until_idle = False
        self._stopping = False
        self._interrupted = False  # a real Ctrl-C arrived (run() in the main thread), as opposed to a request's own
        self.on_end = None  # called with each request's final GenerationOutput, in the stepping thread
        self.steps = 0

    # ---- lifecycle ----
    def start(self) -> None:
        """Runs the steps in a background thread. On CPU prefer run() in the thread that does the process's other
        torch work (see run())."""
        if self.is_running():
            return
        self._stopping = False
        self._thread = threading.Thread(target=self.run, name="decodekit-batching", daemon=True)
        self._thread.start()

    def run(self, until_idle: bool = False) -> None:
        """Runs the steps in the calling thread until stop() (from another thread), or, with `until_idle`, until
        every request added so far has ended.

        On CPU this is the fast way: OpenMP keeps a pool of worker threads per thread that starts parallel regions,
        and where a second pool joins the first on a machine with few cores, libgomp stops spinning and every
        parallel region pays a sleep and wake (several times the region's own time for a step's small operations;
        docs/performance.md). generate_batch and `decodekit serve` run the steps in the main thread."""
        self._owner = threading.current_thread()
        self._until_idle = until_idle
        self._interrupted = False
        previous = None
        if self._owner is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            with torch.inference_mode():
                while self._loop_once():
                    pass
        except BaseException as error:  # Ctrl-C, or a bug of ours: end every request rather than leave waiters hanging
            interrupted = isinstance(error, KeyboardInterrupt)
            if not interrupted:
                logger.exception("continuous batching stopped on an error")
            with self._cv:
                incoming, self._incoming = self._incoming, []
                between, self._between = self._between, []
            for work, done in between:
                _settle(done, work, stopping=True)
            for request in [*self.scheduler.running, *self.scheduler.waiting, *incoming]:
                if interrupted:
                    self._end(request, RequestStatus.CANCELLED)
                else:
                    self._fail(request, error)
            raise
        finally:
            self._owner = None
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _on_sigint(self, signum, frame):
        self._interrupted = True  # so the KeyboardInterrupt below is not taken for a request's own
        raise KeyboardInterrupt

    def between_steps(self, work: Callable[[], Any]) -> Future:
        """Runs `work()` in the thread that runs the steps, between two of them (at once in the caller's thread where
        no thread runs them), and returns a Future of its result: work on the model that must not run beside a step
        (OpenMP's thread pools are the stepping thread's; a second thread's parallel regions would slow both), such
        as a prompt's logprobs for `decodekit serve`'s echo."""
        done: Future = Future()
        with self._cv:
            if self.is_running() and not self._stopping:
                self._between.append((work, done))
                self._cv.notify_all()
                return done
        _settle(done, work, self._stopping)
        return done

    def is_running(self) -> bool:
        return self._owner is not None or (self._thread is not None and self._thread.is_alive())

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stops the thread; requests not finished yet end CANCELLED (their waiters get that result)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if block:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "ContinuousBatchingManager":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(block=True)

    @property
    def free_blocks(self) -> int:
        return self.runner.free_blocks

    @property
    def total_blocks(self) -> int:
        return self.runner.total_blocks

    # ---- requests ----
    def warm_up(self, compile: bool = True) -> list[int]:
        """Does now what the first requests would otherwise pay for (a server calls it before taking requests):
        writes the paged cache once, so its memory (max_cache_bytes) is taken now rather than page by page during
        steps, and with compile=True compiles the decode step and runs it at 1 and max_running rows. Returns
        those row counts, [] where steps are not compiled. Call it from the thread that will run the steps.

        `compile` False: the cache only; steps run eagerly until compile_when's condition holds."""
        sizes = self.runner.warm_up(self.scheduler.max_running, compile)
        if self._compiled_race is not None:
            self._race = self._compiled_race if compile else self._eager_race
            if compile:
                self._race_rows_warm_up()
        return sizes

    def compile_when(self, ready: Callable[[], bool], then: Callable[[list[int]], None] | None = None) -> None:
        """After warm_up(compile=False): the stepping thread compiles the steps (warm_up) at the first moment
        `ready()` is true, between two steps, and calls then(row counts). A server listens at once and serves
        eagerly meanwhile; `ready` says when torch's compile caches are warm (a process compiling the same step),
        so the pause is seconds."""
        self._compile_later = (ready, then)

    def _compile_due(self) -> bool:
        later = self._compile_later
        if later is None or not later[0]():
            return False
        self._compile_later = None
        sizes = self.warm_up(compile=True)
        if later[1] is not None:
            later[1](sizes)
        return True

    def _race_rows_warm_up(self) -> None:
        vocab = self.model.config.vocab_size
        device = self.model.device
        with torch.inference_mode():
            for rows in (2, 3):  # the second call settles the dynamic row count
                self._race(
                    torch.zeros(rows, vocab, device=device),
                    torch.zeros(rows, 1, dtype=torch.int32, device=device),
                    torch.ones(rows, 1, dtype=torch.int32, device=device),
                )

    def add_request(
        self,
        input_ids,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        listener=None,
        **fields,
    ) -> str:
        """Queues one prompt (a list of token ids) with its own generation config fields and decoding method
        (custom_generate=, trust_remote_code=, seed=, logits_processor=, stopping_criteria=, logprobs=). Returns
        the request id. ValueError if anything is invalid; QueueFull if max_queue_size requests already wait.

        `listener`: a callable given the request's outputs in the stepping thread (every step's with `streaming`,
        else only the final one), which then are neither kept for get_result nor streamed: for a caller that
        waits another way (the server hands them to its event loop). It must return quickly and not raise."""
        if request_id is None:
            request_id = new_request_id()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r} is invalid; expected a non-empty string.")
        if listener is not None and not callable(listener):
            raise ValueError(f"listener={listener!r} is invalid; expected a callable taking a GenerationOutput.")
        if max_new_tokens is not None:
            fields["max_new_tokens"] = max_new_tokens
        with failures_fail_the_request_alone():  # a plugin's hook failing on this request's values fails it alone
            request = prepare_request(
                self.model,
                input_ids,
                self.generation_config,
                request_id,
                streaming,
                fields,
                self.methods,
                fits=self._fits,
            )
        with self._cv:
            if self._stopping:
                raise RuntimeError("The manager is stopped; start() it again before adding requests.")
            if request_id in self._outputs:
                raise ValueError(f"request_id={request_id!r} is already in use.")
            # Requests that free running slots will take at the next step do not wait: a burst arriving between two
            # steps must not be refused while slots are free.
            free = max(0, self.scheduler.max_running - len(self.scheduler.running))
            waiting = max(0, len(self._incoming) + len(self.scheduler.waiting) - free)
            if self.max_queue_size and waiting >= self.max_queue_size:
                raise QueueFull(f"{waiting} requests are waiting (max_queue_size={self.max_queue_size}); retry later.")
            self._outputs[request_id] = RequestOutputs(streaming, listener)
            self._active.add(request_id)
            self._incoming.append(request)
            self._cv.notify_all()
        return request_id

    def _fits(self, rows: int, prompt_length: int, max_length: int) -> None:
        need = self.runner.blocks_needed(rows, prompt_length, max_length)
        if need > self.runner.total_blocks:
            raise ValueError(
                f"The request needs {need} cache blocks ({rows} row(s) up to {max_length} positions: prompt "
                f"{prompt_length} + max_new_tokens {max_length - prompt_length}) and the cache has "
                f"{self.runner.total_blocks}: lower max_new_tokens or the number of rows, or give the manager more "
                "cache (max_cache_bytes)."
            )

    def cancel_request(self, request_id: str, keep_result: bool = True) -> None:
        """Cancels a queued or running request: its blocks are freed at the next step, and its result (status
        CANCELLED, the tokens so far) is published, unless `keep_result` is False (a client that went away).
        Nothing happens for an unknown or finished request."""
        with self._cv:
            if request_id in self._active:
                self._cancels.add(request_id)
                if not keep_result:
                    self._discard.add(request_id)
                self._cv.notify_all()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The result of `request_id` (or of whichever request finishes first, without one), waiting up to
        `timeout` seconds (None: as long as it takes); None on timeout. Streaming requests end in their stream
        (request_id_iter), not here."""
        outputs = self._outputs.get(request_id) if request_id is not None else None
        if outputs is not None:
            outputs.check_read("get_result", request_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                if request_id is None and self._finished:
                    return self._outputs.pop(self._finished.popleft()).queue.get_nowait()
                if request_id is not None and request_id in self._finished:
                    self._finished.remove(request_id)
                    return self._outputs.pop(request_id).queue.get_nowait()
                if request_id is not None and request_id not in self._active:
                    raise KeyError(f"No request {request_id!r} is running or waiting to be collected.")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                if not self.is_running() and not self._incoming and not self._finished:
                    return None
                self._cv.wait(left if left is not None else 0.5)

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """The outputs of a streaming request as its tokens come (each with every token so far), the last one
        finished; of a request added without streaming, only its result."""
        outputs = self._outputs.get(request_id)
        if outputs is not None:
            outputs.check_read("request_id_iter", request_id)
        if outputs is None or not outputs.streaming:
            result = self.get_result(request_id)
            if result is not None:
                yield result
            return
        while True:
            output = outputs.queue.get()
            if output.is_finished():
                with self._cv:
                    self._outputs.pop(request_id, None)
                yield output
                return
            yield output

    # ---- the steps ----
    def _loop_once(self) -> bool:
        with self._cv:
            while not (self._stopping or self._incoming or self._cancels or self._between) and self.scheduler.idle:
                if self._until_idle:
                    return False
                if self._compile_later is not None:
                    break  # the compile's condition is looked at outside the lock, below
                self._cv.wait(0.5)
            incoming, self._incoming = self._incoming, []
            cancels, self._cancels = self._cancels, set()
            between, self._between = self._between, []
            stopping = self._stopping
        for work, done in between:
            _settle(done, work, stopping)
        if self._compile_later is not None and not stopping:
            if not self._compile_due() and not incoming and not cancels and self.scheduler.idle:
                with self._cv:
                    self._cv.wait(0.5)  # idle: look again in a moment
                return True
        for request in incoming:
            self.scheduler.waiting.append(request)
        if stopping:
            for request in [*self.scheduler.running, *self.scheduler.waiting]:
                self._end(request, RequestStatus.CANCELLED)
            return False
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            if request.id in cancels:
                self._end(request, RequestStatus.CANCELLED)
        self.scheduler.admit()
        works = self.scheduler.plan()
        if not works:
            return True
        logits = self._forward(works)
        self.steps += 1
        chosen = self._choose([work.request for work in works], logits)
        for work in works:
            request = work.request
            if work.prefill:
                request.prefilled = work.end
            if request.id not in logits:
                continue
            request.status = RequestStatus.DECODING
            outcome = chosen[request.id]
            if isinstance(outcome, BaseException):
                if isinstance(outcome, KeyboardInterrupt) and self._interrupted:
                    raise outcome
                self._fail(request, outcome)
                continue
            request.take(outcome)
            if request.status == RequestStatus.FINISHED:
                self._end(request, RequestStatus.FINISHED)
            elif request.streaming:
                self._publish(request)
        return True

    def _choose(self, requests: list, logits: dict) -> dict:
        """The step's tokens (sampler.choose); where the compiled race raises, it runs eagerly from then on."""
        if self._race is self._eager_race:
            return choose(requests, logits, self._race)
        try:
            return choose(requests, logits, self._race)
        except Exception as error:  # inductor's own failures are AssertionErrors and the like, not dynamo's
            logger.warning(
                "continuous batching: the compiled sampling failed (%s: %s); it runs eagerly from now on",
                type(error).__name__,
                (str(error).splitlines() or [""])[0],
            )
            self._race = self._eager_race
            return choose(requests, logits, self._race)

    def _forward(self, works: list) -> dict[str, torch.Tensor]:
        """The step's logits. If the shared forward fails, each work runs alone (a work's positions are written
        again, to the same slots), so only a request that fails by itself fails."""
        try:
            return self.runner.forward(works)
        except Exception as error:
            if len(works) == 1:
                self._fail(works[0].request, error)
                return {}
            logger.warning(
                "continuous batching: a step of %d requests failed (%s); running them one by one", len(works), error
            )
        logits = {}
        for work in works:
            try:
                logits.update(self.runner.forward([work]))
            except Exception as error:
                self._fail(work.request, error)
        return logits

    def _publish(self, request: Request) -> None:
        """A streaming request's output so far."""
        self._outputs[request.id].put(request.output())

    def _fail(self, request: Request, error: BaseException) -> None:
        # The notes name the plugin or method whose code raised (processors.py, stopping.py add them).
        notes = "".join(f" {note}" for note in getattr(error, "__notes__", ()))
        by = f"method {request.method!r} failed: " if request.method else ""
        request.error = f"{by}{type(error).__name__}: {error}{notes}"
        logger.info("continuous batching: request %s failed: %s", request.id, request.error)
        self._end(request, RequestStatus.FAILED)

    def _end(self, request: Request, status: RequestStatus) -> None:
        """The request's final output, to on_end, then to its reader (nobody's, for a client that went away): a
        client that has its answer finds it counted (serve's /metrics read right after a response missed it)."""
        self.scheduler.remove(request)
        request.status = status
        request.finished_time = time.monotonic()
        output = request.output()
        if self.on_end is not None:
            try:
                self.on_end(output)
            except Exception:  # noqa: BLE001 - a watcher's failure must not keep the output from its reader
                logger.exception("on_end failed for request %s", request.id)
        with self._cv:
            self.counts[status.value] += 1
            self._active.discard(request.id)
            outputs = self._outputs.get(request.id)
            if request.id in self._discard:
                self._discard.discard(request.id)
                self._outputs.pop(request.id, None)
                outputs = None
            elif outputs is not None and outputs.listener is not None:
                self._outputs.pop(request.id)  # the listener has it all once called, outside the lock
            elif outputs is not None:
                outputs.put(output)  # under the lock: get_result finds the output with the id
                if not outputs.streaming:
                    self._finished.append(request.id)
                outputs = None
            self._cv.notify_all()
        if outputs is not None:
            outputs.put(output)


def make_runner(model, block_size: int, max_cache_bytes, max_running: int, compile_options, paged_attention="auto"):
    """The runner of the batch's forwards: a paged cache of `max_cache_bytes` (default_cache_bytes where None) in
    blocks of `block_size` positions where the model has a paged path, else a cache per request."""
    if supports_paged(model):
        per_block = bytes_per_position(model) * block_size
        budget = max_cache_bytes if max_cache_bytes is not None else default_cache_bytes(model, max_running)
        if not is_int(budget) or budget < per_block:
            raise ValueError(
                f"max_cache_bytes={max_cache_bytes!r} is invalid; one block of {block_size} positions "
                f"takes {per_block} bytes for this model."
            )
        logger.info(
            "continuous batching: paged cache of %d blocks of %d positions (%s)",
            budget // per_block,
            block_size,
            human_size(budget // per_block * per_block),
        )
        return PagedRunner(model, budget // per_block, block_size, compile_options, paged_attention)
    if compile_options is not None:
        logger.info("continuous batching: compile=True has no effect on %s (no paged path)", type(model).__name__)
    logger.info(
        "continuous batching: %s has no paged path; each request keeps a cache of its own and runs its own forward "
        "each step",
        type(model).__name__,
    )
    return CacheRunner(model, max_running)


def default_cache_bytes(model, max_running: int) -> int:
    """The smaller of 2 GiB, half the memory available, and what max_running requests at the model's full
    context would take."""
    free = available_bytes(model.device)
    context = getattr(model.config, "max_position_embeddings", None) or 4096
    needed = max_running * (context + 16) * bytes_per_position(model)
    return min(DEFAULT_CACHE_BYTES, needed, *([free // 2] if free is not None else []))


def generate_batch(
    model, inputs: list, generation_config=None, progress_bar: bool = True, **kwargs
) -> dict[str, GenerationOutput]:
    """model.generate_batch() (see decodekit.facade.Model), its steps run in the calling thread."""
    if not isinstance(inputs, (list, tuple)):
        raise ValueError(f"generate_batch() takes a list of prompts (lists of token ids), got {type(inputs).__name__}.")
    options = {k: kwargs.pop(k) for k in MANAGER_OPTIONS if k in kwargs}
    # compile and compile_config decide the batch's shared step: they become the manager's defaults.
    step = {k: kwargs.pop(k) for k in STEP_FIELDS if k in kwargs}
    manager = model.init_continuous_batching(generation_config, **options, **step)
    results: dict[str, GenerationOutput] = {}
    ids = []
    for prompt in inputs:
        request_id = new_request_id()
        ids.append(request_id)
        try:
            manager.add_request(prompt, request_id=request_id, **kwargs)
        except ValueError as error:
            results[request_id] = GenerationOutput(
                request_id=request_id,
                prompt_ids=list(prompt) if isinstance(prompt, (list, tuple)) else [],
                generated_tokens=[],
                sequences=[],
                status=RequestStatus.FAILED,
                error=str(error),
            )
    bar = _progress(progress_bar, len(ids))
    bar.update(len(results))
    manager.on_end = lambda output: bar.update(1)
    manager.run(until_idle=True)
    bar.close()
    for request_id in ids:
        if request_id not in results:
            results[request_id] = manager.get_result(request_id, timeout=0)
    return {request_id: results[request_id] for request_id in ids}


def _progress(enabled: bool, total: int):
    from tqdm.auto import tqdm  # huggingface_hub's dependency, so always there

    return tqdm(total=total, desc="generate_batch", unit="request", disable=not enabled)


__all__ = ["ContinuousBatchingManager", "GenerationOutput", "QueueFull", "RequestStatus", "DONE"]
