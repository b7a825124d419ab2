"""Runs the method on a tiny random model, the way users call it."""

from pathlib import Path

import pytest
import torch

from decodekit.testing import tiny_model

REPO = Path(__file__).resolve().parents[1]
PROMPT = torch.tensor([[5, 6, 7, 8]])
NEW = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


def run(model, **kwargs):
    return model.generate(PROMPT, custom_generate=str(REPO), trust_remote_code=True, max_new_tokens=NEW,
                          eos_token_id=None, **kwargs)

{% if cookiecutter.hook_point == "full loop" %}
def test_plain_run_equals_builtin_greedy(model):
    assert torch.equal(run(model), model.generate(PROMPT, max_new_tokens=NEW, eos_token_id=None))


def test_avoid_last_n(model):
    out = run(model, avoid_last_n=3)[0].tolist()
    for i in range(PROMPT.shape[1], len(out)):
        assert out[i] not in out[i - 3 : i]


def test_bad_argument_is_rejected(model):
    with pytest.raises(ValueError, match="avoid_last_n=-1"):
        run(model, avoid_last_n=-1)
{% else %}
{% include "hook_tests.py.j2" %}
{% endif %}
