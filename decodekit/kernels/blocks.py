"""Weights in blocks of 32, as GGUF files hold them: fewer bytes per decoded token than any float copy of them.

Two layouts, each one GGUF block format kept byte for byte:
- "q4" (GGUF's Q4_1 block, 20 bytes for 32 weights, 5 bits a weight): a float16 scale d and minimum m, then 16
  bytes of 4-bit values q (low nibbles weights 0-15, high nibbles 16-31); weight = d * q + m. Q4_1 tensors are
  kept as read; Q4_0's blocks (weight = d * (q - 8)) become q4 blocks with m = -8 d, exactly; Q4_K's super-blocks
  become q4 blocks with d and m the products of the super-block's and sub-block's scales, rounded to float16
  (relative error at most 2^-11 of a scale: a Q4_K weight moves by at most that fraction of its group's range).
- "q8" (GGUF's Q8_0 block, 34 bytes for 32 weights): a float16 scale d, then 32 int8 values q; weight = d * q.
  Q8_0 tensors are kept as read; Q5_0's blocks (weight = d * (q - 16), q of 5 bits) become q8 blocks exactly.
  Q6_K and Q5_K super-blocks (a Q4_K_M or Q5_K_M file's v and down projections) have no exact q8 form (Q6_K's
  16-weight groups each have a scale, Q5_K's have a minimum): they are rounded again (REQUANTIZED), dequantized by
  the `gguf` package and rounded as its Q8_0 quantizer rounds, a weight within half a q8 step of the file's (about
  an eighth of a Q6_K step), in 8.5 bits a weight against float32's 32; `dtype="float32"` loads them exactly.
Other types load dequantized to float32.

A row of K weights is K / 32 blocks, stored as a [out, K / 32 * 20] uint8 ("q4") or [out, K / 32 * 17] int16
("q8") tensor: the dtype names the layout for decodekit's C++ kernels (csrc/blocks.cpp), which multiply rows by
the blocks converted in registers, in float32, so every route computes the dequantized weight's product.
`quantize="int4"` makes q4 blocks from float weights (safetensors, Hub models) with the rounding of the `gguf`
package's own Q4_1 quantizer (quantize_rows makes q8 blocks as its Q8_0 quantizer does, for tests).
"""

from __future__ import annotations

import logging
import mmap

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from . import native

logger = logging.getLogger("decodekit")

BLOCK = 32
LAYOUTS = {"q4": (torch.uint8, 20), "q8": (torch.int16, 34)}  # layout -> (stored dtype, bytes a block)
# GGUF tensor types kept in blocks, and the layout each becomes.
KEPT_TYPES = {"Q4_0": "q4", "Q4_1": "q4", "Q4_K": "q4", "Q5_0": "q8", "Q8_0": "q8", "Q5_K": "q8", "Q6_K": "q8"}
REQUANTIZED = frozenset({"Q5_K", "Q6_K"})  # kept types whose blocks are rounded again, not converted exactly
_REQUANTIZED_ROWS = 1024  # rows dequantized at a time: a vocabulary's float32 copy never exists whole


def layout_of(blocks: torch.Tensor) -> str:
    for name, (dtype, _) in LAYOUTS.items():
        if blocks.dtype == dtype:
            return name
    raise ValueError(f"blocks of dtype {blocks.dtype} are no block layout; expected uint8 (q4) or int16 (q8)")


def as_stored(raw: np.ndarray, layout: str) -> torch.Tensor:
    """Bytes [rows, blocks * bytes a block] (numpy uint8) as the tensor a layout is stored in: a copy where they are
    a file's mapped bytes, else the array itself (a conversion's own result, copied once is enough)."""
    dtype, _ = LAYOUTS[layout]
    array = np.ascontiguousarray(raw, dtype=np.uint8)
    if _mapped(array):
        array = array.copy()
    data = torch.from_numpy(array)
    return data if dtype == torch.uint8 else data.view(dtype)


def _mapped(array: np.ndarray) -> bool:
    """Whether `array`'s bytes belong to a memory-mapped file (a GGUF file's tensor data)."""
    base = array
    while isinstance(base, np.ndarray) and not isinstance(base, np.memmap) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):  # np.frombuffer of a map (gguf_header)
        base = base.obj
    return isinstance(base, (np.memmap, mmap.mmap))


