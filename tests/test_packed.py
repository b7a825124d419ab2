"""oneDNN-packed linear weights: same logits as plain nn.Linear, ties and state_dict kept, undone before
dtype moves and quantization."""

import gc
import logging

import pytest
import torch
from torch import nn

from decodekit.kernels import choices, cpu
from decodekit.kernels import packed as packed_module
from decodekit.kernels.packed import PackedLinear, pack_linears, unpack_linears
from decodekit.kernels import StepHost
from decodekit.testing import tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this torch build")


@pytest.fixture(autouse=True)
def packing_chosen():
    """These tests check the packed layout; whether a CPU uses it is measured (eager_layout), so it is forced here."""
    with choices.forced(eager_weights_float32="packed", eager_weights_bfloat16="packed"):
        yield


IDS = torch.tensor([[3, 17, 4, 9, 22, 5], [8, 1, 30, 2, 7, 11]])


def linears(model, kind):
    return [m for m in model.modules() if isinstance(m, kind)]


@pytest.fixture
def tied(tmp_path):
    return tiny_model(tmp_path, "llama", tie_word_embeddings=True)


def relative_error(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def plain_logits(model, ids=IDS):
    """Logits through plain nn.Linear layers (a forward with gradients on does not pack)."""
    with torch.enable_grad():
        return model(ids, use_cache=False).logits.detach()


def test_forward_without_gradients_packs_every_linear_and_keeps_the_logits(tied):
    plain = plain_logits(tied)
    assert linears(tied, PackedLinear) == []
    packed = logits(tied)
    assert (
        linears(tied, nn.Linear) == [] and len(linears(tied, PackedLinear)) == 1 + 4 * tied.config.num_hidden_layers
    )  # lm_head; qkv, o, gate_up, down
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)


def test_the_tied_lm_head_stays_tied_through_pack_and_unpack(tied):
    state = {k: v.clone() for k, v in tied.state_dict().items()}
    pack_linears(tied)
    assert tied.lm_head.weight is tied.embed.weight
    packed_state = tied.state_dict()
    assert packed_state.keys() == state.keys()
    for key in state:
        assert torch.equal(packed_state[key], state[key]), key
    unpack_linears(tied)
    assert isinstance(tied.lm_head, nn.Linear) and tied.lm_head.weight is tied.embed.weight
    assert torch.equal(tied.layers[0].mlp.gate_up.weight, state["layers.0.mlp.gate_up.weight"])


def test_an_untied_packed_model_keeps_one_copy_and_loads_its_own_state_dict(tmp_path):
    model = tiny_model(tmp_path, "qwen2")  # q/k/v bias: packed with a bias
    reference = plain_logits(model)
    torch.testing.assert_close(logits(model), reference, atol=1e-5, rtol=1e-5)
    assert model.lm_head.shared_weight is None and model.layers[0].attn.qkv.bias is not None
    fresh = tiny_model(tmp_path / "again", "qwen2", seed=1)
    fresh.load_state_dict(model.state_dict())  # the packed model's state_dict loads into a plain one
    torch.testing.assert_close(logits(fresh), reference, atol=1e-5, rtol=1e-5)


def test_moving_to_bfloat16_unpacks_then_packs_again(tied):
    fp32 = logits(tied)
    tied.to(torch.bfloat16)
    assert tied.dtype == torch.bfloat16 and linears(tied, PackedLinear) == []
    out = logits(tied)
    assert out.dtype == torch.bfloat16
    if cpu.has("onednn_bf16"):
        assert tied.lm_head.packed.dtype == torch.bfloat16
    assert relative_error(out, fp32) < 0.02  # bf16 rounding only
    tied.float()
    back = logits(tied)
    assert tied.lm_head.packed.dtype == torch.float32
    assert relative_error(back, fp32) < 0.01  # weights were rounded to bf16 once


def test_quantizing_a_packed_model_works_and_skips_packing(tmp_path):
    from decodekit.kernels.quantize import Int8Linear, quantize

    model = tiny_model(tmp_path, "llama")
    reference = logits(model)
    quantize(model, "int8")
    assert linears(model, PackedLinear) == [] and linears(model, Int8Linear)
    assert not pack_linears(model)
    assert relative_error(logits(model), reference) < 0.02


