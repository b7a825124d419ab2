"""A method's files read once: hashed and copied, in the same read, into a private read-only snapshot, which
is what the trust gate checks and what gets imported.

So the code that runs is byte for byte the code that was hashed: a file changed after the read (by an
editor, a `git checkout`, another process) reaches neither the hash of this call nor its import. What is
read, and what is refused:
- every file under custom_generate/; a symlink only where it stays inside custom_generate/ (the listing shows
  where it points) or, for a Hub download, leads into that repository's own blob store, where huggingface_hub
  keeps the files its snapshot links to. Any other link, to a file or a folder, is refused before anything is
  read through it: a link to /proc/self/environ would be hashed and copied, one to /proc/kmsg would block the
  read; a link loop is refused too;
- `__pycache__/` folders are skipped: the snapshot is imported from its own source, so no bytecode that
  came with the method ever runs;
- bytecode without its source (.pyc, .pyo) and native extensions (.so, .pyd, .dylib, .dll) are refused:
  they cannot be reviewed, and a hash of them says nothing about what they do;
- a file over MAX_FILE_BYTES, or files over MAX_TOTAL_BYTES together, are refused before they are read
  whole (DECODEKIT_MAX_METHOD_BYTES raises the total); so are more than MAX_FILES files, folders nested deeper
  than MAX_DEPTH, a link to something that is not a regular file or folder (a device, a fifo), and a folder
  that cannot be read (each with a sentence naming it);
- a Python file that imports `custom_generate` absolutely (`from custom_generate import helper`) is refused:
  that name is looked up on sys.path, i.e. in the original folder and its unhashed `__pycache__`, not in the
  snapshot; a sibling is imported relatively (`from . import helper`), as transformers requires too.

Snapshots live in a private temporary folder of this process (one per content hash, removed at exit).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

from ..sizes import human_size as _size
from .trust import UntrustedCodeError, content_hash

CHUNK = 1 << 20
MAX_FILE_BYTES = 16 << 20
TOTAL_VARIABLE = "DECODEKIT_MAX_METHOD_BYTES"
REFUSED_SUFFIXES = {
    ".pyc": "bytecode",
    ".pyo": "bytecode",
    ".so": "a native extension",
    ".pyd": "a native extension",
    ".dylib": "a native library",
    ".dll": "a native library",
}
SKIPPED_DIRS = {"__pycache__"}
MAX_FILES = 1000
MAX_DEPTH = 32


class MethodFilesError(UntrustedCodeError):
    """A method's folder holds something decodekit will not run or read: bytecode, a native extension, a
    file or folder over the size limits, a symlink loop."""


class MissingMethodFileError(MethodFilesError, FileNotFoundError):
    """A file the method's code needs (a relative import's target) is not among its files. A FileNotFoundError too,
    as transformers raises for it, so code that catches that around generate() keeps working."""


def changed_while_read(label: str, name: str, what: str) -> MethodFilesError:
    """The error for custom_generate/`name` of `label` changing between the folder's listing and its read."""
    return MethodFilesError(
        f"`{label}`: custom_generate/{name} changed while the method was read ({what}); read it again once it stops "
        "changing."
    )


def max_total_bytes() -> int:
    value = os.environ.get(TOTAL_VARIABLE, "")
    if not value:
        return 64 << 20
    if not value.isdigit():
        raise ValueError(f"{TOTAL_VARIABLE}={value!r} is invalid; expected a number of bytes.")
    return int(value)


