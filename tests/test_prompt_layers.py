"""The C++ prompt layers (llama.LlamaForCausalLM._prompt_layers: decodekit::prompt_layer_start / prompt_layer_end, and
prompt_layer_finish in continuous batching's steps): the same bits as the Python layers for every product route and
model variant, taken only where they apply, and their refusals. Which route this machine would pick is never assumed: each is forced in turn."""

import pytest
import torch

from decodekit.batching.paged import PagedBatch, PagedCache, Segment
from decodekit.families import llama
from decodekit.families.cache import DynamicCache, StaticCache
from decodekit.kernels import choices, cpu, native
from decodekit.kernels.linear import mkl_packing, onednn_packing
from decodekit.kernels.quantize import int_mm_exact, quantize
from decodekit.testing import tiny_model

pytestmark = pytest.mark.skipif(not native.load(), reason="decodekit's C++ kernels do not build on this machine")

PROMPT = torch.arange(3, 3 + 100)[None] % 90 + 3  # 100 tokens: the class of prompts up to 256 rows
MORE = torch.arange(5, 5 + 30)[None] % 90 + 3  # a second prompt after the first, over its cache (masked: Python layers)
ROUTES = [
    "library",
    "tiles",
    "blocks",
    pytest.param("wide_blocks", marks=pytest.mark.skipif(not cpu.has("avx512f"), reason="needs avx512f")),
    pytest.param("packed", marks=pytest.mark.skipif(not mkl_packing(), reason="this torch has no MKL packing")),
    pytest.param("onednn", marks=pytest.mark.skipif(not onednn_packing(), reason="this torch has no oneDNN")),
]
COPIES = ("packed", "onednn", "float32_copy")  # the routes decided over the one chosen among the others


def pinned(route: str, dtype: str = "float32") -> dict:
    """choices.forced settings that send every prompt product of 100 rows by weights of `dtype` by `route` and
    attention to decodekit's kernel (oneDNN's packed layers, packed.py, would take the products otherwise)."""
    pins = {f"eager_weights_{dtype}": "plain", f"prompt_attention_{dtype}_512": "kernel", "float32_rows_128": "blocks"}
    if route in COPIES:  # a float32 copy multiplied by float32's route, pinned to blocks
        return {**pins, f"{dtype}_rows_128": "library", f"{dtype}_packed_rows_128": route}
    return {**pins, f"{dtype}_rows_128": route, f"{dtype}_packed_rows_128": route}


INT8_ROUTES = [
    pytest.param("int8_split", marks=pytest.mark.skipif(not int_mm_exact(), reason="torch._int_mm is not exact here")),
    "tiles",
    pytest.param("packed", marks=pytest.mark.skipif(not mkl_packing(), reason="this torch has no MKL packing")),
    pytest.param("onednn", marks=pytest.mark.skipif(not onednn_packing(), reason="this torch has no oneDNN")),
    "float32_copy",
]


def pinned_int8(route: str) -> dict:
    """choices.forced settings that send an int8 model's prompt products of 100 rows by `route` and its attention
    to decodekit's float32 kernel (its own choice where the CPU has AVX512-BF16, the float32 one elsewhere)."""
    pins = {
        "prompt_attention_float32_512": "kernel",
        "prompt_attention_int8_512": "kernel",
        "float32_rows_128": "blocks",
    }
    if route in COPIES:
        return {**pins, "int8_many_rows": "tiles", "int8_packed_rows_128": route}
    return {**pins, "int8_many_rows": route, "int8_packed_rows_128": route}


