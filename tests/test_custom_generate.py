"""custom_generate= from local directories, Hub repos (through the local Hub stand-in) and callables."""

import inspect
import logging

import pytest
import torch

from decodekit import AutoModelForCausalLM
from decodekit.hub_loader import UntrustedCodeError
from decodekit.registry import get_plugin_manager

from helpers import write_tiny_model
from methods import HOOK_METHOD, LENGTHS_FROM_CONFIG, TRANSFORMERS_STYLE_GREEDY, write_method


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path_factory.mktemp("m")))


PROMPT = torch.tensor([[5, 6, 7, 8]])


def test_local_transformers_style_method_runs_unchanged(model, tmp_path):
    repo = write_method(tmp_path / "greedy", TRANSFORMERS_STYLE_GREEDY)
    out = model.generate(input_ids=PROMPT, custom_generate=str(repo), trust_remote_code=True, max_new_tokens=6)
    assert torch.equal(out, model.generate(PROMPT, max_new_tokens=6, eos_token_id=None))
    padded = model.generate(PROMPT, custom_generate=str(repo), trust_remote_code=True, max_new_tokens=3, left_padding=2)
    assert padded.shape == (1, 2 + 4 + 3) and padded[0, :2].tolist() == [0, 0]
    with pytest.raises(ValueError, match="left_padding must be an integer"):
        model.generate(PROMPT, custom_generate=str(repo), trust_remote_code=True, left_padding=-1)


def test_local_directory_needs_trust_and_says_why(model, tmp_path):
    repo = write_method(tmp_path / "greedy", TRANSFORMERS_STYLE_GREEDY)
    with pytest.raises(UntrustedCodeError) as e:
        model.generate(PROMPT, custom_generate=str(repo), max_new_tokens=2)
    message = str(e.value)
    assert "is a local directory, and running it runs its Python code" in message
    assert "generate.py  sha256:" in message
    content_hash = message.split("trust_remote_code='")[1].split("'")[0]
    out = model.generate(PROMPT, custom_generate=str(repo), trust_remote_code=content_hash, max_new_tokens=2)
    assert out.shape == (1, 6)
    (repo / "custom_generate" / "generate.py").write_text(TRANSFORMERS_STYLE_GREEDY + "\n# edited\n")
    with pytest.raises(UntrustedCodeError, match="changed since you pinned it"):
        model.generate(PROMPT, custom_generate=str(repo), trust_remote_code=content_hash, max_new_tokens=2)


def test_relative_imports_at_depth_and_module_reuse(model, tmp_path):
    generate_py = """
        from .utils import double
        from .sub.mod import plus_one
        from . import helpers
        from .sub.deeper.leaf import LEAF

        CALLS = []


        def generate(model, input_ids, **kwargs):
            CALLS.append(1)
            return {"value": plus_one(double(helpers.THREE)) + LEAF, "calls": len(CALLS), "module": __name__}
    """
    extra = {
        "utils.py": "def double(x):\n    return 2 * x\n",
        "helpers.py": "THREE = 3\n",
        "sub/mod.py": "from ..utils import double\n\ndef plus_one(x):\n    return x + 1 + double(0)\n",
        "sub/deeper/leaf.py": "from ...helpers import THREE\nLEAF = 100 * THREE\n",
    }
    repo = write_method(tmp_path / "deep", generate_py, extra=extra)
    first = model.generate(PROMPT, custom_generate=str(repo), trust_remote_code=True)
    second = model.generate(PROMPT, custom_generate=str(repo), trust_remote_code=True)
    assert first["value"] == 2 * 3 + 1 + 300
    assert second["calls"] == 2 and first["module"] == second["module"]  # imported once, reused


def test_two_directories_with_the_same_name_never_collide(model, tmp_path):
    a = write_method(tmp_path / "a" / "method", "def generate(model, input_ids, **kw):\n    return 'a'\n")
    b = write_method(tmp_path / "b" / "method", "def generate(model, input_ids, **kw):\n    return 'b'\n")
    assert model.generate(PROMPT, custom_generate=str(a), trust_remote_code=True) == "a"
    assert model.generate(PROMPT, custom_generate=str(b), trust_remote_code=True) == "b"


@pytest.mark.parametrize(
    "code, error, message",
    [
        ("x = 1\n", AttributeError, "defines neither a generate"),
        (
            "def generate(input_ids, model):\n    pass\n",
            TypeError,
            r"must take `model` as its first parameter, got \(input_ids, model\)",
        ),
    ],
)
def test_bad_method_modules(model, tmp_path, code, error, message):
    repo = write_method(tmp_path / "bad", code)
    with pytest.raises(error, match=message):
        model.generate(PROMPT, custom_generate=str(repo), trust_remote_code=True)


