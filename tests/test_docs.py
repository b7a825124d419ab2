"""The documentation's code: every ```python block parses, and runs as written (a page's blocks in order, in one
namespace that starts empty, in an empty working directory, nothing injected), unless it is marked
```python illustrative and says in its first line, a comment, what it needs that a test machine lacks (the Hub,
a running server, Ray or vLLM). The README's quick-start commands run as written too."""

import ast
import io
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
            assert code.startswith("# "), (
                f"{page.name} block {i + 1} is illustrative: its first line says what it needs"
            )


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


def test_the_readme_quick_start_commands_then_the_docs_commands_run_as_written(tmp_path, monkeypatch, capsys):
    # In one folder, in a reader's order: the README's quick start, then docs/custom-generate.md's commands, each
    # naming folders of its own (the README's my-method is the logits-processor template, the docs' my-loop a loop).
    from decodekit.cli import main

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick_start = text[text.index("## Quick start") : text.index("\n## ", text.index("## Quick start") + 1)]
    commands = re.search(r"^```bash\n(.*?)^```", quick_start, re.S | re.M).group(1)
    docs = (ROOT / "docs" / "custom-generate.md").read_text(encoding="utf-8")
    commands += "".join(re.findall(r"^```bash\n(.*?)^```", docs, re.S | re.M))
    monkeypatch.chdir(tmp_path)
    for line in commands.splitlines():
        argv = shlex.split(line, comments=True)
        assert argv[0] == "decodekit", line
        if argv[1] == "chat":  # one message typed, then the end of input
            monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n"))
        assert main([*argv[1:], *(["--max-new-tokens", "4"] if argv[1] in ("generate", "chat") else [])]) == 0, line


CONTINUES = "continues "  # in a block's leading comments: "continues the block above (model, tok)", or another place


def undefined_names(code: str) -> set[str]:
    """Names a block reads at any depth that it never binds (assigns, imports, defines, takes as arguments) and that
    are not builtins: what a reader running the block on its own would get a NameError for."""
    import builtins

    tree = ast.parse(code)
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound - set(dir(builtins))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_runs_on_its_own_or_says_it_continues_the_one_above(page):
    # A reader copies one block: it must not stop at a NameError for what an earlier block made (tok, model).
    for i, (marker, code) in enumerate(blocks(page)):
        leading = " ".join(line for line in code.splitlines()[:3] if line.startswith("#"))
        if CONTINUES in leading:
            assert i > 0 or "block above" not in leading, f"{page.name} block {i + 1} continues no block above"
            continue
        missing = undefined_names(code)
        assert not missing, (
            f"{page.name} block {i + 1} reads {sorted(missing)} without defining them: define them, "
            "or say in its leading comment what it continues ('# continues the block above (model, tok)')"
        )


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#") and line.lstrip("#").startswith(" "):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return found


def local_links() -> list[tuple[str, Path, str]]:
    """(where, target page, anchor) of every link to a file of the repository: in the pages' markdown links and in
    the command line's help texts (docs/x.md#anchor)."""
    links = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            links.append((f"{page.name}: {target}", (page.parent / path).resolve() if path else page, anchor))
    for source in (ROOT / "decodekit").rglob("*.py"):
        for path, anchor in re.findall(r"(docs/[\w-]+\.md)#([\w-]+)", source.read_text(encoding="utf-8")):
            links.append((f"{source.name}: {path}#{anchor}", ROOT / path, anchor))
    return links


def test_every_link_to_a_page_and_its_anchor_exists():
    broken = [
        where
        for where, target, anchor in local_links()
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in anchors(target))
    ]
    assert len(local_links()) > 40 and not broken, broken
