"""PyTorch's int4 layout (kernels/int4pack.py: quantize="int4-g64" / "int4-g128", and "int4" on CUDA): the groups'
rounding against the float weight, the layer's products against the same values multiplied in float (on CPU through
`_weight_int4pack_mm_for_cpu`, the CUDA kernel's twin), and a model quantized so through generate's routes."""

from __future__ import annotations

import copy

import pytest
import torch

from decodekit import AutoModelForCausalLM
from decodekit.kernels import blocks, int4pack
from decodekit.kernels.int4pack import Int4PackLinear
from decodekit.kernels.linear import Linear
from decodekit.testing import write_tiny_gguf, write_tiny_model
from helpers import assert_continuous_batching_gives_each_alone


def dequantized(q: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    scale, zero = (scales_and_zeros[..., i].float().t().repeat_interleave(group, dim=1) for i in (0, 1))
    return (q.float() - 8) * scale + zero


@pytest.mark.parametrize("group", [32, 64, 128])
def test_groups_round_within_half_a_step_and_multiply_as_their_values(group):
    torch.manual_seed(0)
    weight = torch.randn(48, 256)
    q, scales_and_zeros = int4pack.quantize_groups(weight, group)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert scales_and_zeros.shape == (256 // group, 48, 2) and scales_and_zeros.dtype == torch.bfloat16
    values = dequantized(q, scales_and_zeros, group)
    groups = weight.reshape(48, -1, group)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15)[..., None]
    # Half a step, and the zero's rounding to bfloat16 (2^-9 of the largest weight a group holds) moving the grid.
    slack = groups.abs().amax(-1, keepdim=True) * 2.0**-8
    assert ((values.reshape(48, -1, group) - groups).abs() <= step / 2 + slack).all()
    layer = Int4PackLinear(q, scales_and_zeros, group, bias=torch.randn(48))
    x = torch.randn(5, 256)
    want = x.bfloat16().double() @ values.double().t() + layer.bias.double()
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (5, 48)
    # bfloat16 activations and output: within the output's rounding (2^-8 of the row's largest product sum).
    assert ((got.double() - want).abs() <= 2.0**-7 * want.abs().amax(-1, keepdim=True) + 1e-2).all()
    assert torch.allclose(layer.dequantized(), values, rtol=2.0**-7, atol=1e-3)


def test_a_layer_refuses_shapes_and_groups_it_cannot_take_and_stays_on_its_device():
    with pytest.raises(ValueError, match="group_size must be one of \\[32, 64, 128\\], not 96"):
        int4pack.quantize_groups(torch.randn(16, 192), 96)
    q, scales_and_zeros = int4pack.quantize_groups(torch.randn(16, 64), 64)
    with pytest.raises(ValueError, match=r"inputs a multiple of 128 and outputs a multiple of 16, not \[16, 64\]"):
        Int4PackLinear(q, scales_and_zeros, 128)
    layer = Int4PackLinear(q, scales_and_zeros, 64)
    with pytest.raises(RuntimeError, match="packed for cpu and cannot move to meta"):
        layer.to("meta")
    layer.to(torch.float32)  # a dtype change leaves the packed values alone
    assert layer.packed.dtype == torch.uint8


@pytest.mark.parametrize("method", ["int4-g64", "int4-g128"])
def test_a_model_quantized_in_groups_of_64_or_128_generates_through_every_route(tmp_path, method):
    path = write_tiny_model(tmp_path / "tiny", hidden_size=128, intermediate_size=256)
    plain = AutoModelForCausalLM.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, quantize=method)
    module = model.module
    assert module.quantization == method
    group = int(method.removeprefix("int4-g"))
    assert type(module.layers[0].mlp.down) is Int4PackLinear and module.layers[0].mlp.down.group_size == group
    assert type(module.lm_head) is Int4PackLinear
    layers = [m for m in module.modules() if isinstance(m, Int4PackLinear)]
    held = sum(m.out_features * m.in_features // 2 + m.in_features // group * m.out_features * 4 for m in layers)
    assert blocks.weight_formats(module)[f"int4 groups of {group}"] == held  # 4 bits a weight, 32 a group's pair
    ids = torch.tensor([[1, 5, 7, 9, 11, 13]])
    # The oracle: the same model with each int4 layer's values as a float32 weight (its own kernel, identity rows).
    oracle = copy.deepcopy(module)
    for name, layer in list(oracle.named_modules()):
        if isinstance(layer, Int4PackLinear):
            parent, _, child = name.rpartition(".")
            float_layer = Linear(layer.in_features, layer.out_features, bias=False)
            float_layer.weight = torch.nn.Parameter(layer.dequantized(), requires_grad=False)
            setattr(oracle.get_submodule(parent) if parent else oracle, child, float_layer)
    with torch.inference_mode():
        want, got, float_model = oracle(ids).logits.double(), model(ids).logits.double(), plain(ids).logits.double()
    assert float((got - want).norm() / want.norm()) < 0.03  # bfloat16 activations: within their rounding
    assert float((got - float_model).norm() / float_model.norm()) < 0.35  # 4 bits a random weight: near, not equal
    eager = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, compile=True), eager)
    batch = model.generate(torch.cat([ids, ids]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert torch.equal(batch[0], eager[0]) and torch.equal(batch[1], eager[0])


def test_layers_whose_inputs_do_not_fit_the_group_stay_float(tmp_path):
    path = write_tiny_model(tmp_path / "tiny", hidden_size=96, intermediate_size=256)  # 96: not a multiple of 64
    module = AutoModelForCausalLM.from_pretrained(path, quantize="int4-g64").module
    assert type(module.layers[0].attn.qkv) is Linear  # inputs 96 wide
    assert type(module.layers[0].mlp.down) is Int4PackLinear  # inputs 256 wide


def test_q4_blocks_become_int4_groups_of_32_with_the_same_values(tmp_path):
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize as gguf_quantize

    weight = torch.randn(32, 128).numpy()
    kept = blocks.as_stored(blocks.from_gguf(gguf_quantize(weight, Q.Q4_1), "Q4_1")[1], "q4")
    q, scales_and_zeros = int4pack.from_blocks(kept)
    exact = blocks.dequantize(kept)
    # The values are the blocks'; the scale and zero are rounded to bfloat16 (2^-9 of each).
    step = exact.reshape(32, -1, 32).abs().amax(-1, keepdim=True)
    assert ((dequantized(q, scales_and_zeros, 32) - exact).reshape(32, -1, 32).abs() <= 2.0**-7 * step).all()
    with pytest.raises(ValueError, match="only q4 blocks have an int4 form, not q8 blocks"):
        int4pack.from_blocks(blocks.quantize_rows(torch.randn(16, 64), "q8"))


def test_a_gguf_models_blocks_replaced_for_a_device_compute_near_them(tmp_path):
    """What a GGUF file's blocks become on CUDA (replace_blocks), made here on the CPU, where the same layers run."""
    path = write_tiny_gguf(
        tmp_path / "q4.gguf", "Q4_1", embedding="Q8_0", types={"ffn_down": "Q8_0"}, hidden_size=128,
        intermediate_size=256,
    )  # fmt: skip
    kept = AutoModelForCausalLM.from_pretrained(path)
    converted = AutoModelForCausalLM.from_pretrained(path)
    int4pack.replace_blocks(converted.module, "cpu")
    converted.module.to(torch.bfloat16)
    layers = dict(converted.module.named_modules())
    assert type(layers["layers.0.attn.qkv"]) is Int4PackLinear and layers["layers.0.attn.qkv"].group_size == 32
    assert type(layers["lm_head"]) is Int4PackLinear
    down = layers["layers.0.mlp.down"]
    assert type(down) is Linear and down.weight.dtype == torch.bfloat16  # q8: its weight in bfloat16
    assert type(layers["embed"]) is blocks.BlockEmbedding
    ids = torch.tensor([[1, 5, 7, 9, 11, 13]])
    with torch.inference_mode():
        want, got = kept(ids).logits.double(), converted(ids).logits.double()
    assert float((got - want).norm() / want.norm()) < 0.03  # bfloat16 activations and scales
    eager = converted.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(
        converted.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, compile=True), eager
    )


def test_beams_and_continuous_batching_run_on_int4_groups(tmp_path):
    path = write_tiny_model(tmp_path / "tiny", hidden_size=128, intermediate_size=256)
    model = AutoModelForCausalLM.from_pretrained(path, quantize="int4-g64")
    prompts = [[1, 5, 7, 9, 11], [1, 40, 3], [1, 17, 23, 29, 31, 37, 41, 43, 47, 53]]
    beams = dict(max_new_tokens=6, num_beams=3, do_sample=False)
    prompt = torch.tensor([prompts[0]])
    assert torch.equal(model.generate(prompt, **beams, compile=True), model.generate(prompt, **beams))
    assert_continuous_batching_gives_each_alone(model, prompts)
