"""Finding methods and looking at one before trusting it: `decodekit search` and `decodekit info`.

search_methods lists Hub repositories tagged `custom_generate` (huggingface_hub's model listing with that filter, as
the Hub's own search does). describe_method reads one method (a Hub repo id or a local directory) without running any
of its code: what it is (hooks or a whole loop, from generate.py's syntax tree), the arguments it declares, its
requirements and whether each is met here, every file with its size and sha256, the revision a pin would hold (a Hub
commit, or a local directory's content hash: what trust_remote_code=<revision> and the trusted-revisions file take),
its card's summary, and the command that would run it with that pin.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from .requirements import parse_requirements, read_requirements, unmet_requirements
from .source import METHOD_DIR, resolve
from .trust import trusted_revisions_file

TAG = "custom_generate"  # the tag the Hub convention asks method repositories to carry
SORTS = {"downloads": "downloads", "likes": "likes", "updated": "last_modified"}


@dataclasses.dataclass
class Listing:
    """One search result."""

    id: str
    last_modified: str | None
    downloads: int | None
    likes: int | None
    summary: str


def search_methods(query: str | None = None, sort: str = "downloads", limit: int = 20) -> list[Listing]:
    """Hub repositories tagged custom_generate (matching `query` where given), most downloaded, most liked or most
    recently changed first (`sort`: one of SORTS), at most `limit`, each with its card's one-line summary."""
    if sort not in SORTS:
        raise ValueError(f"sort={sort!r} is invalid; expected one of {', '.join(SORTS)}.")
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit={limit!r} is invalid; expected an integer >= 1.")
    from huggingface_hub import HfApi

    from .reach import HubUnreachable, unreachable

    try:
        found = list(
            HfApi().list_models(
                filter=TAG,
                search=query or None,
                sort=SORTS[sort],
                limit=limit,
                expand=["downloads", "likes", "lastModified"],
            )
        )
        return [
            Listing(
                id=info.id,
                last_modified=info.last_modified.isoformat() if info.last_modified else None,
                downloads=info.downloads,
                likes=info.likes,
                summary=_hub_summary(info.id),
            )
            for info in found
        ]
    except Exception as error:
        if not unreachable(error):
            raise
        raise HubUnreachable(
            f"could not reach the Hub to list its methods ({type(error).__name__}: "
            f"{(str(error).splitlines() or ['no answer'])[0]}); searching needs the network (HF_ENDPOINT names a "
            "mirror), and `decodekit list` shows the methods already downloaded."
        ) from None


def _hub_summary(repo_id: str) -> str:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return card_summary(Path(hf_hub_download(repo_id, "README.md")).read_text(encoding="utf-8", errors="replace"))
    except EntryNotFoundError:
        return ""


def card_summary(text: str) -> str:
    """A model card's one-line summary: the first line of its body (after the YAML front matter) that is prose, not a
    heading, an image, a badge, a table or code; at most 160 characters."""
    body = re.sub(r"\A---\n.*?\n---\n", "", text, flags=re.S)
    fenced = False
    for line in body.splitlines():
        line = line.strip()
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or not line or line.startswith(("#", "!", "[!", "|", "<", ">", "---", "- ", "* ")):
            continue
        return line if len(line) <= 160 else line[:157].rstrip() + "..."
    return ""


@dataclasses.dataclass
class MethodInfo:
    """What describe_method found (see the module)."""

    spec: str
    kind: str  # "hub" or "local"
    loop: bool  # a whole decoding loop (generate()) rather than hooks
    hooks: list[str]
    arguments: list[str]
    description: str
    requirements: list[tuple[str, bool]]  # (requirement, met here)
    files: list[tuple[str, int, str]]  # (name, bytes, sha256)
    pin: str  # the revision trust_remote_code=<pin> holds
    summary: str

    def commands(self) -> list[str]:
        """How to run it with the pin: in Python, and on the command line through the trusted-revisions file."""
        return [
            f'model.generate(**inputs, custom_generate="{self.spec}", trust_remote_code="{self.pin}")',
            f'echo "{self.spec} {self.pin}" >> {trusted_revisions_file()}  # then: '
            f'decodekit generate "PROMPT" --custom-generate {self.spec}',
        ]


def _resolved(spec: str, revision: str | None):
    """The method's source, read once into its snapshot (never imported here); a repo the Hub does not show, or a
    revision it lacks, said in one sentence."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return resolve(spec, revision=revision)
    except GatedRepoError:
        raise PermissionError(
            f"{spec} is gated on the Hub: ask for access on its page, then log in (`hf auth login`)."
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{spec!r} is neither a local directory nor a Hub repository this machine can see (a private one needs "
            "`hf auth login`)."
        ) from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{spec} has no revision {revision!r} on the Hub.") from None


def describe_method(spec: str, revision: str | None = None) -> MethodInfo:
    """The facts of the method at `spec` (a Hub repo id, downloaded without its code running, or a local directory)
    and `revision`; nothing of it is imported or run."""
    return facts_of(_resolved(spec, revision), str(spec))


def facts_of(source, spec: str) -> MethodInfo:
    """The facts of a method source already read into its snapshot (hub_loader.source.MethodSource)."""
    from ..registry.listing import describe_method_file

    method_dir = source.method_dir
    hooks, arguments, description = describe_method_file(method_dir / "generate.py")
    requirements = []
    if (method_dir / "requirements.txt").is_file():
        wanted = parse_requirements(read_requirements(method_dir / "requirements.txt", source.label))
        # Each one through the loader's own check: an extra's unmet dependency counts against its requirement.
        requirements = [(str(r), not unmet_requirements([r])) for r in wanted]
    readme = source.root / "README.md"
    summary = card_summary(readme.read_text(encoding="utf-8", errors="replace")) if readme.is_file() else ""
    return MethodInfo(
        spec=spec,
        kind=source.kind,
        loop="generate (whole loop)" in hooks,
        hooks=[h for h in hooks if h != "generate (whole loop)"],
        arguments=list(arguments),
        description=description,
        requirements=requirements,
        files=[(f"{METHOD_DIR}/{name}", (method_dir / name).stat().st_size, sha) for name, sha in source.files],
        pin=source.revision,
        summary=summary,
    )


def cached_methods() -> list[MethodInfo]:
    """The facts of every method in this machine's Hub cache (each cached revision of a repo with
    custom_generate/generate.py), read without running any of it."""
    try:
        from huggingface_hub import constants, scan_cache_dir

        cache = scan_cache_dir(constants.HF_HUB_CACHE)
    except Exception:  # no cache yet, or an unreadable one: nothing cached
        return []
    from .source import from_directory

    found = []
    for repo in cache.repos:
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            root = Path(revision.snapshot_path)
            if (root / METHOD_DIR / "generate.py").is_file():
                try:
                    source = from_directory(root, repo.repo_id, "hub", revision=revision.commit_hash)
                except (OSError, ValueError):  # a method whose files cannot be read as a whole is not listed
                    continue
                found.append(facts_of(source, repo.repo_id))
    return found
