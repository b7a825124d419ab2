"""The CPU speed paths, behind one interface: what this CPU can do (cpu.py), decodekit's C++ kernels (native.py,
csrc/), oneDNN-packed weights (packed.py), the linear layers that pick a product per call (linear.py),
int8 weights (quantize.py) and choices measured once per CPU (choices.py).

The model families build their layers from Linear and Int8Linear; a model's StepHost (step_host.py) holds its compiled
steps and its weight layout: a compiled step holds the layout it asks for (`StepHost.layout`, which puts the weights in
it through `step_layout`). Nothing here imports the rest of decodekit.
"""

from __future__ import annotations

import contextlib

from . import linear, native
from .linear import Linear
from .packed import pack_linears, plain_weights
from .quantize import QUANTIZATIONS, Int8Linear, many_rows_route
from .step_host import StepHost, CallHold

MAX_ROWS = native.MAX_ROWS
# Compiled steps of up to this many rows on CPU multiply plain weights (the C++ layer stack and row products,
# linear.one_row); wider ones use oneDNN's packed weights. bench/bench_few_rows.py sets it to 0 to compare.
PLAIN_WEIGHTS_ROWS = MAX_ROWS


@contextlib.contextmanager
def step_layout(model, rows: int):
    """For a caller that holds `model`'s StepHost lock (StepHost.layout and layout_if_free, CallHold.hold): puts the
    weights in the layout a compiled step of `rows` rows runs fastest on, for the duration, and yields that layout's
    key (dtype, device, packed, quantization), part of the compiled step's own key.

    On CPU the kernels are loaded first (the traced products read whether they are there) and the routes for
    `rows` rows are measured (settle_routes). A step of up to PLAIN_WEIGHTS_ROWS rows runs on plain
    weights, unpacked for the duration; a wider one on packed weights where packing pays on this CPU. The choice
    is made here, once per call: a model holds one layout at a time."""
    quantization = getattr(model, "quantization", None)
    if model.device.type != "cpu":
        yield (model.dtype, model.device, pack_linears(model), quantization)
        return
    native.load()
    settle_routes(model, rows)
    if rows <= PLAIN_WEIGHTS_ROWS:
        with plain_weights(model):
            yield (model.dtype, model.device, False, quantization)
    else:
        yield (model.dtype, model.device, pack_linears(model), quantization)


def settle_routes(model, rows: int) -> None:
    """Makes now, outside any trace, the measured choices a step of `rows` rows reads: how a product of that many
    rows runs (linear.many_rows_route for float32 and bfloat16 weights, quantize.many_rows_route for int8). A
    trace cannot time anything, so a choice first asked for inside one is the fallback, compiled into the step for
    good (continuous batching's 32-row step then ran well below the tiles this CPU had chosen: docs/performance.md,
    measurements behind the code's choices)."""
    if model.device.type != "cpu" or rows <= MAX_ROWS:
        return
    if getattr(model, "quantization", None) == "int8":
        many_rows_route()
    elif model.dtype in linear.TILED_DTYPES:
        linear.many_rows_route(model.dtype, rows)


def paged_step_ready(model, keys) -> bool:
    """Whether a compiled decode step over a paged cache whose key pool is `keys` can run decodekit's kernels: on
    CPU, float32 or bfloat16 pools in the model's dtype, the kernels built."""
    if keys.device.type != "cpu" or keys.dtype != model.dtype or keys.dtype not in native.LAYER_DTYPES:
        return False
    return native.ready(keys)


__all__ = [
    "Int8Linear",
    "Linear",
    "MAX_ROWS",
    "PLAIN_WEIGHTS_ROWS",
    "QUANTIZATIONS",
    "StepHost",
    "CallHold",
    "paged_step_ready",
    "settle_routes",
    "step_layout",
]