def _inside(real: str, roots: tuple[str, ...]) -> bool:
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def _check_link(entry: os.DirEntry, name: str, label: str, roots: tuple[str, ...]) -> None:
    """MethodFilesError unless the symlink `entry` (custom_generate/`name`) leads to an existing regular file or
    folder inside `roots`; decided from the link and the target's metadata, before anything is opened."""
    try:
        target, real = os.readlink(entry.path), os.path.realpath(entry.path)
    except OSError as error:  # removed or replaced since the folder was listed
        raise changed_while_read(label, name, error.strerror or str(error)) from None
    if not os.path.exists(entry.path):
        why = "which does not exist"
    elif not _inside(real, roots):
        why = (
            f"which leads out of the method's folder (to {real}); a method's files must be its own: copy what it "
            "needs into custom_generate/"
        )
    elif not (entry.is_file() or entry.is_dir()):
        why = "which is not a regular file (a device, fifo or socket)"
    else:
        return
    raise MethodFilesError(f"`{label}`: custom_generate/{name} is a symlink to {target}, {why}.")


def _walk(method_dir: Path, label: str, allowed: tuple[str, ...] = ()):
    """(relative posix name, path) of every file to read, sorted, symlinked folders inside the method's folder (or
    `allowed`, real paths) followed once, every other link refused. Iterative, so depth is a limit of ours
    (MAX_DEPTH), not Python's recursion limit."""
    roots = (os.path.realpath(method_dir), *allowed)
    found = []
    stack = [(method_dir, "", (), 0)]  # (folder, its name under custom_generate/, real paths above it, depth)
    while stack:
        folder, prefix, above, depth = stack.pop()
        real = os.path.realpath(folder)
        if real in above:
            raise MethodFilesError(
                f"`{label}`: custom_generate/{prefix} is a symlink loop back to {real}; "
                "a method's folder may not link into itself."
            )
        if depth > MAX_DEPTH:
            raise MethodFilesError(
                f"`{label}`: custom_generate/{prefix} nests folders more than {MAX_DEPTH} deep; a "
                "method's folder may not."
            )
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as error:
            raise MethodFilesError(
                f"`{label}`: custom_generate/{prefix} cannot be read ({error.strerror or error})."
            ) from None
        subfolders = []
        for entry in entries:
            name = prefix + entry.name
            if entry.is_symlink():
                _check_link(entry, name, label, roots)
            if entry.is_dir():  # follows a symlinked folder
                if entry.name not in SKIPPED_DIRS:
                    subfolders.append((Path(entry.path), name + "/", above + (real,), depth + 1))
                continue
            if not entry.is_file():
                continue  # sockets, fifos: nothing Python imports
            why = REFUSED_SUFFIXES.get(Path(entry.name).suffix.lower())
            if why is not None:
                raise MethodFilesError(
                    f"`{label}`: custom_generate/{name} is {why}. decodekit runs a method from its Python source only, "
                    "so that what runs is what can be read and hashed; remove the file (or ship the source)."
                )
            found.append((name, Path(entry.path)))
            if len(found) > MAX_FILES:
                raise MethodFilesError(
                    f"`{label}`: custom_generate/ holds more than {MAX_FILES} files; a method may "
                    f"hold at most {MAX_FILES}. Keep data out of custom_generate/."
                )
        stack.extend(subfolders)
    # The order pins were made with: each folder's entries by name, a subfolder's files where its name falls.
    return sorted(found, key=lambda item: item[0].split("/"))


