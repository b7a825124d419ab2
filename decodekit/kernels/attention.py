"""Causal attention of a prompt or a prompt chunk on CPU: decodekit::prefill_attention where it measured faster than
the library's SDPA on this CPU (see csrc/prefill_attention.cpp: each kv head's query heads stacked into one matmul). Its
products run in float32, or on a CPU with AVX512-BF16 in bfloat16 pairs summed in float32: for bfloat16 models, and
for int8 ones (quantize.py), whose weights' rounding outweighs that of bfloat16 attention many times over. For the
same reason an int8 model's scores may be int8 products where the CPU has AVX512-VNNI (decodekit::
prefill_attention_int8: queries and keys rounded to int8, the keys less their mean; the probabilities times the
values in float32). On the default model over a 1,024-token text, against the float32 model's next-token
distributions: int8 weights KL 0.00602 (top-1 agreement 94.3%), int8 with bfloat16 attention 0.00611 (93.9%), int8
with int8 scores 0.00680 (93.2%); float32 weights with bfloat16 attention 0.00007 (99.1%), with int8 scores 0.00081
(98.0%); a bfloat16 model 0.00129."""

from __future__ import annotations

import torch

from . import choices, cpu, native

ATTENTION_DTYPES = (torch.float32, torch.bfloat16)
BF16_COLUMNS = 32  # kBf16Columns in csrc/prefill_attention.cpp: the bfloat16 products need a head_dim multiple of it
INT8_QUADS = 4  # the int8 scores multiply four bytes at a time: a head_dim multiple of it (up to 256)


# Attention over up to this many keys is measured as one class, longer as another: the kernel's lead over SDPA
# changes with the keys' number (docs/performance.md).
SHORT_KEYS = 1024


def prompt_attention_route(keys: int, dtype: torch.dtype, int8: bool = False) -> str:
    """ "kernel" (decodekit::prefill_attention in float32), "bf16_kernel" (the same in bfloat16 products, offered for
    bfloat16 where the CPU has AVX512-BF16, and for the float32 attention of an `int8` model, its q, k, v rounded to
    bfloat16), "int8_kernel" (an `int8` model's float32 attention with int8 scores, where the CPU has AVX512-VNNI)
    or "sdpa" for attention in `dtype` over `keys` keys, measured once per CPU, dtype (int8 models' apart where a
    rounding kernel is offered) and class of lengths (choices.py: prompt_attention_float32_512,
    prompt_attention_int8_2048, ...) on a prompt of 512 or 2,048 tokens through one layer of the default model's
    shape (9 query heads, 3 kv heads, head_dim 64). The dtypes are measured apart: SDPA computes in the model's
    dtype, which on a CPU with bfloat16 matrix instructions (AMX) ran bfloat16 attention well ahead of the float32
    kernel, and without AMX the bfloat16 kernel was ahead of the float32 one (docs/performance.md)."""
    size = 512 if keys <= SHORT_KEYS else 2048
    quantized = int8 and dtype == torch.float32
    narrowed = quantized and cpu.has("avx512_bf16")  # what bf16_kernel needs for float32 attention
    scored = quantized and int8_scores_run()

    def candidates() -> dict:
        if not native.load():
            return {}
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(1, 9, size, 64, generator=generator).to(dtype)
        k, v = (torch.randn(1, 3, size, 64, generator=generator).to(dtype) for _ in range(2))
        offered = {
            "kernel": lambda: kernel(q[0], k[0], v[0], 0),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        }
        if narrowed or (dtype == torch.bfloat16 and cpu.has("avx512_bf16")):
            offered["bf16_kernel"] = lambda: by_route("bf16_kernel", q[0], k[0], v[0], 0)
        if scored:
            offered["int8_kernel"] = lambda: by_route("int8_kernel", q[0], k[0], v[0], 0)
        return offered

    name = "int8" if narrowed or scored else str(dtype).removeprefix("torch.")
    return choices.decide(f"prompt_attention_{name}_{size}", candidates, otherwise="sdpa")


def wide_softmax() -> bool:
    """Whether the kernel's softmax passes run with AVX-512: where the CPU has it (cpu.py's avx512f probe, which a test
    can force off). The C++ prompt layers ask too (llama.LlamaForCausalLM._prompt_layers)."""
    return cpu.has("avx512f")


def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """decodekit::prefill_attention in float32, the result in q's dtype (softmax passes as wide_softmax says)."""
    return torch.ops.decodekit.prefill_attention(q.float(), k.float(), v.float(), window, wide_softmax()).to(q.dtype)


def bf16_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """decodekit::prefill_attention on bfloat16 q, k, v (a CPU with AVX512-BF16, head_dim a multiple of 32): the
    scores and sums in float32, the probabilities rounded to bfloat16 for the second product; bfloat16 out."""
    return torch.ops.decodekit.prefill_attention(q, k, v, window, True)


def int8_scores_run() -> bool:
    """Whether the int8 kernel may run here: AVX512-VNNI for its products, AVX-512 for its softmax (probes a test
    may force off, as held_to_avx2.sh does)."""
    return cpu.has("avx512_vnni") and cpu.has("avx512f")


def int8_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """decodekit::prefill_attention_int8 on float32 q, k, v (a CPU with AVX512-VNNI, head_dim a multiple of 4 up
    to 256): the scores in int8 products, the rest in float32; float32 out."""
    return torch.ops.decodekit.prefill_attention_int8(q, k, v, window)


def by_route(route: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor | None:
    """Attention of q [H, T, D] over k, v [KV, L, D] by `route` (prompt_attention_route), in q's dtype; None for
    "sdpa", which the caller runs. "bf16_kernel" rounds float32 q, k, v to bfloat16 first; "int8_kernel" takes
    float32 ones. Where the CPU lacks what a rounding kernel needs (a test forced the probe off after the choice was
    made) or head_dim does not tile, the float32 kernel runs instead."""
    if route == "sdpa":
        return None
    D = q.shape[-1]
    if route == "bf16_kernel" and cpu.has("avx512_bf16") and D % BF16_COLUMNS == 0:
        bf16 = torch.bfloat16
        return bf16_kernel(q.to(bf16), k.to(bf16), v.to(bf16), window).to(q.dtype)
    if route == "int8_kernel" and int8_scores_run() and q.dtype == torch.float32 and D % INT8_QUADS == 0 and D <= 256:
        return int8_kernel(q, k, v, window)
    return kernel(q, k, v, window)


def prompt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, int8: bool = False
) -> torch.Tensor | None:
    """Causal attention of q [H, T, D] over k, v [KV, L, D] (query i at position L - T + i; a sliding `window` or
    None), as [H, T, D] in q's dtype, for a model whose weights are `int8` or not (prompt_attention_route); None
    where the kernel does not apply (off CPU, a dtype it does not take, autograd recording, code being compiled) or
    SDPA measured faster here: the caller runs SDPA."""
    if q.device.type != "cpu" or q.dtype not in ATTENTION_DTYPES or torch.compiler.is_compiling():
        return None
    if q.shape[1] <= native.MAX_ROWS or not native.ready(q, k, v):
        return None
    return by_route(prompt_attention_route(k.shape[1], q.dtype, int8), q, k, v, window or 0)
