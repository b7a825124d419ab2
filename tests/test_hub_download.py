"""Loading a model from a Hub repo id through huggingface_hub, against the local Hub stand-in."""

from pathlib import Path

import huggingface_hub.constants as hf_constants
import pytest
import torch

from decodekit import AutoModelForCausalLM

from helpers import write_tiny_model


def test_download_then_offline_cache_reuse(hub, tmp_path, monkeypatch):
    local = write_tiny_model(tmp_path / "src", "qwen2", shards=2)
    (local / "README.md").write_text("not needed for a model load")
    sha = hub.repos.push_dir("acme/tiny-qwen", local)
    model = AutoModelForCausalLM.from_pretrained("acme/tiny-qwen")
    reference = AutoModelForCausalLM.from_pretrained(local)
    ids = torch.tensor([[4, 5, 6]])
    assert torch.equal(model.generate(ids, max_new_tokens=6), reference.generate(ids, max_new_tokens=6))
    fetched = {p.rsplit("/", 1)[-1] for m, p in hub.repos.requests if "/resolve/" in p and m == "GET"}
    assert "README.md" not in fetched and "model.safetensors.index.json" in fetched
    assert (Path(hf_constants.HF_HUB_CACHE) / "models--acme--tiny-qwen" / "snapshots" / sha).is_dir()

    hub.stop()
    hub.repos.requests.clear()
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    cached = AutoModelForCausalLM.from_pretrained("acme/tiny-qwen")
    assert torch.equal(cached.generate(ids, max_new_tokens=6), reference.generate(ids, max_new_tokens=6))


def test_revision_pinning_and_upstream_change(hub, tmp_path):
    first = hub.repos.push_dir("acme/tiny", write_tiny_model(tmp_path / "v1", seed=1))
    hub.repos.push_dir("acme/tiny", write_tiny_model(tmp_path / "v2", seed=2))
    latest = AutoModelForCausalLM.from_pretrained("acme/tiny")
    pinned = AutoModelForCausalLM.from_pretrained("acme/tiny", revision=first)
    v1 = AutoModelForCausalLM.from_pretrained(tmp_path / "v1")
    v2 = AutoModelForCausalLM.from_pretrained(tmp_path / "v2")
    assert torch.equal(pinned.embed.weight, v1.embed.weight)
    assert torch.equal(latest.embed.weight, v2.embed.weight)


def test_unknown_repo_is_a_clear_error(hub):
    from huggingface_hub.errors import RepositoryNotFoundError

    with pytest.raises(RepositoryNotFoundError):
        AutoModelForCausalLM.from_pretrained("acme/missing")


def test_decodekit_download_fetches_what_a_load_reads_then_loads_run_offline(hub, tmp_path, monkeypatch, capsys):
    from decodekit.cli import main

    local = write_tiny_model(tmp_path / "src", "qwen2")
    (local / "notes.bin").write_bytes(b"\0" * 1000)  # a file no load reads: not fetched
    sha = hub.repos.push_dir("acme/tiny-dl", local)
    assert main(["download", "acme/tiny-dl"]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert folder == Path(hf_constants.HF_HUB_CACHE) / "models--acme--tiny-dl" / "snapshots" / sha
    assert (folder / "config.json").is_file() and not (folder / "notes.bin").exists()
    hub.stop()
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    ids = torch.tensor([[4, 5, 6]])
    cached = AutoModelForCausalLM.from_pretrained("acme/tiny-dl")
    assert torch.equal(
        cached.generate(ids, max_new_tokens=4),
        AutoModelForCausalLM.from_pretrained(local).generate(ids, max_new_tokens=4),
    )


@pytest.mark.parametrize("offline", [False, True], ids=["hub-unreachable", "offline-not-cached"])
def test_a_hub_that_cannot_be_reached_names_the_repo_and_the_ways_on(hub, tmp_path, monkeypatch, capsys, offline):
    # Before: a raw ConnectError (or LocalEntryNotFoundError) with no word on offline use or local paths.
    from decodekit.cli import main
    from decodekit.hub_loader import load_method
    from decodekit.hub_loader.reach import HubUnreachable

    hub.stop()
    if offline:
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        HubUnreachable,
        match=r"could not fetch the model 'acme/nowhere' from the Hub .* local directory "
        r".*`decodekit download acme/nowhere`.*HF_HUB_OFFLINE=1",
    ):
        AutoModelForCausalLM.from_pretrained("acme/nowhere")
    with pytest.raises(
        HubUnreachable, match=r"the method 'acme/a-method' .*`decodekit download --method acme/a-method`"
    ) as refused:
        load_method("acme/a-method", True)
    assert ".gguf" not in str(refused.value)  # a method is no model file
    assert main(["download", "acme/nowhere"]) == 2
    err = capsys.readouterr().err
    # decodekit download itself does not send the user to the command just run.
    assert "could not fetch the model 'acme/nowhere'" in err and "Run this again where the Hub can be reached" in err
    assert "`decodekit download" not in err
