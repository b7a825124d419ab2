"""Hardening: the trust gate covers every byte that runs, one broken plugin cannot break generate(), and
bad values are clear errors. Each case here was reproduced against the earlier code first."""

import os
import py_compile
import re
import resource
import sys
import threading

import pytest
import torch

import decodekit
from decodekit.hub_loader import UntrustedCodeError, load_method
from decodekit.hub_loader.snapshot import MethodFilesError
from decodekit.registry import manager
from decodekit.registry.manager import PluginError

from helpers import PATIENCE, TableModel
from methods import write_method

# A method whose generate() says which version of it ran.
VERSIONED = """
def generate(model, input_ids, **kwargs):
    return "{marker}"
"""
EVIL = 'def generate(model, input_ids, **kwargs):\n    return "evil"\n'


def versioned(root, marker, **kw):
    return write_method(root, VERSIONED.format(marker=marker), **kw)


@pytest.fixture
def model():
    return TableModel(torch.eye(8) * 4 + torch.roll(torch.eye(8), 1, dims=1) * 5)  # token i -> i+1


PROMPT = torch.tensor([[1, 2]])


def run(model, repo, trust=True, **kwargs):
    return model.generate(PROMPT, custom_generate=str(repo), trust_remote_code=trust, **kwargs)


# ---- the trust gate ----


def test_bytecode_in_pycache_never_runs(model, tmp_path):
    repo = versioned(tmp_path / "m", "source")
    evil = tmp_path / "evil.py"
    evil.write_text(EVIL)
    cache = repo / "custom_generate" / "__pycache__"
    cache.mkdir()
    tag = sys.implementation.cache_tag
    # Unchecked-hash bytecode is what Python would load for generate.py without looking at the source.
    py_compile.compile(
        str(evil),
        cfile=str(cache / f"generate.{tag}.pyc"),
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )
    assert run(model, repo) == "source"
    assert all("__pycache__" not in name for name, _ in load_method(str(repo), True).source.files)


@pytest.mark.parametrize("name", ["helper.pyc", "fast.so", "sub/native.cpython-311-x86_64-linux-gnu.so", "old.pyo"])
def test_sourceless_bytecode_and_native_extensions_are_refused(model, tmp_path, name):
    repo = versioned(tmp_path / "m", "source")
    path = repo / "custom_generate" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * 16)
    with pytest.raises(MethodFilesError, match=f"custom_generate/{name} is (bytecode|a native extension)"):
        run(model, repo)


def test_a_symlinked_folder_inside_the_method_is_read_hashed_and_listed_so_a_pin_holds(model, tmp_path):
    repo = write_method(
        tmp_path / "m", "from .shared.value import MARK\n\ndef generate(model, input_ids, **kw):\n    return MARK\n"
    )
    inside = repo / "custom_generate" / "real"
    inside.mkdir()
    (inside / "__init__.py").write_text("")
    (inside / "value.py").write_text("MARK = 'first'\n")
    (repo / "custom_generate" / "shared").symlink_to(inside, target_is_directory=True)
    with pytest.raises(UntrustedCodeError) as refused:
        run(model, repo, trust=None)
    assert "shared/value.py  sha256:" in str(refused.value) and f"a link to {inside / 'value.py'}" in str(refused.value)
    pin = load_method(str(repo), True).source.revision
    assert run(model, repo, trust=pin) == "first"
    (inside / "value.py").write_text("MARK = 'second'\n")  # the target changes under the same pin
    with pytest.raises(UntrustedCodeError, match="changed since you pinned it"):
        run(model, repo, trust=pin)


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_link_that_leads_out_of_the_method_folder_is_refused_before_it_is_read(model, tmp_path, kind, monkeypatch):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "value.py").write_text("MARK = 'outside'\n")
    repo = versioned(tmp_path / "m", "source")
    link = repo / "custom_generate" / ("shared" if kind == "folder" else "value.py")
    link.symlink_to(outside if kind == "folder" else outside / "value.py", target_is_directory=kind == "folder")
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    for trust in (None, True):
        with pytest.raises(
            MethodFilesError,
            match=re.escape(f"custom_generate/{link.name} is a symlink to ") + r".*leads out of the method's folder",
        ):
            run(model, repo, trust=trust)
    assert not [path for path in opened if "outside" in path]


@pytest.mark.parametrize("target", ["/proc/self/environ", "/proc/kmsg"])
def test_a_link_into_proc_is_refused_at_once_with_or_without_trust(model, tmp_path, target):
    # Before: /proc/self/environ was read, hashed and copied into the snapshot; /proc/kmsg blocked load_method.
    repo = versioned(tmp_path / "m", "source")
    (repo / "custom_generate" / "data.txt").symlink_to(target)
    for trust in (None, True):
        outcome = []
        thread = threading.Thread(
            target=lambda: outcome.append(pytest.raises(MethodFilesError, run, model, repo, trust=trust))
        )
        thread.start()
        thread.join(timeout=PATIENCE)  # reading /proc/kmsg would block: the load must not read it at all
        assert not thread.is_alive(), "the load reads through the link"
        assert re.search(r"custom_generate/data\.txt is a symlink to /proc/", str(outcome[0].value))


