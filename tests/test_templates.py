"""The authoring workflow: `decodekit new` renders templates whose own tests pass, `decodekit check`
finds what would break a shared repo, and the results run through generate() and `decodekit list`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decodekit.cli import main
from decodekit.registry import manager
from decodekit.templates import render, template_choices
from decodekit.testing import tiny_model
from helpers import PATIENCE

HUB_FILES = {
    "README.md",
    "custom_generate/generate.py",
    "custom_generate/requirements.txt",
    "tests/test_generate.py",
    "tests/test_with_transformers.py",
    ".github/workflows/test.yml",
}


def files_of(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def run_pytest(project: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = None
    if pythonpath is not None:
        import os

        env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=project,
        capture_output=True,
        text=True,
        env=env,
        timeout=PATIENCE,
    )


def test_hub_repos_render_and_their_tests_pass(tmp_path):
    # Every hook point's repository, its own tests run by one pytest (one interpreter start instead of five).
    projects = []
    for hook in template_choices("hub-repo")["hook_point"]:
        project = render(
            "hub-repo", tmp_path / hook.replace(" ", "-"), {"name": "My Method", "hook_point": hook}, no_input=True
        )
        assert project.name == "my-method" and files_of(project) == HUB_FILES, hook
        assert "${{ matrix.python-version }}" in (project / ".github/workflows/test.yml").read_text()
        assert main(["check", str(project)]) == 0, hook
        projects.append(project)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
            # What a rendered method calls is not on its way out of transformers (the full loop passed
            # past_key_values=, which transformers 5.24 deprecates for removal in 5.40).
            "-W",
            "error::FutureWarning",
            *(str(p / "tests") for p in projects),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=PATIENCE,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ran = int(result.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert ran >= 3 * len(projects), result.stdout  # every repository's tests ran, three or more each


def test_rendered_hub_repo_runs_through_generate(tmp_path):
    project = render("hub-repo", tmp_path, {"name": "Avoider"}, no_input=True)
    model = tiny_model(tmp_path)
    prompt = torch.tensor([[5, 6, 7, 8]])
    out = model.generate(
        prompt,
        custom_generate=str(project),
        trust_remote_code=True,
        max_new_tokens=10,
        avoid_last_n=4,
        eos_token_id=None,
    )
    new = out[0].tolist()
    assert all(new[i] not in new[i - 4 : i] for i in range(4, len(new)))


def venv_without_decodekit(root: Path) -> Path:
    """A virtual environment that sees this one's packages (torch, transformers) but not decodekit: its
    site-packages is added by a .pth line, which Python reads as a plain path, so the editable install's own
    finder (a .pth file inside that directory) never runs."""
    import site
    import venv

    venv.create(root, with_pip=False)
    target = next((root / "lib").glob("python3*/site-packages"))
    (target / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return root / "bin" / "python"


def test_a_hub_repos_first_ci_run_passes_where_decodekit_is_not_installed(tmp_path):
    """What the workflow runs on a first push before decodekit can be installed there: every hook point's repository,
    its tests in an environment with torch and transformers but no decodekit. The transformers tests run and pass;
    the decodekit ones are skipped, saying why."""
    projects = [
        render("hub-repo", tmp_path / hook.replace(" ", "-"), {"name": "First Push", "hook_point": hook}, no_input=True)
        for hook in template_choices("hub-repo")["hook_point"]
    ]
    workflow = (projects[0] / ".github/workflows/test.yml").read_text()
    assert "DECODEKIT_REQUIREMENT: ${{ vars.DECODEKIT_REQUIREMENT }}" in workflow and "|| echo" in workflow
    python = venv_without_decodekit(tmp_path / "venv")
    result = subprocess.run(
        [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
            *(str(p / "tests") for p in projects),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=PATIENCE,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert f"{2 * len(projects)} passed" in summary and f"{len(projects)} skipped" in summary, result.stdout
    assert "decodekit is not installed here" in result.stdout


HOOK_OPTIONS = {
    "logits processor": ("_penalty", 1e9),
    "selector": ("_no_immediate_repeat", True),
    "stopping rule": ("_stop_token", None),
    "cache": ("_cache", True),
}


def test_hook_only_repos_run_under_transformers_without_decodekit(tmp_path):
    # One repository per hook point, all run by one child in one environment without decodekit.
    model = tiny_model(tmp_path)
    prompt = torch.tensor([[5, 6, 7, 8]])
    plain = model.generate(prompt, max_new_tokens=8, eos_token_id=None)
    runs, expected = [], []
    for hook, (suffix, value) in HOOK_OPTIONS.items():
        project = render(
            "hub-repo", tmp_path / hook.replace(" ", "-"), {"name": "Lone Method", "hook_point": hook}, no_input=True
        )
        option = {f"lone_method{suffix}": int(plain[0, 6]) if value is None else value}  # stop: the third new token
        runs.append((str(project), option))
        expected.append(
            model.generate(
                prompt,
                custom_generate=str(project),
                trust_remote_code=True,
                max_new_tokens=8,
                eos_token_id=None,
                **option,
            ).tolist()
        )
    python = venv_without_decodekit(tmp_path / "venv")
    script = (
        "import json, sys, torch, transformers\n"
        "try:\n    import decodekit\nexcept ImportError:\n    pass\nelse:\n    sys.exit('decodekit is importable')\n"
        f"model = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'tiny-llama')!r})\n"
        f"outs = [model.generate(torch.tensor([[5, 6, 7, 8]]), custom_generate=repo, trust_remote_code=True,"
        f" max_new_tokens=8, eos_token_id=None, **option).tolist() for repo, option in {runs!r}]\n"
        "print(json.dumps(outs))\n"
    )
    done = subprocess.run([str(python), "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected


def test_plugin_packages_install_list_and_generate(tmp_path, monkeypatch, capsys):
    # One package per hook point, installed by one pip and tested by one pytest (one interpreter start instead of
    # five), then listed and run together: each one's fields default to off, so they do not meet.
    projects = {}
    for hook in template_choices("plugin-package")["hook_point"]:
        name = "Shiny " + hook.title()
        module = name.lower().replace(" ", "_")
        project = render("plugin-package", tmp_path / "src", {"name": name, "hook_point": hook}, no_input=True)
        assert files_of(project) == {
            "README.md",
            "pyproject.toml",
            f"src/{module}/__init__.py",
            f"src/{module}/plugin.py",
            "tests/test_plugin.py",
            ".github/workflows/test.yml",
        }
        projects[hook] = (project, module)
    target = tmp_path / "target"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(target), *(str(project) for project, _ in projects.values())],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
    )
    assert install.returncode == 0, install.stderr
    import os

    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib"]
        + [str(project / "tests") for project, _ in projects.values()],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(target)},
        timeout=PATIENCE,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    monkeypatch.syspath_prepend(str(target))
    manager.reset()
    try:
        assert main(["list"]) == 0
        out = capsys.readouterr().out.splitlines()
        model = tiny_model(tmp_path)
        for hook, (project, module) in projects.items():
            listed = [line for line in out if line.startswith(module + " ")]
            assert listed and "package" in listed[0] and f"{module.replace('_', '-')}==0.1.0" in listed[0], hook
            if hook in ("selector", "whole strategy"):
                out_ids = model.generate(
                    torch.tensor([[5, 6]]),
                    max_new_tokens=8,
                    eos_token_id=None,
                    **{f"{module}_no_immediate_repeat": True},
                )[0].tolist()
                assert all(a != b for a, b in zip(out_ids, out_ids[1:])), hook
    finally:
        manager.reset()
        for name in [m for m in sys.modules if m.startswith("shiny_")]:
            del sys.modules[name]


def test_new_refuses_to_overwrite(tmp_path, capsys):
    args = ["new", "hub-repo", "--no-input", "--name", "Keep Me", "-o", str(tmp_path)]
    assert main(args) == 0
    generate_py = tmp_path / "keep-me" / "custom_generate" / "generate.py"
    generate_py.write_text("# my edits\n")
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "pass --force to overwrite" in err
    assert generate_py.read_text() == "# my edits\n"  # nothing lost
    assert main(args + ["--force"]) == 0
    assert "def generate(model" in generate_py.read_text()
    assert main(["new", "hub-repo", "--no-input", "--hook", "whole strategy", "-o", str(tmp_path / "x")]) == 2
    assert "hook_point='whole strategy' is invalid for hub-repo" in capsys.readouterr().err


@pytest.fixture
def good_repo(tmp_path):
    return render("hub-repo", tmp_path, {"name": "Good"}, no_input=True)


def check_output(repo, capsys):
    code = main(["check", str(repo)])
    return code, capsys.readouterr().out


def test_check_good_repo(good_repo, capsys):
    from decodekit.hub_loader.source import resolve

    code, out = check_output(good_repo, capsys)
    pin = resolve(str(good_repo)).revision
    assert code == 0 and out.startswith(
        f"OK: {good_repo} is a valid custom_generate repository\npin: {good_repo}@{pin}\n"
    )


def test_check_wrong_folder_name(good_repo, capsys):
    (good_repo / "custom_generate").rename(good_repo / "custom-generate")
    code, out = check_output(good_repo, capsys)
    assert code == 1 and "custom-generate: the method folder must be named exactly custom_generate/" in out


def test_check_no_generate(good_repo, capsys):
    (good_repo / "custom_generate" / "generate.py").write_text("def run(model):\n    pass\n")
    code, out = check_output(good_repo, capsys)
    assert code == 1 and "custom_generate/generate.py: defines no generate(model, input_ids, ...) function" in out


def test_check_first_parameter(good_repo, capsys):
    (good_repo / "custom_generate" / "generate.py").write_text(
        "import torch\n\n\ndef generate(input_ids, model):\n    pass\n"
    )
    code, out = check_output(good_repo, capsys)
    assert (
        code == 1
        and "custom_generate/generate.py:4: generate() must take `model` as its first parameter, got (input_ids, model)"
        in out
    )


def test_check_bad_requirements_line(good_repo, capsys):
    (good_repo / "custom_generate" / "requirements.txt").write_text("torch>=2\n-r other.txt\n")
    code, out = check_output(good_repo, capsys)
    assert code == 1 and "custom_generate/requirements.txt:2: '-r other.txt' is not a PEP 508 requirement" in out


def test_check_missing_tag(good_repo, capsys):
    (good_repo / "README.md").write_text("---\ntags:\n- text-generation\n---\n# x\n")
    code, out = check_output(good_repo, capsys)
    assert code == 1 and "README.md:1: the `custom_generate` tag is missing" in out


def test_check_unresolved_relative_import(good_repo, capsys):
    gen = good_repo / "custom_generate" / "generate.py"
    gen.write_text("from .helpers import f\nfrom .sub.mod import g\n\n\ndef generate(model, input_ids):\n    pass\n")
    (good_repo / "custom_generate" / "helpers.py").write_text("def f():\n    pass\n")
    code, out = check_output(good_repo, capsys)
    assert code == 1
    assert (
        "custom_generate/generate.py:2: relative import '.sub.mod' does not resolve: no custom_generate/sub/mod.py"
        in out
    )
    assert "helpers" not in out


def test_check_reports_requirements_unmet_here(good_repo, capsys):
    (good_repo / "custom_generate" / "requirements.txt").write_text("numpy>=99\nno-such-package-xyz\ntorch>=1.0\n")
    code, out = check_output(good_repo, capsys)
    assert code == 1 and "numpy>=99" in out and "no-such-package-xyz" in out and "torch>=1.0" not in out
