"""The elementwise passes between a prompt's products on CPU, fused: RMSNorm, rotary embeddings and SiLU(gate) * up.

Each returns None where the fused kernel does not apply (off CPU, a dtype other than float32 or bfloat16, operands
of two dtypes, autograd recording, code being compiled: inductor fuses those passes itself), and the caller computes
the same values with the library's operations. Prompts take them, and so do eager float32 decode steps: for a row
or a few, what counts is the number of operations each token calls (the library's RMSNorm on CPU is six, the rotary
embedding eight), and an eager float32 decode token of the default model is about a tenth faster with them
(docs/performance.md); a fixed-shape step runs the C++ layer stack instead. A bfloat16 model's values are
computed in float32 and rounded once, in the kernel, where the library's passes round after each operation (the
results differ in the last bit, as the C++ layer stack's do); its decode steps keep the library's passes, whose
roundings its eager and compiled tokens were measured to agree with.
"""

from __future__ import annotations

import torch

from . import native

DTYPES = (torch.float32, torch.bfloat16)


def _applies(x: torch.Tensor, *others: torch.Tensor, contiguous: bool = True) -> bool:
    if x.device.type != "cpu" or x.dtype not in DTYPES or torch.compiler.is_compiling():
        return False
    few_rows = x.numel() // max(x.shape[-1], 1) <= native.MAX_ROWS
    if (few_rows and x.dtype != torch.float32) or (contiguous and not x.is_contiguous()):
        return False
    return all(t.dtype == x.dtype for t in others) and native.ready(x, *others)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension in one pass (decodekit::rms_norm), or None."""
    return torch.ops.decodekit.rms_norm(x, weight, eps) if _applies(x, weight) else None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of a fused gate/up product [..., 2 * I] (gate first) in one pass (decodekit::silu_mul), or
    None."""
    return torch.ops.decodekit.silu_mul(gate_up) if _applies(gate_up) else None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x * cos + rotate_half(x) * sin for x [B, H, T, D] (strided, its last dimension contiguous) and cos, sin
    [B or 1, 1, T, D] in one pass (decodekit::rotary), or None."""
    if x.dim() != 4 or x.stride(-1) != 1 or cos.shape != sin.shape or cos.shape[1:] != (1, *x.shape[2:]):
        return None
    if cos.shape[0] not in (1, x.shape[0]) or not _applies(x, cos, sin, contiguous=False):
        return None
    return torch.ops.decodekit.rotary(x, cos, sin)