@pytest.mark.parametrize("swap", ["fifo", "link to /proc/self/environ", "link out of the folder", "removed"])
def test_a_file_swapped_after_the_walk_checked_it_is_refused_as_opened(model, tmp_path, monkeypatch, swap):
    # The walk checks each entry, then the snapshot opens it: flipping a data file to a FIFO between the two hung an
    # untrusted load, and to a link into /proc copied the environment into the snapshot (12 of 300 loads). The swap
    # is made here exactly in that gap.
    from decodekit.hub_loader import snapshot

    repo = versioned(tmp_path / "m", "source")
    data = repo / "custom_generate" / "data.txt"
    data.write_text("plain data\n")
    (tmp_path / "secret.txt").write_text("SECRET=1\n")
    walk = snapshot._walk

    def walked_then_swapped(*args, **kwargs):
        files = walk(*args, **kwargs)
        data.unlink()
        if swap == "removed":  # a raw FileNotFoundError from the size check before
            return files
        if swap == "fifo":
            os.mkfifo(data)
        else:
            data.symlink_to("/proc/self/environ" if "proc" in swap else tmp_path / "secret.txt")
        return files

    monkeypatch.setattr(snapshot, "_walk", walked_then_swapped)
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(pytest.raises(MethodFilesError, run, model, repo)))
    thread.start()
    thread.join(timeout=PATIENCE)
    assert not thread.is_alive(), "the load waits on the FIFO"
    assert "custom_generate/data.txt changed while the method was read" in str(outcome[0].value)
    taken = [p for p in snapshot._snapshots.root().rglob("data.txt")] if snapshot._snapshots._root else []
    assert not any(b"SECRET" in p.read_bytes() or b"PATH=" in p.read_bytes() for p in taken)


def test_a_symlink_loop_is_refused(model, tmp_path):
    repo = versioned(tmp_path / "m", "source")
    (repo / "custom_generate" / "loop").symlink_to(repo / "custom_generate", target_is_directory=True)
    with pytest.raises(MethodFilesError, match="symlink loop"):
        run(model, repo)


@pytest.mark.parametrize(
    "statement",
    [
        "from custom_generate import helper",
        "import custom_generate.helper as helper",
        "from custom_generate.helper import MARK",
    ],
)
def test_an_absolute_import_of_custom_generate_is_refused_and_flagged_by_check(model, tmp_path, monkeypatch, statement):
    # With the method's root on sys.path (python -m, notebooks, pytest), that name is the original folder, whose
    # __pycache__ was never hashed: a forged helper.pyc there used to run under a valid pin.
    from decodekit.hub_loader.check import check_repo

    repo = write_method(
        tmp_path / "m",
        f"{statement}\n\ndef generate(model, input_ids, **kw):\n    return 'ran'\n",
        extra={"helper.py": "MARK = 'helper'\n"},
    )
    (repo / "custom_generate" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(repo))
    with pytest.raises(
        MethodFilesError,
        match=r"custom_generate/generate.py:1 imports custom_generate absolutely.*"
        r"`from \. import helper`",
    ):
        run(model, repo)
    assert [str(p) for p in check_repo(repo)] == [
        "custom_generate/generate.py:1: imports custom_generate absolutely, which Python finds on sys.path rather than "
        "in the checked copy (decodekit refuses it); import siblings relatively: `from . import helper`"
    ]


