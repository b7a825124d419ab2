"""Weights kept in GGUF blocks (kernels/blocks.py): the conversions against the `gguf` package's own dequantize (the
oracle), every product route against the dequantized weight, and tiny GGUF models written with the `gguf` package's
quantizers against the same files loaded dequantized to float32, through generate's routes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from decodekit import AutoModelForCausalLM
from decodekit.kernels import blocks, choices, cpu, native
from decodekit.kernels.blocks import BlockEmbedding, BlockLinear
from decodekit.kernels.linear import Linear
from decodekit.testing import random_k_quant, write_tiny_gguf, write_tiny_model
from helpers import assert_continuous_batching_gives_each_alone

PROMPTS = [[1, 5, 7, 9, 11], [1, 40, 3], [1, 17, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 2]]


def random_q4k(rows: int, width: int, seed: int = 0) -> np.ndarray:
    """Q4_K rows (the gguf package has no Q4_K quantizer): random bytes are valid blocks once d and dmin are sane."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, width // 256 * 144), dtype=np.uint8)
    supers = raw.reshape(-1, 144)
    supers[:, 0:2] = rng.uniform(0.001, 0.02, (len(supers), 1)).astype(np.float16).view(np.uint8)
    supers[:, 2:4] = rng.uniform(0.0, 0.02, (len(supers), 1)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_kept_types_convert_exactly(kind):
    weight = np.random.default_rng(1).standard_normal((48, 256)).astype(np.float32)
    raw = gguf_quantize(weight, Q[kind])
    layout, rows = blocks.from_gguf(raw, kind)
    assert layout == blocks.KEPT_TYPES[kind]
    kept = blocks.as_stored(rows, layout)
    assert torch.equal(blocks.dequantize(kept), torch.from_numpy(gguf_dequantize(raw, Q[kind])))
    grown = {"Q4_0": 20 / 18, "Q5_0": 34 / 22}.get(kind, 1.0)  # bytes a block: Q4_0's become q4's, Q5_0's q8's
    assert kept.numel() * kept.element_size() <= grown * raw.nbytes


def test_q4k_converts_within_a_float16_rounding_of_its_scales():
    raw = random_q4k(16, 512)
    oracle = torch.from_numpy(gguf_dequantize(raw, Q.Q4_K))
    layout, rows = blocks.from_gguf(raw, "Q4_K")
    got = blocks.dequantize(blocks.as_stored(rows, layout))
    assert layout == "q4" and got.shape == oracle.shape
    # Per 32-weight group: d * sc and dmin * mn rounded to float16 (relative 2^-11): 15 steps of scale plus the minimum.
    groups = oracle.abs().reshape(16, -1, 32).amax(-1, keepdim=True)
    assert ((got - oracle).abs().reshape(16, -1, 32) <= groups * 2.0**-10 + 1e-6).all()
    assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K"])
def test_k_quants_without_an_exact_form_are_rounded_within_half_a_q8_step(kind):
    raw = random_k_quant(kind, 40, 512, seed=3)
    oracle = torch.from_numpy(gguf_dequantize(raw, Q[kind]))
    layout, rows = blocks.from_gguf(raw, kind)
    got = blocks.dequantize(blocks.as_stored(rows, layout))
    assert layout == "q8" and kind in blocks.REQUANTIZED and got.shape == oracle.shape
    groups = oracle.reshape(40, -1, 32)
    # Q8_0 rounds by its float32 scale and stores it as float16: half a step, and 127 values of the scale's rounding.
    step = groups.abs().amax(-1, keepdim=True) / 127
    assert ((got.reshape(40, -1, 32) - groups).abs() <= step * (0.5 + 127 * 2.0**-11) + 1e-6).all()
    assert (got != oracle).any()  # rounded, not copied


def test_q4_blocks_become_q8_exactly_where_their_minimum_is_minus_eight_scales():
    weight = torch.randn(24, 256)
    q4_0 = blocks.as_stored(blocks.from_gguf(gguf_quantize(weight.numpy(), Q.Q4_0), "Q4_0")[1], "q4")
    converted, exact = blocks.as_q8(q4_0)
    assert exact and blocks.layout_of(converted) == "q8"
    assert torch.equal(blocks.dequantize(converted), blocks.dequantize(q4_0))
    q4_1 = blocks.quantize_rows(weight, "q4")
    converted, exact = blocks.as_q8(q4_1)
    assert not exact and blocks.layout_of(converted) == "q8"
    step = blocks.dequantize(q4_1).abs().reshape(24, -1, 32).amax(-1, keepdim=True) / 127
    error = (blocks.dequantize(converted) - blocks.dequantize(q4_1)).abs().reshape(24, -1, 32)
    assert (error <= step * (0.5 + 127 * 2.0**-11) + 1e-6).all()


def test_unkept_types_are_refused_by_name():
    kept = "\\['Q4_0', 'Q4_1', 'Q4_K', 'Q5_0', 'Q5_K', 'Q6_K', 'Q8_0'\\]"
    with pytest.raises(ValueError, match=f"Q3_K is not kept in blocks; kept: {kept}"):
        blocks.from_gguf(np.zeros((1, 110), np.uint8), "Q3_K")


LANES = [
    pytest.param("8", id="avx2"),
    pytest.param("16", id="avx512", marks=pytest.mark.skipif(not cpu.MACHINE["avx512f"], reason="no avx512f here")),
]


@pytest.mark.parametrize("layout", ["q4", "q8"])
@pytest.mark.parametrize("native_kernels", [True, False], ids=["cpp", "dequantized"])
@pytest.mark.parametrize("lanes", LANES)
def test_every_row_count_multiplies_the_dequantized_weight(layout, native_kernels, lanes):
    torch.manual_seed(0)
    weight = torch.randn(80, 192)
    layer = BlockLinear(blocks.quantize_rows(weight, layout), 192, bias=torch.randn(80))
    exact = blocks.dequantize(layer.blocks).double()
    with cpu.forced(native_kernels=native_kernels), choices.forced(block_lanes=lanes), torch.inference_mode():
        if native_kernels and not native.load():
            pytest.skip("decodekit's C++ kernels are not built here")
        for rows in (1, 2, 3, 7, 8, 9, 16, 17, 40):  # the few-row kernel's chunks, then the tiles
            x = torch.randn(rows, 192)
            want = x.double() @ exact.t() + layer.bias.double()
            got = layer(x)
            assert got.dtype == torch.float32 and got.shape == (rows, 80)
            assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4), rows
        assert layer(torch.randn(2, 3, 192, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("lanes", LANES)
def test_a_compiled_product_equals_the_eager_one(lanes):
    if not native.load():
        pytest.skip("decodekit's C++ kernels are not built here")
    torch.manual_seed(0)
    layer = BlockLinear(blocks.quantize_rows(torch.randn(64, 96), "q4"), 96)
    compiled = torch.compile(layer, fullgraph=True)
    with choices.forced(block_lanes=lanes), torch.inference_mode():
        layer(torch.randn(1, 96))  # the eager call sets the lanes, which the compiled call's kernel reads too
        assert torch.ops.decodekit.set_block_lanes(0) == int(lanes)
        for rows in (1, 4, 24):
            x = torch.randn(rows, 96)
            assert torch.equal(compiled(x), layer(x)), rows


def test_a_block_layer_refuses_blocks_of_another_shape():
    with pytest.raises(
        ValueError, match=r"q4 blocks of shape \(4, 40\) do not hold \[4, 96\] weights \(expected \[4, 60\]\)"
    ):
        BlockLinear(torch.zeros(4, 40, dtype=torch.uint8), 96)
    with pytest.raises(ValueError, match="multiples of 32, not 48"):
        blocks.quantize_rows(torch.zeros(4, 48), "q4")


def file_bytes(path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {
        "Q4_1": write_tiny_gguf(root / "q4_1.gguf", "Q4_1", embedding="Q8_0"),
        "Q4_0": write_tiny_gguf(root / "q4_0.gguf", "Q4_0", tie_word_embeddings=True),
        "Q8_0": write_tiny_gguf(root / "q8_0.gguf", "Q8_0"),
        "mixed": write_tiny_gguf(root / "mixed.gguf", "Q4_0", types={"attn_v": "Q8_0", "ffn_down": "F16"}),
        # A Q4_K_M file's mix (random valid K-quant super-blocks: widths are multiples of 256).
        "Q4_K_M": write_tiny_gguf(
            root / "q4_k_m.gguf",
            "Q4_K",
            embedding="Q8_0",
            types={"attn_v": "Q6_K", "ffn_down": "Q6_K"},
            hidden_size=256,
            intermediate_size=512,
        ),  # fmt: skip
    }


def logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model.module(torch.tensor([ids])).logits[0].double()


@pytest.mark.parametrize("name", ["Q4_1", "Q4_0", "Q8_0", "mixed", "Q4_K_M"])
def test_a_gguf_file_keeps_its_blocks_and_computes_what_its_dequantized_weights_do(files, name):
    kept = AutoModelForCausalLM.from_pretrained(files[name])
    oracle = AutoModelForCausalLM.from_pretrained(files[name], dtype="float32")  # gguf's dequantize, as before
    module = kept.module
    assert module.quantization == "blocks" and module.dtype == torch.float32
    layers = dict(module.named_modules())
    if name in ("mixed", "Q4_K_M"):  # v q8 beside q4 q and k: the fused qkv in q8 blocks (exact from Q4_0)
        qkv, down = layers["layers.0.attn.qkv"], layers["layers.0.mlp.down"]
        assert type(qkv) is BlockLinear and blocks.layout_of(qkv.blocks) == "q8"
        assert type(layers["layers.0.mlp.gate_up"]) is BlockLinear
        # ffn_down: F16 dequantized to float32 in "mixed", Q6_K rounded again as q8 blocks in "Q4_K_M"
        assert type(down) is (Linear if name == "mixed" else BlockLinear)
        if name == "Q4_K_M":
            assert blocks.stored_bytes(module) <= 1.3 * file_bytes(files[name])  # q8 over Q6_K: 8.5 bits over 6.6
    else:
        assert isinstance(module.embed, BlockEmbedding) and type(module.lm_head) is BlockLinear
        assert all(
            type(layers[f"layers.1.{p}"]) is BlockLinear for p in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
        )
        assert blocks.stored_bytes(module) <= 1.15 * file_bytes(files[name])
    if name == "Q4_0":  # tied: one table
        assert module.lm_head.blocks is module.embed.blocks
    assert type(oracle.module.lm_head) is Linear
    for ids in PROMPTS:
        want, got = logits(oracle, ids), logits(kept, ids)
        if name == "Q4_K_M":
            # Q4_K's group scales rounded to float16, its Q6_K and its fused q and k rounded again as q8 blocks
            # (blocks.py): close, not equal. Random K-quant groups span far wider ranges than a trained model's, so
            # the rounding moves these logits more than a real file's (bench/bench_accuracy.py --requantize Q4_K_M).
            assert float((got - want).norm() / want.norm()) < 6e-2  # 0.7-4.4% on these prompts
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        else:
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())
        call = dict(max_new_tokens=12, do_sample=False)
        assert torch.equal(kept.generate(torch.tensor([ids]), **call), oracle.generate(torch.tensor([ids]), **call))


def test_compiled_batched_beam_and_sampled_calls_give_the_dequantized_files_tokens(files):
    model = AutoModelForCausalLM.from_pretrained(files["Q4_1"])
    oracle = AutoModelForCausalLM.from_pretrained(files["Q4_1"], dtype="float32")
    prompt = torch.tensor([PROMPTS[0]])
    greedy = oracle.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=10, do_sample=False, compile=True), greedy)
    beams = dict(max_new_tokens=8, num_beams=3, do_sample=False)
    assert torch.equal(model.generate(prompt, **beams), oracle.generate(prompt, **beams))
    sampled = dict(max_new_tokens=8, do_sample=True, top_k=20)
    torch.manual_seed(3)
    want = oracle.generate(prompt, **sampled)
    torch.manual_seed(3)
    assert torch.equal(model.generate(prompt, **sampled), want)
    assert_continuous_batching_gives_each_alone(model, PROMPTS, oracle)


