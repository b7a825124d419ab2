"""custom_generate/requirements.txt: PEP 508 parsing and checking against installed distributions."""

import pytest
from importlib_metadata import version

from decodekit.hub_loader import check_requirements, parse_requirements, unmet_requirements
from methods import write_method


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
        lines = ["Metadata-Version: 2.1", f"Name: {name.replace('_', '-')}", f"Version: {ver}"]
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
packaging~={version("packaging")}
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
    assert unmet('nonexistent-pkg-xyz>=1; python_version >= "3.0"') == [
        'nonexistent-pkg-xyz>=1; python_version >= "3.0" (installed: None)'
    ]
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


def write_requirements(tmp_path, data: bytes):
    method = tmp_path / "custom_generate"
    method.mkdir(exist_ok=True)
    (method / "requirements.txt").write_bytes(data)
    return method


def test_a_byte_order_mark_crlf_and_comments_after_any_whitespace_are_read_as_pip_reads_them(tmp_path):
    text = "\ufefftorch>=2\r\npluggy\t# a note after a tab\r\n  # an indented comment\r\npackaging  # two spaces\r\n"
    check_requirements(write_requirements(tmp_path, text.encode("utf-8")), "org/repo")  # all met: no error
    assert [str(r) for r in parse_requirements(text.lstrip("\ufeff"))] == ["torch>=2", "pluggy", "packaging"]


def test_a_file_that_is_not_utf8_is_named_in_the_error(tmp_path):
    method = write_requirements(tmp_path, b"torch\n\xff\xfenumpy\n")
    with pytest.raises(ValueError, match=r"org/repo: requirements.txt is not UTF-8 text \(byte 6 is 0xff\)"):
        check_requirements(method, "org/repo")


def test_an_extra_the_distribution_does_not_provide_is_unmet(fake_dists):
    assert unmet("dk-extra-pkg[no-such-extra]>=1") == [
        "dk-extra-pkg[no-such-extra]>=1 (installed: 1.5, which has no extra 'no-such-extra')"
    ]
    assert unmet("pluggy[nonexistent]") == [
        f"pluggy[nonexistent] (installed: {version('pluggy')}, which has no extra 'nonexistent')"
    ]


def test_ten_thousand_lines_are_checked_in_one_pass(tmp_path, monkeypatch):
    # Linear work, checked by what is done rather than by a clock: each line parsed once, the installed
    # distributions listed once per check (a lookup per line took 6-11 s for 10,000 lines).
    from decodekit.hub_loader import requirements

    listed, parsed = [], []
    real_distributions, real_requirement = requirements.distributions, requirements.Requirement
    monkeypatch.setattr(requirements, "distributions", lambda: listed.append(1) or real_distributions())
    monkeypatch.setattr(requirements, "Requirement", lambda text: parsed.append(text) or real_requirement(text))
    lines = [f"dk-absent-{i}>={i % 7}.0; python_version >= '3.0'  # line {i}" for i in range(10_000)]
    with pytest.raises(ImportError) as e:
        check_requirements(write_requirements(tmp_path, "\n".join(lines).encode()), "org/repo")
    assert str(e.value).count("(installed: None)") == 10_000
    assert len(listed) == 1 and len(parsed) == 10_000


# ---- loading as transformers loads a dynamic module: trust, then modules, then requirements, then the files ----


def test_an_untrusted_method_is_told_it_needs_trust_before_what_it_needs_installed(tmp_path):
    from decodekit.hub_loader import UntrustedCodeError, load_method

    repo = write_method(
        tmp_path / "m", "def generate(model, input_ids, **kw):\n    return input_ids\n", "nonexistent-pkg-xyz>=1.0\n"
    )
    with pytest.raises(UntrustedCodeError, match="trust_remote_code"):
        load_method(str(repo), None)
    with pytest.raises(ImportError, match=r"(?s)Missing requirements.*nonexistent-pkg-xyz"):
        load_method(str(repo), True)


def test_a_missing_top_level_module_is_named_as_transformers_names_it(tmp_path):
    pytest.importorskip("transformers")
    from transformers.dynamic_module_utils import check_imports as transformers_check_imports

    from decodekit.hub_loader import load_method

    source = "import torch\nimport not_a_module_xyz.sub\n\ntry:\n    import other_missing_xyz\nexcept ImportError:\n    pass\n\n\ndef generate(model, input_ids, **kw):\n    return input_ids\n"
    repo = write_method(tmp_path / "m", source, "")
    with pytest.raises(ImportError, match="not_a_module_xyz"):
        transformers_check_imports(str(repo / "custom_generate" / "generate.py"))  # the oracle refuses it, naming it
    with pytest.raises(ImportError) as refused:
        load_method(str(repo), True)
    assert "'not_a_module_xyz'" in str(refused.value) and "pip install not_a_module_xyz" in str(refused.value)
    assert "other_missing_xyz" not in str(refused.value)  # guarded by its own try, as transformers leaves it
    assert "Missing requirements" not in str(refused.value)


@pytest.mark.parametrize(
    "statement, missing",
    [
        ("from .beam_constraints import Constraint", "beam_constraints.py"),
        ("from . import beam_constraints", "beam_constraints.py"),
        ("from .utils.scores import best", "utils/scores.py"),
    ],
)
def test_a_relative_import_of_a_file_the_method_lacks_is_refused_before_anything_runs(tmp_path, statement, missing):
    from decodekit.hub_loader import load_method
    from decodekit.hub_loader.snapshot import MethodFilesError

    ran = tmp_path / "ran"
    source = f"open({str(ran)!r}, 'w').close()\n{statement}\n\n\ndef generate(model, input_ids, **kw):\n    return input_ids\n"
    repo = write_method(tmp_path / "m", source, "", extra={"utils/__init__.py": "", "present.py": "X = 1\n"})
    with pytest.raises(
        MethodFilesError, match=rf"custom_generate/generate.py:2 imports .* no custom_generate/{missing}"
    ):
        load_method(str(repo), True)
    assert not ran.exists()  # refused before any of the method's code ran
    fine = write_method(
        tmp_path / "ok",
        "from .present import X\nfrom . import present\n\n\ndef generate(model, input_ids, **kw):\n    return input_ids\n",
        "",
        extra={"present.py": "X = 1\n"},
    )
    assert load_method(str(fine), True).generate is not None
