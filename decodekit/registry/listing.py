"""What `decodekit list` shows: registered plugins, plugins that failed to load, and the custom_generate
methods already in the Hugging Face cache (read with `ast`, never imported: listing runs no remote code)."""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

from .manager import PluginRecord, plugin_records


def describe_method_file(path: Path) -> tuple[list[str], dict[str, str], str]:
    """(hooks, kwargs, description) of a custom_generate/generate.py, from its syntax tree."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError) as e:
        return [], {}, f"unreadable generate.py: {e}"
    hooks, kwargs = [], {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name == "generate":
                hooks.append("generate (whole loop)")
                args = node.args.args + node.args.kwonlyargs
                kwargs = {a.arg: "" for a in args[2:] if a.arg not in ("generation_config",)}
            elif node.name.startswith("decodekit_"):
                hooks.append(node.name)
    doc = ast.get_docstring(tree) or ""
    return hooks, kwargs, doc.strip().splitlines()[0] if doc.strip() else ""


def cached_hub_methods() -> list[PluginRecord]:
    try:
        from huggingface_hub import constants, scan_cache_dir

        cache = scan_cache_dir(constants.HF_HUB_CACHE)  # the cache downloads go to, read at call time
    except Exception:  # no cache yet, or an unreadable one: nothing to list
        return []
    out = []
    for repo in cache.repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            method = Path(rev.snapshot_path) / "custom_generate" / "generate.py"
            if method.is_file():
                hooks, kwargs, doc = describe_method_file(method)
                out.append(PluginRecord(repo.repo_id, "hub", f"{repo.repo_id}@{rev.commit_hash}", doc, hooks, kwargs))
    return out


def all_records() -> list[PluginRecord]:
    return plugin_records() + cached_hub_methods()


def render_table(records: list[PluginRecord], width: int | None = None) -> str:
    """One row per decoder when the table fits in `width` columns (default: the terminal's; None and 0 mean no
    limit), else one block per decoder with every line wrapped to `width`."""
    rows = [("NAME", "KIND", "SOURCE", "HOOKS", "KWARGS", "DESCRIPTION")]
    for r in records:
        hooks = ", ".join(h.removeprefix("decodekit_") for h in r.hooks) or "-"
        kwargs = ", ".join(r.kwargs) or "-"  # names only; --json gives the defaults
        rows.append((r.name, r.kind, r.source or "-", hooks, kwargs, f"ERROR: {r.error}" if r.error else r.description))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths)) + "  " + row[5] for row in rows]
    if not width or max(len(line) for line in table) <= width:
        return "\n".join(line.rstrip() for line in table)
    return "\n\n".join(_block(row, width) for row in rows[1:])


def _block(row: tuple[str, ...], width: int) -> str:
    name, kind, source, hooks, kwargs, description = row
    lines = textwrap.wrap(f"{name} ({kind}) {source}", width, subsequent_indent="    ", break_on_hyphens=False)
    for label, text in (("hooks", hooks), ("kwargs", kwargs), ("", description)):
        if text and text != "-":
            lines += textwrap.wrap(
                f"{label}: {text}" if label else text,
                width,
                initial_indent="  ",
                subsequent_indent="    ",
                break_on_hyphens=False,
            )
    return "\n".join(lines)


def render_json(records: list[PluginRecord]) -> str:
    return json.dumps([r.as_dict() for r in records], indent=2, default=repr)
