import pytest
import torch

from decodekit.models.default import DefaultModelMissing, default_model_path

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, loaded once per test session."""
    try:
        path = default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(f"default model not installed ({e}); `make test` installs it")
    from decodekit import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