def from_gguf(raw: np.ndarray, type_name: str) -> tuple[str, np.ndarray]:
    """A GGUF tensor's block bytes [rows, row bytes] (GGUFReader's `data`, type `type_name`) -> (layout, the rows
    in that layout's blocks, uint8 [rows, K / 32 * bytes a block])."""
    rows = raw.shape[0]
    if type_name in ("Q4_1", "Q8_0"):
        return KEPT_TYPES[type_name], np.asarray(raw, dtype=np.uint8)
    if type_name == "Q4_0":
        blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, 18)
        d = blocks[:, :2].copy().view(np.float16)
        m = (d.astype(np.float32) * -8.0).astype(np.float16)  # exact: a power of two times a float16
        out = np.concatenate([d.view(np.uint8), m.view(np.uint8), blocks[:, 2:]], axis=1)
        return "q4", out.reshape(rows, -1)
    if type_name == "Q4_K":
        return "q4", _q4_from_q4k(np.asarray(raw, dtype=np.uint8)).reshape(rows, -1)
    if type_name == "Q5_0":
        return "q8", _q8_from_q5_0(np.asarray(raw, dtype=np.uint8)).reshape(rows, -1)
    if type_name in REQUANTIZED:
        return "q8", _q8_rounded_again(raw, type_name)
    raise ValueError(f"GGUF type {type_name} is not kept in blocks; kept: {sorted(KEPT_TYPES)}")


def _q4_from_q4k(raw: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks (144 bytes: float16 d and dmin, 12 bytes of 6-bit sub-block scales and minimums, 128 bytes
    of 4-bit values for 256 weights; weight = d * sc * q - dmin * mn) -> q4 blocks [n * 8, 20]."""
    blocks = raw.reshape(-1, 144)
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:16].astype(np.uint8)
    sc = np.empty((n, 8), np.uint8)
    mn = np.empty((n, 8), np.uint8)
    sc[:, :4] = packed[:, 0:4] & 63
    mn[:, :4] = packed[:, 4:8] & 63
    sc[:, 4:] = (packed[:, 8:12] & 15) | ((packed[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (packed[:, 8:12] >> 4) | ((packed[:, 4:8] >> 6) << 4)
    qs = blocks[:, 16:].reshape(n, 4, 32)  # four chunks of 64 weights: low nibbles the first 32, high the next
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(n, 8, 32)  # sub-block j: its 32 values in order
    scale = (d * sc).astype(np.float16)
    minimum = (-dmin * mn).astype(np.float16)
    nibbles = (q[:, :, :16] | (q[:, :, 16:] << 4)).astype(np.uint8)
    out = np.concatenate(
        [scale.reshape(n, 8, 1).view(np.uint8), minimum.reshape(n, 8, 1).view(np.uint8), nibbles], axis=2
    )
    return out.reshape(n * 8, 20)


def _q8_from_q5_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0 blocks (22 bytes: float16 d, 32 high bits, 16 bytes of low nibbles; weight = d * (q - 16)) -> q8 blocks
    [n, 34] of the same d and the values q - 16, exactly."""
    blocks = raw.reshape(-1, 22)
    high = blocks[:, 2:6].copy().view("<u4")  # bit i: weight i's fifth bit
    qs = blocks[:, 6:]
    low = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int16)
    bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
    values = (low | (bits << 4)) - 16
    return np.concatenate([blocks[:, :2], values.astype(np.int8).view(np.uint8)], axis=1)