def test_a_compiled_call_of_few_rows_runs_on_plain_weights_and_the_next_eager_call_packs_again(tied, caplog):
    # A step of up to PLAIN_WEIGHTS_ROWS rows (compiled, or an eager call's uncompiled one) multiplies plain weights
    # (the C++ stack, row products); wider steps and eager forwards use the packed ones. The switch keeps the tie
    # and the tokens.
    from decodekit.kernels import PLAIN_WEIGHTS_ROWS

    few, wide = IDS, IDS.repeat(9, 1)[: PLAIN_WEIGHTS_ROWS + 1]
    with torch.inference_mode():
        tied(few)  # an eager forward packs
    assert linears(tied, PackedLinear)
    with caplog.at_level(logging.INFO, logger="decodekit"):
        compiled = tied.generate(few, max_new_tokens=6, compile=True)
    assert "unpacked from oneDNN's layout for a compiled step of few rows" in caplog.text
    assert linears(tied, PackedLinear) == [] and tied.lm_head.weight is tied.embed.weight
    assert not any(p.is_inference() for p in tied.parameters())  # unpacked inside generate, still changeable
    eager = tied.generate(few, max_new_tokens=6)
    assert torch.equal(compiled, eager) and linears(tied, PackedLinear) == []  # the eager call's step: plain too
    with torch.inference_mode():
        tied(few)
    assert linears(tied, PackedLinear)  # the next eager forward packs again
    out = tied.generate(wide, max_new_tokens=6, compile=True)
    assert linears(tied, PackedLinear) and torch.equal(out, tied.generate(wide, max_new_tokens=6))
    # One compiled step per layout (an eager call's uncompiled steps are kept beside them, their options None).
    steps = StepHost.of(tied).steps("fused")
    assert sorted(key[-1][2] for key in steps if key[3] is not None) == [False, True]


def test_one_row_in_a_compiled_step_goes_through_one_row_and_nothing_else_does(monkeypatch):
    import decodekit.kernels.linear as linear_module

    calls = []
    original = linear_module.one_row
    monkeypatch.setattr(linear_module, "one_row", lambda row, w: calls.append(tuple(row.shape)) or original(row, w))
    torch.manual_seed(0)
    layer = linear_module.Linear(64, 48, bias=True)
    compiled = torch.compile(layer, fullgraph=True)
    x1, x3 = torch.randn(1, 1, 64), torch.randn(3, 64)
    torch.testing.assert_close(compiled(x1), layer(x1), atol=1e-5, rtol=1e-5)
    assert calls == [(1, 64)]  # traced once, for the one-row call
    torch.testing.assert_close(compiled(x3), layer(x3), atol=1e-5, rtol=1e-5)
    assert calls == [(1, 64)]  # neither more rows nor eager calls use it


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_many_low_precision_rows_are_multiplied_in_float32_where_the_cpu_has_no_matmul_for_them(dtype, monkeypatch):
    import torch.nn.functional as F

    import decodekit.kernels.linear as linear_module

    torch.manual_seed(1)
    layer = linear_module.Linear(64, 48, bias=True).to(dtype)
    wide, narrow = torch.randn(2, 8, 64).to(dtype), torch.randn(15, 64).to(dtype)  # 16 rows, 15 rows
    expected = {id(x): F.linear(x, layer.weight, layer.bias) for x in (wide, narrow)}
    seen, linear = [], F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: seen.append(w.dtype) or linear(x, w, b))

    def product(x):
        seen.clear()
        y = layer(x)
        assert torch.equal(y, expected[id(x)])  # both round a float32 sum once; at this width, bit for bit
        return seen

    from decodekit.kernels import cpu

    probe = linear_module.MATMUL_PROBE[dtype]
    # Only the decision is checked here, so the probe is set directly (cpu.forced refuses to force on a probe
    # the machine lacks, and F.linear in bf16/fp16 runs on any CPU, slowly).
    monkeypatch.setitem(cpu._answers, "native_kernels", False)  # else up to 16 bf16 rows are decodekit's kernel
    monkeypatch.setitem(cpu._answers, probe, False)
    assert product(wide) == [torch.float32] and product(narrow) == [dtype]
    monkeypatch.setitem(cpu._answers, probe, True)  # a CPU with bf16/fp16 matmul
    assert product(wide) == [dtype]