def test_a_published_methods_loop_runs_on_blocks(files, tmp_path):
    from methods import write_method
    from published_methods import TOP_N_SIGMA

    repo = str(write_method(tmp_path / "top_n_sigma", TOP_N_SIGMA))
    model = AutoModelForCausalLM.from_pretrained(files["Q4_1"])
    oracle = AutoModelForCausalLM.from_pretrained(files["Q4_1"], dtype="float32")
    call = dict(input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=8, custom_generate=repo, trust_remote_code=True)
    want = oracle.generate(**call, n_sigma=1.5, eos_token_id=None)
    assert torch.equal(model.generate(**call, n_sigma=1.5, eos_token_id=None), want)
    assert torch.equal(model.generate(**call, n_sigma=1.5, eos_token_id=None, compile=True), want)


def test_quantize_int4_keeps_a_checkpoint_in_q4_blocks(tmp_path):
    path = write_tiny_model(tmp_path / "tiny", intermediate_size=128)
    plain = AutoModelForCausalLM.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, quantize="int4")
    assert model.module.quantization == "int4" and type(model.module.lm_head) is BlockLinear
    assert model.module.lm_head.layout == "q4"
    reference = plain.module.lm_head.weight.detach()
    # The gguf package's Q4_1 rounding: within half a step of each group's range / 15.
    group_range = reference.reshape(reference.shape[0], -1, 32)
    step = (group_range.amax(-1) - group_range.amin(-1)) / 15
    error = (model.module.lm_head.dequantized() - reference).abs().reshape(reference.shape[0], -1, 32)
    assert (error <= step[..., None] / 2 + 1e-3).all()
    want, got = logits(plain, PROMPTS[0]), logits(model, PROMPTS[0])
    assert (got - want).norm() / want.norm() < 0.2  # 4 bits a weight: close, not equal
    accepted = r"\['int8', 'int4', 'int4-g64', 'int4-g128'\]"
    with pytest.raises(ValueError, match=rf"quantize='int3' is not supported; use one of {accepted} or None"):
        AutoModelForCausalLM.from_pretrained(path, quantize="int3")


