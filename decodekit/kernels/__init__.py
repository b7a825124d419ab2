"""The CPU speed paths, behind one interface: what this CPU can do (cpu.py), decodekit's C++ kernels (native.py,
cpu_kernels.cpp), oneDNN-packed weights (packed.py), the linear layers that pick a product per call (linear.py),
int8 weights (quantize.py) and choices measured once per CPU (choices.py).

The model families build their layers from Linear and Int8Linear; a compiled step asks `step_layout` for the
weight layout it runs on. Nothing here imports the rest of decodekit.
"""

from __future__ import annotations

import contextlib

from . import native
from .linear import Linear
from .packed import pack_linears, plain_weights
from .quantize import QUANTIZATIONS, Int8Linear, many_rows_route

MAX_ROWS = native.MAX_ROWS
# Compiled steps of up to this many rows on CPU multiply plain weights (the C++ layer stack and row products,
# linear.one_row); wider ones use oneDNN's packed weights. bench/bench_few_rows.py sets it to 0 to compare.
PLAIN_WEIGHTS_ROWS = MAX_ROWS


@contextlib.contextmanager
def step_layout(model, rows: int):
    """Holds `model`'s weights in the layout a compiled step of `rows` rows runs fastest on, for the duration, and
    yields that layout's key (dtype, device, packed, quantization), part of the compiled step's own key.

    On CPU the kernels are loaded first (the traced products read whether they are there) and an int8 model's
    route for many rows is measured (a trace cannot time anything). A step of up to PLAIN_WEIGHTS_ROWS rows runs on plain
    weights, unpacked for the duration; a wider one on packed weights where packing pays on this CPU. The choice
    is made here, once per call: a model holds one layout at a time."""
    quantization = getattr(model, "quantization", None)
    if model.device.type != "cpu":
        yield (model.dtype, model.device, pack_linears(model), quantization)
        return
    native.load()
    if rows > MAX_ROWS and quantization == "int8":
        many_rows_route()
    if rows <= PLAIN_WEIGHTS_ROWS:
        with plain_weights(model):
            yield (model.dtype, model.device, False, quantization)
    else:
        yield (model.dtype, model.device, pack_linears(model), quantization)


def paged_step_ready(model, keys) -> bool:
    """Whether a compiled decode step over a paged cache whose key pool is `keys` can run decodekit's kernels: on
    CPU, float32 or bfloat16 pools in the model's dtype, the kernels built. Prepares what such a step reads (the
    int8 route for many rows, measured outside any trace)."""
    if keys.device.type != "cpu" or keys.dtype != model.dtype or keys.dtype not in native.LAYER_DTYPES:
        return False
    if getattr(model, "quantization", None) == "int8":
        many_rows_route()
    return native.ready(keys)


__all__ = ["Int8Linear", "Linear", "MAX_ROWS", "PLAIN_WEIGHTS_ROWS", "QUANTIZATIONS", "paged_step_ready", "step_layout"]
