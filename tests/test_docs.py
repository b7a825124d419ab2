"""The documentation's Python: every block parses, and the blocks marked ```python runnable run as written, in
order, one namespace per page, on the default model (`model`, `tok`, `inputs` and `small_model` are given)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python( runnable)?\n(.*?)^```", re.S | re.M)


def blocks(page: Path, runnable_only: bool = False) -> list[str]:
    return [code for marked, code in BLOCK.findall(page.read_text(encoding="utf-8")) if marked or not runnable_only]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_block_parses(page):
    for i, code in enumerate(blocks(page)):
        ast.parse(code, filename=f"{page.name} block {i + 1}")


RUNNABLE = [page for page in PAGES if blocks(page, runnable_only=True)]


def test_the_readme_quick_start_is_marked_runnable():
    assert ROOT / "README.md" in RUNNABLE


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_runnable_blocks_run(page, default_model):
    model, tok = default_model
    namespace = {"model": model, "tok": tok, "small_model": model,
                 "inputs": tok(["The capital of France is"], return_tensors="pt")}
    for i, code in enumerate(blocks(page, runnable_only=True)):
        exec(compile(code, f"{page.name} runnable block {i + 1}", "exec"), namespace)
