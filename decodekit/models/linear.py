"""The one-row product of a compiled decode step, and the linear layer that uses it.

A compiled decode step of one token multiplies a single row by every weight matrix. Written as a
broadcast multiply and a sum, inductor turns that into one loop that reads each weight row once,
converts it in registers (bfloat16 or int8 to float32) and accumulates in float32. On the 2-core
bench machine this beats calling oneDNN from the step (`packed_linear`) for every weight format:
paired runs of the default model's compiled step measured 0.81-0.93x the time a token in float32 and
0.83x in bfloat16, and the int8 step went from 8.3 to 6.9 ms a token against torch._weight_int8pack_mm.
It is the step's own code, so the activation after it fuses in. Eager calls keep the library kernels.
int8 weights stored interleaved use a form of their own (quantize.one_row_int8): inductor loads 8 int8
or bf16 values a vector on AVX2 through a stack buffer, which made this form 20x slower for int8 there.
Where decodekit's own kernels are built (native.py), bfloat16 and interleaved int8 weights go through
them instead: they read the weights faster than inductor's loop; float32 gained nothing and stays here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import native


def one_row(row: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """row [1, in] @ weight [out, in]^T in float32 for any weight dtype; returns [1, out] float32."""
    return (row.float()[:, None, :] * weight.float()).sum(-1)


class Linear(nn.Linear):
    """nn.Linear whose one-row product inside a compiled step on CPU is decodekit's kernel for bfloat16
    weights (native.py) where it is built, else `one_row`; F.linear everywhere else.

    Only on CPU, where it was measured; on an accelerator the compiled step keeps the vendor's matmul.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.device.type == "cpu" and x.numel() == self.in_features:
            row = x.reshape(1, -1)
            if self.weight.dtype == torch.bfloat16 and native.loaded():
                y = torch.ops.decodekit.row_product(row.float().contiguous(), self.weight)
            else:
                y = one_row(row, self.weight)
            y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)
