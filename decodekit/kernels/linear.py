"""The one-row product of a compiled decode step, and the linear layer that uses it.

A compiled decode step of one token multiplies a single row by every weight matrix. Written as a
broadcast multiply and a sum, inductor turns that into one loop that reads each weight row once,
converts it in registers (bfloat16 or int8 to float32) and accumulates in float32. On the 2-core
bench machine this beats calling oneDNN from the step (`packed_linear`) for every weight format, and
torch._weight_int8pack_mm for int8 (docs/performance.md, "Measurements behind the code's choices").
It is the step's own code, so the activation after it fuses in. Eager float32 calls keep the library kernels.
int8 weights stored interleaved use a form of their own (quantize.one_row_int8): inductor loads 8 int8
or bf16 values a vector on AVX2 through a stack buffer, which made this form 20x slower for int8 there.
Where decodekit's own kernels are built (native.py), one-row products of bfloat16 and interleaved int8
weights go through them instead, eager or compiled: they read the weights faster than inductor's loop
and the library kernels; float32 gained nothing in the compiled step and stays here.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..sizes import host_memory_available
from . import cpu, native


def one_row(row: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """row [1, in] @ weight [out, in]^T in float32 for any weight dtype; returns [1, out] float32."""
    return (row.float()[:, None, :] * weight.float()).sum(-1)


# Rows from which a bf16/fp16 product on a CPU without matrix instructions for them is computed in float32.
# There F.linear runs one matrix-vector product per row (time linear in the rows); converting the weight to
# float32 first costs about six rows' time and then rows are nearly free. Measured crossovers: 8-10 rows for the
# layers, more for the 49152-row lm_head, which a prefill runs on its last position only (docs/performance.md). How the float32 product runs is many_rows_route's choice.
FLOAT32_FROM_ROWS = 16


# The probe that says oneDNN has matrix instructions for each half-precision dtype (cpu.py).
MATMUL_PROBE = {torch.bfloat16: "onednn_bf16", torch.float16: "onednn_fp16"}


def computes_in_float32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of `x` by a bf16/fp16 `weight` is faster in float32 on this CPU."""
    # The device first: off the CPU the rows are not read, so a compiled step over a dynamic row count (continuous
    # batching's) gets no guard on them from here.
    return (
        x.device.type == "cpu"
        and x.numel() >= FLOAT32_FROM_ROWS * weight.shape[1]
        and lacks_matmul_instructions(weight.dtype)
    )


def lacks_matmul_instructions(dtype: torch.dtype) -> bool:
    """Whether this CPU has no matrix instructions for `dtype` (bfloat16 or float16; MATMUL_PROBE), so that products of
    FLOAT32_FROM_ROWS rows or more by such weights are computed in float32."""
    probe = MATMUL_PROBE.get(dtype)
    return probe is not None and not cpu.has(probe)


# Products of many rows are measured in four classes, each at a size that stands for it, because the better route
# differs between them (docs/performance.md, "Measurements behind the code's choices"). Up to 64 rows: a
# continuous-batching decode step (one row per request) or a short prompt; up to 256, up to 1,024 and longer: prompts.
ROW_CLASSES = ((64, 32), (256, 128), (1024, 512))  # (up to rows, measured at); longer: 2,048
TILED_DTYPES = (torch.float32, torch.bfloat16)  # weights decodekit::tiled_product takes (int8: quantize.py)
DECODEKIT_ROUTES = ("tiles", "blocks", "wide_blocks")  # the routes through decodekit::tiled_product
# The prompt routes of Linear.prompt_route and quantize.Int8Linear.prompt_route as the C++ prompt layers number
# them (the routes of csrc/prompt_layers.cpp); an int8 weight whose columns are stored interleaved adds INTERLEAVED.
PROMPT_ROUTES = {
    "library": 0,
    "packed": 1,
    "tiles": 2,
    "blocks": 3,
    "wide_blocks": 4,
    "int8_split": 5,
    "int8_tiles": 6,
    "onednn": 7,
}
# The routes whose operand is a copy of the weight made once (packed_weight): MKL's packed layout, oneDNN's reordered
# one. packed_route decides between them, a plain float32 copy (a bfloat16 or int8 weight's, multiplied by the route
# float32 weights take: FLOAT32_COPY) and the route otherwise taken.
COPY_ROUTES = ("packed", "onednn")
FLOAT32_COPY = "float32_copy"
INTERLEAVED = 16


