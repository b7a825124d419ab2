"""Our Llama-family models against transformers on the same tiny random weights (fp32)."""

import pytest
import torch

from decodekit import AutoModelForCausalLM

from helpers import write_tiny_model

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) is the reference")

VARIANTS = {
    "llama": ("llama", {}),
    "llama-bias-tied": ("llama", {"attention_bias": True, "tie_word_embeddings": True}),
    "llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral-window": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    model_type, overrides = VARIANTS[request.param]
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), model_type, **overrides)
    ours = AutoModelForCausalLM.from_pretrained(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return ours, ref


def prompts(vocab: int, lengths=(5, 11, 8), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def left_pad(seqs, pad_id: int = 0):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = s
        mask[i, width - len(s) :] = 1
    return ids, mask


def test_logits_and_hidden_states_match(pair):
    ours, ref = pair
    ids = prompts(ours.config.vocab_size, lengths=(20,))[0][None]  # longer than Mistral's window of 8
    with torch.no_grad():
        a = ours(ids, output_hidden_states=True)
        b = ref(ids, output_hidden_states=True)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)
    assert len(a.hidden_states) == len(b.hidden_states) == ours.config.num_hidden_layers + 1
    for x, y in zip(a.hidden_states, b.hidden_states):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_padded_batch_logits_match(pair):
    ours, ref = pair
    ids, mask = left_pad(prompts(ours.config.vocab_size))
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
        b = ref(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=1e-4, rtol=1e-4)


def test_incremental_decoding_matches_full_forward(pair):
    ours, _ = pair
    ids = prompts(ours.config.vocab_size, lengths=(14,))[0][None]
    with torch.no_grad():
        full = ours(ids, use_cache=False).logits
        out = ours(ids[:, :9])
        steps = [out.logits]
        for t in range(9, 14):
            out = ours(ids[:, t : t + 1], past_key_values=out.past_key_values)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)


def test_greedy_matches_batch_1(pair):
    ours, ref = pair
    ids = prompts(ours.config.vocab_size, lengths=(7,))[0][None]
    kwargs = dict(max_new_tokens=24, do_sample=False, min_new_tokens=24)
    a = ours.generate(ids, **kwargs)
    b = ref.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kwargs)
    assert a.tolist() == b.tolist()


def test_greedy_matches_left_padded_batch_3(pair):
    ours, ref = pair
    ids, mask = left_pad(prompts(ours.config.vocab_size))
    kwargs = dict(max_new_tokens=16, do_sample=False)
    a = ours.generate(ids, attention_mask=mask, **kwargs)
    b = ref.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)
    assert a.tolist() == b.tolist()
