"""The method through transformers' own generate() on a tiny random model: these run wherever transformers does,
with or without decodekit, so a first push's CI has a test that runs."""

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
PROMPT = torch.tensor([[5, 6, 7, 8]])
NEW = 12


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, eos_token_id=None, bos_token_id=None)
    return transformers.LlamaForCausalLM(config).eval()


def greedy(model):
    return model.generate(PROMPT, do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)


def run(model, **kwargs):
    return model.generate(PROMPT, custom_generate=str(REPO), trust_remote_code=True, do_sample=False,
                          max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, **kwargs)


def test_off_by_default_equals_transformers_greedy(model):
    assert torch.equal(run(model), greedy(model))
{% set m = cookiecutter.module_name %}
{% if cookiecutter.hook_point == "full loop" %}
def test_avoid_last_n(model):
    out = run(model, avoid_last_n=3)[0].tolist()
    for i in range(PROMPT.shape[1], len(out)):
        assert out[i] not in out[i - 3 : i]
{% elif cookiecutter.hook_point == "logits processor" %}
def test_penalty_keeps_recent_tokens_out(model):
    out = run(model, {{ m }}_penalty=1e9)[0].tolist()
    for i in range(PROMPT.shape[1], len(out)):
        assert out[i] not in out[max(0, i - 8) : i]
{% elif cookiecutter.hook_point == "selector" %}
def test_no_immediate_repeat(model):
    out = run(model, {{ m }}_no_immediate_repeat=True)[0].tolist()
    assert all(a != b for a, b in zip(out[PROMPT.shape[1] - 1 :], out[PROMPT.shape[1] :]))
{% elif cookiecutter.hook_point == "stopping rule" %}
def test_stops_at_the_stop_token(model):
    plain = greedy(model)[0].tolist()
    stop = plain[PROMPT.shape[1] + 2]
    out = run(model, {{ m }}_stop_token=stop)[0].tolist()
    assert out[-1] == stop and len(out) <= len(plain)
{% else %}
def test_the_cache_leaves_the_tokens_as_they_are(model):
    assert torch.equal(run(model, {{ m }}_cache=True), greedy(model))
{% endif %}