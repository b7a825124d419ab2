"""Prefill products (kernels.linear.many_rows_route, quantize.many_rows_route): decodekit::tiled_product against the
exact product for every weight format and awkward shape, and each route forced in turn through a whole model, which
must give the logits and tokens of the others. Which route this machine would pick is never assumed."""

import os

import pytest
import torch

from decodekit.kernels import choices, cpu, native
from decodekit.kernels.linear import mkl_packing, onednn_packing
from decodekit.kernels import quantize as kernels_quantize
from decodekit.kernels.quantize import int_mm_exact, interleaved_columns, quantize
from decodekit.testing import tiny_model

pytestmark = pytest.mark.skipif(not native.load(), reason="decodekit's C++ kernels do not build on this machine")

LONG = torch.arange(3, 3 + 40)[None] % 90 + 3  # 40 tokens: more rows than the few-row kernels take
# The AVX-512 variant of a kernel, tested where the CPU has it.
WIDE = pytest.param(True, marks=pytest.mark.skipif(not cpu.has("avx512f"), reason="needs a CPU with avx512f"))


def exact(x, weight, scales=None):
    product = x.double() @ weight.double().t()
    return product if scales is None else product * scales.double()


@pytest.mark.parametrize(
    "rows, n, k",
    [(17, 96, 64), (40, 1000, 72), (300, 37, 100), (129, 2049, 8), (33, 130, 576), (200, 70, 576), (34, 70, 1552)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_tiled_product_equals_the_exact_product(rows, n, k, threads):
    # Tiles are cut from the weight's rows (n need not divide), each converted in vector lanes of 8 plus a tail
    # (k need not be a multiple of 8), and each thread takes its own tiles. Blocks of 64 rows or more widen a bfloat16
    # weight block to float32 once (200 rows of 576: two row ranges), fewer convert it in registers. Blocks take rows
    # longer than 768 in equal panels of the columns (1,552: three, of 520, 520 and 512 columns; 528, 528 and 496 wide).
    generator = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator)
    int8 = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    scales = torch.rand(n, generator=generator) + 0.5
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():  # as a prefill runs: the worker threads' products see it too
            cases = [
                (torch.ops.decodekit.tiled_product(x, weight), exact(x, weight)),
                (torch.ops.decodekit.tiled_product(x, weight.bfloat16()), exact(x, weight.bfloat16().float())),
                (torch.ops.decodekit.tiled_product(x, int8, scales), exact(x, int8, scales)),
                (torch.ops.decodekit.tiled_product(x, int8), exact(x, int8)),
            ]
            if k % 32 == 0:  # an interleaved int8 weight (quantize.interleaved_columns), rows in the input's order
                stored = int8[:, interleaved_columns(k)].contiguous()
                cases += [
                    (torch.ops.decodekit.tiled_product(x, stored, scales, True), exact(x, int8, scales)),
                    (torch.ops.decodekit.tiled_product(x, stored, scales, True, True), exact(x, int8, scales)),
                ]
            if k % 8 == 0:  # register blocks of 3 rows by 4 weight rows, with the rows and weight rows left over
                cases += [
                    (torch.ops.decodekit.tiled_product(x, weight, blocks=True), exact(x, weight)),
                    (
                        torch.ops.decodekit.tiled_product(x, weight.bfloat16(), blocks=True),
                        exact(x, weight.bfloat16().float()),
                    ),
                    (torch.ops.decodekit.tiled_product(x, int8, scales, blocks=True), exact(x, int8, scales)),
                ]
            if k % 16 == 0 and cpu.has("avx512f"):  # the AVX-512 blocks (4 rows by 4 weight rows), where the CPU has it
                cases += [
                    (torch.ops.decodekit.tiled_product(x, weight, blocks=True, wide=True), exact(x, weight)),
                    (
                        torch.ops.decodekit.tiled_product(x, weight.bfloat16(), blocks=True, wide=True),
                        exact(x, weight.bfloat16().float()),
                    ),
                    (
                        torch.ops.decodekit.tiled_product(x, int8, scales, blocks=True, wide=True),
                        exact(x, int8, scales),
                    ),
                ]
            if k % 8 == 0:  # widened or in registers, a bf16 weight's blocks add what float32 blocks would, in order
                bf16 = weight.bfloat16()
                assert torch.equal(
                    torch.ops.decodekit.tiled_product(x, bf16, blocks=True),
                    torch.ops.decodekit.tiled_product(x, bf16.float(), blocks=True),
                )
    finally:
        torch.set_num_threads(saved)
    for got, want in cases:
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-5


def test_tiled_product_refuses_what_it_does_not_take():
    x = torch.randn(20, 16)
    with pytest.raises(RuntimeError, match="rows \\[M, K\\] and weight \\[N, K\\]"):
        torch.ops.decodekit.tiled_product(x, torch.randn(8, 15))
    with pytest.raises(RuntimeError, match="float32, bfloat16, int8 or block"):
        torch.ops.decodekit.tiled_product(x, torch.randn(8, 16).half())
    with pytest.raises(RuntimeError, match="scales go with an int8 weight"):
        torch.ops.decodekit.tiled_product(x, torch.randn(8, 16), torch.ones(8))
    with pytest.raises(RuntimeError, match="interleaved columns are an int8 weight's"):
        torch.ops.decodekit.tiled_product(x, torch.zeros(8, 16, dtype=torch.int8), None, True)
    with pytest.raises(RuntimeError, match="blocks=True takes rows of a width that is a multiple of 8"):
        torch.ops.decodekit.tiled_product(torch.randn(20, 12), torch.randn(8, 12), blocks=True)
    with pytest.raises(
        RuntimeError, match="wide=True goes with blocks=True and rows of a width that is a multiple of 16"
    ):
        torch.ops.decodekit.tiled_product(torch.randn(20, 24), torch.randn(8, 24), blocks=True, wide=True)
    with pytest.raises(RuntimeError, match="wide=True goes with blocks=True"):
        torch.ops.decodekit.tiled_product(x, torch.randn(8, 16), wide=True)


def prefill(model, ids):
    with torch.inference_mode():
        return model(ids, use_cache=False).logits.float()


PROMPT = torch.arange(3, 3 + 100)[None] % 90 + 3  # 100 tokens: the class of prompts up to 256 rows


@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
def test_every_prefill_route_gives_the_same_logits_and_tokens(tmp_path, fmt):
    model = tiny_model(tmp_path, "qwen3")
    if fmt == "bfloat16":
        model = model.to(torch.bfloat16)
    name = f"{fmt}_rows_128"
    routes = ["library", "tiles", "blocks", "wide_blocks"]
    if mkl_packing():  # a bfloat16 weight packed as float32 (where the CPU has no bf16 instructions: forced below)
        routes.append("packed")
    if onednn_packing():  # reordered as float32 for oneDNN
        routes.append("onednn")
    if fmt == "bfloat16":  # a plain float32 copy, multiplied by float32's route (pinned to blocks)
        routes.append("float32_copy")
    # The kernel each route runs (wide_blocks runs the AVX2 blocks where the CPU has no AVX-512: a cached choice from
    # another machine, say).
    ran = {
        "tiles": "decodekit::tiled_product",
        "blocks": "decodekit::tiled_product",
        "wide_blocks": "decodekit::tiled_product",
        "packed": "decodekit::packed_product",
        "onednn": "mkldnn::_linear_pointwise",
        "float32_copy": "decodekit::tiled_product",
    }
    results = {}
    for route in routes:
        # The copy routes are decided apart (over the route chosen among the others); the others pass them by.
        copy = route in ("packed", "onednn", "float32_copy")
        pinned = {name: "library" if copy else route, f"{fmt}_packed_rows_128": route, "float32_rows_128": "blocks"}
        pinned[f"eager_weights_{fmt}"] = "plain"  # oneDNN's packed layers (packed.py) would take every product
        with choices.forced(**pinned), cpu.forced(onednn_bf16=False), torch.profiler.profile() as profile:
            results[route] = (prefill(model, PROMPT), model.generate(PROMPT, max_new_tokens=8, eos_token_id=None))
        if route in ran:  # bf16 products in float32 (AVX2's way) through the route
            assert ran[route] in {event.key for event in profile.key_averages()}, route
        held = model.layers[0].mlp.down.__dict__.get("_mkl_packed", {})
        assert (route in held) == copy, route  # a copy of its kind, only for copies
    logits, tokens = results["library"]
    # Each route sums in its own order. In float32 that moves the last bits; a bfloat16 model rounds every product
    # to 8 bits, where a sum on a rounding boundary lands one step apart and the step travels through the layers
    # (AVX-512's blocks against an AVX2 library on an AMD EPYC: 2.3e-3).
    tolerance = 1e-5 if fmt == "float32" else 1e-2
    for route in routes[1:]:
        assert float((results[route][0] - logits).norm() / logits.norm()) < tolerance, route
        assert torch.equal(results[route][1], tokens), route


needs_mkl_packing = pytest.mark.skipif(not mkl_packing(), reason="this torch has no MKL packed products")


@needs_mkl_packing
@pytest.mark.parametrize("rows, n, k", [(1, 5, 3), (129, 2049, 8), (300, 37, 100), (700, 576, 1536)])
def test_packed_product_equals_the_exact_product(rows, n, k):
    generator = torch.Generator().manual_seed(rows + n + k)
    x, weight = torch.randn(rows, k, generator=generator), torch.randn(n, k, generator=generator)
    with torch.inference_mode():
        got = torch.ops.decodekit.packed_product(x, torch.ops.decodekit.mkl_pack(weight), n)
    want = exact(x, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-5
    bias = torch.randn(n, generator=generator)
    with torch.inference_mode():  # bfloat16 rows, taken a block of 128 at a time, and a bias
        half = torch.ops.decodekit.packed_product(x.bfloat16(), torch.ops.decodekit.mkl_pack(weight), n, bias)
    want = exact(x.bfloat16(), weight) + bias.double()
    assert half.dtype == torch.bfloat16 and half.shape == (rows, n)
    assert float((half.double() - want).abs().max() / want.abs().max()) < 1e-2  # rounded to bfloat16 once
    with pytest.raises(RuntimeError, match="smaller than one of"):
        torch.ops.decodekit.packed_product(torch.randn(2, k), torch.ops.decodekit.mkl_pack(weight), n + 4096)
    with pytest.raises(RuntimeError, match="the bias must be float32 \\[out_features\\]"):
        torch.ops.decodekit.packed_product(x, torch.ops.decodekit.mkl_pack(weight), n, bias[:-1])
    with pytest.raises(RuntimeError, match="float32 or bfloat16 rows"):
        torch.ops.decodekit.packed_product(x.half(), torch.ops.decodekit.mkl_pack(weight), n)


@needs_mkl_packing
@pytest.mark.parametrize("through", ["weight", "bias"])
@pytest.mark.parametrize("rows, threads", [(300, 2), (300, 1), (200, 2)])
def test_a_packed_product_of_bfloat16_rows_rounds_as_torch_does(through, rows, threads):
    # Every output is one chosen float32 value (a weight times 1, or the bias): ties between two bfloat16 values,
    # either sign, infinities, NaN, subnormals, values that round past the largest bfloat16; 37 of them, so each row
    # ends on a tail shorter than a vector. 300 rows on two threads go in blocks of their own on each thread, on one
    # thread in three blocks; 200 rows on two threads (less than a full block each) in blocks the threads share.
    tie = 1 + 2**-8  # halfway between 1 and the next bfloat16
    values = torch.tensor(
        [
            tie,
            -tie,
            1 + 3 * 2**-8,
            2**-130,
            -(2**-133),
            float("inf"),
            -float("inf"),
            float("nan"),
            3.3961e38,
            -3.3961e38,
            0.0,
            1 / 3,
            65504.5,
            1e-3,
        ],
        dtype=torch.float32,
    )
    values = torch.cat([values, torch.randn(23, generator=torch.Generator().manual_seed(1)) * 100])
    n, k = values.numel(), 8
    x = torch.zeros(rows, k, dtype=torch.bfloat16)
    weight, bias = torch.zeros(n, k), None
    if through == "weight":
        x[:, 0], weight[:, 0] = 1, values
    else:
        bias = values
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            got = torch.ops.decodekit.packed_product(x, torch.ops.decodekit.mkl_pack(weight), n, bias)
    finally:
        torch.set_num_threads(saved)
    want = values.bfloat16().expand(rows, n)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int16), want.nan_to_num().view(torch.int16))