@pytest.mark.parametrize(
    "statement",
    [
        "helper = importlib.import_module('custom_generate.helper')",
        "helper = __import__('custom_generate.helper', fromlist=['MARK'])",
        "space = {}\n    exec('import custom_generate.helper as helper', space)\n    helper = space['helper']",
        "import helper",
        # What the frame-based guard let through: code that names no method module, and threads.
        "space = {'__name__': 'x'}\n    exec('import custom_generate.helper as helper', space)\n"
        "    helper = space['helper']",
        "import runpy\n    helper = type('M', (), runpy.run_module('custom_generate.helper'))",
        "import pkgutil\n    helper = pkgutil.resolve_name('custom_generate.helper')",
        "import pydoc\n    helper = pydoc.locate('custom_generate.helper')\n    assert helper is not None, 'not found'",
        "import threading\n    out = []\n"
        "    thread = threading.Thread(target=lambda: out.append(importlib.import_module('custom_generate.helper')))\n"
        "    thread.run()\n    helper = out[0]",
        "from concurrent.futures import ThreadPoolExecutor\n"
        "    helper = ThreadPoolExecutor(1).submit(importlib.import_module, 'custom_generate.helper').result()",
    ],
    ids=[
        "import_module",
        "__import__",
        "exec",
        "bare",
        "exec-named",
        "runpy",
        "pkgutil",
        "pydoc",
        "thread",
        "executor",
    ],
)
def test_an_import_at_run_time_never_loads_the_original_folder_or_its_bytecode(model, tmp_path, monkeypatch, statement):
    # The static check sees only import statements of custom_generate. Under a valid pin, a forged helper.pyc in
    # the original folder's __pycache__ ran when the method reached its sibling by any of these at run time.
    body = f"import importlib\n\ndef generate(model, input_ids, **kw):\n    {statement}\n    return helper.MARK\n"
    repo = write_method(tmp_path / "m", body, extra={"helper.py": "MARK = 'helper'\n"})
    (repo / "custom_generate" / "__init__.py").write_text("")
    forged = tmp_path / "forged.py"
    forged.write_text("MARK = 'forged bytecode'\n")
    cache = repo / "custom_generate" / "__pycache__"
    cache.mkdir()
    py_compile.compile(
        str(forged),
        cfile=str(cache / f"helper.{sys.implementation.cache_tag}.pyc"),
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )
    monkeypatch.syspath_prepend(str(repo / "custom_generate" if statement == "import helper" else repo))
    for name in ("custom_generate", "custom_generate.helper", "helper"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    pin = load_method(str(repo), True).source.revision
    with pytest.raises(
        (ImportError, AssertionError),
        match=r"(import of '(custom_generate(\.helper)?|helper)' at run time would load it from the original folder"
        r".*`from \. import helper`|not found)",
    ):
        run(model, repo, trust=pin)
    assert not {"custom_generate.helper", "helper"} & set(sys.modules)  # nothing of the original folder was loaded
    # Nor anywhere else in the process, while that method is loaded: who asks is not what decides.
    import importlib

    with pytest.raises(ImportError, match="once a method is loaded, its original folder is imported from nowhere"):
        importlib.import_module("helper" if statement == "import helper" else "custom_generate.helper")


def test_threads_loading_the_same_new_method_at_once_all_get_the_whole_module(model, tmp_path):
    # Seven of eight threads used to get the module while the first still executed it (AttributeError: generate).
    repo = write_method(
        tmp_path / "m", "import time\ntime.sleep(0.3)\n\ndef generate(model, input_ids, **kw):\n    return 'whole'\n"
    )
    results, start = [], threading.Barrier(8)

    def load():
        start.wait()
        try:
            results.append(run(model, repo))
        except Exception as error:  # noqa: BLE001 - the test reports what a thread saw
            results.append(error)

    threads = [threading.Thread(target=load) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == ["whole"] * 8


def test_folders_nested_past_the_limit_are_refused_at_once(model, tmp_path):
    from decodekit.hub_loader.snapshot import MAX_DEPTH

    repo = versioned(tmp_path / "m", "source")
    folders = [str(repo / "custom_generate" / "d")]
    for _ in range(1099):  # one by one: pathlib's and shutil's own recursion stop short of 1,100 levels
        folders.append(folders[-1] + "/d")
    for folder in folders:
        os.mkdir(folder)
    try:
        with pytest.raises(MethodFilesError, match=f"nests folders more than {MAX_DEPTH} deep"):
            run(model, repo)  # before: RecursionError after 25 s
    finally:
        for folder in reversed(folders):
            os.rmdir(folder)


def test_too_many_files_are_refused_before_any_is_copied(model, tmp_path):
    from decodekit.hub_loader.snapshot import MAX_FILES

    repo = versioned(tmp_path / "m", "source")
    data = repo / "custom_generate" / "data"
    data.mkdir()
    for i in range(MAX_FILES + 1):
        (data / f"{i}.txt").touch()
    with pytest.raises(MethodFilesError, match=f"holds more than {MAX_FILES} files"):
        run(model, repo)


@pytest.mark.parametrize(
    "target, words",
    [
        ("/sys/kernel", "is a symlink to /sys/kernel, which leads out of"),
        ("/dev/zero", "is a symlink to /dev/zero, which leads out of"),
        ("/no/such/file", "is a symlink to /no/such/file, which does not exist"),
    ],
    ids=["sys-folder", "device", "missing"],
)
def test_links_out_to_system_folders_and_devices_get_their_own_message(model, tmp_path, target, words):
    repo = versioned(tmp_path / "m", "source")
    (repo / "custom_generate" / "link").symlink_to(target)
    with pytest.raises(MethodFilesError, match=re.escape(words)):
        run(model, repo)


@pytest.mark.parametrize("spec", ["", "   ", "x" * 100_000])
def test_an_empty_or_absurd_method_spec_is_refused_by_name(model, spec):
    with pytest.raises(ValueError, match="custom_generate"):
        run(model, spec)


def test_what_runs_is_what_was_hashed_while_the_file_is_swapped(model, tmp_path):
    # Another writer flips generate.py between two contents while pinned calls run: every call either runs
    # the pinned content or is refused; never the other content, and never later from the module cache.
    repo = versioned(tmp_path / "m", "trusted")
    generate_py = repo / "custom_generate" / "generate.py"
    trusted, swapped = generate_py.read_text(), VERSIONED.format(marker="swapped")
    pin = load_method(str(repo), True).source.revision
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            for text in (swapped, trusted):
                scratch = generate_py.with_suffix(".tmp")
                scratch.write_text(text)
                os.replace(scratch, generate_py)
                generate_py.write_text(text)  # and in place, so a read may see a partial file

    thread = threading.Thread(target=writer)
    thread.start()
    outcomes = {"trusted": 0, "refused": 0}
    try:
        for _ in range(300):
            # Forget the imported method each time, so every call imports (the cache would hide the race).
            for name in [m for m in sys.modules if m.startswith("_decodekit_method_")]:
                del sys.modules[name]
            try:
                result = run(model, repo, trust=pin)
            except (UntrustedCodeError, SyntaxError, FileNotFoundError):
                outcomes["refused"] += 1
                continue
            assert result == "trusted"
            outcomes["trusted"] += 1
    finally:
        stop.set()
        thread.join()
    assert outcomes["trusted"] > 0, outcomes
    generate_py.write_text(swapped)
    with pytest.raises(UntrustedCodeError):
        run(model, repo, trust=pin)


def test_a_huge_file_is_refused_before_it_is_read(model, tmp_path):
    repo = versioned(tmp_path / "m", "source")
    huge = repo / "custom_generate" / "weights.bin"
    with open(huge, "wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB by its size, nothing on disk
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(MethodFilesError, match=r"weights.bin is 3.0 GiB; a method's file may be at most 16.0 MiB"):
        run(model, repo, trust=None)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: nothing was read whole


def test_many_files_over_the_total_are_refused(model, tmp_path, monkeypatch):
    repo = versioned(tmp_path / "m", "source")
    for i in range(3):
        (repo / "custom_generate" / f"data{i}.txt").write_bytes(b"x" * 4096)
    monkeypatch.setenv("DECODEKIT_MAX_METHOD_BYTES", "8000")
    with pytest.raises(
        MethodFilesError, match=r"holds 12.1 KiB; a method may hold at most 7.8 KiB \(DECODEKIT_MAX_METHOD_BYTES"
    ):
        run(model, repo)


def test_trust_values_that_are_no_revision_get_their_own_message(model, tmp_path):
    repo = versioned(tmp_path / "m", "source")
    revision = load_method(str(repo), True).source.revision
    for value in ("yes", "True", "main"):
        with pytest.raises(
            ValueError,
            match=rf"trust_remote_code={value!r} is invalid .*expected True, False, or a "
            r"revision to pin, which for a local directory is its content hash",
        ):
            run(model, repo, trust=value)
    with pytest.raises(UntrustedCodeError, match=rf"is a prefix of its content hash.*trust_remote_code='{revision}'"):
        run(model, repo, trust=revision[:12])
    with pytest.raises(ValueError, match=r"trust_remote_code=1 is invalid"):
        run(model, repo, trust=1)
    assert run(model, repo, trust=revision.upper()) == "source"


def test_a_hub_repo_bytecode_never_runs_and_sourceless_is_refused(model, hub, tmp_path):
    repo = versioned(tmp_path / "m", "source")
    evil = tmp_path / "evil.py"
    evil.write_text(EVIL)
    pyc = tmp_path / "generate.pyc"
    py_compile.compile(str(evil), cfile=str(pyc), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    files = {p.relative_to(repo).as_posix(): p.read_bytes() for p in repo.rglob("*") if p.is_file()}
    files[f"custom_generate/__pycache__/generate.{sys.implementation.cache_tag}.pyc"] = pyc.read_bytes()
    sha = hub.repos.push("acme/pyc", files)
    assert model.generate(PROMPT, custom_generate="acme/pyc", trust_remote_code=sha) == "source"
    with pytest.raises(ValueError, match="for a Hub repo is a commit sha"):
        model.generate(PROMPT, custom_generate="acme/pyc", trust_remote_code="yes")
    files["custom_generate/helper.pyc"] = pyc.read_bytes()
    hub.repos.push("acme/pyc", files)
    with pytest.raises(MethodFilesError, match="custom_generate/helper.pyc is bytecode"):
        model.generate(PROMPT, custom_generate="acme/pyc", trust_remote_code=True)


# ---- plugins that break ----


def broken_plugin(hook: str, error: BaseException):
    source = {
        "decodekit_config_fields": "def decodekit_config_fields():\n    raise ERROR\n",
        "decodekit_validate_config": "def decodekit_validate_config(generation_config):\n    raise ERROR\n",
        "decodekit_logits_processors": "def decodekit_logits_processors(generation_config):\n    raise ERROR\n",
        "decodekit_token_selector": "def decodekit_token_selector(generation_config):\n    raise ERROR\n",
        "decodekit_stopping_criteria": "def decodekit_stopping_criteria(generation_config):\n    raise ERROR\n",
        "decodekit_cache": "def decodekit_cache(generation_config, context):\n    raise ERROR\n",
        "decodekit_decoding_loop": "def decodekit_decoding_loop(generation_config):\n    raise ERROR\n",
        "decodekit_next_token_logits": "def decodekit_next_token_logits(generation_config):\n    raise ERROR\n",
    }[hook]
    namespace = {"ERROR": error}
    exec(source, namespace)
    plugin = type("Broken", (), {hook: staticmethod(decodekit.hookimpl(namespace[hook]))})
    return plugin


@pytest.fixture
def clean_manager():
    manager.reset()
    yield
    manager.reset()


HOOKS = [
    "decodekit_config_fields",
    "decodekit_validate_config",
    "decodekit_logits_processors",
    "decodekit_token_selector",
    "decodekit_stopping_criteria",
    "decodekit_cache",
    "decodekit_decoding_loop",
    "decodekit_next_token_logits",
]


@pytest.mark.parametrize(
    "error",
    [RuntimeError("boom"), SystemExit(3), AttributeError("no attribute x")],
    ids=["RuntimeError", "SystemExit", "AttributeError"],
)
@pytest.mark.parametrize("hook", HOOKS)
def test_a_plugin_that_raises_in_any_hook_is_disabled_and_the_rest_keep_working(model, clean_manager, hook, error):
    baseline = model.generate(PROMPT, max_new_tokens=4)
    decodekit.register(broken_plugin(hook, error), name="broken")
    assert torch.equal(model.generate(PROMPT, max_new_tokens=4), baseline)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=4), baseline)
    record = {r.name: r for r in manager.plugin_records()}["broken"]
    assert record.error.startswith(f"disabled after {hook} raised {type(error).__name__}")
    assert manager.get_plugin_manager().get_plugin("broken") is None


def test_strict_plugins_still_raise(model, clean_manager, monkeypatch):
    monkeypatch.setenv("DECODEKIT_STRICT_PLUGINS", "1")
    decodekit.register(broken_plugin("decodekit_logits_processors", RuntimeError("boom")), name="broken")
    with pytest.raises(RuntimeError, match="boom") as e:
        model.generate(PROMPT, max_new_tokens=2)
    assert "(raised by plugin 'broken' in decodekit_logits_processors)" in e.value.__notes__


def test_keyboard_interrupt_is_never_swallowed(model, clean_manager):
    decodekit.register(broken_plugin("decodekit_logits_processors", KeyboardInterrupt()), name="broken")
    with pytest.raises(KeyboardInterrupt):
        model.generate(PROMPT, max_new_tokens=2)


def test_a_plugin_failing_at_import_with_system_exit_is_recorded_and_the_manager_is_built_once(
    model, tmp_path, monkeypatch, clean_manager
):
    site = tmp_path / "site"
    site.mkdir()
    (site / "dk_exits.py").write_text("import sys\nsys.exit('no thanks')\n")
    info = site / "dk_exits-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dk-exits\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[decodekit]\nexits = dk_exits\n")
    monkeypatch.syspath_prepend(str(site))
    manager.reset()
    first = manager.get_plugin_manager()
    assert model.generate(PROMPT, max_new_tokens=2).tolist() == [[1, 2, 3, 4]]
    assert manager.get_plugin_manager() is first  # not rebuilt by the next call
    assert {r.name: r for r in manager.plugin_records()}["exits"].error == "SystemExit: no thanks"


def test_a_misspelt_hook_is_an_error_of_that_plugin(clean_manager):
    misspelt = type("Misspelt", (), {"decodekit_logit_processors": staticmethod(decodekit.hookimpl(lambda: []))})
    with pytest.raises(
        PluginError,
        match="decodekit_logit_processors is not a decodekit hook "
        r"\(did you mean decodekit_logits_processors\?\)",
    ):
        decodekit.register(misspelt, name="misspelt")
    assert manager.get_plugin_manager().get_plugin("misspelt") is None


def test_a_hook_wrapper_is_refused(clean_manager):
    def wrapper(generation_config):
        yield

    plugin = type("Wraps", (), {"decodekit_logits_processors": staticmethod(decodekit.hookimpl(wrapper, wrapper=True))})
    with pytest.raises(PluginError, match="decodekit_logits_processors is a hook wrapper"):
        decodekit.register(plugin, name="wraps")


def processor_plugin(processor=None, selector=None):
    hooks = {}
    if processor is not None:
        hooks["decodekit_logits_processors"] = staticmethod(decodekit.hookimpl(lambda: [processor]))
    if selector is not None:
        hooks["decodekit_token_selector"] = staticmethod(decodekit.hookimpl(lambda: selector))
    return type("Outputs", (), hooks)


def one_row(input_ids, scores):
    return scores[:1]


def narrow(input_ids, scores):
    return scores[:, :5]


def flat(input_ids, scores):
    return scores[0]


def as_double(input_ids, scores):
    return scores.double()


@pytest.mark.parametrize("processor", [one_row, narrow, flat, as_double])
def test_a_processor_returning_the_wrong_shape_or_dtype_names_its_plugin(model, clean_manager, processor):
    batch = torch.tensor([[1, 2], [3, 4]])
    baseline = model.generate(batch, max_new_tokens=3)
    decodekit.register(processor_plugin(processor=processor), name="shapes")
    with pytest.raises(
        PluginError,
        match=rf"the logits processor {processor.__name__} of plugin 'shapes' returned .*"
        r"a torch.float32 tensor \[batch, vocab\] = \[2, 8\]",
    ):
        model.generate(batch, max_new_tokens=3)
    # Disabled for the process, as a plugin whose hook raises is: the next call runs without it, unregistered by nobody.
    record = next(r for r in manager.plugin_records() if r.name == "shapes")
    assert record.error.startswith("disabled after a logits processor raised")
    assert torch.equal(model.generate(batch, max_new_tokens=3), baseline)


def test_a_selector_returning_one_token_for_two_rows_names_its_plugin(model, clean_manager):
    decodekit.register(processor_plugin(selector=lambda input_ids, scores: torch.tensor([3])), name="one_token")
    with pytest.raises(
        PluginError,
        match=r"the token selector function of plugin 'one_token' returned Tensor of shape "
        r"\(1,\).*one integer token id per row, a tensor \[2\]",
    ):
        model.generate(torch.tensor([[1, 2], [3, 4]]), max_new_tokens=3)


def test_an_exception_inside_a_processor_carries_the_plugin_name(model, clean_manager):
    def explodes(input_ids, scores):
        if input_ids.shape[1] > 3:
            raise IndexError("index 99 is out of bounds")
        return scores

    decodekit.register(processor_plugin(processor=explodes), name="explodes")
    with pytest.raises(IndexError) as e:
        model.generate(PROMPT, max_new_tokens=5)  # fails at the third step, after the first-step check
    assert "(raised by the logits processor explodes of plugin 'explodes' at position 4)" in e.value.__notes__
    assert manager.get_plugin_manager().get_plugin("explodes") is None  # disabled: the next call runs without it
    assert model.generate(PROMPT, max_new_tokens=5).shape == (1, PROMPT.shape[1] + 5)


@pytest.mark.parametrize(
    "fill, words", [(float("nan"), "NaN"), (-float("inf"), "-inf for every token")], ids=["nan", "all-banned"]
)
def test_scores_no_token_can_come_from_are_an_error_naming_the_processors(model, clean_manager, fill, words):
    def spoils_at_the_third_step(input_ids, scores):
        return torch.full_like(scores, fill) if input_ids.shape[1] >= PROMPT.shape[1] + 2 else scores

    baseline = model.generate(PROMPT, max_new_tokens=5)
    decodekit.register(processor_plugin(processor=spoils_at_the_third_step), name="spoils")
    with pytest.raises(
        PluginError,
        match=r"the logits processor spoils_at_the_third_step of plugin 'spoils' left the "
        rf"scores {re.escape(words)} in row 0 at position 4",
    ):
        model.generate(PROMPT, max_new_tokens=5)  # before: token 0, silently
    # Disabled as a processor that raises is (before: named at every call, never disabled).
    assert manager.get_plugin_manager().get_plugin("spoils") is None
    assert torch.equal(model.generate(PROMPT, max_new_tokens=5), baseline)


def test_scores_a_builtin_left_unusable_still_name_every_processor(model, clean_manager):
    # Built-in processors are not disabled: the user's own values did it (every token banned here).
    with pytest.raises(
        PluginError,
        match=r"the scores are -inf for every token in row 0 at position 2 after the logits "
        r"processors \[.the logits processor NoBadWordsLogitsProcessor",
    ):
        model.generate(PROMPT, max_new_tokens=2, bad_words_ids=[[t] for t in range(8)])


def test_a_processor_raising_system_exit_fails_its_call_alone_and_is_disabled(model, clean_manager):
    def exits(input_ids, scores):
        raise SystemExit(3)

    baseline = model.generate(PROMPT, max_new_tokens=3)
    decodekit.register(processor_plugin(processor=exits), name="exits")
    with pytest.raises(
        PluginError,
        match=r"the logits processor exits of plugin 'exits' at position 2 raised "
        r"SystemExit\(3\)",
    ):
        model.generate(PROMPT, max_new_tokens=3)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=3), baseline)  # before: SystemExit at every later call
    assert manager.get_plugin_manager().get_plugin("exits") is None


