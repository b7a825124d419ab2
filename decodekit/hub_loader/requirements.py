"""Checking a method's `custom_generate/requirements.txt` against what is installed (PEP 508, via packaging).

The file is read as pip reads it: UTF-8 with or without a byte-order mark, LF or CRLF line ends, `#`
comments at the start of a line or after whitespace. Checking is linear in the file: each line is
parsed once, and the installed distributions are listed once per check.
"""

from __future__ import annotations

import re
from pathlib import Path

from importlib_metadata import distributions
from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

COMMENT = re.compile(r"(^|\s)#.*$")
EXTRA_MARKER = re.compile(r"""extra\s*==\s*['"]([^'"]+)['"]""")
MAX_BYTES = 1 << 20  # a requirements file of 1 MiB is far past any real method's


def _parse_line(raw: str) -> Requirement | None:
    """The requirement on one line, None for a blank or comment line; InvalidRequirement otherwise."""
    line = COMMENT.sub("", raw).strip()
    if not line:
        return None
    if line.startswith("-"):
        raise InvalidRequirement("pip options are not supported")
    return Requirement(line)


def parse_lines(text: str) -> tuple[list[Requirement], list[tuple[int, str, str]]]:
    """(every requirement, (line number, line, reason) of every line that is not one), in one pass."""
    requirements, problems = [], []
    for number, raw in enumerate(text.splitlines(), start=1):
        try:
            req = _parse_line(raw)
        except InvalidRequirement as e:
            problems.append((number, raw.strip(), str(e).splitlines()[0]))
            continue
        if req is not None:
            requirements.append(req)
    return requirements, problems


def requirement_problems(text: str) -> list[tuple[int, str, str]]:
    """(line number, line, reason) for every line that is not a PEP 508 requirement."""
    return parse_lines(text)[1]


def parse_requirements(text: str, source: str = "requirements.txt") -> list[Requirement]:
    """Every requirement line of the file; comments and blank lines skipped.

    Only PEP 508 requirements are accepted: pip options (`-r other.txt`, `--index-url`) and bare URLs
    are not, since they would need pip to resolve.
    """
    requirements, problems = parse_lines(text)
    if problems:
        number, line, reason = problems[0]
        raise ValueError(
            f"{source}, line {number}: {line!r} is not a valid requirement ({reason}). Each line must be a "
            "PEP 508 requirement such as 'numpy>=1.24' or 'foo[extra]==1.0; python_version>=\"3.10\"'."
        )
    return requirements


def read_requirements(path: Path, label: str) -> str:
    """The text of a requirements file, as pip reads it; ValueError naming the file if it is not UTF-8 text."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ValueError(f"{label}: requirements.txt is {size} bytes; at most {MAX_BYTES} are read.")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is not part of line 1
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{label}: requirements.txt is not UTF-8 text (byte {e.start} is {data[e.start]:#04x}); save it as UTF-8."
        ) from None
    return text


class Installed:
    """The installed distributions, listed once: canonical name -> (version, the extras it provides)."""

    def __init__(self) -> None:
        self._found: dict[str, object] = {}
        for dist in distributions():
            name = dist.metadata["Name"]
            if name:
                self._found.setdefault(canonicalize_name(name), dist)  # the first on sys.path wins, as for import

    def version(self, name: str) -> str | None:
        dist = self._found.get(canonicalize_name(name))
        return None if dist is None else dist.version

    def extras(self, name: str) -> set[str]:
        """The extras a distribution declares (Provides-Extra), or names in its requirements' markers (older
        metadata declares none)."""
        dist = self._found.get(canonicalize_name(name))
        if dist is None:
            return set()
        named = set(dist.metadata.get_all("Provides-Extra") or ())
        named.update(m for r in dist.requires or () for m in EXTRA_MARKER.findall(r))
        return {canonicalize_name(e) for e in named}

    def requires(self, name: str) -> list[str]:
        dist = self._found.get(canonicalize_name(name))
        return list(dist.requires or ()) if dist else []


def _satisfied(req: Requirement, version: str | None) -> bool:
    if version is None:
        return False
    try:
        # An installed pre-release counts when its number satisfies the specifier (2.1rc1 meets >=2.0).
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def unmet_requirements(requirements: list[Requirement], installed: Installed | None = None) -> list[str]:
    """One line per unmet requirement, in the form `<requirement> (installed: <version or None>)`.

    A requirement whose environment marker does not apply is skipped. For `pkg[extra]`, an extra the
    installed distribution does not provide is unmet, and the distributions the extra pulls in are checked.
    """
    installed = installed or Installed()
    environment = default_environment()
    lines = []
    for req in requirements:
        if req.marker is not None and not req.marker.evaluate(environment):
            continue
        version = installed.version(req.name)
        if not _satisfied(req, version):
            lines.append(f"{req} (installed: {version})")
            continue
        provided = installed.extras(req.name)
        for extra in sorted(req.extras):
            if canonicalize_name(extra) not in provided:
                lines.append(f"{req} (installed: {version}, which has no extra {extra!r})")
                continue
            for dep_text in installed.requires(req.name):
                dep = Requirement(dep_text)
                if dep.marker is None or not dep.marker.evaluate({**environment, "extra": extra}):
                    continue
                dep_version = installed.version(dep.name)
                if not _satisfied(dep, dep_version):
                    dep.marker = None
                    lines.append(f"{dep} (installed: {dep_version}, needed by {req.name}[{extra}])")
    return lines


def check_requirements(method_dir: Path, label: str) -> None:
    """Raise ImportError listing every unmet line of `method_dir/requirements.txt` (if the file exists)."""
    path = method_dir / "requirements.txt"
    if not path.is_file():
        return
    text = read_requirements(path, label)
    unmet = unmet_requirements(parse_requirements(text, source=f"{label}: requirements.txt"))
    if unmet:
        raise ImportError(f"Missing requirements in your local environment for `{label}`:\n" + "\n".join(unmet))
