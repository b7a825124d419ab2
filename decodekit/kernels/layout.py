"""Who may change a model's weight layout, and when.

A model holds one weight layout at a time (oneDNN-packed or plain linears, the weights bound to the C++ layer stack),
and changing it replaces the model's modules and bindings. One lock per model guards it: a compiled call holds it
for as long as it runs on the layout it chose (kernels.step_layout), and an eager forward packs or binds only
where no other thread holds it, else runs on the layout in force. So no thread changes the weights another
thread's step or forward depends on: the other caller waits (a compiled call) or runs on what is there (an
eager forward). The locks live here, keyed weakly by model, not on the model.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_making = threading.Lock()


def layout_lock(model) -> threading.RLock:
    """The lock over `model`'s weight layout (reentrant: a compiled call's own forwards take it again)."""
    lock = _locks.get(model)
    if lock is None:
        with _making:
            lock = _locks.get(model)
            if lock is None:
                lock = _locks[model] = threading.RLock()
    return lock


@contextlib.contextmanager
def if_layout_free(model):
    """Yields True, holding `model`'s layout lock, where no other thread holds it; else False at once (the caller
    runs on the layout in force and changes nothing)."""
    lock = layout_lock(model)
    held = lock.acquire(blocking=False)
    try:
        yield held
    finally:
        if held:
            lock.release()