@needs_mkl_packing
def test_a_packed_weight_follows_its_weight_and_stays_within_the_memory_budget(monkeypatch):
    # The packed copy is made on first use and made again when the weight changes (in place or replaced); past the
    # budget none is made and the library's product runs; a released copy returns its bytes to the budget.
    import gc

    from decodekit.kernels import linear as kernels_linear

    def packed_weight(layer):
        return kernels_linear.packed_weight(layer, (layer.weight,), layer.weight.float)

    layer = kernels_linear.Linear(64, 48)
    x = torch.randn(100, 64)
    with choices.forced(float32_packed_rows_128="packed"), torch.inference_mode():
        first = layer(x)
        packed = packed_weight(layer)
        assert packed is not None and packed_weight(layer) is packed  # kept while unchanged
        torch.testing.assert_close(first, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        with torch.inference_mode(False), torch.no_grad():
            layer.weight.mul_(-2)  # a new version of the same storage
        torch.testing.assert_close(
            layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
        )
        assert packed_weight(layer) is not packed
        gc.collect()  # copies of earlier tests' layers still in cycles are released now, not in the count below
        used = kernels_linear._packing["used"]
        del packed  # the copy of the old version: no one holds it now
        gc.collect()
        assert kernels_linear._packing["used"] == used - 64 * 48 * 4
        monkeypatch.setitem(kernels_linear._packing, "budget", kernels_linear._packing["used"] - 1)  # no room left
        with torch.inference_mode(False), torch.no_grad():
            layer.weight.add_(1)
        assert packed_weight(layer) is None  # the stale copy released, no room for a new one
        torch.testing.assert_close(
            layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
        )
    other = kernels_linear.Linear(64, 48)
    with choices.forced(float32_packed_rows_128="packed"), torch.inference_mode():
        monkeypatch.setitem(kernels_linear._packing, "budget", 2**40)
        other(x)
        gc.collect()
        held = kernels_linear._packing["used"]
        other.to(torch.bfloat16)  # a new weight: its copy is let go at once, not when the layer is
        gc.collect()
        assert "_mkl_packed" not in other.__dict__ and kernels_linear._packing["used"] == held - 64 * 48 * 4


def test_copies_of_two_kinds_are_held_side_by_side_and_go_together_when_the_weight_changes():
    # Prompts of two classes of lengths may take two copy routes: each kind's copy is kept, not made again when the
    # other is asked for, and both count against the budget; a change of the weight lets both go.
    import gc

    from decodekit.kernels import linear as kernels_linear

    layer = kernels_linear.Linear(64, 48).to(torch.bfloat16)
    kinds = [kind for kind in ("packed", "onednn", "float32_copy") if kernels_linear.copy_available(kind)]
    gc.collect()
    used = kernels_linear._packing["used"]
    first = {kind: kernels_linear.packed_weight(layer, (layer.weight,), layer.weight.float, kind) for kind in kinds}
    assert all(copy is not None for copy in first.values())
    for kind in reversed(kinds):  # asked again, each kind's own copy
        assert kernels_linear.packed_weight(layer, (layer.weight,), layer.weight.float, kind) is first[kind]
    assert kernels_linear._packing["used"] == used + len(kinds) * 64 * 48 * 4
    torch.testing.assert_close(first["float32_copy"], layer.weight.float(), rtol=0, atol=0)
    with torch.no_grad():
        layer.weight.mul_(2)
    again = kernels_linear.packed_weight(layer, (layer.weight,), layer.weight.float, kinds[0])
    assert again is not first[kinds[0]] and set(layer.__dict__["_mkl_packed"]) == {kinds[0]}  # the stale ones went
    del first, again
    gc.collect()
    assert kernels_linear._packing["used"] == used + 64 * 48 * 4


def test_every_int8_prefill_route_gives_the_same_tokens(tmp_path):
    model = quantize(tiny_model(tmp_path, "llama"), "int8")
    # int8_split where torch._int_mm's sums are exact here (not so where oneDNN is held below VNNI on a VNNI CPU).
    copies = (["packed"] if mkl_packing() else []) + (["onednn"] if onednn_packing() else []) + ["float32_copy"]
    routes = ["float32", "tiles", "int8pack"] + (["int8_split"] if int_mm_exact() else []) + copies
    results = {}
    for route in routes:
        # The copies (the dequantized weight copied once as float32 for MKL or oneDNN, or plain for float32's route,
        # pinned to blocks) are decided over the int8 route: pinned off for the others.
        # The attention float32's: a rounding one (attention.py) turns the products' last-bit differences into
        # steps of its roundings.
        pinned = {
            "int8_many_rows": "float32" if route in copies else route,
            "int8_packed_rows_128": route,
            "float32_rows_128": "blocks",
            "prompt_attention_int8_512": "kernel",
        }
        with choices.forced(**pinned), torch.profiler.profile() as profile:
            results[route] = (prefill(model, PROMPT), model.generate(PROMPT, max_new_tokens=8, eos_token_id=None))
        ran = {event.key for event in profile.key_averages()}
        assert ("decodekit::packed_product" in ran) == (route == "packed"), route
        assert ("mkldnn::_linear_pointwise" in ran) == (route == "onednn"), route
        assert ("decodekit::tiled_product" in ran) == (route in ("tiles", "float32_copy")), route
    reference, tokens = results["float32"]
    # tiles, the copies and float32 are the same float32 products; int8_split keeps 14 bits of each row, int8pack 8
    # (bfloat16).
    bounds = {
        "float32": 0,
        "tiles": 1e-5,
        "packed": 1e-5,
        "onednn": 1e-5,
        "float32_copy": 1e-5,
        "int8_split": 1e-3,
        "int8pack": 2e-2,
    }
    for route, (logits, generated) in results.items():
        assert float((logits - reference).norm() / reference.norm()) <= bounds[route], route
    for route in {"tiles", *copies} & set(results):
        assert torch.equal(results[route][1], tokens), route


def test_int8_split_is_offered_only_where_the_int8_sums_are_exact(monkeypatch):
    if not os.environ.get("ONEDNN_MAX_CPU_ISA"):  # torch sends _int_mm to oneDNN only where the CPU has VNNI
        assert int_mm_exact.__wrapped__()
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: real(a, b).clamp(-(2**15), 2**15 - 1))  # 16-bit sums
    assert not int_mm_exact.__wrapped__()
    offered = {}
    monkeypatch.setattr(kernels_quantize, "int_mm_exact", lambda: False)
    monkeypatch.setattr(
        choices, "decide", lambda name, candidates, otherwise: offered.update(candidates()) or otherwise
    )
    kernels_quantize.many_rows_route()
    assert "int8_split" not in offered and {"int8pack", "float32"} <= set(offered)


