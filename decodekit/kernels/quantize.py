"""Weight-only int8 quantization: 4x fewer weight bytes than fp32, for decoding that is bound by memory bandwidth.

Each output channel of a linear layer gets one scale (max |w| / 127); weights are rounded to int8.
Activations go through the matmul in bfloat16, which is what PyTorch's CPU kernel for int8 weights
(`torch._weight_int8pack_mm`) takes. The kernel runs with unit scales and the float32 scales are
applied to its output: on the default model that halves the log-likelihood loss against handing the
kernel bfloat16 scales (1.2% against 2.3% of the fp32 model's mean log-likelihood of its own greedy
text). A product of one row on CPU (a decode step, eager or compiled) does without that kernel: it is
computed in float32 by decodekit's own kernel (native.py; eager and compiled then give the same values),
or where that is not built by `one_row_int8` in a compiled step and by the library kernel in an eager
one, whose tokens then part from the compiled step's only at a near tie. Embeddings stay as they are (a
lookup reads one row per token).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from . import choices, native
from .linear import HoldsPackedCopy, copied_route, one_row, packed_route, prompt_product, sample_layer

QUANTIZATIONS = ("int8", "int4", "int4-g64", "int4-g128")


def interleaved_columns(in_features: int) -> torch.Tensor:
    """The column order of an interleaved int8 weight: stored column 4c + j holds input column j * in/4 + c."""
    return torch.arange(in_features).view(4, in_features // 4).t().reshape(-1)


def one_row_int8(row: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    """row [1, in] @ weight^T for an interleaved int8 weight [out, in] (see Int8Linear) given as its float32
    view `lanes` [out, in/4], in float32: [1, out].

    Each 32-bit lane of a weight row holds four weights, the j-th of which multiplies the row's j-th
    quarter, so the loop inductor generates loads 32 weights and four contiguous slices of the row per
    AVX2 vector. Inductor's loop over plain int8 weights loads 8 at a time through a stack buffer (its
    AVX2 partial load has no fast path), several times slower (docs/performance.md). The lanes come as
    float32 for the same reason: only the float32 load takes the fast path.
    """
    lanes = lanes.view(torch.int32)
    quarters = row.float().view(4, -1)
    acc = None
    for j in range(4):
        part = ((lanes << (24 - 8 * j)) >> 24).float() * quarters[j]  # the j-th byte, sign-extended
        acc = part if acc is None else acc + part
    return acc.sum(-1)[None]


class Int8Linear(HoldsPackedCopy):
    """A linear layer with int8 weights [out, in] and float32 per-output-channel scales; y = (x @ q^T) * scale + b.

    When `in` is a multiple of 4 the weight columns are stored interleaved (interleaved_columns), for the
    compiled one-row product, which reads them through `lanes`, a float32 view of the same bytes kept
    beside the buffer (made in the step, the view was a wrapper call per layer and step, measurable per token);
    the other paths permute their input's columns to match (`input_order`). `dequantized()` gives the
    weight in the input's order.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        order = interleaved_columns(self.in_features) if self.in_features % 4 == 0 else None
        self.register_buffer("weight_int8", (q if order is None else q[:, order]).contiguous())
        self.register_buffer("input_order", order)
        self.register_buffer("scales", scale)
        self.register_buffer("unit_scales", torch.ones(scale.shape, dtype=torch.bfloat16))
        self.bias = linear.bias
        self._view_lanes()

    def _view_lanes(self) -> None:
        self.lanes = self.weight_int8.view(torch.float32) if self.input_order is not None else None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._view_lanes()  # the buffer may be a new tensor (another device)
        return self

    def dequantized(self) -> torch.Tensor:
        """The weight as float32 [out, in], columns in the input's order."""
        w = self.weight_int8.float() * self.scales[:, None].float()
        return w if self.input_order is None else w[:, torch.argsort(self.input_order)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        few_rows_on_cpu = 1 <= flat.shape[0] <= native.MAX_ROWS and flat.device.type == "cpu"
        if few_rows_on_cpu and self.in_features % 32 == 0 and native.ready(x, self.bias):  # interleaved (in % 4 == 0)
            y = torch.ops.decodekit.row_product_int8(flat.float().contiguous(), self.weight_int8)
        elif flat.shape[0] == 1 and torch.compiler.is_compiling():
            y = one_row(flat, self.weight_int8) if self.input_order is None else one_row_int8(flat, self.lanes)
        else:
            scaled = self._scaled(flat)
            if scaled is not None:
                y = scaled.to(x.dtype).view(*x.shape[:-1], self.out_features)
                return y if self.bias is None else y + self.bias
            y = self._many_rows(flat)
        y = (y.float() * self.scales).to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _scaled(self, flat: torch.Tensor, packed_copy: bool = True) -> torch.Tensor | None:
        """The scaled float32 product of a prompt's rows where prompt_route names one of decodekit's kernels, which
        apply the scales and the interleaved columns' order as they go, so neither the rows nor the product take an
        extra pass through memory; None where another route runs."""
        # Without the copy, the int8 route alone (packed_route times it so).
        route = self.prompt_route(flat, flat.shape[0], None if packed_copy else (many_rows_route(), None))
        if route is None:
            return None
        name, operand = route
        if operand.dtype != torch.int8:  # a copy of the weight, dequantized in the input's order
            return prompt_product(flat.float().contiguous(), name, operand, self.out_features)
        interleaved = self.input_order is not None
        if name == "int8_split":
            return split_int8_product(flat, operand, interleaved, self.scales)
        if interleaved and self.in_features % 32:  # the kernel reads 32 interleaved columns at a time
            flat, interleaved = stored_order(flat), False
        return torch.ops.decodekit.tiled_product(flat.float().contiguous(), operand, self.scales, interleaved)

    def prompt_route(
        self, x: torch.Tensor, rows: int, choice: tuple[str, str | None] | None = None
    ) -> tuple[str, torch.Tensor] | None:
        """How a prompt's `rows` rows like `x` are multiplied where one of decodekit's kernels does it, scales
        applied, as `choice` (prompt_choice(rows), looked up where not given) says: ("int8_split", the int8 weight:
        decodekit::split_product), ("int8_tiles", the int8 weight: decodekit::tiled_product), ("packed" or
        "onednn", the dequantized weight copied once for MKL or oneDNN) or (float32's route, the dequantized weight as
        a plain float32 copy) where that measured faster than the int8 route (packed_route: on a CPU without int8
        instructions the int8 routes convert the weight on every call) and the copy fits the memory budget. None
        where another route runs (many_rows_route: int8pack, float32), off CPU, or for as few rows as the few-row
        kernels take."""
        if x.device.type != "cpu" or rows <= native.MAX_ROWS or not native.ready(x, self.bias):
            return None
        route, copy = choice or prompt_choice(rows)
        copied = copied_route(self, (self.weight_int8, self.scales), self.dequantized, copy, rows) if copy else None
        if copied is not None:
            return copied
        if route == "int8_split":
            return "int8_split", self.weight_int8
        return ("int8_tiles", self.weight_int8) if route == "tiles" else None

    def _many_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """The unscaled product of more rows than the few-row kernels take (a prompt), by this CPU's route."""
        route = many_rows_route() if flat.device.type == "cpu" and flat.shape[0] > native.MAX_ROWS else "int8pack"
        interleaved = self.input_order is not None
        if route == "int8_split":
            return split_int8_product(flat, self.weight_int8, interleaved)
        if interleaved:
            flat = stored_order(flat)
        if route == "tiles":  # the kernels are not there (forced off, say): the same float32 products
            route = "float32"
        # PyTorch's kernel takes widths that are multiples of 8: on the AVX2 bench CPU others gave
        # wrong sums or crashed (torch 2.13).
        if route == "int8pack" and flat.device.type == "cpu" and self.in_features % 8 == 0:
            return torch._weight_int8pack_mm(flat.to(torch.bfloat16), self.weight_int8, self.unit_scales)
        if route == "float32":
            return flat.float() @ self.weight_int8.float().t()
        return flat.to(torch.bfloat16) @ self.weight_int8.to(torch.bfloat16).t()  # a width int8pack does not take


def prompt_choice(rows: int) -> tuple[str, str | None]:
    """For a prompt's `rows` rows by int8 weights: the route many_rows_route measured and the copy route of the
    weight dequantized once that beats it ("packed", "onednn" or "float32_copy": packed_route; None where none does, or
    inside a trace). The same for every layer."""
    route = many_rows_route()
    if torch.compiler.is_compiling():
        return route, None
    return route, packed_route(torch.int8, rows, route, int8_problem)


def int8_problem(size: int):
    """packed_route's problem for int8 weights: a default-model-sized layer quantized, its dequantized weights,
    and a call of its products by this CPU's int8 route (what forward runs where the packed copy is not taken)."""
    layer = []
    for x, weight in sample_layer(size, torch.float32):
        linear = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=False)  # the global RNG untouched
        linear.weight = nn.Parameter(weight, requires_grad=False)
        layer.append((x, Int8Linear(linear)))

    def by_int8_route():
        for x, int8 in layer:
            if int8._scaled(x, packed_copy=False) is None:
                int8._many_rows(x).float() * int8.scales

    return [(x, int8.dequantized()) for x, int8 in layer], by_int8_route


