"""`decodekit search` and `decodekit info`: Hub repositories tagged custom_generate listed through huggingface_hub
against the local Hub (its listing endpoint), and one method described without any of its code running."""

from __future__ import annotations

import hashlib
import json

import pytest

from decodekit.cli import main
from decodekit.hub_loader.discover import card_summary, describe_method, search_methods
from methods import write_method

LOOP = '''
"""Greedy, but never the last token again."""
import torch

RAN = open(__file__ + ".ran", "w")  # imported: the test sees this file appear

def generate(model, input_ids, avoid_last_n=1, generation_config=None, **kwargs):
    return input_ids
'''

HOOKS = '''
"""Temperature as a hook."""

def decodekit_logits_processors(generation_config, context):
    return []
'''

CARD = "---\ntags:\n- custom_generate\n---\n# Never twice\n\n![badge](x.svg)\n\nGreedy decoding that never repeats the last token.\n"


@pytest.fixture
def published(hub, tmp_path):
    """Three repos on the local Hub: two methods (tagged custom_generate) and a plain model repo."""
    loop = write_method(tmp_path / "loop", LOOP, requirements="torch>=2.0\nnot-a-package-anywhere>=1\n", readme=CARD)
    hooks = write_method(tmp_path / "hooks", HOOKS, readme="---\ntags:\n- custom_generate\n---\nA hook method.\n")
    shas = {"acme/never-twice": hub.repos.push_dir("acme/never-twice", loop)}
    shas["acme/warm"] = hub.repos.push_dir("acme/warm", hooks)
    hub.repos.push("acme/plain-model", {"README.md": b"---\ntags:\n- text-generation\n---\nA model.\n"})
    hub.repos.stats.update(
        {
            "acme/never-twice": {"downloads": 10, "likes": 1, "lastModified": "2026-03-01T00:00:00.000Z"},
            "acme/warm": {"downloads": 3, "likes": 7, "lastModified": "2026-05-01T00:00:00.000Z"},
        }
    )
    return shas, loop


def test_search_lists_tagged_repos_in_the_order_asked(published, hub):
    found = search_methods()
    assert [f.id for f in found] == ["acme/never-twice", "acme/warm"]  # most downloaded first; the plain repo left out
    assert found[0].summary == "Greedy decoding that never repeats the last token."
    assert found[0].downloads == 10 and found[0].likes == 1 and found[0].last_modified.startswith("2026-03-01")
    assert [f.id for f in search_methods(sort="likes")] == ["acme/warm", "acme/never-twice"]
    assert [f.id for f in search_methods(sort="updated")] == ["acme/warm", "acme/never-twice"]
    assert [f.id for f in search_methods("never")] == ["acme/never-twice"]
    assert [f.id for f in search_methods(limit=1)] == ["acme/never-twice"]
    assert any(path == "/api/models" for _, path in hub.repos.requests)
    with pytest.raises(ValueError, match="sort='stars' is invalid; expected one of downloads, likes, updated"):
        search_methods(sort="stars")


def test_search_on_the_command_line(published, capsys):
    assert main(["search", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == ["acme/never-twice", "acme/warm"] and rows[1]["summary"] == "A hook method."
    assert main(["search", "never"]) == 0
    out = capsys.readouterr().out
    assert "acme/never-twice  (changed 2026-03-01, 10 downloads, 1 likes)" in out
    assert "Greedy decoding that never repeats the last token." in out and "acme/warm" not in out
    assert main(["search", "nothing-like-this"]) == 0
    assert "No Hub repository tagged custom_generate matches 'nothing-like-this'." in capsys.readouterr().out


def test_info_describes_a_hub_method_without_running_it(published, tmp_path):
    shas, loop = published
    info = describe_method("acme/never-twice")
    assert info.kind == "hub" and info.loop and info.arguments == ["avoid_last_n"]
    assert info.description == "Greedy, but never the last token again." and info.pin == shas["acme/never-twice"]
    assert info.summary == "Greedy decoding that never repeats the last token."
    assert info.requirements == [("torch>=2.0", True), ("not-a-package-anywhere>=1", False)]
    body = (loop / "custom_generate" / "generate.py").read_bytes()
    assert ("custom_generate/generate.py", len(body), hashlib.sha256(body).hexdigest()) in info.files
    assert not list(tmp_path.rglob("generate.py.ran")), "the method's code ran"
    assert f'trust_remote_code="{info.pin}"' in info.commands()[0]
    hooks = describe_method("acme/warm")
    assert not hooks.loop and hooks.hooks == ["decodekit_logits_processors"] and hooks.requirements == []


def test_info_of_a_local_directory_pins_its_content_hash(published, capsys):
    _, loop = published
    info = describe_method(str(loop))
    assert info.kind == "local" and len(info.pin) == 64
    from decodekit.hub_loader import resolve

    assert info.pin == resolve(str(loop)).revision  # what the trust gate asks to be pinned
    assert main(["info", str(loop)]) == 0
    out = capsys.readouterr().out
    assert "a whole decoding loop (generate()); its arguments: avoid_last_n" in out
    assert "NOT MET  not-a-package-anywhere>=1" in out and "met      torch>=2.0" in out
    assert f"pin:          {info.pin}" in out and "nothing of it was run" in out
    assert main(["info", str(loop), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pin"] == info.pin


def test_info_at_a_revision_and_errors_in_one_sentence(published, hub, capsys):
    shas, loop = published
    (loop / "custom_generate" / "generate.py").write_text(LOOP.replace("avoid_last_n=1", "avoid_last_n=2, keep=0"))
    newer = hub.repos.push_dir("acme/never-twice", loop)
    assert describe_method("acme/never-twice").arguments == ["avoid_last_n", "keep"]
    old = describe_method("acme/never-twice", revision=shas["acme/never-twice"])
    assert old.arguments == ["avoid_last_n"] and old.pin == shas["acme/never-twice"] != newer
    capsys.readouterr()
    assert main(["info", "acme/missing-repo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodekit: error: 'acme/missing-repo' is neither a local directory nor a Hub repository")
    assert err.count("\n") == 1
    assert main(["info", "acme/never-twice", "--revision", "0" * 40]) == 2
    assert f"acme/never-twice has no revision {'0' * 40!r} on the Hub." in capsys.readouterr().err


def test_card_summary_takes_the_first_line_of_prose():
    assert card_summary("---\na: 1\n---\n# T\n\n```\ncode\n```\n| a |\nThe line.\nMore.") == "The line."
    assert card_summary("# Only a heading\n") == ""
    assert card_summary("x" * 200).endswith("...") and len(card_summary("x" * 200)) == 160


def test_search_without_the_hub_says_so_in_one_sentence(hub, monkeypatch, capsys):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert main(["search"]) == 2
    err = capsys.readouterr().err
    assert "could not reach the Hub to list its methods" in err and err.count("\n") == 1