def _opened(real: str, name: str, label: str, roots: tuple[str, ...]):
    """The file at `real` (a resolved path), opened once and checked as opened: inside the method's folder (or
    `allowed`), not a link (O_NOFOLLOW: one swapped in since the path was resolved is refused), a regular file
    (fstat on the descriptor: a FIFO swapped in is refused, and never waited on: O_NONBLOCK). What the walk saw
    may have changed since; what is read is what this checks."""
    if not _inside(real, roots):
        raise changed_while_read(label, name, f"it is now a link out of the method's folder, to {real}")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(real, flags)
    except OSError as error:
        raise changed_while_read(label, name, f"it is now unreadable: {error.strerror or error}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise changed_while_read(label, name, "it is now not a regular file")
    return os.fdopen(fd, "rb")


class _Snapshots:
    """This process's snapshots, one folder per content hash."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._root: Path | None = None
        self._by_hash: dict[str, Path] = {}

    def root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="decodekit-methods-"))
            atexit.register(_remove, self._root)
        return self._root

    def take(self, method_dir: Path, label: str, show_links: bool, allowed: tuple[str, ...] = ()):
        files = _walk(method_dir, label, allowed)
        limit_total, total = max_total_bytes(), 0
        for name, path in files:  # sizes first: a refusal reads nothing
            try:
                size = path.stat().st_size
            except OSError as error:  # removed since the folder was listed
                raise changed_while_read(label, name, error.strerror or str(error)) from None
            total += size
            if size > MAX_FILE_BYTES:
                raise MethodFilesError(
                    f"`{label}`: custom_generate/{name} is {_size(size)}; a method's file may be at "
                    f"most {_size(MAX_FILE_BYTES)}. Keep data and weights out of custom_generate/."
                )
        if total > limit_total:
            raise MethodFilesError(
                f"`{label}`: custom_generate/ holds {_size(total)}; a method may hold at most "
                f"{_size(limit_total)} ({TOTAL_VARIABLE} raises the limit)."
            )
        with self._lock:
            scratch = Path(tempfile.mkdtemp(dir=self.root(), prefix="taking-"))
        try:
            listing, links, total = [], {}, 0
            real_top = os.path.realpath(method_dir)
            roots = (real_top, *allowed)
            for name, path in files:
                target = scratch / name
                target.parent.mkdir(parents=True, exist_ok=True)
                digest, size = hashlib.sha256(), 0
                real = os.path.realpath(path)
                with _opened(real, name, label, roots) as src, open(target, "wb") as dst:
                    while chunk := src.read(CHUNK):
                        size += len(chunk)
                        total += len(chunk)
                        if size > MAX_FILE_BYTES or total > limit_total:  # it grew while being read
                            raise MethodFilesError(
                                f"`{label}`: custom_generate/{name} grew past the size limit while "
                                "it was read; read it again once it stops changing."
                            )
                        digest.update(chunk)
                        dst.write(chunk)
                listing.append((name, digest.hexdigest()))
                if show_links and real != os.path.join(real_top, name):  # a link on the way: show where it leads
                    links[name] = real
            revision = content_hash(listing)
            with self._lock:
                final = self._by_hash.get(revision)
                if final is None:
                    final = self.root() / revision
                    _make_read_only(scratch)
                    os.rename(scratch, final)
                    self._by_hash[revision] = final
                    scratch = None
        finally:
            if scratch is not None:
                _remove(scratch)
        return final, tuple(listing), links, revision


def _make_read_only(folder: Path) -> None:
    for dirpath, _, filenames in os.walk(folder, topdown=False):  # contents first, then their folder
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), stat.S_IRUSR | stat.S_IRGRP)
        os.chmod(dirpath, stat.S_IRUSR | stat.S_IXUSR)


def _remove(folder: Path) -> None:
    def writable_then_retry(function, path, _):
        os.chmod(os.path.dirname(path), stat.S_IRWXU)
        os.chmod(path, stat.S_IRWXU)
        function(path)

    if os.path.exists(folder):
        os.chmod(folder, stat.S_IRWXU)
        shutil.rmtree(folder, onerror=writable_then_retry)


_snapshots = _Snapshots()


def take_snapshot(method_dir: Path, label: str, show_links: bool = True, allowed: tuple[str, ...] = ()):
    """Reads `method_dir` once into a read-only snapshot. Returns (snapshot folder, ((name, sha256), ...),
    {name: where a symlinked file really is}, content hash). The snapshot folder holds the files under their
    names; the same content taken twice in a process gives the same folder. `allowed`: folders (real paths)
    besides `method_dir` that its symlinks may lead into."""
    return _snapshots.take(Path(method_dir), label, show_links, allowed)