def test_layout_errors(model, tmp_path):
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "generate.py").write_text("def generate(model, input_ids): pass\n")
    with pytest.raises(
        FileNotFoundError, match="generate.py: it is at the top level; move it into a folder named custom_generate/"
    ):
        model.generate(PROMPT, custom_generate=str(tmp_path / "flat"), trust_remote_code=True)
    with pytest.raises(ValueError, match="neither an existing local directory nor a Hub repo id"):
        model.generate(PROMPT, custom_generate="./does/not/exist", trust_remote_code=True)
    with pytest.raises(ValueError, match="custom_generate=42 is invalid"):
        model.generate(PROMPT, custom_generate=42)


def test_unmet_requirements_stop_before_the_code_runs(model, tmp_path):
    repo = write_method(
        tmp_path / "needs", "raise RuntimeError('must not be imported')\n", requirements="foo\ntorch>=99.0\n"
    )
    with pytest.raises(
        ImportError, match="Missing requirements in your local environment for `.*needs`:\nfoo \\(installed: None\\)"
    ):
        model.generate(PROMPT, custom_generate=str(repo), trust_remote_code=True)


def test_hook_method_runs_inside_the_core_loop_for_that_call_only(model, tmp_path):
    repo = write_method(tmp_path / "hooks", HOOK_METHOD)
    plain = model.generate(PROMPT, max_new_tokens=5, eos_token_id=None)
    banned = int(plain[0, 4])
    out = model.generate(
        PROMPT,
        custom_generate=str(repo),
        trust_remote_code=True,
        max_new_tokens=5,
        banned_token=banned,
        eos_token_id=None,
    )
    assert banned not in out[0, 4:].tolist()
    assert out[0, 4] != plain[0, 4]
    names = {name for name, _ in get_plugin_manager().list_name_plugin()}
    assert not any(n.startswith("local:") for n in names)  # unregistered after the call
    with pytest.raises(ValueError, match=r"unknown arguments \['banned_token'\]"):
        model.generate(PROMPT, max_new_tokens=2, banned_token=banned)


def test_callable_receives_prepared_inputs(model):
    seen = {}

    def method(
        model,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        streamer=None,
        boost=None,
        **model_kwargs,
    ):
        seen.update(
            max_length=stopping_criteria.max_length,
            boost=boost,
            streamer=streamer,
            n_processors=len(logits_processor),
            mask=model_kwargs["attention_mask"],
            cache=model_kwargs["past_key_values"],
            temperature=generation_config.temperature,
        )
        return "done"

    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    result = model.generate(
        ids,
        attention_mask=mask,
        custom_generate=method,
        max_new_tokens=7,
        boost=3,
        do_sample=True,
        temperature=0.5,
        top_k=10,
    )
    assert result == "done"
    assert seen["max_length"] == 3 + 7  # prompt length + max_new_tokens
    assert seen["boost"] == 3 and seen["temperature"] == 0.5
    assert seen["n_processors"] == 2  # temperature and top-k, from the config
    assert torch.equal(seen["mask"], mask) and seen["cache"] is not None
    with pytest.raises(ValueError, match="unknown arguments"):
        model.generate(ids, attention_mask=mask, custom_generate=method, max_new_tokens=2, not_declared=1)


