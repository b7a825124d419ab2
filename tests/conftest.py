import pytest
import torch

from decodekit.loading.default import DefaultModelMissing, default_model_path

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


@pytest.fixture(scope="session")
def default_model_in_transformers(default_model):
    """The embedded default model's GGUF loaded by transformers (float32), once per session: decodekit's Model over
    it (backend="transformers"); `.module` is transformers' own model."""
    pytest.importorskip("transformers")
    from decodekit import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path(), backend="transformers")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local Hub (see hub_server.py) with an empty cache; HF_ENDPOINT points at it."""
    import huggingface_hub.constants as hf_constants

    from hub_server import HubServer

    server = HubServer().start()
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr(hf_constants, "ENDPOINT", server.url)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(
        hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    yield server
    server.stop()