def test_stats_say_the_weights_formats_and_bytes(files):
    from decodekit.cli.terminal import weights_line

    model = AutoModelForCausalLM.from_pretrained(files["Q4_1"])  # Q4_1 layers, a Q8_0 embedding, an untied lm_head
    formats = blocks.weight_formats(model.module)
    assert set(formats) == {"q4 blocks", "q8 blocks", "float32"} and sum(formats.values()) == blocks.stored_bytes(
        model.module
    )
    assert formats["q8 blocks"] == model.module.embed.blocks.numel() * 2  # int16 elements: 34 bytes a block
    line = weights_line(model)
    assert line.startswith("weights: ") and "q4 blocks" in line and "q8 blocks" in line
    plain = AutoModelForCausalLM.from_pretrained(files["Q4_1"], dtype="float32")
    assert set(blocks.weight_formats(plain.module)) == {"float32"}


def test_without_the_kernels_a_file_loads_dequantized(files, caplog):
    # A block layer without decodekit's kernels dequantizes its weight on every call: the loader keeps blocks only
    # where the kernels multiply them, and says why it did not.
    import logging

    with cpu.forced(native_kernels=False), caplog.at_level(logging.INFO, logger="decodekit"):
        model = AutoModelForCausalLM.from_pretrained(files["Q4_1"])
    assert getattr(model.module, "quantization", None) is None and type(model.module.lm_head) is Linear
    assert "blocks load dequantized to float32: decodekit's C++ kernels are not built here" in caplog.text
