"""Weight-only int8 quantization: 4x fewer weight bytes than fp32, for decoding that is bound by memory bandwidth.

Each output channel of a linear layer gets one scale (max |w| / 127); weights are rounded to int8.
Activations go through the matmul in bfloat16, which is what PyTorch's CPU kernel for int8 weights
(`torch._weight_int8pack_mm`) takes. The kernel runs with unit scales and the float32 scales are
applied to its output: on the default model that halves the log-likelihood loss against handing the
kernel bfloat16 scales (1.2% against 2.3% of the fp32 model's mean log-likelihood of its own greedy
text). A compiled one-token step does without the kernel: it uses linear.one_row, in float32, so the
compiled step is the more precise of the two and their tokens part only at a near tie. Embeddings stay
as they are (a lookup reads one row per token).
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import one_row

QUANTIZATIONS = ("int8",)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights [out, in] and float32 per-output-channel scales; y = (x @ q^T) * scale + b."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous())
        self.register_buffer("scales", scale)
        self.register_buffer("unit_scales", torch.ones(scale.shape, dtype=torch.bfloat16))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 1 and torch.compiler.is_compiling():
            y = one_row(flat, self.weight_int8)
        elif flat.device.type == "cpu":
            y = torch._weight_int8pack_mm(flat.to(torch.bfloat16), self.weight_int8, self.unit_scales)
        else:  # no fused kernel assumed elsewhere: convert, then matmul
            y = flat.to(torch.bfloat16) @ self.weight_int8.to(torch.bfloat16).t()
        y = (y.float() * self.scales).to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize(model: nn.Module, method: str) -> nn.Module:
    """Replaces every nn.Linear of `model` (lm_head included) in place; returns the model."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantize={method!r} is not supported; use one of {list(QUANTIZATIONS)} or None.")
    from .packed import linear_children, unpack_linears

    unpack_linears(model)  # quantize from plain nn.Linear weights
    for parent, name, linear in linear_children(model):
        setattr(parent, name, Int8Linear(linear))
    model.quantization = method
    return model