def _q8_rounded_again(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Rows of super-blocks of a REQUANTIZED type -> q8 blocks, a slice of rows at a time: each slice dequantized by
    the `gguf` package and rounded as its Q8_0 quantizer rounds."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind = GGMLQuantizationType[type_name]
    parts = [
        quantize(dequantize(raw[start : start + _REQUANTIZED_ROWS], kind), GGMLQuantizationType.Q8_0)
        for start in range(0, raw.shape[0], _REQUANTIZED_ROWS)
    ]
    return np.concatenate(parts).reshape(raw.shape[0], -1)


def as_q8(kept: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Blocks of any layout as q8 blocks, and whether exactly: q8 as they are; q4 blocks whose minimum is -8 times
    their scale (a Q4_0 file's) as the same scale and the values q - 8; any other q4 blocks rounded again (Q8_0's
    rounding of their dequantized weights). For a fused q/k/v whose parts a file holds in two layouts."""
    if layout_of(kept) == "q8":
        return kept, True
    raw = kept.view(torch.uint8).reshape(-1, 20)
    d = raw[:, 0:2].contiguous().view(torch.float16).float()
    m = raw[:, 2:4].contiguous().view(torch.float16).float()
    if not torch.equal(m, -8 * d):
        return quantize_rows(dequantize(kept), "q8"), False
    qs = raw[:, 4:]
    values = (torch.cat([qs & 15, qs >> 4], dim=1).to(torch.int16) - 8).to(torch.int8)
    out = torch.cat([raw[:, 0:2], values.view(torch.uint8)], dim=1)
    return out.reshape(kept.shape[0], -1).view(torch.int16), True


def quantize_rows(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """A float weight [out, in] (in % 32 == 0) in `layout`'s blocks, rounded as the `gguf` package's Q4_1
    (q4: d = (max - min) / 15, m = min, q = round((w - m) / d)) and Q8_0 (q8: d = max|w| / 127) quantizers do."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"block layouts take input widths that are multiples of {BLOCK}, not {in_features}")
    kind = GGMLQuantizationType.Q4_1 if layout == "q4" else GGMLQuantizationType.Q8_0
    raw = quantize(weight.detach().float().cpu().numpy(), kind)
    return as_stored(raw.reshape(out_features, -1), layout)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks [rows, stored] -> float32 weights [rows, K], with torch operations (any device)."""
    layout = layout_of(blocks)
    _, size = LAYOUTS[layout]
    raw = blocks.view(torch.uint8).reshape(blocks.shape[0], -1, size)
    d = raw[..., 0:2].contiguous().view(torch.float16).float()
    if layout == "q8":
        return (raw[..., 2:].contiguous().view(torch.int8).float() * d).reshape(blocks.shape[0], -1)
    m = raw[..., 2:4].contiguous().view(torch.float16).float()
    qs = raw[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
    return (q * d + m).reshape(blocks.shape[0], -1)


def block_lanes() -> str:
    """The vector width of decodekit's products of a few rows by blocks on this CPU, "8" (AVX2) or "16" (AVX-512,
    offered where the CPU has avx512f and avx512bw), measured once (choices.py) on a default-model-sized layer and
    set in the kernels (decodekit::set_block_lanes, which they read at every call: compiled steps follow it too).
    Half the conversions and products a block of AVX2's (docs/performance.md has what it measured)."""
    from . import choices, cpu

    def candidates() -> dict:
        if not native.load():
            return {}
        generator = torch.Generator().manual_seed(0)
        weight = quantize_rows(torch.randn(1536, 576, generator=generator), "q4")
        row = torch.randn(1, 576, generator=generator)
        offered = {"8": 8}
        if cpu.has("avx512f"):
            try:
                torch.ops.decodekit.set_block_lanes(16)  # refused without avx512bw
                offered["16"] = 16
            except RuntimeError:
                pass

        global _lanes_set
        _lanes_set = None  # measuring sets the lanes of each candidate

        def product(lanes: int):
            def run():
                torch.ops.decodekit.set_block_lanes(lanes)
                for _ in range(8):
                    torch.ops.decodekit.row_product(row, weight)

            return run

        return {label: product(lanes) for label, lanes in offered.items()}

    global _lanes_set
    chosen = choices.decide("block_lanes", candidates, otherwise="8")
    if native.loaded() and not torch.compiler.is_compiling() and _lanes_set != chosen:
        torch.ops.decodekit.set_block_lanes(int(chosen))  # a call into the kernels only when the choice changes
        _lanes_set = chosen
    return chosen


_lanes_set: str | None = None  # the lanes block_lanes last set in the kernels (the measurement sets others)


def weight_formats(module: nn.Module) -> dict[str, int]:
    """{format: bytes} of a module's weights as held, each tensor once: "q4 blocks", "q8 blocks", "int8" (with its
    scales), "int4 groups of 64" (PyTorch's int4 layout, with its scales and zeros), or the dtype's name ("float32",
    "bfloat16", ...)."""
    from .int4pack import Int4PackLinear
    from .quantize import Int8Linear

    seen, formats = set(), {}
    for layer in module.modules():
        if isinstance(layer, (BlockLinear, BlockEmbedding)):
            kind = f"{layer.layout} blocks"
        elif isinstance(layer, Int8Linear):
            kind = "int8"
        elif isinstance(layer, Int4PackLinear):
            kind = f"int4 groups of {layer.group_size}"
        else:
            kind = None
        for t in [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]:
            if t is None or t.data_ptr() in seen or t.numel() == 0:
                continue
            seen.add(t.data_ptr())
            # A block layer's bias is float; an int8 layer's scales and column order count as its format, and an int4
            # layer's scales and zeros as its.
            scales = kind is not None and kind.startswith("int4") and t is not layer.bias
            held = kind == "int8" or scales or (kind is not None and not t.is_floating_point())
            name = kind if held else str(t.dtype).removeprefix("torch.")
            formats[name] = formats.get(name, 0) + t.numel() * t.element_size()
    return formats


def kept_on(device) -> bool:
    """Whether weights in blocks are multiplied fast on `device`: on CPU with decodekit's kernels. Elsewhere (a GPU,
    a machine where the kernels do not build) a block layer would dequantize its weight on every call, so a file's
    blocks load dequantized there instead."""
    where = torch.device(device if device is not None else "cpu")
    if where.type == "cpu" and native.load() and native.loaded():  # loaded(): the probe a test may force off
        return True
    reason = "decodekit's C++ kernels are not built here" if where.type == "cpu" else f"on {where.type}"
    logger.info("a GGUF file's blocks load dequantized to float32: %s", reason)
    return False


def stored_bytes(module: nn.Module) -> int:
    """The bytes of a module's parameters and buffers, each tensor once (tied weights share one)."""
    return sum(weight_formats(module).values())


class BlockLinear(nn.Module):
    """A linear layer whose weight is kept in blocks (`layout`: "q4" or "q8"); y = x @ W^T + b, W the dequantized
    weight. On CPU with decodekit's kernels, up to native.MAX_ROWS rows (decode steps, eager or compiled) go through
    decodekit::row_product and more (prompts) through decodekit::tiled_product, a tile of dequantized rows at a time
    in cache; elsewhere the weight is dequantized for the call."""

    def __init__(self, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.layout = layout_of(blocks)
        self.in_features, self.out_features = in_features, blocks.shape[0]
        expected = in_features // BLOCK * LAYOUTS[self.layout][1] // blocks.element_size()
        if in_features % BLOCK or blocks.dim() != 2 or blocks.shape[1] != expected:
            raise ValueError(
                f"{self.layout} blocks of shape {tuple(blocks.shape)} do not hold [{blocks.shape[0]}, {in_features}] "
                f"weights (expected [{blocks.shape[0]}, {expected}])"
            )
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, layout: str) -> "BlockLinear":
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(quantize_rows(linear.weight, layout), linear.in_features, bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (float32, a new tensor each read): for code that reads a layer's weight."""
        return self.dequantized()

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.device.type == "cpu" and flat.shape[0] >= 1 and native.ready(x):
            if not torch.compiler.is_compiling():
                block_lanes()  # measured once, then a lookup
            rows = flat.float().contiguous()
            if flat.shape[0] <= native.MAX_ROWS:
                y = torch.ops.decodekit.row_product(rows, self.blocks)
            else:
                y = torch.ops.decodekit.tiled_product(rows, self.blocks)
        else:
            y = F.linear(flat.float(), self.dequantized().to(flat.device))
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, layout={self.layout}"


class BlockEmbedding(nn.Module):
    """An embedding table kept in blocks (shared with a tied BlockLinear lm_head): a lookup dequantizes the rows it
    reads, in the model's dtype (an empty buffer that .to() converts with the rest says which)."""

    def __init__(self, blocks: torch.Tensor, embedding_dim: int):
        super().__init__()
        self.layout = layout_of(blocks)
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self.register_buffer("blocks", blocks)
        self.register_buffer("like", torch.empty(0, device=blocks.device), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table (a new tensor each read), for code that reads an embedding's weight."""
        return dequantize(self.blocks).to(self.like.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize(self.blocks[ids.reshape(-1)])
        return rows.to(self.like.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, layout={self.layout}"
