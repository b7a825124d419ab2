"""Weight-only int8: close to the fp32 layer, and the 2% log-likelihood quality bar on the real model."""

import pytest
import torch
from torch import nn

from decodekit import AutoModelForCausalLM
from decodekit.models.quantize import Int8Linear
from decodekit.testing import write_tiny_model


def test_int8_linear_is_close_to_fp32():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    q = Int8Linear(linear)
    assert q.weight_int8.dtype == torch.int8 and q.weight_int8.shape == (48, 64) and q.scales.shape == (48,)
    x = torch.randn(3, 5, 64)
    ref = linear(x)
    err = (q(x) - ref).norm() / ref.norm()
    assert err < 0.02, err


def test_compiled_one_row_product_matches_the_int8_kernel():
    # A compiled step computes one-row products itself (quantize._one_row), the eager path calls
    # torch._weight_int8pack_mm: both round the product to bfloat16, so they agree to one bf16 step.
    torch.manual_seed(0)
    q = Int8Linear(nn.Linear(576, 96, bias=False))
    compiled = torch.compile(q, fullgraph=True)
    for rows in (1, 3):  # 3 rows keep the kernel inside the compiled graph too
        x = torch.randn(rows, 576)
        eager, fused = q(x), compiled(x)
        assert fused.shape == eager.shape == (rows, 96)
        assert torch.allclose(fused, eager, rtol=2**-7, atol=1e-6), (fused - eager).abs().max()
    with torch.no_grad():
        q.scales.mul_(2.0)  # the scales are read at run time, not baked into the compiled code
    x = torch.randn(1, 576)
    assert torch.allclose(compiled(x), q(x), rtol=2**-7, atol=1e-6)


def test_quantized_tiny_model_generates_and_rejects_unknown_methods(tmp_path):
    path = write_tiny_model(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(path, quantize="int8")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4).shape == (1, 7)
    with pytest.raises(ValueError, match=r"quantize='int4' is not supported; use one of \['int8'\]"):
        AutoModelForCausalLM.from_pretrained(path, quantize="int4")


def mean_loglik(model, sequences, prompt_lengths):
    total, count = 0.0, 0
    with torch.no_grad():
        for seq, n in zip(sequences, prompt_lengths):
            logp = model(seq[None]).logits[0, :-1].float().log_softmax(-1)
            picked = logp.gather(-1, seq[1:, None])[:, 0]
            total += picked[n - 1:].sum().item()
            count += len(seq) - n
    return total / count


def test_int8_keeps_the_log_likelihood_within_two_percent(default_model):
    fp32, tok = default_model
    from decodekit.models.default import default_model_path

    int8 = AutoModelForCausalLM.from_pretrained(default_model_path(), quantize="int8")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    sequences, lengths = [], []
    for p in prompts:
        ids = tok(p, return_tensors="pt")["input_ids"]
        sequences.append(fp32.generate(ids, max_new_tokens=32, min_new_tokens=32)[0])
        lengths.append(ids.shape[1])
    own, quantized = mean_loglik(fp32, sequences, lengths), mean_loglik(int8, sequences, lengths)
    assert abs(quantized - own) / abs(own) < 0.02, (own, quantized)
