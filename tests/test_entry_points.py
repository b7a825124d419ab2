"""Installed plugin packages (entry-point group `decodekit`), broken ones, selection, strict mode, and `decodekit list`."""

import json
import sys
import textwrap

import pytest
import torch

from decodekit.cli import main
from decodekit.registry import manager
from decodekit.registry.manager import PluginLoadError, get_plugin_manager

from helpers import TableModel
from methods import TRANSFORMERS_STYLE_GREEDY, write_method

PLUGINS = {
    # name: (module source, version)
    "dk_shout": (
        '''
        """Always picks token 3, when shout=True."""
        from decodekit import hookimpl

        @hookimpl
        def decodekit_config_fields():
            return {"shout": False}

        @hookimpl
        def decodekit_token_selector(generation_config):
            if generation_config.shout:
                return lambda input_ids, scores: torch.full((scores.shape[0],), 3, dtype=torch.long)

        import torch
    ''',
        "1.2.0",
    ),
    "dk_broken": ("raise ImportError('dk_broken needs a library that is not installed')\n", "0.1.0"),
    "dk_badsig": (
        """
        from decodekit import hookimpl

        @hookimpl
        def decodekit_logits_processors(generation_config, not_a_hook_argument):
            return []
    """,
        "0.2.0",
    ),
}


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Three distributions installed as .dist-info folders on sys.path, each declaring one entry point."""
    site = tmp_path / "site"
    site.mkdir()
    for module, (source, version) in PLUGINS.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        dist = module.replace("_", "-") + "-plugin"
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[decodekit]\n{module.removeprefix('dk_')} = {module}\n")
    monkeypatch.syspath_prepend(str(site))
    manager.reset()
    yield site
    manager.reset()
    for module in PLUGINS:
        sys.modules.pop(module, None)


def records():
    return {r.name: r for r in manager.plugin_records()}


def test_installed_plugin_is_used_and_broken_ones_are_recorded(installed):
    r = records()
    assert r["shout"].kind == "package" and r["shout"].source == "dk-shout-plugin==1.2.0" and r["shout"].error is None
    assert "decodekit_token_selector" in r["shout"].hooks and r["shout"].kwargs == {"shout": False}
    assert r["shout"].description == "Always picks token 3, when shout=True."
    assert "ImportError: dk_broken needs a library" in r["broken"].error
    assert "not_a_hook_argument" in r["badsig"].error
    model = TableModel(torch.eye(6) * 5)
    prompt = torch.tensor([[1]])
    assert model.generate(prompt, max_new_tokens=2).tolist() == [[1, 1, 1]]  # built-ins still work
    assert model.generate(prompt, max_new_tokens=2, shout=True).tolist() == [[1, 3, 3]]


def test_cli_list_shows_packages_errors_and_json(installed, capsys):
    assert main(["list"]) == 0
    table = capsys.readouterr().out
    assert "shout" in table and "dk-shout-plugin==1.2.0" in table and "ERROR: ImportError: dk_broken" in table
    assert "greedy" in table and "built-in" in table
    assert main(["list", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["shout"]["hooks"] == ["decodekit_config_fields", "decodekit_token_selector"]
    assert rows["broken"]["error"].startswith("ImportError")


def test_load_plugins_selection(installed, monkeypatch):
    monkeypatch.setenv("DECODEKIT_LOAD_PLUGINS", "")
    manager.reset()
    assert "shout" not in records() and "broken" not in records()
    monkeypatch.setenv("DECODEKIT_LOAD_PLUGINS", "shout")
    manager.reset()
    assert "shout" in records() and "broken" not in records() and "badsig" not in records()


def test_strict_mode_raises(installed, monkeypatch):
    monkeypatch.setenv("DECODEKIT_STRICT_PLUGINS", "1")
    monkeypatch.setenv("DECODEKIT_LOAD_PLUGINS", "shout,broken")
    manager.reset()
    with pytest.raises(PluginLoadError, match="plugin 'broken' .*dk-broken-plugin==0.1.0"):
        get_plugin_manager()


def test_cached_hub_methods_are_listed_with_their_revision(hub, tmp_path, capsys):
    from decodekit import AutoModelForCausalLM

    from helpers import write_tiny_model

    repo = write_method(tmp_path / "m", TRANSFORMERS_STYLE_GREEDY)
    sha = hub.repos.push_dir("acme/listed", repo)
    model = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "tiny"))
    model.generate(torch.tensor([[4, 5]]), custom_generate="acme/listed", trust_remote_code=True, max_new_tokens=1)
    main(["list", "--json"])
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["acme/listed"]["kind"] == "hub" and rows["acme/listed"]["source"] == f"acme/listed@{sha}"
    assert rows["acme/listed"]["kwargs"] == {"left_padding": ""}
    assert rows["acme/listed"]["hooks"] == ["generate (whole loop)"]