def test_a_processor_refusing_the_calls_values_with_value_error_is_not_disabled(model, clean_manager):
    # A ValueError says the call's own values are invalid: one client's bad field must not disable the plugin for all.
    def picky(input_ids, scores):
        if input_ids.shape[1] > 2:
            raise ValueError("this call's values are invalid")
        return scores

    decodekit.register(processor_plugin(processor=picky), name="picky")
    with pytest.raises(ValueError, match="this call's values are invalid"):
        model.generate(PROMPT, max_new_tokens=3)
    assert manager.get_plugin_manager().get_plugin("picky") is not None


def criterion_plugin(criterion):
    return type("Stops", (), {"decodekit_stopping_criteria": staticmethod(decodekit.hookimpl(lambda: [criterion]))})


def one_for_all(input_ids, scores):
    return torch.tensor([input_ids[0, -1] == 3])


def of_longs(input_ids, scores):
    return torch.zeros(input_ids.shape[0], dtype=torch.long)


def exits(input_ids, scores):
    raise SystemExit("stop")


@pytest.mark.parametrize(
    "criterion, words",
    [
        (
            one_for_all,
            r"returned a torch.bool tensor of shape \(1,\) on cpu at position 3; a criterion returns done "
            r"\[batch\] = \[2\]",
        ),
        (of_longs, r"returned a torch.int64 tensor of shape \(2,\)"),
        (exits, r"at position 3 raised SystemExit\(stop\)"),
    ],
    ids=["one-for-all", "longs", "system-exit"],
)
def test_a_stopping_criterion_of_the_wrong_shape_or_raising_names_its_plugin_and_is_disabled(
    model, clean_manager, criterion, words
):
    # Before: a [1] tensor was broadcast and stopped the row it never judged, in every later call too.
    batch = torch.tensor([[1, 2], [5, 6]])
    baseline = model.generate(batch, max_new_tokens=4)
    decodekit.register(criterion_plugin(criterion), name="stops")
    with pytest.raises(PluginError, match=rf"the stopping criterion {criterion.__name__} of plugin 'stops' {words}"):
        model.generate(batch, max_new_tokens=4)
    record = next(r for r in manager.plugin_records() if r.name == "stops")
    assert record.error.startswith("disabled after a stopping criterion raised")
    assert torch.equal(model.generate(batch, max_new_tokens=4), baseline)