def stored_order(rows: torch.Tensor) -> torch.Tensor:
    """rows [M, in] with their columns in the stored order of an interleaved int8 weight (interleaved_columns),
    as a strided copy (indexing with the order was 3x slower)."""
    width = rows.shape[-1]
    return rows.reshape(-1, 4, width // 4).transpose(1, 2).reshape(-1, width)


def split_int8_product(
    rows: torch.Tensor, weight_int8: torch.Tensor, interleaved: bool = False, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """rows [M, in] @ weight_int8^T [out, in] as int8 x int8 products (torch._int_mm: oneDNN's VNNI or AMX
    kernels where the CPU has them), in float32 [M, out], times the per-channel `scales` [out] where given;
    `interleaved`: the weight's columns are stored interleaved (interleaved_columns) and the rows are given in the
    input's order.

    Each row is split into two int8 parts, row = s * (high + low / 127) with s = max|row| / 127, so the
    activations keep about 14 bits where the bfloat16 rows of torch._weight_int8pack_mm keep 8 (relative
    error of the product against the exact one 6e-5 against 2.3e-3), and the int32 sums are exact. One
    int8 part alone would be faster still but 3x less exact than the bfloat16 rows. decodekit's kernel
    (split_product) splits, multiplies and joins a block of rows at a time, its sums staying in cache; the library
    operations below compute the same values in about ten passes through memory.
    """
    rows = rows.float().contiguous()
    if native.ready(rows):
        return torch.ops.decodekit.split_product(rows, weight_int8, scales, interleaved)
    if interleaved:
        rows = stored_order(rows)
    top = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    scaled = rows * (127.0 / top)
    high = torch.round(scaled)
    low = torch.round((scaled - high) * 127.0)
    sums = torch._int_mm(torch.cat([high, low]).to(torch.int8), weight_int8.t()).float()
    count, scale = rows.shape[0], top / 127.0
    y = sums[:count] * scale + sums[count:] * (scale / 127.0)
    return y if scales is None else y * scales


@functools.cache
def int_mm_exact() -> bool:
    """Whether torch._int_mm's int32 sums are exact here. oneDNN's int8 products without VNNI add pairs in 16 bits,
    which overflow: torch calls oneDNN only where the CPU has VNNI, but a process that holds oneDNN to fewer
    instructions (ONEDNN_MAX_CPU_ISA=AVX2 on a VNNI machine) got 8,160 for a sum of 1,032,256."""
    a, b = torch.full((32, 64), 127, dtype=torch.int8), torch.full((64, 32), 127, dtype=torch.int8)
    b[0] = -127
    want = 127 * 127 * 62
    return bool((torch._int_mm(a, b) == want).all())


def many_rows_route() -> str:
    """How an int8 product of many rows (a prompt's prefill) runs on this CPU, measured once (choices.py):
    "int8_split" (the rows split into two int8 parts, int8 x int8 products; split_int8_product), "int8pack"
    (PyTorch's int8-weight kernel, rows in bfloat16), "float32" (the weight converted, then the fp32
    matmul; one pass over the weight, which a few hundred rows repay where the others are slow) or "tiles"
    (decodekit::tiled_product, where the kernels are built: the weight converted a tile of rows at a time into a
    buffer that stays in cache, each tile's product the fp32 matmul, so no float32 copy of the weight goes
    through memory). Another
    route, converting to bf16 for oneDNN's bf16 matmul, rounds each product to bfloat16: the default
    model's int8 log-likelihood moved 2.1% from fp32 against 1.3% (int8pack), so it is not offered."""

    def candidates() -> dict:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(256, 576, generator=generator)  # a prompt of 256 tokens through a default-model-sized layer
        weight = torch.randint(-127, 128, (1536, 576), generator=generator, dtype=torch.int8)
        ones = torch.ones(1536, dtype=torch.bfloat16)
        offered = {
            "int8pack": lambda: torch._weight_int8pack_mm(x.to(torch.bfloat16), weight, ones),
            "float32": lambda: x @ weight.float().t(),
        }
        if int_mm_exact():
            offered["int8_split"] = lambda: split_int8_product(x, weight)
        if native.load():  # decodekit::tiled_product: converted a tile of weight rows at a time, in cache
            offered["tiles"] = lambda: torch.ops.decodekit.tiled_product(x, weight)
        return offered

    return choices.decide("int8_many_rows", candidates, otherwise="int8pack")


def quantize(model: nn.Module, method: str) -> nn.Module:
    """Replaces every nn.Linear of `model` (lm_head included) in place; returns the model. "int8": Int8Linear
    (per-channel scales); "int4": 4-bit groups of 32 with a scale and minimum each, as blocks.BlockLinear's q4 blocks
    (GGUF's Q4_1) on CPU and as int4pack.Int4PackLinear (PyTorch's int4 layout) on CUDA; "int4-g64" / "int4-g128":
    groups of 64 / 128 in PyTorch's int4 layout (int4pack.py: bfloat16 activations). Layers whose shape the format
    does not take (input widths not a multiple of the group) stay as they are."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantize={method!r} is not supported; use one of {list(QUANTIZATIONS)} or None.")
    from . import int4pack
    from .blocks import BLOCK, BlockLinear
    from .packed import linear_children, unpack_linears

    group = int(method.partition("-g")[2] or BLOCK)
    unpack_linears(model)  # quantize from plain nn.Linear weights
    for parent, name, linear in linear_children(model):
        cuda = linear.weight.device.type == "cuda"
        if method == "int8":
            setattr(parent, name, Int8Linear(linear))
        elif (group != BLOCK or cuda) and int4pack.fits(linear.out_features, linear.in_features, group):
            setattr(parent, name, int4pack.Int4PackLinear.from_linear(linear, group))
        elif group == BLOCK and not cuda and linear.in_features % BLOCK == 0:
            setattr(parent, name, BlockLinear.from_linear(linear, "q4"))
    model.quantization = method
    return model