def test_where_plain_weights_measure_faster_they_stay_plain_with_the_same_logits(tied):
    with choices.forced(eager_weights_float32="plain"):
        plain = logits(tied)
        assert linears(tied, PackedLinear) == [] and not pack_linears(tied)
    unpack_linears(tied)  # the next forward decides afresh
    packed = logits(tied)
    assert linears(tied, PackedLinear) and relative_error(packed, plain) < 1e-5


needs_bf16_packing = pytest.mark.skipif(not cpu.has("onednn_bf16"), reason="oneDNN runs no bfloat16 matmul on this CPU")


@needs_bf16_packing
def test_both_layouts_take_prompts_packed_and_steps_plain_with_the_same_logits(tmp_path, monkeypatch):
    model = tiny_model(tmp_path, "llama", tie_word_embeddings=False).to(torch.bfloat16)
    prompt = torch.arange(3, 43)[None]  # 40 rows: past native.MAX_ROWS, a prompt's products
    with choices.forced(eager_weights_bfloat16="plain"):
        want_prompt, want_step = logits(model, prompt), logits(model, prompt[:, :1])
    unpack_linears(model)
    calls = []
    monkeypatch.setattr(
        torch.ops.decodekit,
        "row_product",
        lambda *a, op=torch.ops.decodekit.row_product: calls.append("row_product") or op(*a),
        raising=False,
    )
    with choices.forced(eager_weights_bfloat16="both"):
        got_prompt = logits(model, prompt)
        assert calls == []  # every product of 40 rows ran on the packed weights
        got_step = logits(model, prompt[:, :1])
    layers = linears(model, PackedLinear)
    assert len(layers) == 1 + 4 * model.config.num_hidden_layers and all(layer.plain_steps for layer in layers)
    assert len(calls) == len(layers)  # and every one-row product on the plain ones
    assert torch.equal(got_step, want_step)  # the same kernel as plain weights
    assert relative_error(got_prompt, want_prompt) < 0.02  # oneDNN's and the library's bf16 products round alike
    state = model.state_dict()
    unpack_linears(model)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@needs_bf16_packing
@pytest.mark.parametrize("fits", [True, False])
def test_both_layouts_are_offered_to_a_bfloat16_model_only_where_the_second_copy_fits(tmp_path, monkeypatch, fits):
    model = tiny_model(tmp_path, "llama", tie_word_embeddings=True).to(torch.bfloat16)
    asked, held = [], {"used": 0}

    def reserve(size):
        held["used"] += size if fits else 0
        return fits

    monkeypatch.setattr(packed_module, "reserve_copy", reserve)
    monkeypatch.setattr(packed_module, "release_copy", lambda size: held.__setitem__("used", held["used"] - size))
    monkeypatch.setattr(packed_module, "eager_layout", lambda dtype, both=False: asked.append(both) or "both")
    assert pack_linears(model)
    untied = sum(m.shared_weight.nbytes for m in linears(model, PackedLinear) if m is not model.lm_head)
    assert asked == [fits] and held["used"] == (untied if fits else 0)  # the tied lm_head's weight costs nothing
    unpack_linears(model)
    gc.collect()
    assert held["used"] == 0  # released with the packed layers


def test_the_layouts_offered_for_each_dtype(monkeypatch):
    offered = []
    monkeypatch.setattr(
        choices,
        "decide",
        lambda name, candidates, otherwise, sample="": offered.append((name, sorted(candidates()))) or otherwise,
    )
    packed_module.eager_layout(torch.float32, both=True)  # its plain prompts take C++ layers no sample runs
    want = [["packed", "plain"]]
    if cpu.has("onednn_bf16"):  # elsewhere a bfloat16 weight is never packed (can_pack)
        packed_module.eager_layout(torch.bfloat16, both=True)
        packed_module.eager_layout(torch.bfloat16, both=False)
        want += [["both", "packed", "plain"], ["packed", "plain"]]
    assert [labels for name, labels in offered if name.startswith("eager")] == want
