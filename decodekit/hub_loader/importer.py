"""Importing custom_generate/ as a real package, so relative imports work at any depth.

Each (source, revision, content) gets its own package name, so two methods never collide, and
the same one is imported once per process.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.machinery
import importlib.util
import re
import sys
from types import ModuleType

from .source import MethodSource
from .trust import content_hash


def package_name(source: MethodSource) -> str:
    key = f"{source.kind}\0{source.label}\0{source.revision}\0{content_hash(list(source.files))}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    slug = re.sub(r"\W+", "_", source.label).strip("_")[-40:] or "method"
    return f"_decodekit_method_{slug}_{digest}"


def absolute_self_imports(text: str) -> list[int]:
    """Lines of Python source that import `custom_generate` absolutely (`import custom_generate.x`,
    `from custom_generate import x`): Python looks that name up on sys.path, not in the method's snapshot."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []  # the import itself reports a syntax error, with its line
    lines = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        if any(n == "custom_generate" or n.startswith("custom_generate.") for n in names):
            lines.append(node.lineno)
    return sorted(lines)


def check_imports(source: MethodSource) -> None:
    """MethodFilesError if a file of the method imports custom_generate absolutely (see absolute_self_imports)."""
    from .snapshot import MethodFilesError

    for name, _ in source.files:
        if name.endswith(".py"):
            lines = absolute_self_imports((source.method_dir / name).read_text(encoding="utf-8", errors="replace"))
            if lines:
                raise MethodFilesError(
                    f"`{source.label}`: custom_generate/{name}:{lines[0]} imports custom_generate absolutely. Python "
                    "finds that name on sys.path (the original folder, and bytecode beside it that was never hashed), "
                    "not in the copy decodekit checked; import siblings relatively: `from . import helper`.")


def import_generate_module(source: MethodSource) -> ModuleType:
    """custom_generate/generate.py of `source`, imported as `<unique package>.generate`."""
    pkg = package_name(source)
    name = f"{pkg}.generate"
    if name in sys.modules:
        return sys.modules[name]
    check_imports(source)
    method_dir = source.method_dir
    init = method_dir / "__init__.py"
    if init.is_file():
        spec = importlib.util.spec_from_file_location(pkg, init, submodule_search_locations=[str(method_dir)])
    else:
        spec = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
        spec.submodule_search_locations = [str(method_dir)]
    package = importlib.util.module_from_spec(spec)
    sys.modules[pkg] = package
    try:
        if spec.loader is not None:
            spec.loader.exec_module(package)
        return importlib.import_module(name)
    except BaseException:
        # Leave nothing half-imported behind: a fixed file must import fresh next time.
        for mod in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
            del sys.modules[mod]
        raise
