"""Weight-only int8: close to the fp32 layer, and the 2% log-likelihood quality bar on the real model."""

import pytest
import torch
from torch import nn

from decodekit import AutoModelForCausalLM
from decodekit.kernels import choices, cpu
from decodekit.kernels.quantize import Int8Linear, int_mm_exact, many_rows_route
from decodekit.testing import write_tiny_model
from helpers import needs_exact_int_mm


def test_int8_linear_is_close_to_fp32():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    q = Int8Linear(linear)
    assert q.weight_int8.dtype == torch.int8 and q.weight_int8.shape == (48, 64) and q.scales.shape == (48,)
    assert (q.dequantized() - linear.weight).abs().max() <= q.scales.max() / 2 + 1e-6  # rounding, columns in order
    x = torch.randn(3, 5, 64)
    ref = linear(x)
    err = (q(x) - ref).norm() / ref.norm()
    assert err < 0.02, err


def test_few_row_products_are_float32_and_more_rows_use_the_library_kernel():
    # Up to 16 rows on CPU (decode steps, short prompts) are multiplied in float32 by decodekit's kernel,
    # eager or compiled; without it, one row in a compiled step by quantize.one_row_int8. More rows (a
    # longer prompt) take the route measured for this CPU (quantize.many_rows_route); one of them,
    # torch._weight_int8pack_mm, takes the rows in bfloat16, as do the eager rows when the kernel is not built.
    from decodekit.kernels import native

    torch.manual_seed(0)
    q = Int8Linear(nn.Linear(576, 96, bias=False))
    built = native.load()  # before tracing, as FusedStep does: compiled code cannot build it
    many_rows_route()  # the same: compiled code cannot measure the route of many rows
    compiled = torch.compile(q, fullgraph=True)

    def error(y, x):
        exact = x.double() @ q.dequantized().double().t()
        return float((y - exact).norm() / exact.norm())

    x, x3, many = torch.randn(1, 576), torch.randn(3, 576), torch.randn(20, 576)  # many: more than 16 rows
    fused, eager = compiled(x), q(x)
    assert error(fused, x) < 1e-6
    if built:
        assert torch.equal(eager, fused) and error(q(x3), x3) < 1e-6
    else:
        assert 1e-4 < error(eager, x) < 1e-2
    from decodekit.kernels import choices

    with choices.forced(int8_many_rows="int8pack"):
        assert 1e-4 < error(q(many), many) < 1e-2  # bfloat16 rows and product
    if int_mm_exact():  # where it is offered (tests/helpers.py: needs_exact_int_mm)
        with choices.forced(int8_many_rows="int8_split"):
            assert error(q(many), many) < 1e-4  # rows split into two int8 parts
    assert torch.equal(compiled(x3), q(x3)) and torch.equal(compiled(many), q(many))
    exact = x.double() @ q.dequantized().double().t()
    with torch.no_grad():
        q.scales.mul_(2.0)  # the scales are read at run time, not baked into the compiled code
    assert torch.allclose(compiled(x).double(), 2 * exact, rtol=1e-5, atol=1e-6)


def test_quantized_tiny_model_generates_and_rejects_unknown_methods(tmp_path):
    path = write_tiny_model(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(path, quantize="int8")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4).shape == (1, 7)
    with pytest.raises(ValueError, match=r"quantize='int2' is not supported; use one of \['int8', 'int4', 'int4-g64'"):
        AutoModelForCausalLM.from_pretrained(path, quantize="int2")


def mean_loglik(model, sequences, prompt_lengths):
    total, count = 0.0, 0
    with torch.no_grad():
        for seq, n in zip(sequences, prompt_lengths):
            logp = model(seq[None]).logits[0, :-1].float().log_softmax(-1)
            picked = logp.gather(-1, seq[1:, None])[:, 0]
            total += picked[n - 1 :].sum().item()
            count += len(seq) - n
    return total / count


# The int8 model's prompt attention by each route it may take (kernels/attention.py: in bfloat16 products only where
# the CPU has AVX512-BF16, with int8 scores only where it has AVX512-VNNI; its own choice takes whichever measured
# faster).
ATTENTION = [
    "kernel",
    pytest.param(
        "bf16_kernel",
        marks=pytest.mark.skipif(
            not cpu.has("avx512_bf16"), reason="the bfloat16 attention needs a CPU with avx512_bf16"
        ),
    ),
    pytest.param(
        "int8_kernel",
        marks=pytest.mark.skipif(not cpu.has("avx512_vnni"), reason="the int8 scores need a CPU with avx512_vnni"),
    ),
]


@pytest.mark.parametrize("attention", ATTENTION)
def test_int8_keeps_the_log_likelihood_within_two_percent(default_model, attention):
    fp32, tok = default_model
    from decodekit.loading.default import default_model_path

    int8 = AutoModelForCausalLM.from_pretrained(default_model_path(), quantize="int8")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    sequences, lengths = [], []
    for p in prompts:
        ids = tok(p, return_tensors="pt")["input_ids"]
        sequences.append(fp32.generate(ids, max_new_tokens=32, min_new_tokens=32)[0])
        lengths.append(ids.shape[1])
    own = mean_loglik(fp32, sequences, lengths)
    with choices.forced(prompt_attention_int8_512=attention, prompt_attention_float32_512="kernel"):
        quantized = mean_loglik(int8, sequences, lengths)
    assert abs(quantized - own) / abs(own) < 0.02, (own, quantized)


