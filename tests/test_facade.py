"""decodekit.Model, the facade from_pretrained and wrap return: one class over decodekit's model families (and, in
test_transformers_backend.py, transformers models), the module behind it, and the old import paths of what moved."""

import pytest
import torch

import decodekit
from decodekit import AutoModelForCausalLM, Model
from decodekit.families.config import ModelConfig
from decodekit.families.llama import LlamaForCausalLM
from decodekit.loading.pretrained import to_native
from decodekit.testing import tiny_config, tiny_state_dict, write_tiny_model

PROMPT = torch.tensor([[3, 17, 42, 7]])


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path_factory.mktemp("facade") / "m"))


def test_from_pretrained_returns_the_facade_over_a_plain_family_module(loaded):
    assert type(loaded) is Model and loaded.backend == "native"
    assert type(loaded.module) is LlamaForCausalLM
    # The family knows nothing of generation: that is the facade's.
    assert not hasattr(LlamaForCausalLM, "generate") and not hasattr(loaded.module, "generation_config")
    assert loaded.config is loaded.module.config and loaded.lm_head is loaded.module.lm_head
    assert "LlamaForCausalLM" in repr(loaded) and "native" in repr(loaded)


def test_module_methods_that_return_the_module_return_the_facade(loaded):
    assert loaded.to(torch.float32) is loaded and loaded.eval() is loaded and loaded.cpu() is loaded
    assert loaded.requires_grad_(False) is loaded
    assert not loaded.module.training and all(not p.requires_grad for p in loaded.module.parameters())


def test_attributes_set_on_the_facade_are_the_modules_except_its_own(loaded):
    loaded.method_state = 7
    assert loaded.module.method_state == 7 and "method_state" not in vars(loaded)
    del loaded.module.method_state
    config = loaded.generation_config
    loaded.generation_config = config.copy()  # the facade's own: the module has none
    assert not hasattr(loaded.module, "generation_config")
    loaded.generation_config = config


def test_a_family_module_built_by_hand_generates_through_wrap_as_a_loaded_one(loaded):
    config = ModelConfig(**tiny_config())
    module = LlamaForCausalLM(config)
    module.load_state_dict(to_native(tiny_state_dict(tiny_config()), config))  # write_tiny_model's weights
    wrapped = decodekit.wrap(module.eval())
    assert decodekit.wrap(wrapped) is wrapped and wrapped.module is module
    expected = loaded.generate(PROMPT, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(wrapped.generate(PROMPT, max_new_tokens=6, eos_token_id=None), expected)
    batch = wrapped.generate_batch([PROMPT[0].tolist()], max_new_tokens=6, eos_token_id=None, progress_bar=False)
    assert next(iter(batch.values())).generated_tokens == expected[0, PROMPT.shape[1] :].tolist()


def test_wrap_refuses_what_has_no_forward_contract():
    with pytest.raises(TypeError, match=r"wrap\(\) takes a transformers causal LM .* got Linear"):
        decodekit.wrap(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="got str"):
        decodekit.wrap("org/repo")
