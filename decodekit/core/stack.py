"""Room on CPython's frame stack for generate(), whose loops make the same deep calls thousands of times.

CPython (3.11 on) keeps Python frames in per-thread chunks and frees a chunk (munmap) as soon as the
frame that opened it returns. When a decode loop's frames happen to sit just short of a chunk's end,
every call the step makes below that point opens and frees a chunk of its own: a page fault each time.
In the compiled step on the default model that was one fault per operator, a quarter of the token
(docs/performance.md), decided only by how deep the user's code happened to call generate().

`@stack_room` runs the function inside a frame sized so that it always opens a fresh chunk and leaves
about 64 KiB of it free for what the function calls; the chunk is opened once per call, not per token.
"""

from __future__ import annotations

import functools
import types

# CPython sizes a new chunk as the smallest 16 KiB * 2**k holding the frame plus 1000 slots. With 8200
# extra slots (8 bytes each) the frame is ~64.2 KiB: it always opens a 128 KiB chunk, leaves ~63.8 KiB
# of it for its callees, and a nested generate() (a custom method calling it again) does not fit in
# that remainder, so it opens a chunk of its own instead of squeezing its callees.
PAD_SLOTS = 8200


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


def _padded(function: types.FunctionType, slots: int) -> types.FunctionType:
    code = function.__code__
    names = code.co_varnames + tuple(f"_pad{i}" for i in range(slots))
    try:
        padded = code.replace(co_varnames=names, co_nlocals=len(names))
    except (TypeError, ValueError):  # an interpreter whose code objects do not take this: run unpadded
        return function
    return types.FunctionType(padded, function.__globals__, function.__name__)


_call_padded = _padded(_call, PAD_SLOTS)


def stack_room(fn):
    """Decorator: `fn` runs from a frame that leaves ample room on the frame stack for its callees."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return _call_padded(fn, args, kwargs)

    return wrapper
