"""The speed paths other CPUs take, forced on this one (decodekit.kernels.cpu): each path is taken exactly
where its probes say, and gives what the reference computes. Settings this machine cannot run are skipped
with the missing CPU feature as the reason."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from decodekit.kernels import choices, cpu, native
from decodekit.kernels.linear import Linear
from decodekit.kernels.packed import PackedLinear
from decodekit.kernels.quantize import quantize
from decodekit.testing import cpu_path_settings, tiny_model
from helpers import PATIENCE, needs_exact_int_mm

PROMPT = torch.tensor([[5, 9, 14, 3, 7]])
BATCH = torch.tensor([[5, 9, 14, 3, 7, 8], [0, 0, 0, 4, 5, 6], [0, 11, 12, 13, 14, 15]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
LONG = torch.arange(3, 3 + 40)[None] % 90 + 3  # a prompt of 40 tokens: more rows than the few-row kernels take


def calls(fn, name):
    with torch.profiler.profile() as profile:
        fn()
    return {e.key: e.count for e in profile.key_averages()}.get(name, 0)


def logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


def relative_error(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("setting", cpu_path_settings("onednn_bf16", "native_kernels"))
def test_bfloat16_paths(tmp_path, setting):
    reference = tiny_model(tmp_path, "qwen3")
    expected = {ids.shape: logits(reference, ids) for ids in (PROMPT, LONG)}
    with cpu.forced(**setting), choices.forced(eager_weights_bfloat16="packed"):  # packing where oneDNN can
        model = tiny_model(tmp_path, "qwen3").to(torch.bfloat16)
        for ids in (PROMPT, LONG):  # few rows and a prefill's many rows
            assert relative_error(logits(model, ids), expected[ids.shape]) < 0.03
        packed = any(isinstance(m, PackedLinear) for m in model.modules())
        assert packed == setting["onednn_bf16"]  # oneDNN's bf16 matmul only where the CPU has it
        if not packed:
            rows = calls(lambda: logits(model, PROMPT), "decodekit::row_product")
            assert (rows > 0) == (setting["native_kernels"] and native.load())
        eager = model.generate(BATCH, attention_mask=MASK, max_new_tokens=12)
        compiled = model.generate(BATCH, attention_mask=MASK, max_new_tokens=12, compile=True)
        stack = calls(lambda: model.generate(PROMPT, max_new_tokens=3, compile=True), "decodekit::decode_layers")
        assert (stack > 0) == (setting["native_kernels"] and native.load())
    # bf16 products round differently on each path; the tokens of a random tiny model agree for most steps.
    assert (eager == compiled).float().mean() > 0.9


@pytest.mark.parametrize("setting", cpu_path_settings("native_kernels"))
def test_int8_paths(tmp_path, setting):
    reference = tiny_model(tmp_path, "llama", intermediate_size=128)
    expected = {ids.shape: logits(reference, ids) for ids in (PROMPT, LONG)}
    with cpu.forced(**setting):
        model = quantize(tiny_model(tmp_path, "llama", intermediate_size=128), "int8")
        for ids in (PROMPT, LONG):
            assert relative_error(logits(model, ids), expected[ids.shape]) < 0.03
        rows = calls(lambda: logits(model, PROMPT), "decodekit::row_product_int8")
        assert (rows > 0) == (setting["native_kernels"] and native.load())
        eager = model.generate(BATCH, attention_mask=MASK, max_new_tokens=12)
        assert torch.equal(eager, model.generate(BATCH, attention_mask=MASK, max_new_tokens=12, compile=True))


@pytest.mark.parametrize("setting", cpu_path_settings("native_kernels"))
def test_float32_compiled_step_equals_eager_on_each_path(tmp_path, setting):
    with cpu.forced(**setting):
        model = tiny_model(tmp_path, "mistral")
        eager = model.generate(BATCH, attention_mask=MASK, max_new_tokens=16)
        assert torch.equal(eager, model.generate(BATCH, attention_mask=MASK, max_new_tokens=16, compile=True))
        stack = calls(lambda: model.generate(PROMPT, max_new_tokens=3, compile=True), "decodekit::decode_layers")
        assert (stack > 0) == (setting["native_kernels"] and native.load())


def test_forcing_a_probe_on_that_the_machine_lacks_or_an_unknown_one_is_refused(monkeypatch):
    monkeypatch.setitem(cpu.MACHINE, "amx_int8", False)
    with pytest.raises(ValueError, match="this machine lacks amx_int8"):
        with cpu.forced(amx_int8=True):
            pass
    with pytest.raises(ValueError, match="unknown probe 'avx3'"):
        with cpu.forced(avx3=False):
            pass
    with pytest.raises(ValueError, match="should be PROBE=0 or PROBE=1"):
        cpu._parse_force("onednn_bf16=yes")
    assert cpu._parse_force("onednn_bf16=0, native_kernels=1") == {"onednn_bf16": False, "native_kernels": True}


def test_forced_answers_are_restored_afterwards():
    before = dict(cpu._answers)
    with cpu.forced(native_kernels=False, onednn_bf16=False):
        assert not cpu.has("native_kernels") and not native.loaded()
    assert cpu._answers == before


@pytest.mark.parametrize("route", [pytest.param("int8_split", marks=needs_exact_int_mm), "int8pack", "float32"])
def test_each_int8_prefill_route_gives_the_reference_logits(tmp_path, route):

    reference = tiny_model(tmp_path, "llama", intermediate_size=128)
    expected = logits(reference, LONG)
    model = quantize(tiny_model(tmp_path, "llama", intermediate_size=128), "int8")
    with choices.forced(int8_many_rows=route):
        assert relative_error(logits(model, LONG), expected) < 0.03
        assert (calls(lambda: logits(model, LONG), "aten::_weight_int8pack_mm") > 0) == (route == "int8pack")
        assert (calls(lambda: logits(model, LONG), "aten::_int_mm") > 0) == (route == "int8_split")


def test_a_choice_is_measured_once_cached_by_cpu_and_cleared(tmp_path, monkeypatch, caplog):
    import logging

    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choices, "_made", {})
    monkeypatch.setattr(choices, "cpu_ticks", lambda: None)  # however busy the machine running the suite is
    runs, order = {"slow": 0, "fast": 0}, []
    per = choices.WARM_UP_CALLS + choices.ROUNDS  # calls of each candidate in one measurement

    def candidate(label, seconds):
        def run():
            runs[label] += 1
            order.append(label)
            time.sleep(seconds)

        return run

    candidates = {"slow": candidate("slow", 0.004), "fast": candidate("fast", 0.0)}
    with caplog.at_level(logging.INFO, logger="decodekit"):
        assert choices.choose("demo", candidates) == "fast"
    assert "demo: chose fast on this CPU" in caplog.text and runs["slow"] == per
    # Timed round-robin after the warm-up calls: a slow spell of the machine falls on both alike.
    assert order[-2 * choices.ROUNDS :] == ["slow", "fast"] * choices.ROUNDS
    assert choices.choose("demo", candidates) == "fast" and runs["slow"] == per  # remembered in this process
    stored = json.loads((tmp_path / "choices.json").read_text())
    assert stored == {choices.signature(): {"demo(fast,slow)": "fast"}}
    assert choices.signature().startswith(
        cpu.signature()
    )  # and the kernels' source: a changed kernel is measured again
    monkeypatch.setattr(choices, "_made", {})  # a new process on the same machine reads the file
    assert choices.choose("demo", candidates) == "fast" and runs["slow"] == per
    monkeypatch.setattr(choices, "_made", {})  # a later version offers one more route: measured, not skipped
    runs["faster"] = 0
    with_new = {**candidates, "faster": candidate("faster", 0.0)}
    choices.choose("demo", with_new)
    assert runs["faster"] == per and runs["slow"] == 2 * per
    candidates = {"slow": candidates["slow"], "fast": candidates["fast"]}
    monkeypatch.setattr(choices, "_made", {})
    assert choices.choose("demo", candidates) == "fast" and runs["slow"] == 2 * per  # the old set's entry is kept
    monkeypatch.setattr(choices, "_made", {})
    monkeypatch.setenv("DECODEKIT_CHOICES", "measure")
    assert choices.choose("demo", candidates) == "fast" and runs["slow"] == 3 * per
    choices.clear()
    assert not (tmp_path / "choices.json").exists() and choices._made == {}
    with choices.forced(demo="slow"):
        assert choices.choose("demo", candidates) == "slow"
    # A later version times another sample under the same name: the choice made on the old one is made again.
    monkeypatch.setattr(choices, "_made", {})
    choices.choose("demo", candidates)
    monkeypatch.setattr(choices, "_made", {})
    choices.choose("demo", candidates, sample="bigger")
    assert runs["slow"] == 5 * per
    assert set(json.loads((tmp_path / "choices.json").read_text())[choices.signature()]) == {
        "demo(fast,slow)",
        "demo@bigger(fast,slow)",
    }


def test_the_last_level_cache_is_read_from_sysfs(tmp_path):
    for index, (level, size) in enumerate([(1, "48K"), (2, "2048K"), (3, "32768K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
        (tmp_path / f"index{index}" / "level").write_text(f"{level}\n")
    assert cpu.last_level_cache_bytes(tmp_path) == 32 << 20
    assert cpu.last_level_cache_bytes(tmp_path / "absent") == cpu.DEFAULT_CACHE_BYTES


def test_the_packing_sample_reads_its_steps_weights_from_memory(monkeypatch):
    # Timed on one layer, which stays in cache, oneDNN's packed product won while the whole model decoded 1.35x
    # faster on plain weights: the sample's steps must go round distinct layers that overflow the cache.
    from decodekit.kernels import packed

    monkeypatch.setattr(cpu, "last_level_cache_bytes", lambda: 4 << 20)
    offered = {}

    def capture(name, candidates, otherwise, sample=""):
        if name.startswith("eager_weights"):  # the prompt's products decide their own routes: left as they fall
            offered.update(candidates(), name=name, sample=sample)
        return otherwise

    monkeypatch.setattr(choices, "decide", capture)
    packed.eager_layout(torch.float32)
    assert offered["name"] == "eager_weights_float32" and offered["sample"]  # not the one-layer sample's cache entry
    read = []
    for kind in (Linear, PackedLinear):
        monkeypatch.setattr(
            kind, "forward", lambda self, x, forward=kind.forward: read.append(self) or forward(self, x)
        )
    with torch.inference_mode():
        for label in ("plain", "packed"):
            read.clear()
            offered[label]()
            offered[label]()
            # 2 x 4 MiB over 3.4 MiB float32 layers: 3 copies, each read in turn, the first by the prompt too
            assert len(read) == 2 * 65 and len({id(m) for m in read}) == 3, label
            assert len({m.weight.data_ptr() for m in read}) == 3, label  # weights of their own


def test_a_choice_measured_while_other_work_takes_the_cpus_is_used_but_not_cached(tmp_path, monkeypatch, caplog):
    import logging

    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choices, "_made", {})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    candidates = {"slow": lambda: time.sleep(0.002), "fast": lambda: None}
    # Two CPUs busy throughout the measurement, half of it another process's: (busy, all, own) clock ticks.
    readings = iter([(1000, 2000, 10), (1200, 2200, 110)])
    monkeypatch.setattr(choices, "cpu_ticks", lambda: next(readings))
    with caplog.at_level(logging.INFO, logger="decodekit"):
        assert choices.choose("demo", candidates) == "fast"
    assert "demo: not cached, other work took 50% of this process's CPUs" in caplog.text
    assert not (tmp_path / "choices.json").exists() and choices.made("demo") == "fast"  # used by this process only
    monkeypatch.setattr(choices, "_made", {})  # the next process measures again, quietly this time: cached
    readings = iter([(1000, 2000, 10), (1200, 2200, 206)])
    assert choices.choose("demo", candidates) == "fast"
    assert json.loads((tmp_path / "choices.json").read_text()) == {choices.signature(): {"demo(fast,slow)": "fast"}}


def test_the_share_of_its_cpus_other_work_took_counts_only_the_cpus_a_measurement_needs():
    share = choices.taken_share
    # 16 CPUs, 2 threads: other work on 14 of them leaves this process its own; on 15, half of what it needs.
    assert share((0, 0, 0), (1600, 1600, 200), cpus=16, threads=2) == 0.0
    assert share((0, 0, 0), (1600, 1600, 100), cpus=16, threads=2) == 0.5
    assert share((0, 0, 0), (19, 19, 0), cpus=2, threads=2) == 0.0  # too short a reading to judge
    assert share(None, (100, 100, 0), cpus=2, threads=2) == 0.0  # no /proc


@pytest.mark.skipif(choices.cpu_ticks() is None, reason="reads /proc (Linux)")
def test_cpu_ticks_count_this_process_and_its_cpus():
    # Work until this process's own ticks have moved (however busy the machine, they do; the deadline only stops a
    # broken reading from spinning forever), then check the readings agree with each other: no figure of time.
    before = choices.cpu_ticks()
    deadline = time.monotonic() + PATIENCE
    while (now := choices.cpu_ticks())[2] - before[2] < 5:
        assert time.monotonic() < deadline, "this process's own CPU ticks never moved in /proc/self/stat"
        sum(range(10_000))
    busy, total, own = (a - b for a, b in zip(now, before))
    # The process and the CPUs are sampled apart from each other, with ticks of 10 ms: a tick or two either way.
    assert busy >= own - 2 and total >= busy >= 0


def test_choices_made_under_forced_probes_or_held_instructions_are_cached_apart(monkeypatch):
    # With its probes forced off and the libraries held to AVX2 (ISA_VARIABLES), an AVX-512 machine measures what an
    # AVX2-only one would choose: those choices must not be read back by a run without the limits, nor the reverse.
    for name in cpu.ISA_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    plain = cpu.signature()
    with cpu.forced(native_kernels=False):
        assert cpu.signature() != plain
    with cpu.forced(native_kernels=cpu.MACHINE["native_kernels"]):  # forced to what the machine says: the same
        assert cpu.signature() == plain
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert cpu.signature() != plain


def test_a_choice_made_while_another_is_measured_does_not_deadlock(tmp_path):
    # eager_layout times plain Linear layers, whose prompt products ask many_rows_route: a choice made inside
    # another's measurement. With a plain lock that waited forever on a machine with no cached choices (a fresh
    # CI runner, a Ray actor); run in a child so a regression fails by timeout instead of hanging the suite.
    # The child measures from an empty choices file, with this machine's C++ build copied beside it (building it again
    # is what the native build's own test does), one round of each candidate on one copy of the layer: the nesting
    # is what is checked, not the choice.
    if native.load():
        built = native._built_library()
        shutil.copy2(built, tmp_path / built.name)
    script = (
        "import torch\nfrom decodekit.kernels import packed, choices\n"
        "choices.WARM_UP_CALLS, choices.ROUNDS, packed.CACHE_MULTIPLE = 0, 1, 0\n"
        "packed.eager_layout(torch.float32)\nprint(sorted(choices._made))\n"
    )
    env = {**os.environ, "DECODEKIT_CACHE_DIR": str(tmp_path), "DECODEKIT_CHOICES": "measure"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 0, done.stderr
    assert "eager_weights_float32" in done.stdout and "float32_rows_128" in done.stdout  # the inner one was made too


def test_choices_timed_under_another_openmp_wait_policy_are_kept_apart(monkeypatch):
    # A process run with OMP_WAIT_POLICY=PASSIVE (a busy machine's choice) times the candidates differently from one
    # whose threads spin (the default): neither's choice is the other's.
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    spinning = cpu.signature()
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert cpu.signature() != spinning
