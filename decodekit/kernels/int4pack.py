"""Weights in PyTorch's own int4 layout, for its tinygemm kernels: `torch.ops.aten._weight_int4pack_mm` on CUDA and
its twin `_weight_int4pack_mm_for_cpu` on CPU.

A weight [out, in] is 4-bit values q (0-15) in groups of `group_size` inputs (32, 64 or 128), each group with a
bfloat16 scale and zero: weight = (q - 8) * scale + zero. The kernels take bfloat16 activations only (on CPU float32
and float16 ones run a scalar loop), so a layer casts its input to bfloat16 and its output back. Used for:
- `quantize="int4-g64"` / `"int4-g128"`: 4.5 / 4.25 bits a weight, against the q4 blocks' 5 (kernels/blocks.py);
- `quantize="int4"` on CUDA (groups of 32), where decodekit's C++ block products do not run;
- a GGUF file's q4 blocks loaded on CUDA (replace_blocks): each block's float16 scale and minimum become the group's
  scale and zero (m + 8 d), rounded to bfloat16.
The packed layout differs per device, so a layer is packed on the device it is made for and cannot move (a model
with such layers is loaded with the device it runs on).
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_SIZES = (32, 64, 128)


def fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the kernels take a weight of this shape: inputs a multiple of the group (and of 32 for the packing),
    outputs a multiple of 16 (the CPU kernel's tiles; 8 on CUDA)."""
    return in_features % group_size == 0 and in_features % 32 == 0 and out_features % 16 == 0


def quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [out, in] as (q, scales_and_zeros): q int32 [out, in] of 0-15, scales_and_zeros bfloat16
    [in / group_size, out, 2]. Each group's range split in 15 steps from its minimum (a scale and minimum, as the q4
    blocks round), the scale and zero rounded to bfloat16 first and the values rounded against those."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {list(GROUP_SIZES)}, not {group_size!r}")
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(torch.bfloat16)
    zero = (low + 8 * scale.float()).to(torch.bfloat16)
    minimum = zero.float() - 8 * scale.float()
    q = torch.round((groups - minimum[..., None]) / scale.float()[..., None]).clamp(0, 15)
    return q.to(torch.int32).reshape(out_features, in_features), _scales_and_zeros(scale, zero)


def from_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4 blocks [out, K / 32 * 20] (kernels/blocks.py) as (q, scales_and_zeros) of groups of 32: the same values,
    each block's d and m as the scale d and the zero m + 8 d, rounded to bfloat16."""
    from .blocks import layout_of

    if layout_of(blocks) != "q4":
        raise ValueError(f"only q4 blocks have an int4 form, not {layout_of(blocks)} blocks")
    raw = blocks.view(torch.uint8).reshape(blocks.shape[0], -1, 20)
    d = raw[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    m = raw[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
    qs = raw[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(blocks.shape[0], -1).to(torch.int32)
    return q, _scales_and_zeros(d.to(torch.bfloat16), (m + 8 * d).to(torch.bfloat16))


def runs_on(device) -> bool:
    """Whether a GGUF file's blocks load into this layout on `device`: on CUDA, where decodekit's block kernels do not
    run and PyTorch's int4 kernel does."""
    return device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()


def replace_blocks(module: nn.Module, device) -> None:
    """A model's block layers (a GGUF file's, kernels/blocks.py) as layers that multiply fast on `device`: q4 layers
    as Int4PackLinear (groups of 32), q8 layers as bfloat16 Linear layers of their dequantized weights; a block
    embedding stays (a lookup dequantizes the rows it reads). The new layers are made on `device`."""
    from .blocks import BlockLinear
    from .linear import Linear

    for name, layer in list(module.named_modules()):
        if type(layer) is not BlockLinear:
            continue
        if layer.layout == "q4" and fits(layer.out_features, layer.in_features, 32):
            replacement = Int4PackLinear(*from_blocks(layer.blocks), 32, layer.bias, device)
        else:
            replacement = Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device=device)
            replacement.weight = nn.Parameter(layer.dequantized().to(device, torch.bfloat16), requires_grad=False)
            if layer.bias is not None:
                replacement.bias = nn.Parameter(layer.bias.detach().to(device), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, replacement)


def _scales_and_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """[out, groups] each -> the kernels' [groups, out, 2]."""
    return torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()


def pack(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """q int32 [out, in] in the layout the kernels of `device` read."""
    if device.type == "cuda":
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)  # the CUDA packer takes two values a byte
        tiles = next(t for t in (8, 4, 2) if q.shape[1] % (16 * t) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
    if device.type != "cpu":
        raise ValueError(f"int4 layers run on CPU and CUDA, not {device.type}")
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(device), 1)


class Int4PackLinear(nn.Module):
    """A linear layer over PyTorch's int4 layout (see the module's docstring): `packed` for the device it was made
    on, `scales_and_zeros` [in / group_size, out, 2] bfloat16, an optional float bias."""

    def __init__(self, q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, bias=None, device=None):
        super().__init__()
        out_features, in_features = q.shape
        if not fits(out_features, in_features, group_size):
            raise ValueError(
                f"an int4 layer of group {group_size} takes inputs a multiple of {max(group_size, 32)} and outputs "
                f"a multiple of 16, not [{out_features}, {in_features}]"
            )
        device = torch.device(device or q.device)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("packed", pack(q, device))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(device=device, dtype=torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> "Int4PackLinear":
        q, scales_and_zeros = quantize_groups(linear.weight, group_size)
        return cls(q, scales_and_zeros, group_size, linear.bias, linear.weight.device)

    def _apply(self, fn, recurse=True):
        before = self.packed.device
        result = super()._apply(fn, recurse)
        if self.packed.device != before:
            raise RuntimeError(
                f"an int4 layer is packed for {before} and cannot move to {self.packed.device}: PyTorch's int4 layout "
                "differs per device; load the model with device= set to where it runs"
            )
        return result

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] as float32 (each value rounded to bfloat16, as the kernel writes it): the identity
        through the layer's own kernel."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        return self._product(eye).t().float().contiguous()

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.packed.device.type == "cuda":
            return torch.ops.aten._weight_int4pack_mm(rows, self.packed, self.group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = self._product(rows).reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (float32, a new tensor each read): for code that reads a layer's weight."""
        return self.dequantized()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"