@pytest.mark.parametrize("width", [66, 68])
def test_widths_that_are_not_multiples_of_eight(width):
    # 66: plain columns; 68: interleaved columns. Neither may reach torch._weight_int8pack_mm, which
    # crashed or summed wrongly for such widths.
    torch.manual_seed(0)
    linear = nn.Linear(width, 10, bias=True)
    q = Int8Linear(linear)
    assert (q.input_order is None) == (width % 4 != 0)
    x = torch.randn(1, width)
    exact = x.double() @ q.dequantized().double().t() + linear.bias.double()
    compiled = torch.compile(q, fullgraph=True)(x)
    assert ((compiled - exact).norm() / exact.norm()) < 1e-6
    x4 = torch.randn(4, width)
    assert ((q(x4) - linear(x4)).norm() / linear(x4).norm()) < 0.02


def test_the_float32_view_of_the_weights_follows_the_buffer():
    q = Int8Linear(nn.Linear(64, 8))
    assert q.lanes.dtype == torch.float32 and q.lanes.shape == (8, 16)
    q.to(torch.bfloat16)  # casts floating tensors only: the int8 bytes stay, and the view is made anew
    assert q.weight_int8.dtype == torch.int8 and q.lanes.data_ptr() == q.weight_int8.data_ptr()
    q.weight_int8 = q.weight_int8.clone()
    q.to("cpu")
    assert q.lanes.data_ptr() == q.weight_int8.data_ptr()


@pytest.mark.parametrize("width", [96, 66])  # interleaved columns, plain columns
@needs_exact_int_mm
def test_split_int8_rows_keep_fourteen_bits_where_bfloat16_rows_keep_eight(width):
    # The int8_split prefill route: its error against the exact product of the int8 weight is about 40x
    # smaller than that of rows rounded to bfloat16, as PyTorch's int8-weight kernel takes them; zero rows stay
    # zero; decodekit's kernels and the library operations give the same values.
    from decodekit.kernels import cpu
    from decodekit.kernels.quantize import split_int8_product

    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(40, width, generator=generator) * torch.logspace(-3, 3, 40)[:, None]  # rows of any scale
    rows[7] = 0.0
    q = Int8Linear(nn.Linear(width, 24, bias=False))
    interleaved = q.input_order is not None
    assert interleaved == (width % 4 == 0)
    plain = q.weight_int8 if not interleaved else q.weight_int8[:, torch.argsort(q.input_order)]
    exact = rows.double() @ plain.double().t()

    def error(y):
        return float((y.double() - exact).norm(dim=1).div(exact.norm(dim=1).clamp(min=1e-300)).max())

    split = split_int8_product(rows, q.weight_int8, interleaved)
    with cpu.forced(native_kernels=False):
        library = split_int8_product(rows, q.weight_int8, interleaved)
    assert split.dtype == torch.float32 and torch.all(split[7] == 0)
    assert error(split) < 2e-4 and torch.allclose(split, library, rtol=1e-6, atol=0)
    assert error(rows.bfloat16().double() @ plain.double().t()) > 1e-3  # the rows int8pack takes (any width)


@needs_exact_int_mm
@pytest.mark.parametrize("count, out", [(600, 48), (200, 48), (100, 48), (600, 9000)])
def test_split_product_runs_long_prompts_a_block_at_a_time_with_the_channel_scales(count, out):
    # decodekit::split_product splits, multiplies and joins a block of rows at a time into buffers it reuses: with at
    # least 64 rows for each thread, each thread takes blocks of its own of up to 128 (600 rows on two threads: six of
    # 100; 200 rows: two of 100); with fewer (100), or outputs too wide for a thread's block of sums to stay small
    # (9,000), the threads share each step of blocks of up to 256. Either gives the library operations' values (the kernel's float32 arithmetic is
    # ordered differently, which moves a low part's rounding now and then), the weight's channel scales applied as
    # it joins.
    from decodekit.kernels import cpu
    from decodekit.kernels.quantize import split_int8_product

    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(count, 64, generator=generator)
    q = Int8Linear(nn.Linear(64, out, bias=False))
    scaled = split_int8_product(rows, q.weight_int8, True, q.scales)
    with cpu.forced(native_kernels=False):
        library = split_int8_product(rows, q.weight_int8, True)
    unscaled = split_int8_product(rows, q.weight_int8, True)
    assert torch.equal(scaled, unscaled * q.scales)
    assert float((unscaled - library).norm() / library.norm()) < 1e-5
    exact = rows.double() @ q.dequantized().double().t()
    assert float((scaled.double() - exact).norm() / exact.norm()) < 2e-4


@needs_exact_int_mm
def test_split_product_runs_in_and_out_of_inference_mode_in_one_thread():
    # Its buffers outlive a call: made under inference mode (a prefill's) they were inference tensors, and the next
    # call outside it (autograd off by no_grad only, as a test or a user's loop) failed writing to them.
    from decodekit.kernels.quantize import split_int8_product

    rows = torch.randn(300, 64)
    q = Int8Linear(nn.Linear(64, 5000, bias=False))  # wider than earlier tests': the buffers grow in inference mode
    with torch.inference_mode():
        inside = split_int8_product(rows, q.weight_int8, True, q.scales)
    with torch.no_grad():
        outside = split_int8_product(rows, q.weight_int8, True, q.scales)
    assert torch.equal(inside, outside) and not outside.is_inference()
