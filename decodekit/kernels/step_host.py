"""A model's StepHost: the one holder of its compiled steps, of the weight layout in force and of what happens when a
step fails, as the registry's PluginHost is the one holder of a call's plugins.

- **Steps.** Every compiled step of a model is kept here, by kind ("fused": generate(compile=True)'s; "method decode":
  a published method's one-token step; "paged decode": continuous batching's) and key (everything that decides the
  compiled code). The owners (core/fused_loop.py, facade/view_step.py, batching/compiled.py) supply a key and a
  function that makes the step; nothing is kept on the model's __dict__ or set on a step or a cache from outside.
- **Layout.** A model holds one weight layout at a time (oneDNN-packed or plain linears, the weights bound to the C++
  layer stack), and changing it replaces the model's modules and bindings. Only a holder of the host's lock changes
  it: a compiled call holds it for as long as it runs on the layout it chose (`layout`, `call_hold`), and an eager
  forward or a continuous-batching step takes it only where it is free (`if_free`), else runs on the layout in force.
  So no thread changes the weights another thread's step or forward depends on.
- **Fallback.** `failed` is the one policy for a step that raised: where the caller can still run the same work
  eagerly, the step's key is dropped for good and the reason logged once; else the error goes to the caller.

A native model declares its host (`step_host`, made with the model); any other module gets one kept weakly here,
which holds its layout lock (such a module declares no compiled step).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections import OrderedDict
from typing import Callable

logger = logging.getLogger("decodekit")

MAX_STEPS = 8  # compiled steps kept per model and kind (each fused step holds a static cache)

_hosts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_making = threading.Lock()


class StepCache(OrderedDict):
    """Compiled steps by key, the most recently used last; at most `limit` (None: no limit)."""

    def __init__(self, limit: int | None = MAX_STEPS):
        super().__init__()
        self.limit = limit

    def get_or_make(self, key, make: Callable[[], object]):
        """The step for `key`, made by make() and kept where there is none, and marked most recently used."""
        if key in self:
            self.move_to_end(key)
            return self[key]
        while self.limit is not None and len(self) >= self.limit:
            self.popitem(last=False)
        self[key] = step = make()
        return step


class StepHost:
    """The compiled steps, the weight-layout lock and the fallback policy of one model (module docstring)."""

    def __init__(self):
        self.lock = threading.RLock()  # reentrant: a compiled call's own forwards take it again
        self._kinds: dict[str, StepCache] = {}
        self._failed: dict[tuple, str] = {}  # (kind, key) -> why its step failed
        self._told: set[tuple] = set()
        self._guard = threading.Lock()  # over the step caches (threads running eagerly may look steps up)

    # A copy of a model (copy.deepcopy, pickling) starts with no compiled steps and a lock of its own.
    def __deepcopy__(self, memo) -> StepHost:
        return StepHost()

    def __reduce__(self):
        return (StepHost, ())

    @staticmethod
    def of(model) -> StepHost:
        """`model`'s host: the one it declares (`step_host`), else one kept weakly for it."""
        host = getattr(model, "step_host", None)
        if isinstance(host, StepHost):
            return host
        host = _hosts.get(model)
        if host is None:
            with _making:
                host = _hosts.get(model)
                if host is None:
                    host = _hosts[model] = StepHost()
        return host

    # --- steps ------------------------------------------------------------------------------------------------

    def steps(self, kind: str, limit: int | None = MAX_STEPS) -> StepCache:
        """The steps of `kind` (made empty at first use), most recently used last."""
        with self._guard:
            if kind not in self._kinds:
                self._kinds[kind] = StepCache(limit)
            return self._kinds[kind]

    def step(self, kind: str, key, make: Callable[[], object], limit: int | None = MAX_STEPS):
        """The step of `kind` for `key`, made by make() at first use; None where a step for it failed before (the
        caller runs eagerly)."""
        if (kind, key) in self._failed:
            return None
        steps = self.steps(kind, limit)
        with self._guard:
            if key in steps:
                steps.move_to_end(key)
                return steps[key]
        step = make()  # outside the guard: making a step may run the model
        with self._guard:
            return steps.setdefault(key, step) if steps.limit is None else steps.get_or_make(key, lambda: step)

    def failed(self, kind: str, key, error: BaseException, what: str, *, redo: bool) -> str:
        """The one policy for a step of `kind` that raised `error`. Where the caller can run the same work eagerly
        (`redo`: nothing the step computed was handed out yet), the step for `key` is dropped for good, "`what`
        (why)" is logged once per kind and reason, and the reason returned; else `error` is raised again. An error
        that is the inputs' rather than the compiler's is raised again by the eager run, which names it."""
        if not redo:
            raise error
        why = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        with self._guard:
            self._failed[(kind, key)] = why
            if kind in self._kinds:
                self._kinds[kind].pop(key, None)
            first = (kind, why) not in self._told
            self._told.add((kind, why))
        if first:
            logger.warning("%s (%s)", what, why)
        return why

    def failure(self, kind: str, key) -> str | None:
        """Why the step of `kind` for `key` failed, or None."""
        return self._failed.get((kind, key))

    # --- layout -----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def layout(self, model, rows: int):
        """Holds `model`'s weights, under the lock, in the layout a compiled step of `rows` rows runs fastest on, for
        the duration; yields that layout's key (kernels.step_layout puts them in it). Another thread's call waits."""
        from . import step_layout

        with self.lock:
            with step_layout(model, rows) as key:
                yield key

    @contextlib.contextmanager
    def layout_if_free(self, model, rows: int):
        """As `layout`, where no other thread holds the lock; else yields None at once, changing nothing (the caller
        runs on the layout in force)."""
        from . import step_layout

        with self.if_free() as held:
            if not held:
                yield None
                return
            with step_layout(model, rows) as key:
                yield key

    @contextlib.contextmanager
    def if_free(self):
        """Yields True, holding the lock, where no other thread holds it; else False at once (the caller runs on the
        layout in force and changes nothing)."""
        held = self.lock.acquire(blocking=False)
        try:
            yield held
        finally:
            if held:
                self.lock.release()

    def call_hold(self, model) -> CallHold:
        """A call's hold on this host (CallHold): close() it when the call ends."""
        return CallHold(self, model)


class CallHold:
    """One call's hold on a model's StepHost for its duration: the layout it holds (taken at its first step, without
    waiting: `hold` gives None where another thread's call holds it, and the call then runs eagerly to its end).
    What else a call keeps while it runs is its own (the view step's cache mirrors: facade/view_step.ViewCompile)."""

    def __init__(self, host: StepHost, model):
        self.host, self.model = host, model
        self.thread = threading.get_ident()  # the lock is taken and released on the call's thread
        self.held = self.refused = False
        self.rows: int | None = None
        self.key = None
        self._layout = contextlib.ExitStack()

    def hold(self, rows: int):
        """The layout key for steps of `rows` rows, the layout held (changed where `rows` needs another); None where
        another thread holds the model's layout, or this is not the call's thread (a thread the method started)."""
        if threading.get_ident() != self.thread or self.refused:
            return None
        if not self.held:
            # Never waited for: another thread's method may hold it for the whole of its own loop.
            if not self.host.lock.acquire(blocking=False):
                self.refused = True
                return None
            self.held = True
        if self.rows != rows:
            from . import step_layout

            self._layout.close()
            self.key = self._layout.enter_context(step_layout(self.model, rows))
            self.rows = rows
        return self.key

    def close(self) -> None:
        self._layout.close()
        self.rows = self.key = None
        if self.held:
            self.held = False
            self.host.lock.release()