@needs_mkl_packing
def test_a_packed_int8_weight_follows_its_weight_and_is_not_pickled():
    import pickle

    from decodekit.kernels.quantize import Int8Linear

    layer = Int8Linear(torch.nn.Linear(64, 48))
    x = torch.randn(100, 64)
    want = x @ layer.dequantized().t() + layer.bias
    with choices.forced(int8_packed_rows_128="packed"), torch.inference_mode(), torch.profiler.profile() as profile:
        got = layer(x)
    assert "decodekit::packed_product" in {event.key for event in profile.key_averages()}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert "_mkl_packed" in layer.__dict__ and "_mkl_packed" not in pickle.loads(pickle.dumps(layer)).__dict__
    with torch.no_grad():
        layer.scales.mul_(2)  # the scales are part of the packed float32 weight
    with choices.forced(int8_packed_rows_128="packed"), torch.inference_mode():
        torch.testing.assert_close(layer(x), x @ layer.dequantized().t() + layer.bias, rtol=1e-5, atol=1e-5)
    layer.to(torch.float32)  # its tensors replaced (the same dtype here): the copy goes with them
    assert "_mkl_packed" not in layer.__dict__


@pytest.mark.parametrize("text, share", [("", 0.25), ("0", 0.0), ("0.5", 0.5), (" 1 ", 1.0)])
def test_the_packed_copies_memory_share_comes_from_the_environment(monkeypatch, text, share):
    from decodekit.kernels import linear as kernels_linear

    monkeypatch.setenv("DECODEKIT_PACKED_MEMORY_SHARE", text)
    assert kernels_linear.packed_memory_share() == share


