"""The documentation's code: every ```python block parses, and runs as written (a page's blocks in order, in one
namespace that starts empty, in an empty working directory, nothing injected), unless it is marked
```python illustrative and says in its first line, a comment, what it needs that a test machine lacks (the Hub,
a running server, Ray or vLLM). The README's quick-start commands run as written too."""

import ast
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)


def blocks(page: Path) -> list[tuple[str, str]]:
    """(marker, code) of each python block: marker "" (runs) or "illustrative"."""
    return [(marker.strip(), code) for marker, code in BLOCK.findall(page.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_block_parses_and_is_runnable_or_says_why_not(page):
    for i, (marker, code) in enumerate(blocks(page)):
        ast.parse(code, filename=f"{page.name} block {i + 1}")
        assert marker in ("", "illustrative"), f"{page.name} block {i + 1}: unknown marker {marker!r}"
        if marker == "illustrative":
            assert code.startswith("# "), f"{page.name} block {i + 1} is illustrative: its first line says what it needs"


RUNNABLE = [page for page in PAGES if any(marker == "" for marker, _ in blocks(page))]


def test_the_readme_quick_start_runs():
    assert ROOT / "README.md" in RUNNABLE


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_runnable_blocks_run_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and none reaches the network
    namespace: dict = {}
    for i, (marker, code) in enumerate(blocks(page)):
        if marker == "":
            exec(compile(code, f"{page.name} block {i + 1}", "exec"), namespace)


def test_the_readme_quick_start_commands_run_as_written(tmp_path, monkeypatch, capsys):
    from decodekit.cli import main

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick_start = text[text.index("## Quick start"):text.index("\n## ", text.index("## Quick start") + 1)]
    commands = re.search(r"^```bash\n(.*?)^```", quick_start, re.S | re.M).group(1)
    monkeypatch.chdir(tmp_path)
    for line in commands.splitlines():
        argv = shlex.split(line, comments=True)
        assert argv[0] == "decodekit", line
        assert main([*argv[1:], *(["--max-new-tokens", "4"] if argv[1] == "generate" else [])]) == 0, line
