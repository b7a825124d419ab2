"""The one-query attention used for bf16/fp16 decoding on CPU equals scaled_dot_product_attention."""

import torch
import torch.nn.functional as F

from decodekit.families.llama import one_query_attention
from decodekit.testing import tiny_model


def test_one_query_attention_equals_sdpa_with_gqa_and_masks():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 16, generator=gen) for h, n in ((6, 1), (2, 20), (2, 20)))
    mask = torch.rand(2, 1, 1, 20, generator=gen) > 0.3
    mask[..., 0] = True
    for m in (None, mask, mask[:1]):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        torch.testing.assert_close(one_query_attention(q, k, v, m), expected, atol=1e-5, rtol=1e-5)
    low = one_query_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert low.dtype == torch.bfloat16
    reference = F.scaled_dot_product_attention(
        q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), attn_mask=mask, enable_gqa=True
    )
    torch.testing.assert_close(low.float(), reference, atol=1e-2, rtol=1e-2)  # bf16 output rounding only


def test_bf16_decoding_follows_the_fp32_model(tmp_path):
    model = tiny_model(tmp_path, "mistral")  # a sliding window: the windowed mask goes through the one-query path
    prompt = torch.tensor([[5, 9, 14, 3, 7, 8, 2, 11, 4, 6, 13, 1, 10, 12]])  # longer than the window of 8
    with torch.no_grad():
        full = model(prompt, use_cache=False).logits[:, -1]
        model.to(torch.bfloat16)
        out = model(prompt[:, :-1], use_cache=True)  # prefill, then one decode step through the cache
        step = model(prompt[:, -1:], past_key_values=out.past_key_values).logits[:, -1]
    assert float((step.float() - full).norm() / full.norm()) < 0.02
