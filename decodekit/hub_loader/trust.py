"""The trust gate: no method code is imported unless the caller trusts that exact source.

`trust_remote_code=True` trusts whatever revision is there now; a string trusts only that revision
(a Hub commit sha, or for a local directory the content hash that the refusal message shows).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


class UntrustedCodeError(PermissionError):
    """Method code was not run because the caller did not trust it (or trusted another revision)."""


def code_files(method_dir: Path) -> list[tuple[str, str]]:
    """(relative path, sha256) of every file of the method, sorted; caches and compiled files excluded."""
    out = []
    for path in sorted(method_dir.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
            out.append((path.relative_to(method_dir).as_posix(), hashlib.sha256(path.read_bytes()).hexdigest()))
    return out


def content_hash(files: list[tuple[str, str]]) -> str:
    digest = hashlib.sha256()
    for name, sha in files:
        digest.update(f"{name}\0{sha}\n".encode())
    return digest.hexdigest()


def check_trust(label: str, kind: str, revision: str, files: list[tuple[str, str]], trust_remote_code) -> None:
    """Raise UntrustedCodeError unless `trust_remote_code` allows running `revision` of `label`."""
    listing = "\n".join(f"  {name}  sha256:{sha}" for name, sha in files)
    if trust_remote_code is True:
        return
    if isinstance(trust_remote_code, str) and trust_remote_code:
        if revision == trust_remote_code or (kind == "hub" and len(trust_remote_code) >= 7 and revision.startswith(trust_remote_code)):
            return
        raise UntrustedCodeError(
            f"Refusing to run custom_generate from `{label}`: you trusted revision {trust_remote_code}, but the "
            f"{'repo is now at' if kind == 'hub' else 'directory now has content hash'} {revision}. It changed since "
            f"you pinned it. Review the files, then pin the new revision with trust_remote_code={revision!r}:\n{listing}"
        )
    if trust_remote_code not in (None, False):
        raise ValueError(
            f"trust_remote_code={trust_remote_code!r} is invalid; use True, False, or a revision string to pin."
        )
    if kind == "local":
        how = (
            f"`{label}` is a local directory, and running it runs its Python code. If you wrote it or have read it, "
            f"pass trust_remote_code=True (or trust_remote_code={revision!r} to allow only this content)."
        )
    else:
        how = (
            f"Read the code first (https://huggingface.co/{label}/tree/{revision}), then pass trust_remote_code=True, "
            f"or trust_remote_code={revision!r} to allow only this exact revision."
        )
    raise UntrustedCodeError(
        f"custom_generate from `{label}` was not run: it is code from outside decodekit and trust_remote_code "
        f"is not set. It would run revision {revision} with these files:\n{listing}\n{how}"
    )


def trusted_revisions_file() -> Path:
    """$DECODEKIT_CONFIG_DIR/trusted_revisions.txt, else $XDG_CONFIG_HOME/decodekit/..., else ~/.config/decodekit/..."""
    base = os.environ.get("DECODEKIT_CONFIG_DIR")
    if base:
        return Path(base) / "trusted_revisions.txt"
    xdg = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(xdg) / "decodekit" / "trusted_revisions.txt"


def trusted_revision(label: str, path: Path | None = None) -> str | None:
    """The revision pinned for `label` in the trusted-revisions file: lines of `<repo or dir> <revision>`, # comments."""
    path = path or trusted_revisions_file()
    if not path.is_file():
        return None
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}, line {number}: {raw.strip()!r} should be '<repo id or directory> <revision>'.")
        if parts[0] == label:
            return parts[1]
    return None