def run(model, native_layers: bool, monkeypatch, cache_kind="dynamic"):
    """Logits of PROMPT then MORE over the same cache, the cache, and how many prompt layer calls ran."""
    monkeypatch.setattr(llama, "NATIVE_LAYERS", native_layers)
    cache = DynamicCache() if cache_kind == "dynamic" else StaticCache.for_model(model, 1, 160)
    with torch.inference_mode(), torch.profiler.profile() as profile:
        first = model(PROMPT, past_key_values=cache).logits
        second = model(MORE, past_key_values=cache).logits
    calls = {e.key: e.count for e in profile.key_averages()}
    return (first, second, cache), calls.get("decodekit::prompt_layer_end", 0)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_prompt_layers_give_the_python_layers_bits(tmp_path, monkeypatch, model_type, route):
    # qwen2: q/k/v biases; qwen3: q/k norms and a head_dim that is not hidden / heads.
    model = tiny_model(tmp_path, model_type)
    with choices.forced(**pinned(route)):
        (first, second, cache), calls = run(model, True, monkeypatch)
        (first_py, second_py, cache_py), calls_py = run(model, False, monkeypatch)
    assert calls == model.config.num_hidden_layers and calls_py == 0
    assert torch.equal(first, first_py) and torch.equal(second, second_py)
    for mine, theirs in zip(cache.keys + cache.values, cache_py.keys + cache_py.values):
        assert mine.shape == theirs.shape == (1, model.config.num_key_value_heads, 130, model.config.head_dim)
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("route", [*ROUTES, "float32_copy"])
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_prompt_layers_give_a_bfloat16_models_bits_where_its_products_run_in_float32(
    tmp_path, monkeypatch, model_type, route
):
    # On a CPU without bfloat16 matrix instructions (forced here) a bfloat16 model's prompt products run in float32
    # and its values are rounded to bfloat16 where the model stores them: the C++ layers round at the same places.
    # qwen2: bfloat16 q/k/v biases, added in float32; qwen3: q/k norms.
    model = tiny_model(tmp_path, model_type).to(torch.bfloat16)
    with choices.forced(**pinned(route, "bfloat16")), cpu.forced(onednn_bf16=False):
        (first, second, cache), calls = run(model, True, monkeypatch)
        (first_py, second_py, cache_py), _ = run(model, False, monkeypatch)
    assert calls == model.config.num_hidden_layers
    assert first.dtype == torch.bfloat16 and torch.equal(first, first_py) and torch.equal(second, second_py)
    assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, cache_py.keys + cache_py.values))


@pytest.mark.parametrize("route", INT8_ROUTES)
# Every weight's columns stored interleaved in groups of 32, or some in groups of 4 only (tiles: Python layers).
@pytest.mark.parametrize("width, inner", [(64, 128), (72, 112)])
def test_prompt_layers_give_an_int8_models_bits(tmp_path, monkeypatch, route, width, inner):
    model = quantize(tiny_model(tmp_path, "qwen2", hidden_size=width, intermediate_size=inner), "int8")  # q/k/v biases
    with choices.forced(**pinned_int8(route)):
        (first, second, cache), calls = run(model, True, monkeypatch)
        (first_py, second_py, cache_py), _ = run(model, False, monkeypatch)
    # Tiles of a width that is not a multiple of 32 reorder the rows in Python first: those layers stay in Python.
    assert calls == (0 if route == "tiles" and width % 32 else model.config.num_hidden_layers)
    assert torch.equal(first, first_py) and torch.equal(second, second_py)
    assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, cache_py.keys + cache_py.values))


# The kernels an int8 model's float32 prompt attention may round in (attention.py), where the CPU has what they need.
ROUNDING_ATTENTION = [
    pytest.param(
        "bf16_kernel",
        torch.bfloat16,
        marks=pytest.mark.skipif(
            not cpu.has("avx512_bf16"), reason="the bfloat16 attention needs a CPU with avx512_bf16"
        ),
    ),
    pytest.param(
        "int8_kernel",
        torch.float32,
        marks=pytest.mark.skipif(not cpu.has("avx512_vnni"), reason="the int8 scores need a CPU with avx512_vnni"),
    ),
]