@pytest.mark.parametrize("text", ["half", "-0.1", "2", "nan"])
def test_a_bad_packed_copies_memory_share_is_refused_with_the_accepted_values(monkeypatch, text):
    from decodekit.kernels import linear as kernels_linear

    monkeypatch.setenv("DECODEKIT_PACKED_MEMORY_SHARE", text)
    with pytest.raises(ValueError, match="DECODEKIT_PACKED_MEMORY_SHARE=.*from 0 \\(no packed copies\\) to 1"):
        kernels_linear.packed_memory_share()


def on_threads(call):
    """call()'s result on 1 and on 2 threads, in inference mode."""
    got = []
    for threads in (1, 2):
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                got.append(call())
        finally:
            torch.set_num_threads(saved)
    return got


# The last cases see more than 768 keys: those take the keys in blocks of 256 with an online softmax (a window of
# 300 makes some blocks invisible to some rows and a row's first visible block start mid-block).
@pytest.mark.parametrize(
    "first, length, window",
    [(0, 40, 0), (0, 130, 0), (0, 130, 17), (50, 70, 0), (300, 33, 64), (0, 1000, 0), (700, 150, 0), (600, 260, 300)],
)
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("wide", [False, WIDE])
def test_prefill_attention_equals_masked_sdpa(first, length, window, heads, kv_heads, wide):
    # Query i sits at position first + i and sees keys j <= it (and j > it - window with a window); a block's
    # query heads of one kv head are stacked, the blocks taken out of order so the threads' shares cost alike.
    # Rows of every length: the AVX-512 softmax ends each row on a masked vector, AVX2's on a scalar tail.
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(first + length + window)
    keys = first + length
    q = torch.randn(heads, length, 32, generator=generator)
    k, v = torch.randn(kv_heads, keys, 32, generator=generator), torch.randn(kv_heads, keys, 32, generator=generator)
    q_pos, k_pos = torch.arange(first, keys)[:, None], torch.arange(keys)[None]
    mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    expected = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]
    for got in on_threads(lambda: torch.ops.decodekit.prefill_attention(q, k, v, window, wide)):
        assert (got - expected).abs().max() < 1e-5


