"""The trust gate: no method code is imported unless the caller trusts that exact source.

`trust_remote_code=True` trusts whatever revision is there now; a string trusts only that revision
(a Hub commit sha, or for a local directory the content hash that the refusal message shows).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path


class UntrustedCodeError(PermissionError):
    """Method code was not run because the caller did not trust it (or trusted another revision)."""


def content_hash(files: list[tuple[str, str]]) -> str:
    digest = hashlib.sha256()
    for name, sha in files:
        digest.update(f"{name}\0{sha}\n".encode())
    return digest.hexdigest()


HUB_REVISION = re.compile(r"[0-9a-f]{7,40}")
LOCAL_REVISION = re.compile(r"[0-9a-f]{64}")


def check_trust(label: str, kind: str, revision: str, files, trust_remote_code, links: dict | None = None) -> None:
    """Raise UntrustedCodeError unless `trust_remote_code` allows running `revision` of `label`; ValueError if
    `trust_remote_code` is neither a bool nor a plausible revision."""
    links = links or {}
    listing = "\n".join(
        f"  {name}  sha256:{sha}" + (f"  (a link to {links[name]})" if name in links else "") for name, sha in files
    )
    if trust_remote_code is True:
        return
    what = "commit sha" if kind == "hub" else "content hash"
    if isinstance(trust_remote_code, str) and trust_remote_code:
        pin = trust_remote_code.strip().lower()
        if kind == "hub" and HUB_REVISION.fullmatch(pin) and revision.startswith(pin):
            return
        if kind == "local" and pin == revision:
            return
        if kind == "local" and len(pin) < 64 and revision.startswith(pin) and re.fullmatch(r"[0-9a-f]+", pin):
            raise UntrustedCodeError(
                f"Refusing to run custom_generate from `{label}`: trust_remote_code={trust_remote_code!r} is a prefix "
                f"of its content hash; a local directory is pinned by the whole hash, "
                f"trust_remote_code={revision!r}.\n{listing}"
            )
        if not (HUB_REVISION if kind == "hub" else LOCAL_REVISION).fullmatch(pin):
            raise ValueError(
                f"trust_remote_code={trust_remote_code!r} is invalid for `{label}`: expected True, False, or a revision "
                f"to pin, which for {'a Hub repo is a commit sha (7 to 40 hex digits)' if kind == 'hub' else 'a local directory is its content hash (64 hex digits)'}."
                f" This one is at {what} {revision}."
            )
        raise UntrustedCodeError(
            f"Refusing to run custom_generate from `{label}`: you trusted revision {trust_remote_code}, but the "
            f"{'repo is now at' if kind == 'hub' else 'directory now has content hash'} {revision}. It changed since "
            f"you pinned it. Review the files, then pin the new revision with trust_remote_code={revision!r}:\n{listing}"
        )
    if trust_remote_code not in (None, False):
        raise ValueError(
            f"trust_remote_code={trust_remote_code!r} is invalid; use True, False, or a revision string to pin "
            f"(for `{label}`, its {what} {revision})."
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