def test_a_stopping_criterion_passed_to_generate_is_named_as_such(model, clean_manager):
    with pytest.raises(
        PluginError,
        match=r"the stopping criterion one_for_all of stopping_criteria \(passed to "
        r"generate\) returned a torch.bool tensor of shape \(1,\)",
    ):
        model.generate(torch.tensor([[1, 2], [5, 6]]), max_new_tokens=4, stopping_criteria=[one_for_all])
    # One Python bool for every row, as transformers' older criteria return, is accepted.
    out = model.generate(PROMPT, max_new_tokens=4, stopping_criteria=[lambda ids, scores: ids.shape[1] >= 4])
    assert out.shape == (1, 4)


def test_a_plugin_disabled_after_failing_can_be_unregistered_by_its_name(model, clean_manager):
    decodekit.register(processor_plugin(processor=one_row), name="shapes")
    with pytest.raises(PluginError):
        model.generate(torch.tensor([[1, 2], [3, 4]]), max_new_tokens=2)
    assert "shapes" in {r.name for r in manager.plugin_records()}
    decodekit.unregister("shapes")  # before: "No plugin named 'shapes' is registered"
    assert "shapes" not in {r.name for r in manager.plugin_records()}
    with pytest.raises(ValueError, match="No plugin named 'shapes' is registered"):
        decodekit.unregister("shapes")