# ---- The "packed" route: a float32 weight packed once for MKL (decodekit::mkl_pack) for prompts' products. ----
# A packed weight is one more copy of the weight, as float32 whatever the weight's own format (a bfloat16 or int8
# weight is converted first). Copies are made while all of them together stay within a share of the memory the
# system had available when the first was made (PACKED_MEMORY_SHARE, or DECODEKIT_PACKED_MEMORY_SHARE: 0 makes
# none); past it a product takes the next route. The same budget holds the second copy of a bfloat16 model that keeps
# both oneDNN's packed weights and the plain ones (packed.eager_layout's "both").
PACKED_MEMORY_SHARE = 0.25
SHARE_VARIABLE = "DECODEKIT_PACKED_MEMORY_SHARE"
_packing = {"budget": None, "used": 0}
_packing_lock = threading.RLock()  # generate() may run in several threads; re-entered if a collection releases a copy


def mkl_packing() -> bool:
    """Whether this torch carries MKL's packed-matrix products (decodekit::mkl_pack answers an empty tensor if not)."""
    if "available" not in _packing:
        _packing["available"] = native.load() and torch.ops.decodekit.mkl_pack(torch.zeros(1, 1)).numel() > 0
    return _packing["available"]


def packed_memory_share() -> float:
    """The share of available memory packed copies may take: DECODEKIT_PACKED_MEMORY_SHARE, else PACKED_MEMORY_SHARE."""
    text = os.environ.get(SHARE_VARIABLE, "").strip()
    if not text:
        return PACKED_MEMORY_SHARE
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise ValueError(
            f"{SHARE_VARIABLE}={text!r}: expected a number from 0 (no packed copies) to 1 "
            f"(the default is {PACKED_MEMORY_SHARE})."
        )
    return share


def release_copy(size: int) -> None:
    with _packing_lock:
        _packing["used"] -= size


def reserve_copy(size: int) -> bool:
    """Counts a copy of `size` bytes against the budget of packed copies (packed_memory_share of the memory available
    when the first was made); False, and nothing counted, where it would pass it. The caller releases it
    (weakref.finalize(copy, release_copy, size)) when the copy goes."""
    with _packing_lock:
        if _packing["budget"] is None:  # unknown available memory: no copies
            _packing["budget"] = int(packed_memory_share() * (host_memory_available() or 0))
        if _packing["used"] + size > _packing["budget"]:
            return False
        _packing["used"] += size
        return True


def onednn_packing() -> bool:
    """Whether this torch carries oneDNN (mkldnn), whose linear takes a float32 weight reordered once."""
    return torch.backends.mkldnn.is_available()


# The row count oneDNN is told to lay a float32 weight out for: a weight laid out for 4, 128, 512 or 2,048 rows ran
# products of 128 to 2,048 rows alike (docs/performance.md), so one copy serves every prompt.
ONEDNN_ROWS_HINT = 128


def copy_of_weight(kind: str, weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight as a copy route holds it: "packed" for MKL (decodekit::mkl_pack), "onednn" reordered into
    oneDNN's blocked layout, "float32_copy" as it is (FLOAT32_COPY)."""
    if kind == FLOAT32_COPY:
        return weight
    if kind == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS_HINT)
    return torch.ops.decodekit.mkl_pack(weight)


def copy_available(kind: str) -> bool:
    """Whether this torch can make and multiply a copy of `kind` (copy_of_weight)."""
    if kind == "onednn":
        return onednn_packing()
    return native.load() if kind == FLOAT32_COPY else mkl_packing()


