"""decodekit's own CPU kernels (kernels/native.py, kernels/csrc/): products of a few rows and the decoder layer
stack of fixed-shape decode steps; results, errors, build cache, fallback."""

import logging
import shutil

import pytest
import torch

from decodekit.families.cache import StaticCache
from decodekit.families import llama
from decodekit.kernels import choices, native
from decodekit.kernels.linear import Linear
from decodekit.kernels.packed import plain_weights
from decodekit.kernels.quantize import Int8Linear, quantize
from decodekit.testing import tiny_model

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not torch.backends.cpu.get_cpu_capability().startswith("AVX"),
    reason="the kernels need g++ and an x86 CPU with AVX2 (CI and the bench machine have both)",
)


@pytest.fixture(scope="module", autouse=True)
def loaded():
    assert native.load(), "the kernels should build and load where g++ and AVX2 are present"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [576, 112, 40, 13])  # whole blocks of 32, a tail of 8s, a scalar tail
def test_row_product_equals_the_float64_product(dtype, width):
    torch.manual_seed(width)
    weight = torch.randn(77, width).to(dtype)
    for rows in range(1, 17):  # one loop for one row, one instantiation for each of 2 to 8, then two passes
        x = torch.randn(rows, width)
        got = torch.ops.decodekit.row_product(x, weight)
        assert got.dtype == torch.float32 and got.shape == (rows, 77)
        torch.testing.assert_close(got.double(), x.double() @ weight.double().t(), rtol=1e-5, atol=1e-5 * width**0.5)


