"""`decodekit check DIR`: what would stop a custom_generate repo from working once shared.

Everything is read as text and syntax trees; nothing in the repo is imported or run.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from .importer import absolute_self_imports
from .requirements import parse_lines, read_requirements, unmet_requirements
from .source import METHOD_DIR, layout_problem


@dataclass
class Problem:
    file: str
    line: int | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.message}"


def check_repo(root: Path) -> list[Problem]:
    root = Path(root)
    if not root.is_dir():
        return [Problem(str(root), None, "not a directory; pass the folder that holds custom_generate/")]
    problems = _check_layout(root)
    method = root / METHOD_DIR
    if method.is_dir() and (method / "generate.py").is_file():
        problems += _check_generate(method / "generate.py", root)
        problems += _check_relative_imports(method, root)
    requirements = method / "requirements.txt"
    if requirements.is_file():
        problems += _check_requirements(requirements, root)
    problems += _check_readme(root)
    return problems


def _check_requirements(requirements: Path, root: Path) -> list[Problem]:
    """Lines that are not PEP 508 requirements, else the requirements not met here (as the run would refuse)."""
    name = _rel(requirements, root)
    try:
        text = read_requirements(requirements, str(root))
    except ValueError as e:
        return [Problem(name, None, str(e))]
    requirements, invalid = parse_lines(text)
    found = [
        Problem(name, number, f"{line!r} is not a PEP 508 requirement ({reason}); write e.g. 'numpy>=1.24'")
        for number, line, reason in invalid
    ]
    return found or [
        Problem(name, None, f"not met in this environment: {line}") for line in unmet_requirements(requirements)
    ]


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _check_layout(root: Path) -> list[Problem]:
    problem = layout_problem(root)
    return [] if problem is None else [Problem(problem[0], None, problem[1])]


def _check_generate(path: Path, root: Path) -> list[Problem]:
    name = _rel(path, root)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=name)
    except SyntaxError as e:
        return [Problem(name, e.lineno, f"syntax error: {e.msg}")]
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    problems = _check_hook_names(functions, name)
    if "generate" in functions:
        fn = functions["generate"]
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        if not params or params[0] != "model":
            return problems + [
                Problem(
                    name, fn.lineno, f"generate() must take `model` as its first parameter, got ({', '.join(params)})"
                )
            ]
        return problems
    if any(n.startswith("decodekit_") for n in functions):
        return problems
    return [
        Problem(name, None, "defines no generate(model, input_ids, ...) function and no decodekit hook implementations")
    ]


def _check_hook_names(functions: dict, name: str) -> list[Problem]:
    """Functions named like a hook (decodekit_...) that no hookspec has: generate() would refuse the method."""
    from ..registry.hookspecs import unknown_hook

    return [
        Problem(name, node.lineno, unknown_hook(function))
        for function, node in functions.items()
        if function.startswith("decodekit_") and unknown_hook(function) is not None
    ]


def _check_relative_imports(method: Path, root: Path) -> list[Problem]:
    problems = []
    for path in sorted(method.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except SyntaxError:
            continue  # reported for generate.py; other files fail at import with a clear message anyway
        for line in absolute_self_imports(path.read_text(encoding="utf-8")):
            problems.append(
                Problem(
                    _rel(path, root),
                    line,
                    f"imports {METHOD_DIR} absolutely, which Python finds on "
                    "sys.path rather than in the checked copy (decodekit refuses it); import siblings "
                    "relatively: `from . import helper`",
                )
            )
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            where = Problem(_rel(path, root), node.lineno, "")
            if base != method and method not in base.parents:
                where.message = f"relative import goes above {METHOD_DIR}/; only files inside it are shared"
                problems.append(where)
                continue
            targets = [node.module.replace(".", "/")] if node.module else [a.name for a in node.names]
            for target in targets:
                if not (
                    (base / f"{target}.py").is_file()
                    or (base / target).is_dir()
                    or (not node.module and (base / "__init__.py").is_file())
                ):
                    dots = "." * node.level
                    shown = f"{dots}{node.module}" if node.module else f"{dots}{target}"
                    problems.append(
                        Problem(
                            _rel(path, root),
                            node.lineno,
                            f"relative import {shown!r} does not resolve: no {_rel(base / target, root)}.py",
                        )
                    )
    return problems


def _check_readme(root: Path) -> list[Problem]:
    readme = root / "README.md"
    fix = "start README.md with front matter whose tags list custom_generate: the lines `---`, `tags:`, `- custom_generate`, `---`"
    if not readme.is_file():
        return [Problem("README.md", None, f"missing; create it, document the method's arguments, and {fix}")]
    from huggingface_hub.repocard import metadata_load

    try:
        meta = metadata_load(readme) or {}
    except Exception as e:  # malformed YAML front matter
        return [Problem("README.md", 1, f"front matter is not valid YAML ({e})")]
    tags = meta.get("tags") or []
    if "custom_generate" not in (tags if isinstance(tags, list) else [tags]):
        return [Problem("README.md", 1, f"the `custom_generate` tag is missing: {fix}")]
    return []
