"""custom_generate/requirements.txt: PEP 508 parsing and checking against installed distributions."""

import pytest
from importlib_metadata import version

from decodekit.hub_loader import check_requirements, parse_requirements, unmet_requirements


@pytest.fixture
def fake_dists(tmp_path, monkeypatch):
    """Two installed distributions made of .dist-info folders: a pre-release, and one with an extra."""
    site = tmp_path / "site"
    for name, ver, requires in (
        ("dk_pre_pkg", "2.0rc1", []),
        ("dk_extra_pkg", "1.5", ["dk-missing-dep>=1.0; extra == 'fast'", "packaging; extra == 'ok'"]),
    ):
        info = site / f"{name}-{ver}.dist-info"
        info.mkdir(parents=True)
        lines = [f"Metadata-Version: 2.1", f"Name: {name.replace('_', '-')}", f"Version: {ver}"]
        lines += [f"Requires-Dist: {r}" for r in requires]
        (info / "METADATA").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(site))
    return site


def unmet(text):
    return unmet_requirements(parse_requirements(text))


def test_met_requirements_and_comments():
    text = f"""
# a comment line
torch>=2.0, <3     # several specifiers, trailing comment
packaging~={version('packaging')}
pluggy!=0.1.0
"""
    assert unmet(text) == []


def test_unmet_requirements_message_in_transformers_format(tmp_path):
    method = tmp_path / "custom_generate"
    method.mkdir()
    (method / "requirements.txt").write_text("foo\nbar==0.0.0\ntorch>=99.0\npluggy\n")
    with pytest.raises(ImportError) as e:
        check_requirements(method, "org/repo")
    assert str(e.value) == (
        "Missing requirements in your local environment for `org/repo`:\n"
        "foo (installed: None)\n"
        "bar==0.0.0 (installed: None)\n"
        f"torch>=99.0 (installed: {version('torch')})"
    )


def test_markers_skip_lines_that_do_not_apply():
    assert unmet('nonexistent-pkg-xyz>=1; python_version < "3.0"') == []
    assert unmet('nonexistent-pkg-xyz>=1; python_version >= "3.0"') == ['nonexistent-pkg-xyz>=1; python_version >= "3.0" (installed: None)']
    assert unmet('nonexistent-pkg-xyz; sys_platform == "no-such-platform"') == []


def test_compatible_and_arbitrary_equality_and_prereleases(fake_dists):
    assert unmet("pluggy~=0.1") == [f"pluggy~=0.1 (installed: {version('pluggy')})"]
    assert unmet("dk-pre-pkg===2.0rc1") == []
    assert unmet("dk-pre-pkg===2.0") == ["dk-pre-pkg===2.0 (installed: 2.0rc1)"]
    assert unmet("dk-pre-pkg>=1.0") == []  # an installed pre-release that satisfies the number counts
    assert unmet("dk-pre-pkg>=2.0") == ["dk-pre-pkg>=2.0 (installed: 2.0rc1)"]  # 2.0rc1 comes before 2.0
    assert unmet("dk-pre-pkg>=2.0rc1") == []


def test_extras_check_what_the_extra_pulls_in(fake_dists):
    assert unmet("dk-extra-pkg[ok]>=1") == []
    assert unmet("dk-extra-pkg[fast]>=1") == ["dk-missing-dep>=1.0 (installed: None, needed by dk-extra-pkg[fast])"]


@pytest.mark.parametrize(
    "line",
    ["-r other.txt", "https://example.com/pkg.tar.gz", "foo >= = 1", "--index-url https://x", "!!garbage"],
)
def test_invalid_lines_are_quoted_with_their_number(line):
    with pytest.raises(ValueError) as e:
        parse_requirements(f"torch\n\n{line}\n", source="org/repo: requirements.txt")
    assert f"org/repo: requirements.txt, line 3: {line!r} is not a valid requirement" in str(e.value)
