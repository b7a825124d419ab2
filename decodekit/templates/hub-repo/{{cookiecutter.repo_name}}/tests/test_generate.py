"""Runs the method through decodekit on a tiny random model, the way users call it (skipped where decodekit is not
installed; tests/test_with_transformers.py runs everywhere)."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("decodekit", reason="decodekit is not installed here (see .github/workflows/test.yml)")
from decodekit import AutoModelForCausalLM  # noqa: E402
from decodekit.testing import write_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPT = torch.tensor([[5, 6, 7, 8]])
NEW = 12


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def model(weights):
    return AutoModelForCausalLM.from_pretrained(weights)


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


def test_runs_in_transformers_own_generate(model, weights):
    """The same repository as transformers' custom_generate, on the same weights: the same tokens."""
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(weights)
    options = {% if cookiecutter.hook_point == "full loop" %}dict(avoid_last_n=2){% elif cookiecutter.hook_point == "logits processor" %}dict({{ cookiecutter.module_name }}_penalty=1e9){% elif cookiecutter.hook_point == "selector" %}dict({{ cookiecutter.module_name }}_no_immediate_repeat=True){% elif cookiecutter.hook_point == "stopping rule" %}dict({{ cookiecutter.module_name }}_stop_token=run(model)[0, PROMPT.shape[1] + 2].item()){% else %}dict({{ cookiecutter.module_name }}_cache=True){% endif %}
    theirs = hf_model.generate(PROMPT, custom_generate=str(REPO), trust_remote_code=True, max_new_tokens=NEW,
                               eos_token_id=None, **options)
    assert torch.equal(theirs, run(model, **options))
