"""The plugin's hooks, registered by hand so the tests do not depend on the package being installed."""

import pytest
import torch

import decodekit
from decodekit.testing import tiny_model
from {{ cookiecutter.module_name }} import plugin

PROMPT = torch.tensor([[5, 6, 7, 8]])
NEW = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    name = "{{ cookiecutter.module_name }}-under-test"
    if decodekit.get_plugin_manager().get_plugin("{{ cookiecutter.module_name }}") is None:
        decodekit.register(plugin, name=name)
    yield tiny_model(tmp_path_factory.mktemp("model"))
    if decodekit.get_plugin_manager().get_plugin(name) is not None:
        decodekit.unregister(name)


def run(model, **kwargs):
    return model.generate(PROMPT, max_new_tokens=NEW, eos_token_id=None, **kwargs)


{% include "hook_tests.py.j2" %}
