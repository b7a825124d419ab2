"""Importing custom_generate/ as a real package, so relative imports work at any depth.

Each (source, revision, content) gets its own package name, so two methods never collide, and
the same one is imported once per process (under a lock: a thread that asks while another imports it waits
for the whole module, never sees it half-executed).

Only the snapshot's sources run (snapshot.py). A method cannot reach back into the folder it was read from:
absolute imports of `custom_generate` are refused in its source (check_imports), and once a method is imported any
import by name that Python would resolve in its original folder, where bytecode in `__pycache__` was never hashed,
raises ImportError instead (OriginalFolderGuard, on sys.meta_path): whoever asks (a method's code, exec'd code with
bare globals, runpy.run_module, pkgutil.resolve_name, pydoc.locate, a thread or an executor the method started) and
through whichever API. Looking at who asks could not hold: a thread's stack has no frame of the method that started
it. Code that opens files by path (runpy.run_path, exec(open(...)), spec_from_file_location, subprocess, ctypes)
is not an import by name; docs/custom-generate.md says what trust covers there.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import threading
from types import ModuleType

from .source import METHOD_DIR, MethodSource
from .trust import content_hash

PACKAGE_PREFIX = "_decodekit_method_"
SIBLINGS_HINT = "import siblings relatively: `from . import helper`"


class OriginalFolderGuard(importlib.abc.MetaPathFinder):
    """Refuses every import that would load from a loaded method's original folder (its real path), where a
    `__pycache__` nobody hashed sits beside the sources; every other import passes untouched."""

    def __init__(self) -> None:
        self.originals: dict[str, str] = {}  # real path of an original custom_generate/ -> the method's label

    def find_spec(self, name, path=None, target=None):
        if not self.originals or name.startswith(PACKAGE_PREFIX):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        places = [spec.origin] if spec.origin else []
        places += list(spec.submodule_search_locations or [])
        for place in places:
            real = os.path.realpath(place)
            for folder, label in self.originals.items():
                if real == folder or real.startswith(folder + os.sep):
                    raise ImportError(
                        f"an import of {name!r} at run time would load it from the original folder of the method "
                        f"`{label}` ({folder}) and its unhashed __pycache__, not from the copy decodekit checked: once "
                        f"a method is loaded, its original folder is imported from nowhere in the process. In a "
                        f"method, {SIBLINGS_HINT}; to work on the folder's own modules, use a process that has not "
                        "loaded it as a method.",
                        name=name,
                    )
        return None


_guard = OriginalFolderGuard()
_lock = threading.RLock()


def guard_original(source: MethodSource) -> None:
    """Puts `source`'s original custom_generate/ under the guard (installed on first use)."""
    _guard.originals[os.path.realpath(source.root / METHOD_DIR)] = source.label
    if _guard not in sys.meta_path:
        sys.meta_path.insert(0, _guard)


def package_name(source: MethodSource) -> str:
    key = f"{source.kind}\0{source.label}\0{source.revision}\0{content_hash(list(source.files))}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    slug = re.sub(r"\W+", "_", source.label).strip("_")[-40:] or "method"
    return f"{PACKAGE_PREFIX}{slug}_{digest}"


def absolute_self_imports(text: str) -> list[int]:
    """Lines of Python source that import `custom_generate` absolutely (`import custom_generate.x`,
    `from custom_generate import x`): Python looks that name up on sys.path, not in the method's snapshot."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []  # the import itself reports a syntax error, with its line
    lines = []
    for node in ast.walk(tree):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level == 0
            else []
        )
        if any(n == "custom_generate" or n.startswith("custom_generate.") for n in names):
            lines.append(node.lineno)
    return sorted(lines)


def _imports(tree: ast.AST):
    """(node, guarded) of each import statement; `guarded` where it sits in a try whose handlers catch ImportError
    (or everything), which transformers' check leaves to the file itself."""
    guarded_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            h.type is None
            or any(kind in ast.unparse(h.type) for kind in ("ImportError", "ModuleNotFound", "Exception"))
            for h in node.handlers
        ):
            guarded_nodes.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, id(node) in guarded_nodes


def _trees(source: MethodSource):
    """(file name, parsed tree) of each Python file of the method; a file that does not parse is left to the
    import, which reports its syntax error with its line."""
    for name, _ in source.files:
        if name.endswith(".py"):
            text = (source.method_dir / name).read_text(encoding="utf-8", errors="replace")
            try:
                yield name, ast.parse(text)
            except (SyntaxError, ValueError):
                continue