@pytest.mark.parametrize("route, operand", ROUNDING_ATTENTION)
def test_an_int8_models_prompt_attention_takes_a_rounding_kernel_where_chosen(tmp_path, monkeypatch, route, operand):
    # An int8 model's weights round far more than bfloat16 attention or int8 scores do (attention.py), so where the
    # CPU has AVX512-BF16 or AVX512-VNNI its float32 attention has a choice of its own: chosen, the kernel runs (its
    # q, k, v rounded to bfloat16 first, or float32 to the int8 kernel) in the C++ layers as in the Python ones and
    # in continuous batching's prompt chunks. A float32 model keeps the float32 choice. head_dim 32 (2 heads of 64):
    # the bfloat16 products' tiles.
    from decodekit.kernels import attention

    called = []
    rounding = getattr(attention, route)
    monkeypatch.setattr(attention, route, lambda q, *rest: called.append(q.dtype) or rounding(q, *rest))
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
    fp32 = tiny_model(tmp_path, "llama", **shape)
    model = quantize(tiny_model(tmp_path, "llama", **shape), "int8")
    layers, outputs = model.config.num_hidden_layers, {}
    for chosen in ("kernel", route):
        with choices.forced(**{**pinned_int8("tiles"), "prompt_attention_int8_512": chosen}):
            (first, second, cache), calls = run(model, True, monkeypatch)
            assert calls == (layers if chosen == "kernel" else 0)  # prompt_layer_end calls the float32 kernel
            assert called == ([] if chosen == "kernel" else [operand] * layers)
            (first_py, _, cache_py), _ = run(model, False, monkeypatch)
            assert torch.equal(first, first_py)
            assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, cache_py.keys + cache_py.values))
            called.clear()
            model.generate_batch([PROMPT[0].tolist()], max_new_tokens=1, progress_bar=False)
            assert len(called) == (0 if chosen == "kernel" else layers)  # the prompt's chunk
            called.clear()
            outputs[chosen] = first
            with torch.inference_mode():
                fp32(PROMPT)
            assert not called
    assert not torch.equal(outputs["kernel"], outputs[route])
    assert float((outputs[route] - outputs["kernel"]).norm() / outputs["kernel"].norm()) < 1e-2


def test_prompt_layers_fill_a_static_cache_as_the_python_layers_do(tmp_path, monkeypatch):
    model = tiny_model(tmp_path, "llama")
    with choices.forced(**pinned("library")):
        (first, second, cache), calls = run(model, True, monkeypatch, "static")
        (first_py, second_py, cache_py), _ = run(model, False, monkeypatch, "static")
    assert calls == model.config.num_hidden_layers
    assert torch.equal(first, first_py) and torch.equal(second, second_py)
    assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, cache_py.keys + cache_py.values))


def test_generate_through_the_prompt_layers_keeps_its_tokens_and_the_callers_embeddings(tmp_path, monkeypatch):
    model = tiny_model(tmp_path, "llama")
    embeds = model.get_input_embeddings()(PROMPT).detach()
    kept = embeds.clone()
    outputs = {}
    with choices.forced(**pinned("library")):
        for native_layers in (True, False):
            monkeypatch.setattr(llama, "NATIVE_LAYERS", native_layers)
            with torch.inference_mode():
                outputs[native_layers] = (
                    model.generate(PROMPT, max_new_tokens=6, eos_token_id=None),
                    model(inputs_embeds=embeds, use_cache=False).logits,
                )
    assert torch.equal(outputs[True][0], outputs[False][0])
    assert torch.equal(outputs[True][1], outputs[False][1])
    assert torch.equal(embeds, kept)  # the layers update a copy of the rows in place, never the caller's tensor


def batching_steps(model, native_layers: bool, monkeypatch):
    """Two continuous-batching steps over one paged cache: two prompt chunks (60 and 30 tokens), then the second
    prompt's last 25 tokens beside the first's first decode row. Each step's logits, the pools and how many
    prompt_layer_finish calls ran."""
    monkeypatch.setattr(llama, "NATIVE_LAYERS", native_layers)
    cache = PagedCache(model, num_blocks=16, block_size=16)
    cache.commit()
    first, second = cache.allocator.allocate(6), cache.allocator.allocate(6)
    steps = [
        ([first, second], [Segment(0, 60, 0, 0), Segment(60, 90, 1, 0)], PROMPT[:, :90], [59, 89]),
        ([second, first], [Segment(0, 25, 0, 30), Segment(25, 26, 1, 60)], MORE[:, :26], [24, 25]),
    ]
    logits = []
    with torch.inference_mode(), torch.profiler.profile() as profile:
        for tables, segments, ids, keep in steps:
            batch = PagedBatch(cache, tables, segments)
            logits.append(
                model(
                    ids, position_ids=batch.position_ids, past_key_values=batch, logits_to_keep=torch.tensor(keep)
                ).logits
            )
    calls = {e.key: e.count for e in profile.key_averages()}.get("decodekit::prompt_layer_finish", 0)
    return logits, cache.keys + cache.values, calls


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral"])
def test_continuous_batching_steps_through_the_prompt_layers_give_the_python_layers_bits(
    tmp_path, monkeypatch, model_type, route
):
    # A step of several requests' rows: each layer's attention runs between the C++ calls through PagedBatch.attend
    # (prompt chunks and a decode row; mistral: a sliding window shorter than the chunks).
    model = tiny_model(tmp_path, model_type)
    with choices.forced(**pinned(route)):
        logits, pools, calls = batching_steps(model, True, monkeypatch)
        logits_py, pools_py, calls_py = batching_steps(model, False, monkeypatch)
    assert calls == 2 * model.config.num_hidden_layers and calls_py == 0
    assert all(torch.equal(a, b) for a, b in zip(logits, logits_py))
    assert all(torch.equal(a, b) for a, b in zip(pools, pools_py))


