"""Linear weights pre-packed for oneDNN: the fast CPU matmul for decoding.

A decode step multiplies a handful of rows (1 token, a few beams, a dozen speculative candidates) by
every weight matrix, so its speed is how fast the weights stream from memory. PyTorch's default CPU
matmul re-packs the weight on every call; oneDNN's linear with a weight reordered once into its
blocked layout reads it at close to memory speed: two to four times faster for 1 to 11 rows, in float32 and
bfloat16 alike (docs/performance.md, "Measurements behind the code's choices"; bench/bench_generate.py measures
the whole token).

`pack_linears(model)` replaces each nn.Linear by a PackedLinear holding the packed copy; a weight
shared with another module (a tied lm_head) stays as well, so the tie survives `unpack_linears`.
Packing is skipped off CPU, for dtypes oneDNN cannot run here, for quantized models, and where plain weights
measured faster on this CPU (eager_layout, a choice cached by CPU signature). Where prompts run faster packed and
decode steps plain, as bfloat16 weights did on the AVX512-BF16 EPYC, a bfloat16 model keeps both layouts while the
second copy fits the budget of packed copies (linear.reserve_copy): its steps take the plain weights.

A compiled step of up to 16 rows multiplies plain weights faster itself (the C++ layer stack and row
products, linear.one_row), so it holds the model unpacked while it runs (`plain_weights`); the next
eager call packs again. Switching costs a copy of the weights.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import time
import weakref

import torch
from torch import nn

from . import cpu
from .linear import Linear, few_rows, release_copy, reserve_copy

logger = logging.getLogger("decodekit")

# oneDNN picks its blocked layout for an expected row count; 4 is fast for 1 to 16 rows on the bench machine.
ROWS_HINT = 4


# An operator of our own so that torch.compile treats the oneDNN call and its opaque weight as one node
# (inductor cannot lower mkldnn._linear_pointwise on an input it did not pack itself). Defined with the
# low-level Library API: its dispatch costs a fifth of torch.library.custom_op's, which adds up over the 121 linear
# layers of a token.
_LIBRARY = torch.library.Library("decodekit", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], out_features)


_LIBRARY.impl("packed_linear", _linear, "CompositeExplicitAutograd")


@torch.library.register_fake("decodekit::packed_linear")
def _(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def can_pack(weight: torch.Tensor) -> bool:
    """True where oneDNN runs a packed linear for this weight: CPU, float32, or bfloat16 on CPUs with bf16 support.
    Whether packing pays is eager_layout's question."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16 and not cpu.has("onednn_bf16"):
        return False
    return weight.dtype in (torch.float32, torch.bfloat16)


# The layouts eager calls may hold weights in: oneDNN's packed one, the plain one, or "both": packed for prompts, the
# plain weight kept for products of up to native.MAX_ROWS rows (decode steps), at the cost of a second copy.
LAYOUTS = ("packed", "plain", "both")

# The layers a sample's decode steps go round fill this many times the last-level cache, at most SAMPLE_MEMORY
# bytes (twice that with the packed copies, which "both" shares): each step then reads its weights from memory, as a
# model's steps do.
CACHE_MULTIPLE, SAMPLE_MEMORY = 2, 256 << 20
LAYOUT_SAMPLE = "steps_from_memory"  # the sample's name in the choices' cache key (choices._key)


