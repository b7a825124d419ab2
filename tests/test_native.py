"""decodekit's own one-row kernels (models/native.py, cpu_kernels.cpp): results, errors, build cache, fallback."""

import logging
import shutil

import pytest
import torch

from decodekit.models import native
from decodekit.models.linear import Linear
from decodekit.models.quantize import Int8Linear

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not torch.backends.cpu.get_cpu_capability().startswith("AVX"),
    reason="the kernels need g++ and an x86 CPU with AVX2 (CI and the bench machine have both)")


@pytest.fixture(scope="module", autouse=True)
def loaded():
    assert native.load(), "the kernels should build and load where g++ and AVX2 are present"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [576, 112, 40, 13])  # whole blocks of 32, a tail of 8s, a scalar tail
def test_row_product_equals_the_float64_product(dtype, width):
    torch.manual_seed(width)
    weight = torch.randn(77, width).to(dtype)
    for rows in range(1, 9):  # one loop for one row, one instantiation for each of 2 to 8
        x = torch.randn(rows, width)
        got = torch.ops.decodekit.row_product(x, weight)
        assert got.dtype == torch.float32 and got.shape == (rows, 77)
        torch.testing.assert_close(got.double(), x.double() @ weight.double().t(), rtol=1e-5, atol=1e-5 * width**0.5)


@pytest.mark.parametrize("width", [576, 64, 1536])
def test_row_product_int8_reads_the_interleaved_layout(width):
    torch.manual_seed(width)
    layer = Int8Linear(torch.nn.Linear(width, 45, bias=False))
    for rows in range(1, 9):
        x = torch.randn(rows, width)
        got = torch.ops.decodekit.row_product_int8(x, layer.weight_int8) * layer.scales
        expected = x.double() @ layer.dequantized().double().t()
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_bad_operands_are_refused_with_the_reason():
    row = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="weight must be float32 or bfloat16"):
        torch.ops.decodekit.row_product(row, torch.ones(8, 64, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="rows have 64 values, weight rows 32"):
        torch.ops.decodekit.row_product(row, torch.ones(8, 32))
    with pytest.raises(RuntimeError, match=r"rows must be a contiguous float32 \[rows, in\] matrix"):
        torch.ops.decodekit.row_product(row.double(), torch.ones(8, 64))
    for rows in (0, 9):
        with pytest.raises(RuntimeError, match=f"takes 1 to 8 rows, not {rows}"):
            torch.ops.decodekit.row_product(torch.randn(rows, 64), torch.ones(8, 64))
    with pytest.raises(RuntimeError, match="multiple of 32, not 40"):
        torch.ops.decodekit.row_product_int8(torch.randn(1, 40), torch.ones(8, 40, dtype=torch.int8))


def graph_targets(module, x):
    seen = []

    def backend(gm, inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=backend, fullgraph=True)(x)
    return seen


def test_compiled_products_call_the_kernels_only_where_they_apply(monkeypatch):
    bf16 = Linear(64, 32, bias=False).to(torch.bfloat16)
    assert "decodekit.row_product" in graph_targets(bf16, torch.randn(1, 64, dtype=torch.bfloat16))
    int8 = Int8Linear(torch.nn.Linear(64, 32))
    assert "decodekit.row_product_int8" in graph_targets(int8, torch.randn(1, 64))
    narrow = Int8Linear(torch.nn.Linear(112, 32))  # interleaved, but not in whole 32-byte blocks
    assert "decodekit.row_product_int8" not in graph_targets(narrow, torch.randn(1, 112))
    assert "decodekit.row_product" in graph_targets(bf16, torch.randn(8, 64, dtype=torch.bfloat16))
    assert "decodekit.row_product" not in graph_targets(bf16, torch.randn(9, 64, dtype=torch.bfloat16))
    monkeypatch.setattr(native, "_loaded", False)
    assert "decodekit.row_product" not in graph_targets(bf16, torch.randn(1, 64, dtype=torch.bfloat16))


def test_the_build_is_cached_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path))
    first = native._built_library()
    stamp = first.stat().st_mtime_ns
    assert native._built_library() == first and first.stat().st_mtime_ns == stamp  # not built again
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # the scratch directory is gone


def test_without_a_working_compiler_the_step_keeps_inductors_loops(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.INFO, logger="decodekit"):
        assert native.load() is False and native.load() is False
    assert caplog.text.count("the compiled step uses inductor's row products (building or loading") == 1
    assert not native.loaded() and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setenv("DECODEKIT_NATIVE_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="decodekit"):
        assert native.load() is False
    assert "(DECODEKIT_NATIVE_KERNELS=0)" in caplog.text


def test_eager_products_of_up_to_8_rows_go_through_the_kernels_too():
    bf16, int8 = Linear(64, 32).to(torch.bfloat16), Int8Linear(torch.nn.Linear(64, 32))
    with torch.profiler.profile() as profile:
        bf16(torch.randn(1, 1, 64, dtype=torch.bfloat16))  # a decode step's row
        bf16(torch.randn(2, 4, 64, dtype=torch.bfloat16))  # a short prompt
        bf16(torch.randn(9, 64, dtype=torch.bfloat16))  # more rows: the library's matmul
        int8(torch.randn(1, 64))
        int8(torch.randn(3, 64))
        int8(torch.randn(12, 64))
    calls = {e.key: e.count for e in profile.key_averages()}
    assert calls.get("decodekit::row_product") == 2 and calls.get("decodekit::row_product_int8") == 2
    assert calls.get("aten::_weight_int8pack_mm") == 1