def importable(name: str) -> bool:
    """Whether `import name` finds a module, decided as transformers' check_imports decides it: a module already in
    sys.modules counts whatever its __spec__ (a stub, an injected module, a test double: find_spec raises ValueError
    for one whose __spec__ is None), else a finder must find it. Nothing is imported here."""
    if name in sys.modules:
        return sys.modules[name] is not None  # None in sys.modules is Python's own "this import fails"
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder refused it (the guard): the import itself says why
        return True
    except ValueError:  # a module that put itself in sys.modules while being found, without a spec
        return name in sys.modules


def missing_modules(source: MethodSource) -> list[str]:
    """The top-level modules the method's files import absolutely, outside a try that catches ImportError, that are
    not installed here, as transformers' check_imports finds them (importable)."""
    missing = []
    own = {name.split("/")[0].removesuffix(".py") for name, _ in source.files}  # a sibling imported by bare name
    for _, tree in _trees(source):
        for node, guarded in _imports(tree):
            if guarded:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names}:
                if top in ("custom_generate", *own, *missing) or top in sys.builtin_module_names:
                    continue  # the method's own files: the import says where Python would look (OriginalFolderGuard)
                if not importable(top):
                    missing.append(top)
    return sorted(missing)


def check_modules(source: MethodSource) -> None:
    """ImportError naming the modules the method imports that are not installed (missing_modules), before
    requirements.txt is read: transformers refuses such a file the same way, naming them."""
    missing = missing_modules(source)
    if missing:
        raise ImportError(
            f"custom_generate of `{source.label}` imports {', '.join(repr(m) for m in missing)}, not installed in this "
            f"environment: pip install {' '.join(missing)} (the package that provides it, where its name differs)."
        )


def _relative_target_missing(name: str, node: ast.ImportFrom, method_dir) -> str | None:
    """The file a relative import of custom_generate/`name` needs that the method does not have, or None."""
    package = name.split("/")[:-1]  # the importing file's package, as folders under custom_generate/
    if node.level - 1 > len(package):
        return f"{'.' * node.level}{node.module or ''} (above custom_generate/)"
    base = package[: len(package) - (node.level - 1)]
    parts = base + (node.module.split(".") if node.module else [])
    candidates = [parts] if node.module else [parts + [a.name] for a in node.names]
    for target in candidates:
        folder = method_dir.joinpath(*target)
        if folder.with_suffix(".py").is_file() or folder.is_dir():
            continue
        if node.module is None and method_dir.joinpath(*parts, "__init__.py").is_file():
            continue  # `from . import x`: x may be a name the package's __init__.py defines
        return "/".join(target) + ".py"
    return None


def check_imports(source: MethodSource) -> None:
    """MethodFilesError if a file of the method imports custom_generate absolutely (see absolute_self_imports)."""
    from .snapshot import MethodFilesError, MissingMethodFileError

    for name, _ in source.files:
        if name.endswith(".py"):
            lines = absolute_self_imports((source.method_dir / name).read_text(encoding="utf-8", errors="replace"))
            if lines:
                raise MethodFilesError(
                    f"`{source.label}`: custom_generate/{name}:{lines[0]} imports custom_generate absolutely. Python "
                    "finds that name on sys.path (the original folder, and bytecode beside it that was never hashed), "
                    f"not in the copy decodekit checked; {SIBLINGS_HINT}."
                )
    # Every relative import's file exists before anything runs: a missing one started the method and failed with
    # ModuleNotFoundError on a mangled package name.
    for name, tree in _trees(source):
        for node, guarded in _imports(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0 and not guarded:
                missing = _relative_target_missing(name, node, source.method_dir)
                if missing is not None:
                    raise MissingMethodFileError(
                        f"`{source.label}`: custom_generate/{name}:{node.lineno} imports "
                        f"{'.' * node.level}{node.module or ', '.join(a.name for a in node.names)}, but the method has "
                        f"no custom_generate/{missing}; add the file (it was not in the folder decodekit read)."
                    )


def import_generate_module(source: MethodSource) -> ModuleType:
    """custom_generate/generate.py of `source`, imported as `<unique package>.generate` (its files checked first:
    check_imports)."""
    pkg = package_name(source)
    name = f"{pkg}.generate"
    with _lock:
        if name in sys.modules:
            return sys.modules[name]
        guard_original(source)
        return _import_package(pkg, name, source.method_dir)


def _import_package(pkg: str, name: str, method_dir) -> ModuleType:
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
    except BaseException as error:
        # Leave nothing half-imported behind: a fixed file must import fresh next time.
        for mod in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
            del sys.modules[mod]
        if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == "transformers":
            # A method written for transformers, where it is not installed: decodekit's extra installs it, and
            # decodekit's own models then present transformers' generation surface to the method.
            raise ImportError(
                f"{method_dir / 'generate.py'} imports transformers, which is not installed; install it "
                "with:\n    pip install 'decodekit[transformers]'\n(methods written against decodekit's "
                "hooks need no transformers).",
                name="transformers",
            ) from error
        raise