def eager_layout(dtype: torch.dtype, both: bool = False) -> str:
    """The layout (LAYOUTS) eager calls hold weights of `dtype` in on this CPU, measured once per dtype (choices.py)
    on default-model-sized layers over what a typical call does to each layer of a model: a 256-token prompt, then
    64 one-row decode steps. Plain weights take decodekit's row kernel for the steps and the library's matmul for the
    prompt. "both" is offered where `both` (the caller found memory for the second copy) and for bfloat16 weights:
    a float32 prompt on plain weights takes decodekit's C++ prompt layers, which a sample of one layer does not run,
    while a bfloat16 one on a CPU with bf16 instructions runs the library's matmul, as here.

    The steps go round copies of the layer that overflow the last-level cache (CACHE_MULTIPLE): on one layer, which
    stays in cache, oneDNN's packed bfloat16 product won on an AVX512-BF16 EPYC while the whole model decoded faster
    on plain weights, and its prompts ran faster packed: the case for both (docs/performance.md)."""
    from . import choices, native

    offered = LAYOUTS if both and dtype == torch.bfloat16 else LAYOUTS[:2]

    def candidates() -> dict:
        native.load()
        generator = torch.Generator().manual_seed(0)
        first = Linear(576, 1536, bias=False, dtype=dtype)
        with torch.no_grad():
            first.weight.copy_(torch.randn(1536, 576, generator=generator))
        layer_bytes = first.weight.numel() * first.weight.element_size()
        wanted = min(CACHE_MULTIPLE * cpu.last_level_cache_bytes(), SAMPLE_MEMORY)
        plain = [first] + [copy.deepcopy(first) for _ in range(max(1, -(-wanted // layer_bytes)) - 1)]
        layers = {"plain": plain, "packed": [PackedLinear(layer, keep_weight=True) for layer in plain]}
        if "both" in offered:
            layers["both"] = [_with_plain_steps(layer) for layer in layers["packed"]]
        prompt = torch.randn(256, 576, generator=generator).to(dtype)
        step = torch.randn(1, 576, generator=generator).to(dtype)

        def typical_call(layers):
            turn = itertools.cycle(layers)  # carried on from call to call: every copy is read in turn

            def call():
                layers[0](prompt)
                for _ in range(64):
                    next(turn)(step)

            return call

        return {label: typical_call(layers[label]) for label in offered}

    name = f"eager_weights_{str(dtype).removeprefix('torch.')}"
    return choices.decide(name, candidates, otherwise="packed", sample=LAYOUT_SAMPLE)


def _with_plain_steps(packed: "PackedLinear") -> "PackedLinear":
    """`packed` in the "both" layout, sharing its packed copy and weight."""
    twin = copy.copy(packed)  # the module's dicts of buffers and parameters are shared, not copied
    twin.plain_steps = True
    return twin


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W in oneDNN's blocked layout. `weight` gives W back as a plain tensor. With `plain_steps`
    (the "both" layout, which keeps the weight), products of up to native.MAX_ROWS rows take the plain weight by
    decodekit's row kernel (linear.few_rows)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool, plain_steps: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT)
        self.register_buffer("packed", packed, persistent=False)
        self.bias = linear.bias
        # A shared (tied) weight is kept: it costs nothing extra and unpacking restores the tie.
        self.shared_weight = linear.weight if keep_weight or plain_steps else None
        self.plain_steps = plain_steps

    @property
    def weight(self) -> torch.Tensor:
        return self.shared_weight if self.shared_weight is not None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain_steps:
            y = few_rows(x, x.numel() // self.in_features, self.shared_weight, self.bias)
            if y is not None:
                return y
        if torch.compiler.is_compiling():
            return torch.ops.decodekit.packed_linear(x, self.packed, self.bias, self.out_features)
        return _linear(x, self.packed, self.bias, self.out_features)  # eager: no dispatch through our operator

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Same keys as the nn.Linear it replaced, so saved weights load into an unpacked model.
        destination[prefix + "weight"] = self.weight if keep_vars else self.weight.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def to_linear(self) -> Linear:
        linear = Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = (
            self.shared_weight
            if self.shared_weight is not None
            else nn.Parameter(self.packed.to_dense(), requires_grad=False)
        )
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def linear_children(model: nn.Module, kind: type = nn.Linear):
    """(parent, attribute name, module) for every submodule of type `kind`, listed before any is replaced."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, kind):
                yield parent, name, child


def pack_linears(model: nn.Module) -> bool:
    """Packs every nn.Linear of `model` in place where oneDNN can run it; returns whether the model is packed.

    The answer is kept on the model (`_packed_linears`), so calling this at every forward costs an
    attribute read; unpack_linears, or a dtype or device move of a decodekit model, clears it.
    """
    decided = getattr(model, "_packed_linears", None)
    if decided is None:
        decided = model._packed_linears = _pack(model)
    return decided


def _pack(model: nn.Module) -> bool:
    if getattr(model, "quantization", None):
        return False
    linears = list(linear_children(model))
    if not linears or not all(can_pack(linear.weight) for _, _, linear in linears):
        return False
    others = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    counts: dict[int, int] = {}
    for _, _, linear in linears:
        counts[id(linear.weight)] = counts.get(id(linear.weight), 0) + 1
    shared = {
        id(linear.weight) for _, _, linear in linears if id(linear.weight) in others or counts[id(linear.weight)] > 1
    }
    # "both" keeps every weight beside its packed copy: that copy counts against linear.py's budget of packed copies.
    extra = sum(linear.weight.nbytes for _, _, linear in linears if id(linear.weight) not in shared)
    dtypes = {linear.weight.dtype for _, _, linear in linears}
    both = len(dtypes) == 1 and torch.bfloat16 in dtypes and reserve_copy(extra)
    try:
        layouts = {dtype: eager_layout(dtype, both) for dtype in dtypes}
    except BaseException:
        if both:
            release_copy(extra)
        raise
    if both and "both" not in layouts.values():
        release_copy(extra)
        both = False
    if "plain" in layouts.values():
        return False
    for parent, name, linear in linears:
        packed = PackedLinear(
            linear, keep_weight=id(linear.weight) in shared, plain_steps=layouts[linear.weight.dtype] == "both"
        )
        setattr(parent, name, packed)
    if both:
        weakref.finalize(packed, release_copy, extra)  # the copies go with the packed layers, all at once
    return True


def unpack_linears(model: nn.Module) -> None:
    """Turns every PackedLinear back into an nn.Linear; the next pack_linears decides afresh."""
    for parent, name, packed in linear_children(model, PackedLinear):
        setattr(parent, name, packed.to_linear())
    model._packed_linears = None


@contextlib.contextmanager
def plain_weights(model: nn.Module):
    """Holds `model`'s linear layers unpacked for the duration (unpacking them first if they are packed).

    For a compiled step of up to fused.PLAIN_WEIGHTS_ROWS rows, which multiplies plain weights itself.
    Afterwards the model decides afresh, so the next eager forward packs again.
    """
    if getattr(model, "_packed_linears", None):
        start = time.perf_counter()
        # Outside inference mode (generate runs in it): the weights it makes stay ordinary tensors, which
        # the user may later change in place.
        with torch.inference_mode(False):
            unpack_linears(model)
        logger.info(
            "linear weights unpacked from oneDNN's layout for a compiled step of few rows "
            "(%.0f ms); the next eager call packs them again",
            1000 * (time.perf_counter() - start),
        )
    model._packed_linears = False
    try:
        yield
    finally:
        model._packed_linears = None