def test_a_selector_that_goes_wrong_after_the_first_step_names_its_plugin(model, clean_manager):
    def strays_later(input_ids, scores):
        chosen = scores.argmax(dim=-1)
        return chosen + 1000 if input_ids.shape[1] >= PROMPT.shape[1] + 2 else chosen

    decodekit.register(processor_plugin(selector=strays_later), name="strays")
    with pytest.raises(
        PluginError,
        match=r"plugin 'strays' returned token ids \[\d+\] at position 4, outside the "
        r"vocabulary",
    ):
        model.generate(PROMPT, max_new_tokens=5)  # before: an IndexError deep inside the next forward


def test_a_processor_writing_into_input_ids_leaves_the_callers_tensor_alone(model, clean_manager):
    def scribbles(input_ids, scores):
        input_ids.fill_(0)
        return scores

    prompt = PROMPT.clone()
    decodekit.register(processor_plugin(processor=scribbles), name="scribbles")
    model.generate(prompt, max_new_tokens=2)
    assert torch.equal(prompt, PROMPT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unusable_rows_are_those_with_one_nan_anywhere_or_minus_inf_everywhere(dtype):
    # One reduction finds both (processors.unusable_rows): a single NaN at either end of a row or in a vector's tail,
    # and a row banned everywhere; a row banned all but once, or holding +inf, stays usable.
    from decodekit.core.processors import unusable_rows

    scores = torch.randn(8, 1003).to(dtype)
    scores[0, 0] = scores[1, 1002] = scores[2, 517] = float("nan")
    scores[3] = float("-inf")
    scores[4] = float("-inf")
    scores[4, 999] = 0.0
    scores[5, 3] = float("inf")
    scores[6, :500] = float("nan")
    assert unusable_rows(scores).tolist() == [True, True, True, True, False, False, True, False]


class _RaisingLoop:
    def rows_per_prompt(self, generation_config):
        return 1

    def __call__(self, *arguments):
        raise SystemExit("the loop gives up")


@pytest.mark.parametrize(
    "hook, returned, words",
    [
        ("decodekit_decoding_loop", lambda: 42, r"plugin 'odd': decodekit_decoding_loop returned int, not a loop"),
        (
            "decodekit_decoding_loop",
            _RaisingLoop,
            r"the decoding loop of plugin 'odd' raised SystemExit\(the loop gives up\)",
        ),
        (
            "decodekit_cache",
            lambda: object(),
            r"plugin 'odd': decodekit_cache returned a object without \['update', "
            r"'get_seq_length'\]",
        ),
    ],
    ids=["loop-not-callable", "loop-raises", "cache-without-protocol"],
)
def test_a_wrong_loop_or_cache_hook_names_its_plugin_and_is_disabled(model, clean_manager, hook, returned, words):
    # Before: an AttributeError or TypeError from deep inside generate() that named no plugin, at every later call.
    baseline = model.generate(PROMPT, max_new_tokens=3)
    plugin = type(
        "Odd",
        (),
        {
            "decodekit_config_fields": staticmethod(decodekit.hookimpl(lambda: {"odd": True})),
            hook: staticmethod(decodekit.hookimpl(lambda: returned())),
        },
    )
    decodekit.register(plugin, name="odd")
    with pytest.raises(PluginError, match=words):
        model.generate(PROMPT, max_new_tokens=3)
    record = next(r for r in manager.plugin_records() if r.name == "odd")
    assert record.error is not None and manager.get_plugin_manager().get_plugin("odd") is None
    assert torch.equal(model.generate(PROMPT, max_new_tokens=3), baseline)


def test_a_plugin_disabled_by_another_thread_mid_call_stays_in_the_call_that_was_prepared_with_it(model, clean_manager):
    # Before: between this call's validation of the plugin's field and its processors hook, another thread's failure
    # disabled the plugin, and this call was answered without its effect (its argument taken, nothing done).
    plain = model.generate(PROMPT, max_new_tokens=4)
    banned = int(plain[0, PROMPT.shape[1]])

    class Plugin:
        @decodekit.hookimpl
        def decodekit_config_fields(self):
            return {"ban_one": None, "explode": False}

        @decodekit.hookimpl
        def decodekit_validate_config(self, generation_config):
            if generation_config.ban_one is not None:  # another thread's call fails in this plugin, now
                other = threading.Thread(
                    target=model.generate, args=(PROMPT,), kwargs=dict(max_new_tokens=2, explode=True)
                )
                other.start()
                other.join(timeout=PATIENCE)

        @decodekit.hookimpl
        def decodekit_logits_processors(self, generation_config):
            if generation_config.explode:
                raise RuntimeError("boom")
            token = generation_config.ban_one

            def ban(input_ids, scores):
                scores = scores.clone()
                scores[:, token] = -float("inf")
                return scores

            return [] if token is None else [ban]

    decodekit.register(Plugin(), name="flaky")
    out = model.generate(PROMPT, max_new_tokens=4, ban_one=banned)
    assert manager.get_plugin_manager().get_plugin("flaky") is None  # the other call disabled it
    assert int(out[0, PROMPT.shape[1]]) != banned  # this call kept it: the ban took effect
    with pytest.raises(ValueError, match="ban_one"):  # and the next call runs without it
        model.generate(PROMPT, max_new_tokens=4, ban_one=banned)