def test_hub_method_trust_pinning_and_offline_reuse(model, hub, tmp_path, monkeypatch, caplog):
    import huggingface_hub.constants as hf_constants

    repo = write_method(tmp_path / "repo", TRANSFORMERS_STYLE_GREEDY, requirements="torch>=2\n")
    (repo / "model.safetensors").write_bytes(b"not for method downloads")
    first = hub.repos.push_dir("acme/greedy", repo)
    with pytest.raises(UntrustedCodeError) as e:
        model.generate(PROMPT, custom_generate="acme/greedy", max_new_tokens=3)
    assert f"revision {first}" in str(e.value) and "custom_generate/generate.py" not in str(e.value)
    assert "generate.py  sha256:" in str(e.value) and "requirements.txt  sha256:" in str(e.value)
    with caplog.at_level(logging.INFO, logger="decodekit"):
        out = model.generate(PROMPT, custom_generate="acme/greedy", trust_remote_code=first, max_new_tokens=3)
    assert out.shape == (1, 7) and first in caplog.text
    fetched = {p.split("/resolve/")[1].split("/", 1)[1] for m, p in hub.repos.requests if "/resolve/" in p}
    assert fetched <= {"custom_generate/generate.py", "custom_generate/requirements.txt", "README.md"}

    (repo / "custom_generate" / "generate.py").write_text(TRANSFORMERS_STYLE_GREEDY.replace("argmax", "argmin"))
    second = hub.repos.push_dir("acme/greedy", repo)
    with pytest.raises(UntrustedCodeError, match=f"you trusted revision {first}, but the repo is now at {second}"):
        model.generate(PROMPT, custom_generate="acme/greedy", trust_remote_code=first, max_new_tokens=3)
    pinned = model.generate(
        PROMPT, custom_generate="acme/greedy", revision=first, trust_remote_code=first, max_new_tokens=3
    )
    assert torch.equal(pinned, out)
    changed = model.generate(PROMPT, custom_generate="acme/greedy", trust_remote_code=True, max_new_tokens=3)
    assert not torch.equal(changed, out)

    hub.stop()
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    again = model.generate(
        PROMPT, custom_generate="acme/greedy", revision=first, trust_remote_code=True, max_new_tokens=3
    )
    assert torch.equal(again, out)


def test_model_repo_with_custom_generate_becomes_generate(hub, tmp_path, caplog):
    repo = write_tiny_model(tmp_path / "model")
    write_method(repo, TRANSFORMERS_STYLE_GREEDY)
    sha = hub.repos.push_dir("acme/model-with-method", repo)
    with caplog.at_level(logging.WARNING, logger="decodekit"):
        plain = AutoModelForCausalLM.from_pretrained("acme/model-with-method")
    assert "trust_remote_code=True" in caplog.text
    assert "left_padding" not in inspect.signature(plain.generate).parameters
    custom = AutoModelForCausalLM.from_pretrained("acme/model-with-method", trust_remote_code=True)
    params = list(inspect.signature(custom.generate).parameters)
    assert params[:3] == ["input_ids", "generation_config", "left_padding"]
    out = custom.generate(PROMPT, max_new_tokens=2, left_padding=1)
    assert out.shape == (1, 1 + 4 + 2) and custom.custom_generate_source.revision == sha
    # The built-in generate stays reachable, and a method calling model.generate() does not recurse.
    assert custom.generate(PROMPT, custom_generate=lambda m, ids, *a, **k: "builtin path") == "builtin path"


def test_a_method_bound_from_a_model_repo_gets_the_calls_prepared_config(tmp_path):
    repo = write_tiny_model(tmp_path / "model")
    write_method(repo, LENGTHS_FROM_CONFIG)
    model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)
    plain = AutoModelForCausalLM.from_pretrained(repo)
    assert torch.equal(
        model.generate(PROMPT, max_new_tokens=3), plain.generate(PROMPT, max_new_tokens=3, eos_token_id=None)
    )
    assert model.generate(input_ids=PROMPT, max_length=7).shape == (1, 7)  # by name too


def test_a_method_bound_from_a_model_repo_calling_model_generate_gets_the_builtin_one(tmp_path):
    # The method is handed the model as it was before the binding (no thread-local guard): its model.generate()
    # is the built-in generate, as in transformers; the bound model still runs the method.
    from published_methods import REENTERS_GENERATE

    repo = write_tiny_model(tmp_path / "model")
    write_method(repo, REENTERS_GENERATE)
    model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)
    plain = AutoModelForCausalLM.from_pretrained(repo)
    prefixed = torch.cat([PROMPT[:, :1].repeat(1, 2), PROMPT], dim=-1)
    options = dict(max_new_tokens=5, repetition_penalty=1.3, eos_token_id=None, do_sample=False)
    expected = plain.generate(prefixed, **options)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=5), expected)
    assert "generate" in model.__dict__ and torch.equal(model.generate(PROMPT, max_new_tokens=5), expected)


def test_hook_method_in_a_model_repo(tmp_path):
    repo = write_tiny_model(tmp_path / "model")
    write_method(repo, HOOK_METHOD)
    model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)
    plain = AutoModelForCausalLM.from_pretrained(repo)
    ref = plain.generate(PROMPT, max_new_tokens=4, eos_token_id=None)
    out = model.generate(PROMPT, max_new_tokens=4, eos_token_id=None, banned_token=int(ref[0, 4]))
    assert out[0, 4] != ref[0, 4]