def onednn_product(x: torch.Tensor, reordered: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 @ W^T (+ bias) by oneDNN's linear, W given as copy_of_weight("onednn", ...) made it."""
    return torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")


def packed_weight(
    module: nn.Module, sources: tuple[torch.Tensor, ...], float32: Callable[[], torch.Tensor], kind: str = "packed"
):
    """`module`'s weight as float32 (`float32()`, computed from `sources`: the weight, and an int8 weight's scales)
    copied once for a copy route (copy_of_weight: `kind` "packed" for MKL, "onednn" for oneDNN, "float32_copy"
    plain), made on first use and again when a source has changed (its data or version); None where the library is
    missing or the copy would pass the memory budget. Copies of each kind are held apart, in the module's __dict__, out
    of its state (HoldsPackedCopy): prompts of two classes of lengths may take two kinds (on the AVX512-BF16 EPYC held
    to AVX2, a bfloat16 model's 128-row products took the plain copy, its 512-row ones oneDNN's), and one copy
    replaced by the other on every change of length would be made again at every such prefill."""
    # An inference tensor keeps no version counter (changed in place only inside inference mode, its data pointer
    # stands for it).
    current = tuple((t.data_ptr(), None if t.is_inference() else t._version, tuple(t.shape)) for t in sources)
    held = module.__dict__.setdefault("_mkl_packed", {})  # kind -> (the sources it was made from, the copy)
    if kind in held and held[kind][0] == current:
        return held[kind][1]
    for stale in [k for k, (made_from, _) in held.items() if k == kind or made_from != current]:
        del held[stale]  # released before a new one is counted
    if any(t.device.type != "cpu" for t in sources) or not copy_available(kind):
        return None
    size = 4 * sources[0].numel()  # float32, whatever the weight's own format
    if not reserve_copy(size):
        return None
    try:
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable in and out of inference mode
            packed = copy_of_weight(kind, float32().detach().float().contiguous())
    except BaseException:
        release_copy(size)
        raise
    weakref.finalize(packed, release_copy, size)
    held[kind] = (current, packed)
    return packed


class HoldsPackedCopy(nn.Module):
    """A layer that may hold a packed copy of its weight (packed_weight). `.to()`, `.bfloat16()` and friends replace
    the weight, so the copy goes at once, not when the layer does; copies and pickles of the layer pack again (the
    copy is tied to this weight's memory)."""

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_mkl_packed", None)
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.pop("_mkl_packed", None)
        return state


def many_rows_routes() -> tuple[str, ...]:
    """The routes many_rows_route measures on this CPU: "wide_blocks" only where it has AVX-512 (cpu.py's avx512f
    probe, which a test can force off)."""
    return ("tiles", "blocks", *(("wide_blocks",) if cpu.has("avx512f") else ()), "library")


def row_class(rows: int) -> int:
    """The size that stands for `rows` rows' class (ROW_CLASSES)."""
    return next((at for most, at in ROW_CLASSES if rows <= most), 2048)


def sample_layer(size: int, dtype: torch.dtype) -> list:
    """A prompt of `size` rows and the weights of one default-model-sized layer: q/k/v, o, gate/up and down."""
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(size, k, generator=generator), torch.randn(n, k, generator=generator).to(dtype))
        for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536))
    ]


def _through(route: str, layer: list):
    """A call of `layer`'s products by `route` (one of many_rows_routes())."""

    def library():
        for x, weight in layer:
            x @ weight.float().t()

    def through_decodekit():
        for x, weight in layer:
            torch.ops.decodekit.tiled_product(x, weight, blocks=route != "tiles", wide=route == "wide_blocks")

    return library if route == "library" else through_decodekit


# The decode class's sample: copies of a layer filling this many times the last-level cache, at most
# STEP_SAMPLE_MEMORY bytes, named in the choices' cache key.
STEP_CACHE_MULTIPLE, STEP_SAMPLE_MEMORY, STEP_SAMPLE = 2, 256 << 20, "weights_from_memory"


