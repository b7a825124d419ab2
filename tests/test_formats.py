"""`decodekit list --models`: the model files on this machine (the default model, GGUF and safetensors models in the
Hugging Face cache, downloaded here from the local Hub), their formats, and their weights' bytes in the files and as
decodekit holds them, read from the files' headers and checked against what loading each model holds."""

from __future__ import annotations

import json

import pytest
from gguf import GGUFReader
from huggingface_hub import snapshot_download
from safetensors import safe_open

from decodekit import AutoModelForCausalLM
from decodekit.cli import main
from decodekit.kernels import blocks, native
from decodekit.loading.formats import local_models, render_models
from decodekit.testing import write_tiny_gguf, write_tiny_model


@pytest.fixture
def cached(hub, tmp_path):
    """A K-quant GGUF repo (q4 q and k beside a Q6_K v: the fused qkv held as q8) and a safetensors repo, in the
    cache through huggingface_hub's own download."""
    gguf_dir, st_dir = tmp_path / "gguf", tmp_path / "st"
    gguf_dir.mkdir()
    write_tiny_gguf(
        gguf_dir / "tiny-q4_k_m.gguf", "Q4_K", embedding="Q8_0", types={"attn_v": "Q6_K", "ffn_down": "F16"},
        hidden_size=256, intermediate_size=512,
    )  # fmt: skip
    write_tiny_model(st_dir)
    hub.repos.push_dir("acme/tiny-gguf", gguf_dir)
    hub.repos.push_dir("acme/tiny-st", st_dir)
    return {repo: snapshot_download(repo) for repo in ("acme/tiny-gguf", "acme/tiny-st")}


def test_list_models_says_each_files_format_and_what_a_load_holds(cached, capsys):
    if not native.load():
        pytest.skip("without decodekit's kernels a GGUF file loads dequantized")
    assert main(["list", "--models", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert {"acme/tiny-gguf/tiny-q4_k_m.gguf", "acme/tiny-st"} <= set(listed)
    gguf = listed["acme/tiny-gguf/tiny-q4_k_m.gguf"]
    tensors = GGUFReader(gguf["path"]).tensors
    assert gguf["format"] == "GGUF" and gguf["file_bytes"] == sum(int(t.n_bytes) for t in tensors)
    assert gguf["types"] == {k: sum(t.tensor_type.name == k for t in tensors) for k in gguf["types"]}
    assert set(gguf["types"]) == {"Q4_K", "Q6_K", "Q8_0", "F16", "F32"}
    for model in (gguf, listed["acme/tiny-st"]):
        loaded = AutoModelForCausalLM.from_pretrained(model["path"])
        assert model["held"] == blocks.weight_formats(loaded.module)  # the headers say what the load holds
    assert set(gguf["held"]) == {"q4 blocks", "q8 blocks", "float32"}  # v Q6_K: the fused qkv as q8
    with safe_open(f"{cached['acme/tiny-st']}/model.safetensors", "pt") as f:
        assert listed["acme/tiny-st"]["types"] == {"F32": len(list(f.keys()))}
    assert main(["list", "--models"]) == 0
    table = capsys.readouterr().out
    assert "acme/tiny-st" in table and "GGUF: " in table and "q8 blocks" in table


def test_list_models_says_when_there_is_none(monkeypatch):
    from decodekit.loading import formats

    monkeypatch.setattr(formats, "_cached_snapshots", lambda: [])
    monkeypatch.setattr("decodekit.loading.default.default_model_path", lambda: (_ for _ in ()).throw(OSError("no")))
    assert local_models() == []
    assert "No model files here" in render_models([])
