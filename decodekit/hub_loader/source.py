"""Where a method's code comes from: a Hub repo (downloaded with huggingface_hub) or a local directory."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .snapshot import take_snapshot

METHOD_DIR = "custom_generate"
HUB_PATTERNS = [f"{METHOD_DIR}/**", "README.md"]


@dataclass(frozen=True)
class MethodSource:
    label: str  # the repo id, or the directory as the user gave it
    kind: str  # "hub" or "local"
    root: Path  # the folder that holds custom_generate/
    revision: str  # the Hub commit sha, or a local directory's content hash
    files: tuple[tuple[str, str], ...]  # (path under custom_generate/, sha256), as read into the snapshot
    snapshot: Path  # the read-only copy of custom_generate/ that was hashed, and is what gets imported
    links: dict = field(default_factory=dict, compare=False)  # path -> where a symlinked file really is

    @property
    def method_dir(self) -> Path:
        """The snapshot of custom_generate/: requirements are read and code imported from here, never from root."""
        return self.snapshot


def layout_problem(root: Path) -> tuple[str, str] | None:
    """(the path at fault, what to do) where `root` does not hold custom_generate/generate.py; None where it does.
    The one layout check: loading a method refuses it, `decodekit check` lists it."""
    if (root / METHOD_DIR / "generate.py").is_file():
        return None
    for candidate in sorted(root.iterdir()):
        if candidate.is_dir() and (candidate / "generate.py").is_file():
            return (
                candidate.name,
                f"the method folder must be named exactly {METHOD_DIR}/ (the Hub looks for that path); rename it",
            )
    if (root / "generate.py").is_file():
        return "generate.py", f"it is at the top level; move it into a folder named {METHOD_DIR}/"
    return (
        f"{METHOD_DIR}/generate.py",
        "missing; create it with a generate(model, input_ids, ...) function or decodekit hooks (optionally "
        f"beside {METHOD_DIR}/requirements.txt)",
    )


def _check_layout(root: Path, label: str) -> None:
    problem = layout_problem(root)
    if problem is not None:
        raise FileNotFoundError(f"`{label}` has no {METHOD_DIR}/generate.py: {problem[0]}: {problem[1]}.")


def from_directory(root: Path, label: str, kind: str, revision: str | None = None) -> MethodSource:
    """A source already on disk, read once into its snapshot (snapshot.py); `revision` defaults to the
    content hash of what was read."""
    _check_layout(root, label)
    # Hub cache files are symlinks into its blob store (<repo>/blobs beside <repo>/snapshots/<sha>): where they point
    # says nothing to a reviewer, and that store is the only place outside custom_generate/ a link may lead.
    blobs = (os.path.realpath(root.parent.parent / "blobs"),) if kind == "hub" else ()
    snapshot, files, links, digest = take_snapshot(root / METHOD_DIR, label, show_links=kind != "hub", allowed=blobs)
    return MethodSource(label, kind, root, revision or digest, files, snapshot, links)


def is_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~")) and "\\" not in text


def resolve(
    spec: str | os.PathLike,
    revision: str | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
) -> MethodSource:
    """A local directory if `spec` is one, else a Hub repo id, downloading only custom_generate/ and README.md."""
    if not str(spec).strip():  # Path("") is the current directory: never load that by accident
        raise ValueError(
            f"custom_generate={str(spec)!r} is empty; it accepts a directory holding "
            "custom_generate/generate.py, a Hub repo id 'org/name', or a callable."
        )
    if len(str(spec)) > 4096:
        raise ValueError(
            f"custom_generate is a string of {len(str(spec))} characters, longer than any path or Hub "
            "repo id (at most 4096)."
        )
    path = Path(spec).expanduser()
    if path.is_dir():
        return from_directory(path.resolve(), str(spec), "local")
    text = str(spec)
    if not is_hub_id(text):
        raise ValueError(
            f"custom_generate={text!r} is neither an existing local directory nor a Hub repo id 'org/name'. "
            "It accepts a directory holding custom_generate/generate.py, a Hub repo id, or a callable."
        )
    from huggingface_hub import snapshot_download

    from .reach import hub_download

    with hub_download(text, "method"):
        snapshot = Path(
            snapshot_download(
                text, revision=revision, allow_patterns=HUB_PATTERNS, token=token, local_files_only=local_files_only
            )
        )
    # The Hub cache stores each revision under snapshots/<commit sha>/.
    return from_directory(snapshot, text, "hub", revision=snapshot.name)