def test_continuous_batching_steps_of_a_bfloat16_model_give_the_python_layers_bits(tmp_path, monkeypatch):
    model = tiny_model(tmp_path, "qwen2").to(torch.bfloat16)
    with choices.forced(**pinned("library", "bfloat16")), cpu.forced(onednn_bf16=False):
        logits, pools, calls = batching_steps(model, True, monkeypatch)
        logits_py, pools_py, _ = batching_steps(model, False, monkeypatch)
    assert calls == 2 * model.config.num_hidden_layers
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, b) for a, b in zip(logits, logits_py))
    assert all(torch.equal(a, b) for a, b in zip(pools, pools_py))


def layer_calls(model, call) -> int:
    with torch.profiler.profile() as profile:
        call()
    counts = {e.key: e.count for e in profile.key_averages()}
    return counts.get("decodekit::prompt_layer_end", 0) + counts.get("decodekit::prompt_layer_finish", 0)


def test_the_python_layers_run_where_the_prompt_layers_do_not_apply(tmp_path):
    model = tiny_model(tmp_path, "llama")
    padded = torch.ones(2, 100, dtype=torch.long)
    padded[1, :7] = 0

    def forward(ids=PROMPT, **kwargs):
        return lambda: model(ids, use_cache=False, **kwargs)

    with choices.forced(**pinned("library")):
        with torch.inference_mode():
            assert layer_calls(model, forward()) == model.config.num_hidden_layers  # they apply here
            assert layer_calls(model, forward(output_hidden_states=True)) == 0  # each layer's output is kept
            assert layer_calls(model, forward(PROMPT.expand(2, -1), attention_mask=padded)) == 0  # a mask
            assert layer_calls(model, forward(PROMPT[:, :16])) == 0  # as few rows as the few-row kernels take
            with choices.forced(prompt_attention_float32_512="sdpa"):  # SDPA measured faster here
                assert layer_calls(model, forward()) == 0
        if cpu.MACHINE["onednn_bf16"]:  # a bfloat16 model on a CPU with bf16 matrix instructions: the library's
            with torch.no_grad(), cpu.forced(onednn_bf16=True):  # bfloat16 products, in Python layers
                assert layer_calls(model.to(torch.bfloat16), forward()) == 0
            model.float()
        assert layer_calls(model, forward()) == 0  # autograd recording: the C++ layers have no backward
    cache = PagedCache(model, num_blocks=8, block_size=16)
    batch = PagedBatch(
        cache, [cache.allocator.allocate(1) for _ in range(5)], [Segment(i, i + 1, i, 3) for i in range(5)]
    )
    with choices.forced(**pinned("library")), torch.inference_mode():  # a step of five decode rows: few-row kernels
        assert (
            layer_calls(model, lambda: model(PROMPT[:, :5], position_ids=batch.position_ids, past_key_values=batch))
            == 0
        )
    window = tiny_model(tmp_path, "mistral")  # a sliding window shorter than the prompt: masks
    with choices.forced(**pinned("library")), torch.inference_mode():
        assert layer_calls(window, lambda: window(PROMPT, use_cache=False)) == 0