def attention_weights(q, k, v, first, window):
    """The float64 probabilities [H, T, L] of causal attention of q [H, T, D] at positions first.. over k [KV, L, D],
    and v repeated for every query head."""
    heads, kv_heads = q.shape[0], k.shape[0]
    q, k, v = (
        q.double(),
        k.double().repeat_interleave(heads // kv_heads, 0),
        v.double().repeat_interleave(heads // kv_heads, 0),
    )
    q_pos, k_pos = torch.arange(first, first + q.shape[1])[:, None], torch.arange(k.shape[1])[None]
    mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    return (q @ k.transpose(1, 2) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1), v


def bf16_kernel_on_threads(q, k, v, window):
    """The bfloat16 kernel's output on 1 and on 2 threads."""
    return on_threads(lambda: torch.ops.decodekit.prefill_attention(q, k, v, window, True))


BF16_KERNEL = pytest.mark.skipif(not cpu.has("avx512_bf16"), reason="the bfloat16 products need a CPU with avx512_bf16")
BF16_CASES = [
    (0, 40, 0),
    (0, 130, 0),
    (0, 130, 17),
    (50, 70, 0),
    (301, 33, 64),
    (0, 1000, 0),
    (700, 150, 0),
    (600, 260, 300),
    (3, 100, 9),
]
BF16_SHAPES = [(6, 2, 32), (4, 4, 64), (9, 3, 128)]


@BF16_KERNEL
@pytest.mark.parametrize("first, length, window", BF16_CASES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", BF16_SHAPES)
def test_bfloat16_prefill_attention_is_within_its_roundings(first, length, window, heads, kv_heads, head_dim):
    # Scores and sums in float32; two roundings to bfloat16 (unit 2^-8): each probability's, then the output's. So
    # each output is within 2^-7 x sum_j p_j |v_j| of exact attention on the same bfloat16 inputs (the worst case
    # seen here was 0.73 of that); a score read from the wrong keys, or a tile of them masked wrongly, is not.
    # The threads split tasks, never a task's sums: 1 and 2 threads agree bit for bit.
    generator = torch.Generator().manual_seed(first + length + window + head_dim)
    q = torch.randn(heads, length, head_dim, generator=generator).bfloat16()
    k, v = (torch.randn(kv_heads, first + length, head_dim, generator=generator).bfloat16() for _ in range(2))
    p, values = attention_weights(q, k, v, first, window)
    one, two = bf16_kernel_on_threads(q, k, v, window)
    assert one.dtype == torch.bfloat16 and torch.equal(one, two)
    error, bound = (one.double() - p @ values).abs(), 2**-7 * (p @ values.abs()) + 1e-6
    assert bool((error <= bound).all()), f"{float((error / bound).max()):.2f}x the rounding bound"


@BF16_KERNEL
@pytest.mark.parametrize("first, length, window", BF16_CASES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", BF16_SHAPES[:2])
def test_bfloat16_prefill_attention_averages_exactly_the_visible_values(
    first, length, window, heads, kv_heads, head_dim
):
    # Zero queries score every key alike: each output is the mean of the values its query sees, and with integer
    # values the kernel's sums are exact, so one key too many or too few (in a pair split at an odd window start, a
    # tile's tail, a block seen by some rows only) moves the mean by far more than its one rounding to bfloat16.
    generator = torch.Generator().manual_seed(first + length + window)
    q = torch.zeros(heads, length, head_dim).bfloat16()
    k = torch.randn(kv_heads, first + length, head_dim, generator=generator).bfloat16()
    v = torch.randint(-100, 101, (kv_heads, first + length, head_dim), generator=generator).bfloat16()
    p, values = attention_weights(q, k, v, first, window)
    one, two = bf16_kernel_on_threads(q, k, v, window)
    assert torch.equal(one, two)
    torch.testing.assert_close(one.double(), p @ values, atol=1e-9, rtol=2**-8 * 1.001)  # atol: float64 softmax noise


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=BF16_KERNEL)])
@pytest.mark.parametrize("length", [300, 1000])  # whole rows, then keys in blocks
def test_prefill_attention_reads_keys_and_values_at_a_row_stride(dtype, length):
    # Continuous batching gathers a chunk's keys as [L, KV, D] rows and passes them transposed: the products read
    # rows KV x D apart, with the results of contiguous keys; a last dimension not contiguous is copied first.
    generator = torch.Generator().manual_seed(length)
    q = torch.randn(6, 200, 64, generator=generator).to(dtype)
    rows = torch.randn(2, length, 2, 64, generator=generator).to(dtype)  # k and v as [L, KV, D] rows
    k, v = rows[0].transpose(0, 1), rows[1].transpose(0, 1)
    with torch.inference_mode():
        want = torch.ops.decodekit.prefill_attention(q, k.contiguous(), v.contiguous(), 0, True)
        assert torch.equal(torch.ops.decodekit.prefill_attention(q, k, v, 0, True), want)
        spread = torch.zeros(2, 2, length, 128, dtype=dtype)
        spread[..., ::2] = torch.stack([k, v])
        assert torch.equal(
            torch.ops.decodekit.prefill_attention(q, spread[0, ..., ::2], spread[1, ..., ::2], 0, True), want
        )


@BF16_KERNEL
def test_bfloat16_prefill_attention_refuses_a_head_dim_it_does_not_tile():
    q, k = torch.zeros(2, 4, 48).bfloat16(), torch.zeros(1, 4, 48).bfloat16()
    with pytest.raises(RuntimeError, match="head_dim multiple of 32, got 48"):
        torch.ops.decodekit.prefill_attention(q, k, k, 0, True)


INT8_KERNEL = pytest.mark.skipif(not cpu.has("avx512_vnni"), reason="the int8 scores need a CPU with avx512_vnni")


def int8_scores_attention(q, k, v, first, window):
    """Causal attention in float64 on the scores decodekit::prefill_attention_int8 computes: each query row rounded to
    int8 by 127 / its largest magnitude, each key less its kv head's mean key likewise, their products exact."""
    heads, kv_heads, D = q.shape[0], k.shape[0], q.shape[-1]

    def rounded(x):
        top = x.abs().amax(-1, keepdim=True)
        return (x * torch.full_like(top, 127).div(top)).round().double(), top.double() / 127  # as the kernel divides

    q8, q_scale = rounded(q)
    k8, k_scale = rounded(k - k.double().mean(1, keepdim=True).float())
    k8, k_scale = k8.repeat_interleave(heads // kv_heads, 0), k_scale.repeat_interleave(heads // kv_heads, 0)
    scores = (q8 @ k8.transpose(1, 2)) * (q_scale / D**0.5) * k_scale.transpose(1, 2)
    q_pos, k_pos = torch.arange(first, first + q.shape[1])[:, None], torch.arange(k.shape[1])[None]
    mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.double().repeat_interleave(heads // kv_heads, 0)


def int8_kernel_on_threads(q, k, v, window):
    """The int8 kernel's output on 1 and on 2 threads."""
    return on_threads(lambda: torch.ops.decodekit.prefill_attention_int8(q, k, v, window))


@INT8_KERNEL
@pytest.mark.parametrize("first, length, window", BF16_CASES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(6, 2, 32), (4, 4, 12), (9, 3, 64), (2, 1, 128)])
def test_int8_prefill_attention_is_attention_on_its_rounded_scores(first, length, window, heads, kv_heads, head_dim):
    # The scores are exact integer sums scaled in float32, the rest float32: the output is within float32's rounding
    # of float64 attention on the same rounded queries and keys (a key read from the wrong position, a tile masked
    # wrongly or a mean key not taken off both rows alike is not), and within the roundings' error of exact
    # attention. Keys far from zero (offset 3) are what the mean key is taken off for. 1 and 2 threads agree bit
    # for bit. head_dim 12: quads that do not fill a vector.
    generator = torch.Generator().manual_seed(first + length + window + head_dim)
    q = torch.randn(heads, length, head_dim, generator=generator)
    k = torch.randn(kv_heads, first + length, head_dim, generator=generator) + 3
    v = torch.randn(kv_heads, first + length, head_dim, generator=generator)
    one, two = int8_kernel_on_threads(q, k, v, window)
    assert one.dtype == torch.float32 and torch.equal(one, two)
    assert float((one.double() - int8_scores_attention(q, k, v, first, window)).abs().max()) < 2e-6
    p, values = attention_weights(q, k, v, first, window)
    assert float((one.double() - p @ values).norm() / (p @ values).norm()) < 2e-2


@INT8_KERNEL
def test_int8_prefill_attention_reads_keys_and_values_at_a_row_stride():
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(6, 200, 64, generator=generator)
    for length in (300, 1000):  # whole rows, then keys in blocks
        rows = torch.randn(2, length, 2, 64, generator=generator)  # k and v as [L, KV, D] rows, as batching's chunks
        k, v = rows[0].transpose(0, 1), rows[1].transpose(0, 1)
        with torch.inference_mode():
            want = torch.ops.decodekit.prefill_attention_int8(q, k.contiguous(), v.contiguous(), 0)
            assert torch.equal(torch.ops.decodekit.prefill_attention_int8(q, k, v, 0), want)


def test_int8_prefill_attention_refuses_what_it_does_not_take():
    ops = torch.ops.decodekit
    with pytest.raises(RuntimeError, match="all float32 expected"):
        ops.prefill_attention_int8(torch.zeros(2, 4, 8).bfloat16(), torch.zeros(1, 4, 8), torch.zeros(1, 4, 8))
    with pytest.raises(RuntimeError, match="shapes do not fit"):
        ops.prefill_attention_int8(torch.zeros(3, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 4, 8))
    with pytest.raises(RuntimeError, match="head_dim a multiple of 4 up to 256 expected, got 6"):
        ops.prefill_attention_int8(torch.zeros(2, 4, 6), torch.zeros(1, 4, 6), torch.zeros(1, 4, 6))


@INT8_KERNEL
def test_the_int8_route_falls_back_to_the_float32_kernel_where_it_cannot_run():
    from decodekit.kernels import attention

    generator = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(4, 300, 32, generator=generator), *torch.randn(2, 2, 300, 32, generator=generator)
    with torch.inference_mode():
        scored = attention.by_route("int8_kernel", q, k, v, 0)
        assert torch.equal(scored, torch.ops.decodekit.prefill_attention_int8(q, k, v, 0))
        for probe in ("avx512_vnni", "avx512f"):  # a probe forced off after the choice was made
            with cpu.forced(**{probe: False}):
                assert torch.equal(attention.by_route("int8_kernel", q, k, v, 0), attention.kernel(q, k, v, 0))
        assert torch.equal(
            attention.by_route("int8_kernel", q.bfloat16(), k.bfloat16(), v.bfloat16(), 0),
            attention.kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0),
        )  # float32 q, k, v only


@pytest.mark.skipif(not cpu.has("avx512f"), reason="the AVX-512 softmax needs a CPU with avx512f")
def test_prompt_attention_takes_the_avx512_softmax_only_where_the_probe_says_so():
    from decodekit.kernels import attention

    generator = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(4, 300, 32, generator=generator), *torch.randn(2, 2, 300, 32, generator=generator)
    with torch.inference_mode():
        narrow, wide = (torch.ops.decodekit.prefill_attention(q, k, v, 0, flag) for flag in (False, True))
        assert not torch.equal(narrow, wide)  # the two sum a row's exponentials in different orders
        assert torch.equal(attention.kernel(q, k, v, 0), wide)
        with cpu.forced(avx512f=False):
            assert torch.equal(attention.kernel(q, k, v, 0), narrow)


def test_prefill_attention_refuses_what_it_does_not_take():
    with pytest.raises(RuntimeError, match="all float32 or all bfloat16 expected"):
        torch.ops.decodekit.prefill_attention(
            torch.zeros(2, 4, 8).bfloat16(), torch.zeros(1, 4, 8), torch.zeros(1, 4, 8)
        )
    with pytest.raises(RuntimeError, match="shapes do not fit"):
        torch.ops.decodekit.prefill_attention(torch.zeros(3, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 4, 8))


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_both_prompt_attention_routes_give_the_same_logits_tokens_and_batches(tmp_path, model_type):
    # mistral's tiny config has a sliding window: prompts longer than it take SDPA's masked path either way, and
    # continuous batching's prompt chunks pass the window to the kernel.
    model = tiny_model(tmp_path, model_type)
    prompts = [LONG[0].tolist(), LONG[0, :25].tolist()]
    results = {}
    for route in ("sdpa", "kernel"):
        with choices.forced(prompt_attention_float32_512=route, prompt_attention_float32_2048=route):
            batch = model.generate_batch(prompts, max_new_tokens=6, eos_token_id=None, progress_bar=False)
            results[route] = (
                prefill(model, LONG),
                model.generate(LONG, max_new_tokens=8, eos_token_id=None),
                [r.generated_tokens for r in batch.values()],
            )
    (logits, tokens, batched), (kernel_logits, kernel_tokens, kernel_batched) = results["sdpa"], results["kernel"]
    assert float((kernel_logits - logits).norm() / logits.norm()) < 1e-5
    assert torch.equal(kernel_tokens, tokens) and kernel_batched == batched
    with choices.forced(prompt_attention_float32_512="kernel"), torch.profiler.profile() as profile:
        prefill(model, LONG)  # the kernel did run (mistral's window masks: only in batching's chunks)
        model.generate_batch(prompts[:1], max_new_tokens=1, progress_bar=False)
    counts = {e.key: e.count for e in profile.key_averages()}
    # A whole prompt's layers run in C++ (prompt_layer_end calls the kernel), the chunks' through the operator.
    calls = counts.get("decodekit::prefill_attention", 0) + counts.get("decodekit::prompt_layer_end", 0)
    layers = model.config.num_hidden_layers
    assert calls == (2 * layers if model_type == "llama" else layers)


def test_a_bfloat16_model_takes_the_attention_route_measured_for_bfloat16(tmp_path):
    # Each dtype has its own choice: SDPA's bfloat16 attention ran 3-4x the kernel's on an AMX CPU, while float32
    # models there kept the kernel at 512 keys. The two routes agree to bfloat16's rounding.
    model = tiny_model(tmp_path).to(torch.bfloat16)
    outputs, calls = {}, {}
    for bf16_route, fp32_route in (("kernel", "sdpa"), ("sdpa", "kernel")):
        with (
            choices.forced(prompt_attention_bfloat16_512=bf16_route, prompt_attention_float32_512=fp32_route),
            torch.profiler.profile() as profile,
        ):
            outputs[bf16_route] = prefill(model, LONG).float()
        counts = {e.key: e.count for e in profile.key_averages()}
        # Without bfloat16 matrix instructions the prompt's layers run in C++, which calls the kernel itself.
        calls[bf16_route] = counts.get("decodekit::prefill_attention", 0) + counts.get("decodekit::prompt_layer_end", 0)
    assert calls == {"kernel": model.config.num_hidden_layers, "sdpa": 0}
    assert float((outputs["kernel"] - outputs["sdpa"]).norm() / outputs["sdpa"].norm()) < 2e-2


@BF16_KERNEL
def test_a_bfloat16_model_takes_the_bfloat16_kernel_where_chosen_in_prompts_and_batch_chunks(tmp_path):
    # head_dim 32 (2 heads of 64): the bfloat16 products' tiles. Forced, every layer's prompt attention and every
    # prompt chunk of continuous batching calls the bfloat16 operator (the Python layers run it); its logits agree
    # with SDPA's to bfloat16's rounding, and greedy continuations of both prompts are the same tokens.
    model = tiny_model(tmp_path, num_attention_heads=2, num_key_value_heads=1).to(torch.bfloat16)
    prompts = [LONG[0].tolist(), LONG[0, :25].tolist()]
    outputs, batches, calls = {}, {}, {}
    for route in ("sdpa", "bf16_kernel"):
        with choices.forced(prompt_attention_bfloat16_512=route), torch.profiler.profile() as profile:
            outputs[route] = prefill(model, LONG)
            batch = model.generate_batch(prompts, max_new_tokens=6, eos_token_id=None, progress_bar=False)
            batches[route] = [r.generated_tokens for r in batch.values()]
        calls[route] = sum(e.count for e in profile.key_averages() if e.key == "decodekit::prefill_attention")
    layers = model.config.num_hidden_layers
    assert calls == {"sdpa": 0, "bf16_kernel": 3 * layers}  # the prompt's layers, then both prompts' chunks
    with choices.forced(prompt_attention_bfloat16_512="bf16_kernel"), cpu.forced(avx512_bf16=False):
        unprobed = prefill(model, LONG)  # the probe forced off after the choice: the float32 kernel instead
    with choices.forced(prompt_attention_bfloat16_512="kernel"):
        assert torch.equal(unprobed, prefill(model, LONG)) and not torch.equal(unprobed, outputs["bf16_kernel"])
    assert float((outputs["bf16_kernel"] - outputs["sdpa"]).norm() / outputs["sdpa"].norm()) < 2e-2
    assert batches["bf16_kernel"] == batches["sdpa"]


# float32 within float32's rounding; bfloat16 computed in float32 and rounded once, the library rounding after each
# operation: within two of bfloat16's last bits.
TOLERANCE = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2 * 2**-8, atol=2 * 2**-8)}


