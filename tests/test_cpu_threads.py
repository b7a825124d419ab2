"""How many CPU threads torch's kernels get (kernels/threads.py): the choice, who may make it, and the flags."""

from __future__ import annotations

import pytest
import torch

from decodekit.cli.parser import build_parser
from decodekit.kernels import threads


@pytest.fixture
def restored(monkeypatch):
    """The process's thread count and decodekit's record of its choice, as they were, afterwards."""
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_chosen", None)
    monkeypatch.delenv(threads.VARIABLE, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield monkeypatch
    torch.set_num_threads(before)


@pytest.mark.parametrize("value,parsed", [("auto", "auto"), ("torch", "torch"), (" 3 ", 3), (2, 2), ("AUTO", "auto")])
def test_a_thread_setting_is_a_count_auto_or_torch(value, parsed):
    assert threads.parse(value) == parsed


@pytest.mark.parametrize("value", [0, -1, "0", "two", True, 1.5, None, ""])
def test_a_bad_thread_setting_names_the_argument_and_what_is_accepted(value):
    with pytest.raises(ValueError, match=r"threads=.* is invalid; expected a positive integer, 'auto'"):
        threads.parse(value)


@pytest.mark.parametrize(
    "cpus,physical,quota,busy,want",
    [
        (2, 2, None, 0.0, 2),  # a quiet machine: every core
        (2, 2, None, 0.3, 2),  # a little other work is noise
        (2, 2, None, 1.0, 1),  # one CPU held by other work: the one left
        (2, 2, None, 7.5, 1),  # load far above the cores: one thread, never none
        (8, 4, None, 0.0, 4),  # hyperthreads: one per physical core
        (8, 8, 3, 0.0, 3),  # a cgroup quota of 2.5 CPUs: 3
        (8, 8, None, 2.6, 5),
    ],
)
def test_auto_takes_the_cpus_other_work_leaves_free_one_per_core(restored, cpus, physical, quota, busy, want):
    restored.setattr(threads, "_cpus", lambda: set(range(cpus)))
    restored.setattr(threads, "physical_cores", lambda found: physical)
    restored.setattr(threads, "quota_cpus", lambda: quota)
    assert threads.auto_threads(busy) == want


def test_auto_samples_other_work_from_proc_stat_where_not_given(restored):
    readings = iter([(100, 1000, 10), (100 + 100, 1000 + 200, 10 + 0)])  # others held 100 of 200 ticks on 2 CPUs
    restored.setattr("decodekit.kernels.choices.cpu_ticks", lambda: next(readings))
    restored.setattr(threads, "_cpus", lambda: {0, 1})
    restored.setattr(threads, "SAMPLE_S", 0.0)
    assert threads.others_busy(0.0) == pytest.approx(1.0)


def test_a_load_chooses_once_and_keeps_a_count_chosen_outside_decodekit(restored):
    restored.setattr(threads, "auto_threads", lambda busy=None: 1)
    torch.set_num_threads(threads.torch_default())
    threads.threads_for_load()
    assert torch.get_num_threads() == 1  # "auto" at the first load
    torch.set_num_threads(2)
    threads.threads_for_load()
    assert torch.get_num_threads() == 2  # not again: the user's later choice stands
    restored.setattr(threads, "_chosen", None)
    torch.set_num_threads(threads.torch_default() + 1)
    threads.threads_for_load()
    assert torch.get_num_threads() == threads.torch_default() + 1  # one set before the first load is the user's too
    restored.setenv(threads.VARIABLE, "3")
    threads.threads_for_load()
    assert torch.get_num_threads() == 3  # DECODEKIT_THREADS decides
    threads.threads_for_load(threads=1)
    assert torch.get_num_threads() == 1  # and threads= over everything
    restored.setenv(threads.VARIABLE, "many")
    restored.setattr(threads, "_chosen", None)
    with pytest.raises(ValueError, match="DECODEKIT_THREADS='many' is invalid"):
        threads.threads_for_load()


def test_from_pretrained_takes_threads_and_refuses_a_bad_value_before_loading(restored, tmp_path):
    from decodekit import AutoModelForCausalLM
    from helpers import write_tiny_model

    path = write_tiny_model(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match="threads=0 is invalid"):
        AutoModelForCausalLM.from_pretrained(path, threads=0)
    AutoModelForCausalLM.from_pretrained(path, threads=1)
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("command", [["generate", "Hi"], ["chat"], ["serve"], ["batch", "in.jsonl", "out.jsonl"]])
def test_every_model_command_takes_threads(command, capsys):
    assert build_parser().parse_args([*command, "--threads", "auto"]).threads == "auto"
    assert build_parser().parse_args([*command, "--threads", "2"]).threads == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--threads", "0"])
    assert "argument --threads: expected a positive integer" in capsys.readouterr().err