def test_prompt_layer_calls_refuse_what_they_do_not_take():
    x, norm = torch.randn(20, 8), torch.ones(8)
    weight, cos = torch.randn(24, 8), torch.ones(20, 4)
    start = torch.ops.decodekit.prompt_layer_start
    with pytest.raises(RuntimeError, match="a product route from 0 to 7 expected .* got 8"):
        start(x, norm, 1e-6, weight, 8, None, None, None, None, cos, cos, 2, 2)
    with pytest.raises(RuntimeError, match="got 23"):  # nor oneDNN's
        start(x, norm, 1e-6, weight, 7 + 16, None, None, None, None, cos, cos, 2, 2)
    with pytest.raises(RuntimeError, match="oneDNN's route takes a float32 weight"):
        start(x, norm, 1e-6, weight.bfloat16(), 7, None, None, None, None, cos, cos, 2, 2)
    with pytest.raises(RuntimeError, match="got 18"):  # interleaved columns are an int8 weight's
        start(x, norm, 1e-6, weight, 2 + 16, None, None, None, None, cos, cos, 2, 2)
    with pytest.raises(RuntimeError, match="scales go with an int8 weight's route"):
        start(x, norm, 1e-6, weight, 0, None, torch.ones(24), None, None, cos, cos, 2, 2)
    with pytest.raises(RuntimeError, match=r"a weight \[24, 8\] expected"):
        start(x, norm, 1e-6, weight[:20], 0, None, None, None, None, cos, cos, 2, 2)
    with pytest.raises(RuntimeError, match="contiguous float32 or bfloat16 rows"):
        start(x.double(), norm, 1e-6, weight, 0, None, None, None, None, cos, cos, 2, 2)
    with pytest.raises(RuntimeError, match=r"cos, sin \[T, head_dim\] \(head_dim even\) of the rows' dtype"):
        start(x, norm, 1e-6, weight, 0, None, None, None, None, cos[:5], cos[:5], 2, 2)
    with pytest.raises(RuntimeError, match="a norm weight \\[hidden\\] of the rows' dtype"):
        start(x.bfloat16(), norm, 1e-6, weight, 0, None, None, None, None, cos, cos, 2, 2)
    with pytest.raises(RuntimeError, match=r"a bias must be float32 \[24\]"):
        start(x, norm, 1e-6, weight, 0, torch.ones(3), None, None, None, cos, cos, 2, 2)
    q, k, v = start(x, norm, 1e-6, weight, 0, None, None, None, None, cos, cos, 2, 2)
    assert q.shape == k.shape == v.shape == (1, 2, 20, 4)
    end = torch.ops.decodekit.prompt_layer_end
    with pytest.raises(RuntimeError, match=r"k, v \[1, kv_heads, L >= T, D\]"):
        end(
            x,
            q,
            k[:, :, :5],
            v[:, :, :5],
            0,
            False,
            weight[:8],
            0,
            None,
            None,
            norm,
            1e-6,
            weight,
            0,
            None,
            None,
            weight[:8, :4],
            0,
            None,
            None,
            12,
        )
    finish = torch.ops.decodekit.prompt_layer_finish
    with pytest.raises(RuntimeError, match=r"the attention output \[T, heads x head_dim\] of the rows' dtype"):
        finish(
            x,
            torch.randn(19, 8),
            weight[:8],
            0,
            None,
            None,
            norm,
            1e-6,
            weight,
            0,
            None,
            None,
            weight[:8, :4],
            0,
            None,
            None,
            12,
        )
    y = x.clone()
    finish(
        y,
        torch.randn(20, 8),
        weight[:8],
        0,
        None,
        None,
        norm,
        1e-6,
        weight,
        0,
        None,
        None,
        torch.randn(8, 12),
        0,
        None,
        None,
        12,
    )
    assert not torch.equal(y, x)  # updated in place


def test_prompt_products_make_their_choices_where_none_is_cached(tmp_path, monkeypatch):
    # On a machine with no cached choices (a fresh CI runner) the first prompt measures them. Int8Linear.prompt_route
    # asks for the packed copy's choice, whose measurement times the int8 route through prompt_route again: that
    # inner call must not ask for the choice being made (it recursed until Python's stack ran out).
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path))  # the kernels are loaded already: only choices.json
    monkeypatch.setattr(choices, "_made", {})
    reference = tiny_model(tmp_path, "llama", intermediate_size=128)
    model = quantize(tiny_model(tmp_path, "llama", intermediate_size=128), "int8")
    with torch.inference_mode():
        expected = reference(PROMPT, use_cache=False).logits
        for each in (reference, model):
            logits = each(PROMPT, use_cache=False).logits
            assert float((logits - expected).norm() / expected.norm()) < 0.03
    assert {"int8_many_rows", "float32_rows_128"} <= {key.split("(")[0] for key in choices._made}