@pytest.mark.parametrize("shape", [(40, 576), (3, 17, 100), (20, 8)])
def test_bfloat16_passes_are_the_float32_ones_rounded_once(shape):
    # A bfloat16 tensor in, the same tensor in: each kernel computes in float32 and rounds its result as torch does
    # (widths that are not a multiple of 8 end on the scalar tail).
    generator = torch.Generator().manual_seed(sum(shape))
    x, weight = (
        torch.randn(*shape, generator=generator).bfloat16() * 3,
        torch.randn(shape[-1], generator=generator).bfloat16(),
    )
    with torch.inference_mode():
        pairs = [
            (
                torch.ops.decodekit.rms_norm(x, weight, 1e-5),
                torch.ops.decodekit.rms_norm(x.float(), weight.float(), 1e-5),
            ),
            (torch.ops.decodekit.silu_mul(x), torch.ops.decodekit.silu_mul(x.float())),
        ]
        if shape[-1] % 2 == 0:
            q = x.reshape(1, -1, shape[-2], shape[-1])
            cos, sin = (torch.randn(1, 1, shape[-2], shape[-1], generator=generator).bfloat16() for _ in range(2))
            pairs.append(
                (
                    torch.ops.decodekit.rotary(q, cos, sin),
                    torch.ops.decodekit.rotary(q.float(), cos.float(), sin.float()),
                )
            )
    for got, wide in pairs:
        assert got.dtype == torch.bfloat16 and wide.dtype == torch.float32
        assert torch.equal(got.view(torch.int16), wide.bfloat16().view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(40, 576), (3, 17, 100), (20, 8)])
