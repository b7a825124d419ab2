"""Checking a method's `custom_generate/requirements.txt` against what is installed (PEP 508, via packaging)."""

from __future__ import annotations

from pathlib import Path

from importlib_metadata import PackageNotFoundError, distribution
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version


def _parse_line(raw: str) -> Requirement | None:
    """The requirement on one line, None for a blank or comment line; InvalidRequirement otherwise."""
    line = "" if raw.lstrip().startswith("#") else raw.split(" #", 1)[0].strip()
    if not line:
        return None
    if line.startswith("-"):
        raise InvalidRequirement("pip options are not supported")
    return Requirement(line)


def requirement_problems(text: str) -> list[tuple[int, str, str]]:
    """(line number, line, reason) for every line that is not a PEP 508 requirement."""
    problems = []
    for number, raw in enumerate(text.splitlines(), start=1):
        try:
            _parse_line(raw)
        except InvalidRequirement as e:
            problems.append((number, raw.strip(), str(e).splitlines()[0]))
    return problems


def parse_requirements(text: str, source: str = "requirements.txt") -> list[Requirement]:
    """Every requirement line of the file; comments and blank lines skipped.

    Only PEP 508 requirements are accepted: pip options (`-r other.txt`, `--index-url`) and bare URLs
    are not, since they would need pip to resolve.
    """
    problems = requirement_problems(text)
    if problems:
        number, line, reason = problems[0]
        raise ValueError(
            f"{source}, line {number}: {line!r} is not a valid requirement ({reason}). Each line must be a "
            "PEP 508 requirement such as 'numpy>=1.24' or 'foo[extra]==1.0; python_version>=\"3.10\"'."
        )
    return [req for req in map(_parse_line, text.splitlines()) if req is not None]


def installed_version(name: str) -> str | None:
    try:
        return distribution(name).version
    except PackageNotFoundError:
        return None


def _satisfied(req: Requirement, version: str | None) -> bool:
    if version is None:
        return False
    try:
        # An installed pre-release counts when its number satisfies the specifier (2.1rc1 meets >=2.0).
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def unmet_requirements(requirements: list[Requirement]) -> list[str]:
    """One line per unmet requirement, in the form `<requirement> (installed: <version or None>)`.

    A requirement whose environment marker does not apply is skipped. For `pkg[extra]`, the
    distributions that extra pulls in are checked too.
    """
    lines = []
    for req in requirements:
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = installed_version(req.name)
        if not _satisfied(req, version):
            lines.append(f"{req} (installed: {version})")
            continue
        for extra in sorted(req.extras):
            for dep_text in distribution(req.name).requires or ():
                dep = Requirement(dep_text)
                if dep.marker is None or not dep.marker.evaluate({"extra": extra}):
                    continue
                dep_version = installed_version(dep.name)
                if not _satisfied(dep, dep_version):
                    dep.marker = None
                    lines.append(f"{dep} (installed: {dep_version}, needed by {req.name}[{extra}])")
    return lines


def check_requirements(method_dir: Path, label: str) -> None:
    """Raise ImportError listing every unmet line of `method_dir/requirements.txt` (if the file exists)."""
    path = method_dir / "requirements.txt"
    if not path.is_file():
        return
    unmet = unmet_requirements(parse_requirements(path.read_text(encoding="utf-8"), source=f"{label}: requirements.txt"))
    if unmet:
        raise ImportError(f"Missing requirements in your local environment for `{label}`:\n" + "\n".join(unmet))
