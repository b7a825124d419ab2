"""decodekit as pip installs it from a built wheel: every file it needs at run time is in the wheel, and the
installed package works where this checkout is not importable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from helpers import PATIENCE

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_what_runs_and_works_installed_on_its_own(tmp_path):
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the checkout (build/, egg-info)
    skip = shutil.ignore_patterns(".venv*", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(
        ROOT,
        source,
        ignore=lambda where, names: (
            skip(where, names) | ({"bench", "tests"} & set(names) if Path(where) == ROOT else set())
        ),
    )
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    # A data folder with an importable name printed setuptools' 40-line "Package would be ignored" on every install.
    assert "would be ignored" not in built.stdout + built.stderr, built.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("decodekit-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = {
        "decodekit/kernels/csrc/kernels.cpp",
        "decodekit/kernels/csrc/common.h",
        "decodekit/kernels/csrc/blocks.cpp",
        "decodekit/templates/hub-repo/cookiecutter.json",
        "decodekit/templates/shared-snippets/hooks.py.j2",
        "decodekit/templates/hub-repo/{{cookiecutter.repo_name}}/.github/workflows/test.yml",
        "decodekit/templates/hub-repo/{{cookiecutter.repo_name}}/tests/test_with_transformers.py",
        "decodekit/templates/hub-repo/{{cookiecutter.repo_name}}/tests/test_generate.py",
        "decodekit/templates/plugin-package/{{cookiecutter.repo_name}}/.github/workflows/test.yml",
        "decodekit/chat.py",
        "decodekit/facade/as_transformers.py",
    }
    assert needed <= names, sorted(needed - names)
    assert not any(name.startswith(("tests/", "bench/")) for name in names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "decodekit = decodekit.cli:main" in entry_points and "vllm.logits_processors" in entry_points

    # Installed on its own: the dependencies from this environment, decodekit only from the wheel.
    target = tmp_path / "installed"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    from test_templates import venv_without_decodekit

    python = venv_without_decodekit(tmp_path / "venv")
    script = (
        "import decodekit, sys\n"
        "from decodekit.cli import main\n"
        "print(decodekit.__file__)\n"
        "sys.exit(main(['new', 'hub-repo', '--name', 'From Wheel', '--no-input']))\n"
    )
    ran = subprocess.run(
        [str(python), "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        env={**os.environ, "PYTHONPATH": str(target)},
    )
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    assert ran.stdout.splitlines()[0].startswith(str(target))
    assert (tmp_path / "from-wheel" / ".github/workflows/test.yml").is_file()
    assert (tmp_path / "from-wheel" / "custom_generate/generate.py").is_file()