def test_fused_norm_and_silu_equal_the_library_passes(shape, dtype):
    # One pass each where the library makes several; widths that are not a multiple of 8 take the scalar tail.
    from decodekit.kernels import elementwise

    generator = torch.Generator().manual_seed(sum(shape))
    x, weight = (
        torch.randn(*shape, generator=generator).to(dtype) * 3,
        torch.randn(shape[-1], generator=generator).to(dtype),
    )
    want = weight * torch.nn.functional.rms_norm(x.float(), (shape[-1],), eps=1e-5).to(dtype)  # as llama.RMSNorm
    got = elementwise.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    few = x.reshape(-1, shape[-1])[:1]  # an eager decode step's row: the kernel's in float32, the library's in bfloat16
    if dtype == torch.float32:
        torch.testing.assert_close(
            elementwise.rms_norm(few, weight, 1e-5), want.reshape(-1, shape[-1])[:1], **TOLERANCE[dtype]
        )
    else:
        assert elementwise.rms_norm(few, weight, 1e-5) is None and elementwise.silu_mul(few) is None
    x[..., 0] = -200.0  # far below exp's range: silu is 0 there, not NaN
    gate, up = x.split(shape[-1] // 2, dim=-1)
    torch.testing.assert_close(elementwise.silu_mul(x), torch.nn.functional.silu(gate) * up, **TOLERANCE[dtype])
    assert (
        elementwise.rms_norm(x.half(), weight.half(), 1e-5) is None
        and elementwise.rms_norm(x, weight.double(), 1e-5) is None
    )
    with pytest.raises(RuntimeError, match="rms_norm: rows \\[..., D\\] and weight \\[D\\]"):
        torch.ops.decodekit.rms_norm(x, weight[:-1], 1e-5)
    with pytest.raises(RuntimeError, match="silu_mul: rows \\[..., 2 \\* I\\]"):
        torch.ops.decodekit.silu_mul(torch.randn(20, 7))
    with pytest.raises(RuntimeError, match="rotary: float32 or bfloat16 tensors expected"):
        torch.ops.decodekit.rotary(*(torch.randn(1, 2, 20, 8).half() for _ in range(3)))
    with pytest.raises(RuntimeError, match="rms_norm: tensors of one dtype expected"):
        torch.ops.decodekit.rms_norm(x.float(), weight.bfloat16(), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch, heads, tokens, dim, table_rows", [(1, 9, 40, 64, 1), (2, 3, 20, 64, 2), (1, 4, 30, 10, 1)]
)
def test_fused_rotary_equals_rotate_half_on_the_strided_split_of_qkv(batch, heads, tokens, dim, table_rows, dtype):
    from decodekit.families.rope import apply_rotary
    from decodekit.kernels import elementwise

    generator = torch.Generator().manual_seed(tokens + dim)
    qkv = torch.randn(batch, tokens, 2 * heads * dim, generator=generator).to(dtype)
    x = qkv[..., : heads * dim].view(batch, tokens, heads, dim).transpose(1, 2)  # as Attention.forward passes q
    cos, sin = (torch.randn(table_rows, 1, tokens, dim, generator=generator).to(dtype) for _ in range(2))
    half = dim // 2
    wide, cos32, sin32 = x.float(), cos.float(), sin.float()  # bfloat16: rounded once (the library rounds three
    want = (wide * cos32 + torch.cat((-wide[..., half:], wide[..., :half]), dim=-1) * sin32).to(dtype)  # times)
    got = elementwise.rotary(x, cos, sin)
    assert got is not None and got.is_contiguous() and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    torch.testing.assert_close(apply_rotary(x, cos, sin), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_with_the_fused_passes_gives_the_library_passes_logits_and_tokens(tmp_path, monkeypatch, dtype):
    from decodekit.families import llama
    from decodekit.kernels import elementwise

    monkeypatch.setattr(llama, "NATIVE_LAYERS", False)  # the Python layers' passes (the C++ layers: test_prompt_layers)
    model = tiny_model(tmp_path, "qwen3").to(dtype)  # q/k norms too (strided: those keep the library's passes)
    ran = []

    def spy(fn):
        def call(*args):
            out = fn(*args)
            ran.append((fn.__name__, out is not None))
            return out

        return call

    for name in ("rms_norm", "silu_mul", "rotary"):
        monkeypatch.setattr(elementwise, name, spy(getattr(elementwise, name)))
    fused = (prefill(model, LONG), model.generate(LONG, max_new_tokens=8, eos_token_id=None))
    assert {name for name, done in ran if done} == {"rms_norm", "silu_mul", "rotary"}
    for name in ("rms_norm", "silu_mul", "rotary"):
        monkeypatch.setattr(elementwise, name, lambda *args: None)
    plain = (prefill(model, LONG), model.generate(LONG, max_new_tokens=8, eos_token_id=None))
    if dtype == torch.float32:
        assert float((fused[0] - plain[0]).norm() / plain[0].norm()) < 1e-5
        assert torch.equal(fused[1], plain[1])
    else:  # rounded once instead of after each operation: the logits move by about bfloat16's precision, no more
        assert float((fused[0] - plain[0]).norm() / plain[0].norm()) < 2e-2