def many_rows_route(dtype: torch.dtype, rows: int) -> str:
    """How a float32 product of `rows` rows (a prompt's prefill, a continuous-batching step) by a float32 or bfloat16
    weight runs on this CPU, measured once per weight dtype and row class (choices.py). Each route but the
    library's splits the weight's rows into tiles, one thread's own each (decodekit::tiled_product):
    "tiles"    each tile's product is a one-thread library matmul (MKL packs the tile: near the peak for many rows),
               a bfloat16 tile converted to float32 into a buffer that stays in cache first;
    "blocks"   register blocks of 3 rows by 4 weight rows read the weights as stored, no packing (a bfloat16
               weight converted in registers): for a few dozen rows, which a packed tile would serve too few times;
    "wide_blocks"  the same with AVX-512 (blocks of 4 rows, 16 lanes), offered where the CPU has it (it won on the
               AMX bench machine; docs/performance.md);
    "library"  the library's threaded matmul; a bfloat16 weight converted whole on every call, a float32 copy of it
               written and read back through memory.
    An eager prompt's float32 product may take a faster route still: packed_route.

    The decode class's sample reads its weights from memory, as a step's products do (a model's layers overflow the
    last-level cache), going round copies of the layer that fill STEP_CACHE_MULTIPLE times it: measured on one layer
    in cache, the AVX-512 and AVX2 blocks ran alike and the choice fell either way, while from memory the AVX2 ones
    were faster on the AVX512-BF16 EPYC (docs/performance.md)."""
    from . import choices

    size = row_class(rows)
    from_memory = size == ROW_CLASSES[0][1]

    def candidates() -> dict:
        if dtype not in TILED_DTYPES or not native.load():
            return {}
        layer = sample_layer(size, dtype)
        if from_memory:
            layer_bytes = sum(weight.numel() * weight.element_size() for _, weight in layer)
            wanted = min(STEP_CACHE_MULTIPLE * cpu.last_level_cache_bytes(), STEP_SAMPLE_MEMORY)
            layer = layer + [(x, weight.clone()) for _ in range(-(-wanted // layer_bytes) - 1) for x, weight in layer]
        return {route: _through(route, layer) for route in many_rows_routes()}

    return choices.decide(
        f"{str(dtype).removeprefix('torch.')}_rows_{size}",
        candidates,
        otherwise="library",
        sample=STEP_SAMPLE if from_memory else "",
    )


def packed_route(
    dtype: torch.dtype, rows: int, other: str, problem: Callable[[int], tuple[list, Callable[[], object]]]
) -> str | None:
    """The copy route that runs a product of `rows` rows outside a trace faster than `other`, the route otherwise
    chosen for those rows and weights of `dtype` (float32, bfloat16, int8), or None where none does: the weight as
    float32 copied once (packed_weight), "packed" (MKL's packed layout: the library's matmul packs a float32 weight on
    every call, and a bfloat16 or int8 weight is converted first), "onednn" (oneDNN's reordered one) or, for a
    bfloat16 or int8 weight, "float32_copy" (the copy as it is, multiplied by the route float32 weights take here:
    many_rows_route; so a prompt by such weights runs as float32's does where nothing else beats that); measured once
    per dtype and class of prompt rows (over 64; choices.py: float32_packed_rows_128, ...) among the copies this torch
    can make.
    `problem(size)` gives a default-model-sized layer's [(rows, float32 weight)] and a call of the same products by
    `other`. Which copy wins differs by CPU class (MKL's packed copies on the AMX machine, oneDNN's on the AVX512-BF16
    EPYC: docs/performance.md). Compiled steps (continuous batching's decode rows) keep the other route: a trace
    cannot make the copy."""
    from . import choices

    size = row_class(rows)
    kinds = [kind for kind in (*COPY_ROUTES, FLOAT32_COPY) if copy_available(kind)]
    if dtype == torch.float32 and FLOAT32_COPY in kinds:
        kinds.remove(FLOAT32_COPY)  # the weight itself
    if size <= ROW_CLASSES[0][1] or not kinds:
        return None

    def candidates() -> dict:
        pairs, by_other = problem(size)
        offered = {other: by_other}
        if "packed" in kinds:
            packs = [(x, copy_of_weight("packed", weight), weight.shape[0]) for x, weight in pairs]
            offered["packed"] = lambda: [torch.ops.decodekit.packed_product(x, p, n) for x, p, n in packs]
        if "onednn" in kinds:
            reordered = [(x, copy_of_weight("onednn", weight)) for x, weight in pairs]
            offered["onednn"] = lambda: [onednn_product(x, w) for x, w in reordered]
        if FLOAT32_COPY in kinds:
            offered[FLOAT32_COPY] = _through(many_rows_route(torch.float32, size), pairs)
        return offered

    name = f"{str(dtype).removeprefix('torch.')}_packed_rows_{size}"
    chosen = choices.decide(name, candidates, otherwise=other)
    return chosen if chosen in kinds else None


def _tiled_problem(dtype: torch.dtype, other: str) -> Callable[[int], tuple[list, Callable[[], object]]]:
    """packed_route's problem for a float32 or bfloat16 weight whose products otherwise take `other`."""

    def problem(size: int):
        layer = sample_layer(size, dtype)
        return [(x, weight.float()) for x, weight in layer], _through(other, layer)

    return problem


def prompt_choice(dtype: torch.dtype, rows: int, ready: bool = True) -> tuple[str, str | None]:
    """For a prompt's `rows` rows by a weight of `dtype`: the route many_rows_route measured ("library" for a dtype it
    does not take) and the copy route that beats it ("packed", "onednn" or "float32_copy": packed_route; None where
    none does, inside a trace, or where decodekit's kernels are not `ready`). The same for every layer of a model: its
    prompt layers look it up once."""
    if dtype not in TILED_DTYPES:
        return "library", None
    route = many_rows_route(dtype, rows)
    if not ready or torch.compiler.is_compiling():
        return route, None
    return route, packed_route(dtype, rows, route, _tiled_problem(dtype, route))


def float32_route(rows: int) -> str:
    """The route of a product of `rows` rows by a float32 weight (many_rows_route): a float32 copy's (FLOAT32_COPY)."""
    return many_rows_route(torch.float32, rows)


def kernel_route(route: str, weight: torch.Tensor, ready: bool) -> tuple[str, torch.Tensor]:
    """(prompt route, `weight`) for a product by `weight` where `route` (one of many_rows_routes()) was chosen: blocks
    read 8 columns at a time, 16 wide, so "wide_blocks" takes the AVX2 blocks where the CPU lacks AVX-512 (a
    forced-off avx512f probe) or the width is not a multiple of 16, and blocks take tiles where it is not a multiple
    of 8; the library where decodekit's kernels are not `ready`."""
    if route in DECODEKIT_ROUTES and ready:
        if route == "wide_blocks" and weight.shape[1] % 16 == 0 and cpu.has("avx512f"):
            return "wide_blocks", weight
        return ("blocks" if route != "tiles" and weight.shape[1] % 8 == 0 else "tiles"), weight
    return "library", weight


def copied_route(
    module: nn.Module, sources: tuple[torch.Tensor, ...], float32: Callable[[], torch.Tensor], copy: str, rows: int
) -> tuple[str, torch.Tensor] | None:
    """(prompt route, operand) for a product of `rows` rows by `module`'s weight copied once for the copy route `copy`
    (packed_weight's arguments): MKL's and oneDNN's copies take their own route, a plain float32 copy (FLOAT32_COPY)
    the one float32 weights take (kernel_route); None where no copy is made."""
    operand = packed_weight(module, sources, float32, copy)
    if operand is None:
        return None
    return kernel_route(float32_route(rows), operand, True) if copy == FLOAT32_COPY else (copy, operand)


def prompt_product(
    rows: torch.Tensor, route: str, operand: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """rows [M, K] @ W^T (+ bias) by a prompt route that names no int8 kernel, `operand` the weight or its copy
    (Linear.prompt_route): "packed" (decodekit::packed_product; bfloat16 rows widened and the product rounded back a
    block at a time, in cache), "onednn" (onednn_product), "library" (F.linear, the weight widened), "tiles", "blocks"
    or "wide_blocks" (decodekit::tiled_product); the others in float32."""
    if route == "packed":
        rows = rows if rows.dtype in (torch.float32, torch.bfloat16) else rows.float()
        return torch.ops.decodekit.packed_product(rows, operand, out_features, bias)
    rows = rows.float()
    if route == "onednn":
        return onednn_product(rows.contiguous(), operand, bias)
    if route == "library":
        return F.linear(rows, operand.float(), bias)
    y = torch.ops.decodekit.tiled_product(rows, operand, blocks=route != "tiles", wide=route == "wide_blocks")
    return y if bias is None else y + bias


def few_rows(x: torch.Tensor, rows: int, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x @ weight^T + bias for x of 1 to native.MAX_ROWS `rows` on CPU, by decodekit's row kernel (float32 and
    bfloat16 weights) or, inside a compiled step, one_row; None where neither applies."""
    if x.device.type != "cpu" or not 1 <= rows <= native.MAX_ROWS:
        return None
    flat = x.reshape(rows, -1)
    compiling = torch.compiler.is_compiling()
    if rows == 1 and compiling and weight.dtype == torch.float32:
        y = one_row(flat, weight)
    elif weight.dtype in (torch.bfloat16, torch.float32) and native.ready(flat, weight, bias):
        y = torch.ops.decodekit.row_product(flat.float().contiguous(), weight)
    elif rows == 1 and compiling:
        y = one_row(flat, weight)
    else:
        return None
    y = y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class Linear(HoldsPackedCopy, nn.Linear):
    """nn.Linear whose products of up to 16 rows (native.MAX_ROWS) on CPU are decodekit's kernel for bfloat16 weights
    (native.py) where it is built; else one row inside a compiled step is `one_row`; F.linear otherwise.

    Only on CPU, where it was measured; on an accelerator the compiled step keeps the vendor's matmul.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        y = few_rows(x, rows, self.weight, self.bias)
        if y is not None:
            return y
        # A prompt's prefill on CPU: bf16/fp16 weights without matrix instructions for them, and float32 weights.
        prompt_in_float32 = x.device.type == "cpu" and rows > native.MAX_ROWS and self.weight.dtype == torch.float32
        if prompt_in_float32 or computes_in_float32(x, self.weight):
            return self._many_rows(x, rows)
        return F.linear(x, self.weight, self.bias)

    def _many_rows(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The float32 product of a prompt's rows, by the route prompt_route chooses."""
        route, operand = self.prompt_route(x, rows)
        bias = None if self.bias is None else self.bias.float()
        y = prompt_product(x.reshape(rows, -1), route, operand, self.out_features, bias)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def prompt_route(
        self, x: torch.Tensor, rows: int, choice: tuple[str, str | None] | None = None
    ) -> tuple[str, torch.Tensor]:
        """How `rows` rows like `x` (a prompt's, on CPU) are multiplied by this weight, as `choice` (prompt_choice for
        this weight's dtype and the rows, looked up where not given) says: ("packed", MKL's packed copy), ("onednn",
        oneDNN's reordered copy), ("tiles", "blocks" or "wide_blocks", the weight or its plain float32 copy:
        decodekit::tiled_product) or ("library", the weight or its copy: F.linear in float32). PROMPT_ROUTES numbers
        them for the C++ prompt layers."""
        ready = native.ready(x, self.weight, self.bias)
        route, copy = choice or prompt_choice(self.weight.dtype, rows, ready)
        copied = copied_route(self, (self.weight,), self.weight.float, copy, rows) if copy and ready else None
        return copied or kernel_route(route, self.weight, ready)