def test_cli_runs_a_method_with_trust_flag_or_trusted_revisions_file(default_model, tmp_path, monkeypatch, capsys):
    from decodekit.cli import main

    repo = write_method(tmp_path / "cli-method", TRANSFORMERS_STYLE_GREEDY)
    base = [
        "generate",
        "The capital of France is",
        "--custom-generate",
        str(repo),
        "--max-new-tokens",
        "3",
        "--no-stream",
    ]
    monkeypatch.setenv("DECODEKIT_CONFIG_DIR", str(tmp_path / "config"))
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "is a local directory" in err
    assert main(base + ["--trust-remote-code", "--arg", "left_padding=0"]) == 0
    assert capsys.readouterr().out.startswith("The capital of France is Paris")
    # The refusal says the line to add, in the command line's words rather than Python's keyword.
    line = err.split("pass --trust-remote-code (or the line '")[1].split("' in ")[0]
    assert line.startswith(f"{repo} ") and f"{tmp_path / 'config' / 'trusted_revisions.txt'}" in err
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "trusted_revisions.txt").write_text(f"# reviewed\n{line}\n")
    assert main(base) == 0
    assert "Paris" in capsys.readouterr().out
    assert main(base + ["--arg", "left_padding"]) == 2
    assert "--arg 'left_padding' is invalid; expected KEY=VALUE" in capsys.readouterr().err


def test_a_hook_only_method_runs_in_the_call_that_named_it(tmp_path, monkeypatch):
    # Before: generate(custom_generate=<hooks>) registered the hooks, then called model.generate() again; now the
    # call goes on from its own arguments (GenerationMixin.generate_call), entering generate() once.
    from decodekit.core.generate import GenerationMixin

    model = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "m"))
    method = write_method(tmp_path / "ban", HOOK_METHOD)
    prompt = torch.tensor([[5, 6, 7]])
    plain = model.generate(prompt, max_new_tokens=4, eos_token_id=None)
    entered = []
    original = GenerationMixin.generate

    def counted(self, *args, **kwargs):
        entered.append(kwargs.get("custom_generate"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", counted)
    banned = int(plain[0, 3])
    out = model.generate(
        prompt,
        max_new_tokens=4,
        eos_token_id=None,
        custom_generate=str(method),
        trust_remote_code=True,
        banned_token=banned,
    )
    assert banned not in out[0, 3:].tolist() and entered == [str(method)]


def test_a_module_in_sys_modules_without_a_spec_counts_as_installed(model, tmp_path, monkeypatch):
    # As transformers' check decides (import_module finds it): a stub, an injected module or a test double has
    # __spec__ None, for which find_spec raises ValueError; that read as "not installed" refused the method.
    import sys
    import types

    monkeypatch.setitem(sys.modules, "fakepkg_xyz", types.ModuleType("fakepkg_xyz"))
    repo = write_method(tmp_path / "stub", "import fakepkg_xyz\n" + TRANSFORMERS_STYLE_GREEDY)
    out = model.generate(PROMPT, custom_generate=str(repo), trust_remote_code=True, max_new_tokens=3)
    assert torch.equal(out, model.generate(PROMPT, max_new_tokens=3, eos_token_id=None))
    monkeypatch.delitem(sys.modules, "fakepkg_xyz")
    with pytest.raises(ImportError, match="imports 'fakepkg_xyz', not installed"):
        model.generate(PROMPT, custom_generate=str(repo), trust_remote_code=True, max_new_tokens=3)


def test_a_missing_relative_import_file_is_a_file_not_found_error_before_requirements(model, tmp_path):
    # transformers reads the files a method's relative imports need before requirements.txt, and a missing one is
    # a FileNotFoundError there: code that catches it around generate() works the same here.
    from decodekit.hub_loader.snapshot import MethodFilesError

    source = "from .helpers import thing\n" + TRANSFORMERS_STYLE_GREEDY
    repo = write_method(tmp_path / "nohelper", source, requirements="foo-not-installed-anywhere\n")
    with pytest.raises(FileNotFoundError, match=r"no custom_generate/helpers\.py") as caught:
        model.generate(PROMPT, custom_generate=str(repo), trust_remote_code=True, max_new_tokens=3)
    assert isinstance(caught.value, MethodFilesError)
    (repo / "custom_generate" / "helpers.py").write_text("thing = 1\n")
    with pytest.raises(ImportError, match="(?s)Missing requirements.*foo-not-installed-anywhere"):
        model.generate(PROMPT, custom_generate=str(repo), trust_remote_code=True, max_new_tokens=3)