@pytest.mark.parametrize("width", [576, 64, 1536])
def test_row_product_int8_reads_the_interleaved_layout(width):
    torch.manual_seed(width)
    layer = Int8Linear(torch.nn.Linear(width, 45, bias=False))
    for rows in range(1, 17):
        x = torch.randn(rows, width)
        got = torch.ops.decodekit.row_product_int8(x, layer.weight_int8) * layer.scales
        expected = x.double() @ layer.dequantized().double().t()
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_bad_operands_are_refused_with_the_reason():
    row = torch.randn(1, 64)
    with pytest.raises(
        RuntimeError, match=r"weight must be float32, bfloat16 or blocks \(uint8: 4-bit, int16: 8-bit\), not Half"
    ):
        torch.ops.decodekit.row_product(row, torch.ones(8, 64, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="rows have 64 values, weight rows 32"):
        torch.ops.decodekit.row_product(row, torch.ones(8, 32))
    with pytest.raises(RuntimeError, match=r"rows must be a contiguous float32 \[rows, in\] matrix"):
        torch.ops.decodekit.row_product(row.double(), torch.ones(8, 64))
    for rows in (0, 17):
        with pytest.raises(RuntimeError, match=f"takes 1 to 16 rows, not {rows}"):
            torch.ops.decodekit.row_product(torch.randn(rows, 64), torch.ones(8, 64))
    with pytest.raises(RuntimeError, match="multiple of 32, not 40"):
        torch.ops.decodekit.row_product_int8(torch.randn(1, 40), torch.ones(8, 40, dtype=torch.int8))


def graph_targets(module, x):
    seen = []

    def backend(gm, inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():  # decode steps run without autograd; with it the kernels (no backward) are not used
        torch.compile(module, backend=backend, fullgraph=True)(x)
    return seen


def test_compiled_products_call_the_kernels_only_where_they_apply(monkeypatch):
    bf16 = Linear(64, 32, bias=False).to(torch.bfloat16)
    assert "decodekit.row_product" in graph_targets(bf16, torch.randn(1, 64, dtype=torch.bfloat16))
    int8 = Int8Linear(torch.nn.Linear(64, 32))
    assert "decodekit.row_product_int8" in graph_targets(int8, torch.randn(1, 64))
    narrow = Int8Linear(torch.nn.Linear(112, 32))  # interleaved, but not in whole 32-byte blocks
    assert "decodekit.row_product_int8" not in graph_targets(narrow, torch.randn(1, 112))
    assert "decodekit.row_product" in graph_targets(bf16, torch.randn(16, 64, dtype=torch.bfloat16))
    assert "decodekit.row_product" not in graph_targets(bf16, torch.randn(17, 64, dtype=torch.bfloat16))
    monkeypatch.setattr(native, "_loaded", False)
    assert "decodekit.row_product" not in graph_targets(bf16, torch.randn(1, 64, dtype=torch.bfloat16))


def test_the_kernels_build_and_load_wherever_they_can():
    # A C++ source that no longer compiles would otherwise only turn the kernels off, and their tests skip.
    if native._unusable_reason() is not None:
        pytest.skip(f"the kernels cannot be built here: {native._unusable_reason()}")
    assert native.load() is True and native.loaded()


def test_the_build_is_cached_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    # A stand-in compiler that writes its output in two parts: what is checked is the cache and the rename into place
    # (the real build is the test above's, once per machine).
    compiler = tmp_path / "cxx"
    compiler.write_text(
        '#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\nprintf half > "$2"\nsleep 0.1\nprintf whole >> "$2"\n'
    )
    compiler.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(cache))
    first = native._built_library()
    stamp = first.stat().st_mtime_ns
    assert first.read_text() == "halfwhole"
    assert native._built_library() == first and first.stat().st_mtime_ns == stamp  # not built again
    assert [p.name for p in cache.iterdir()] == [first.name]  # the scratch directory is gone


def test_without_a_working_compiler_the_step_keeps_inductors_loops(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.INFO, logger="decodekit"):
        assert native.load() is False and native.load() is False
    assert (
        caplog.text.count(
            "no C++ kernels, compiled steps run the Python layers with inductor's products (building or loading"
        )
        == 1
    )
    assert not native.loaded() and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setenv("DECODEKIT_NATIVE_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="decodekit"):
        assert native.load() is False
    assert "(DECODEKIT_NATIVE_KERNELS=0)" in caplog.text


def test_eager_products_of_up_to_16_rows_go_through_the_kernels_too():
    bf16, int8 = Linear(64, 32).to(torch.bfloat16), Int8Linear(torch.nn.Linear(64, 32))
    with torch.profiler.profile() as profile, torch.no_grad():
        bf16(torch.randn(1, 1, 64, dtype=torch.bfloat16))  # a decode step's row
        bf16(torch.randn(2, 4, 64, dtype=torch.bfloat16))  # a short prompt
        bf16(torch.randn(17, 64, dtype=torch.bfloat16))  # more rows: the library's matmul
        int8(torch.randn(1, 64))
        int8(torch.randn(3, 64))
        with choices.forced(int8_many_rows="int8pack"):  # more rows: the route measured for the CPU, here forced
            int8(torch.randn(20, 64))
        with choices.forced(int8_many_rows="int8_split"):
            int8(torch.randn(20, 64))
    calls = {e.key: e.count for e in profile.key_averages()}
    assert calls.get("decodekit::row_product") == 2 and calls.get("decodekit::row_product_int8") == 2
    assert calls.get("aten::_weight_int8pack_mm") == 1 and calls.get("aten::_int_mm") == 1
    assert calls.get("decodekit::split_product") == 1


def test_with_autograd_recording_products_keep_the_library_kernels_and_have_gradients():
    layer = Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(1, 64, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()  # the kernels have no backward: F.linear ran
    torch.testing.assert_close(x.grad.float(), layer.weight.float().sum(0, keepdim=True), rtol=1e-2, atol=1e-2)


# ---- decodekit::decode_layers: the layer stack of a fixed-shape decode step ----


def fixed_step(model, native_layers, monkeypatch, rows=1, prompt=12, pad=0, seed=0, reorder=None, shared=False):
    """Prefills a StaticCache through the Python layers, then runs one fixed-shape step (the compiled step's
    forward) with the C++ stack or the Python layers; returns (logits, cache). `reorder`: row indices the
    cache is reordered by before the step, by copying or, with `shared`, through its shared rows."""
    monkeypatch.setattr(llama, "NATIVE_LAYERS", native_layers)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 90, (rows, prompt), generator=g)
    attention = torch.ones(rows, prompt, dtype=torch.long)
    attention[1:, :pad] = 0  # left padding on every row but the first
    cache = StaticCache.for_model(model, rows, 32)
    mask = torch.zeros(rows, 32, dtype=torch.long)
    mask[:, : prompt + 1] = 1
    mask[:, :prompt] = attention
    with torch.no_grad():
        model(ids, attention_mask=attention, past_key_values=cache, use_cache=True)
        if shared:
            cache.share_rows()
        if reorder is not None:
            cache.reorder(torch.tensor(reorder))
        out = model(
            torch.randint(3, 90, (rows, 1), generator=g),
            attention_mask=mask,
            position_ids=attention.sum(-1, keepdim=True),
            past_key_values=cache,
            cache_position=torch.tensor([prompt]),
            logits_to_keep=1,
        )
    return out.logits, cache


def stack_calls(model, monkeypatch, **step):
    with torch.profiler.profile() as profile:
        fixed_step(model, True, monkeypatch, **step)
    return {e.key: e.count for e in profile.key_averages()}.get("decodekit::decode_layers", 0)


# llama; qwen2: q/k/v biases; qwen3: q/k norms and head_dim 24 != hidden/heads; mistral: a window of 8 slots
# that a 12-token prompt overflows.
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("rows,pad", [(1, 0), (3, 5), (12, 5)])  # 12: two passes of the row products
def test_the_float32_stack_equals_the_python_layers(tmp_path, monkeypatch, model_type, rows, pad):
    model = tiny_model(tmp_path, model_type)
    with plain_weights(model):  # float32 weights packed for oneDNN are not the stack's
        expected, python_cache = fixed_step(model, False, monkeypatch, rows, pad=pad)
        got, cache = fixed_step(model, True, monkeypatch, rows, pad=pad)
        assert stack_calls(model, monkeypatch, rows=rows, pad=pad) == 1
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)
    for mine, theirs in zip(cache.keys + cache.values, python_cache.keys + python_cache.values):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stack_reads_a_shared_rows_cache_as_the_python_layers_read_a_reordered_one(tmp_path, monkeypatch, dtype):
    # Compiled beam search reorders its cache by permuting `rows` (StaticCache.share_rows), not the buffers.
    model = tiny_model(tmp_path, "qwen3").to(dtype)
    with plain_weights(model):
        expected, copied = fixed_step(model, False, monkeypatch, 3, pad=5, reorder=[2, 0, 0])
        python, _ = fixed_step(model, False, monkeypatch, 3, pad=5, reorder=[2, 0, 0], shared=True)
        got, cache = fixed_step(model, True, monkeypatch, 3, pad=5, reorder=[2, 0, 0], shared=True)
        assert stack_calls(model, monkeypatch, rows=3, pad=5, reorder=[2, 0, 0], shared=True) == 1
    assert torch.equal(python, expected)
    torch.testing.assert_close(
        got, expected, rtol=1e-5, atol=2e-5
    ) if dtype == torch.float32 else torch.testing.assert_close(got.float(), expected.float(), rtol=0.05, atol=0.05)
    assert cache.rows[:, :12].tolist() == [[2] * 12, [0] * 12, [0] * 12] and cache.rows[:, 12].tolist() == [0, 1, 2]
    for layer in range(len(model.layers)):  # each row's view of the cache: the reordered prompt, then its own new entry
        seen, reordered = cache._shared(cache.keys[layer], 13), copied.keys[layer][:, :, :13]
        assert torch.equal(seen[:, :, :12], reordered[:, :, :12])
        torch.testing.assert_close(
            seen.float(), reordered.float(), rtol=0.02, atol=2e-5 if dtype == torch.float32 else 0.05
        )


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_the_bfloat16_stack_is_as_close_to_float32_as_the_python_layers(tmp_path, monkeypatch, model_type):
    model = tiny_model(tmp_path, model_type)
    with plain_weights(model):
        reference, _ = fixed_step(model, False, monkeypatch, 3, pad=5)
    bf16 = tiny_model(tmp_path, model_type).to(torch.bfloat16)
    # Plain weights, as a compiled step of few rows holds them: on CPUs with oneDNN bf16 (AVX512-BF16, AMX) an
    # eager forward would pack them, and the stack reads only plain ones.
    with plain_weights(bf16):
        assert stack_calls(bf16, monkeypatch, rows=3, pad=5) == 1
        stack_error = (fixed_step(bf16, True, monkeypatch, 3, pad=5)[0].float() - reference).abs().max()
        python_error = (fixed_step(bf16, False, monkeypatch, 3, pad=5)[0].float() - reference).abs().max()
    assert stack_error <= 2 * python_error and stack_error < 0.2, (stack_error, python_error)


def test_the_int8_stack_equals_the_python_layers(tmp_path, monkeypatch):
    model = quantize(tiny_model(tmp_path, "llama", intermediate_size=128), "int8")  # widths of whole 32-byte blocks
    assert stack_calls(model, monkeypatch, rows=2, pad=3) == 1
    expected, _ = fixed_step(model, False, monkeypatch, 2, pad=3)
    torch.testing.assert_close(fixed_step(model, True, monkeypatch, 2, pad=3)[0], expected, rtol=1e-5, atol=1e-5)
    narrow = quantize(tiny_model(tmp_path / "narrow", "llama"), "int8")  # intermediate 112: not interleaved in 32s
    assert narrow.layers[0].native_operands() is None and stack_calls(narrow, monkeypatch) == 0


def test_the_stack_refuses_bad_operands_with_the_reason(tmp_path):
    model = tiny_model(tmp_path, "llama")
    with plain_weights(model), torch.no_grad():
        handle = model.bind_native_layers()
    assert handle is not None
    layers = len(model.layers)
    cache = StaticCache.for_model(model, 1, 16)
    x, cos, mask = torch.randn(1, 64), torch.randn(1, 16), torch.ones(1, 16, dtype=torch.bool)

    def call(x=x, slots=torch.tensor([3]), mask=mask, keys=cache.keys, values=cache.values, handle=handle):
        masks = [mask] * len(keys)
        return torch.ops.decodekit.decode_layers(x, cos, cos, slots, masks, keys, values, handle, 4, 2, 1e-6)

    assert call().shape == (1, 64)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        call(x=x.double())
    with pytest.raises(RuntimeError, match="slot 16 is outside the cache of 16 slots"):
        call(slots=torch.tensor([16]))
    with pytest.raises(RuntimeError, match="every mask must be a contiguous boolean"):
        call(mask=mask.long())
    with pytest.raises(RuntimeError, match=r"every cache must be a contiguous \[1, 2, 16, 16\]"):
        call(keys=[k.transpose(2, 3) for k in cache.keys])
    with pytest.raises(RuntimeError, match=f"a mask, a key and a value cache for each of the {layers} layers"):
        call(keys=cache.keys[:1], values=cache.values[:1])
    with pytest.raises(RuntimeError, match="no weights are bound to handle -5"):
        call(handle=-5)
    masks = [mask] * layers
    for rows, why in (
        (torch.zeros(1, 16, dtype=torch.int32), r"rows must be a contiguous int64 \[1, 16\]"),
        (torch.zeros(2, 16, dtype=torch.long), r"rows must be a contiguous int64 \[1, 16\]"),
        (torch.ones(1, 16, dtype=torch.long), r"rows must hold row indices in \[0, 1\)"),
    ):
        with pytest.raises(RuntimeError, match=why):
            torch.ops.decodekit.decode_layers(
                x, cos, cos, torch.tensor([3]), masks, cache.keys, cache.values, handle, 4, 2, 1e-6, rows
            )
    weights, scales, biases, norms = model.layers[0].native_operands()
    other = native.weights_handle(model)
    one_layer = dict(keys=cache.keys[:1], values=cache.values[:1], handle=other)
    torch.ops.decodekit.bind_weights(other, [weights[1], *weights[1:]], scales, biases, norms)
    with pytest.raises(RuntimeError, match=r"a weight is \[64, 64\] where \[128, 64\] was expected"):
        call(**one_layer)
    torch.ops.decodekit.bind_weights(other, weights, [torch.ones(128), *scales[1:]], biases, norms)
    with pytest.raises(RuntimeError, match="int8 weights, and only they, come with scales"):
        call(**one_layer)
    with pytest.raises(RuntimeError, match="4 weights, scales and biases"):
        torch.ops.decodekit.bind_weights(other, weights[:3], scales[:3], biases[:3], norms[:3])
    native.unbind(other)
    with pytest.raises(RuntimeError, match=f"no weights are bound to handle {other}"):
        call(**one_layer)
    model.to(torch.bfloat16)  # new weights: the old binding is released
    with pytest.raises(RuntimeError, match=f"no weights are bound to handle {handle}"):
        call()
