"""How many threads torch's CPU kernels use: chosen for the machine as it is when a model loads.

torch's own default is one thread per CPU the process may run on. On a machine where other work holds some of those
CPUs, its threads wait for each other at every operator: decoding collapses (bench/bench_threads.py measures it).
"auto" counts the CPUs other work leaves free, over a short sample of /proc/stat at the choice, and takes that many,
at most one per physical core and within a cgroup's CPU quota, at least one.

Who chooses: `threads=` (from_pretrained, decodekit.set_threads), else DECODEKIT_THREADS, else "auto" at the first
CPU model a process loads, unless the count was already chosen outside decodekit (OMP_NUM_THREADS, or
torch.set_num_threads before the load), which is then kept. The command line's --threads does the same.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger("decodekit")

VARIABLE = "DECODEKIT_THREADS"
ACCEPTED = (
    "a positive integer, 'auto' (the CPUs other work leaves free, one per physical core) or 'torch' (torch's own)"
)
SAMPLE_S = 0.2  # how long /proc/stat is watched for other work: long enough for ~20 clock ticks per CPU
BUSY = 0.5  # a CPU's worth of other work counts from half a CPU on

_chosen: int | None = None  # the count decodekit set in this process, if any


def _cpus() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def torch_default() -> int:
    """The count torch takes by itself: OMP_NUM_THREADS where set, else one thread per CPU of the process."""
    variable = os.environ.get("OMP_NUM_THREADS", "")
    return int(variable) if variable.isdigit() and int(variable) >= 1 else len(_cpus())


def parse(value, name: str = "threads") -> int | str:
    """`value` as a thread setting: an int >= 1, "auto" or "torch"; ValueError naming `name` otherwise."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "torch"):
            return text
        if text.isdigit() and int(text) >= 1:
            return int(text)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"{name}={value!r} is invalid; expected {ACCEPTED}.")


def physical_cores(cpus: set[int]) -> int:
    """How many physical cores the CPUs `cpus` belong to (hyperthreads of one core counted once); len(cpus) where
    the topology cannot be read."""
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(
                (topology / "physical_package_id").read_text().strip()
                + ":"
                + (topology / "core_id").read_text().strip()
            )
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def quota_cpus() -> int | None:
    """The CPUs a cgroup v2 quota (cpu.max) allows this process, rounded up; None where there is none."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def others_busy(sample_s: float = SAMPLE_S) -> float | None:
    """CPUs' worth of other processes' work on this process's CPUs over `sample_s` (None without /proc)."""
    from .choices import cpu_ticks

    before = cpu_ticks()
    if before is None:
        return None
    time.sleep(sample_s)
    after = cpu_ticks()
    busy, total, own = (a - b for a, b in zip(after, before))
    if total <= 0:
        return None
    return max(0, busy - own) * len(_cpus()) / total


def auto_threads(busy: float | None = None) -> int:
    """The thread count "auto" gives now: the CPUs of this process that other work leaves free (`busy`: CPUs' worth
    of it, sampled where not given), at most one per physical core and the cgroup quota, at least one."""
    cpus = _cpus()
    limit = min(physical_cores(cpus), quota_cpus() or len(cpus))
    if busy is None:
        busy = others_busy() or 0.0
    free = len(cpus) - math.floor(busy + 1 - BUSY)
    return max(1, min(limit, free))


def set_threads(value="auto") -> int:
    """Sets the thread count torch's CPU kernels use for this process: an int, "auto" (auto_threads) or "torch"
    (torch's own default, as the process started). Returns the count now in use."""
    global _chosen
    setting = parse(value)
    count = torch_default() if setting == "torch" else auto_threads() if setting == "auto" else setting
    if count != torch.get_num_threads():
        torch.set_num_threads(count)
    _chosen = count
    logger.info("decodekit: %d CPU threads (%s)", count, "chosen: " + str(value) if setting != "auto" else "auto")
    return count


def threads_for_load(threads=None) -> None:
    """At a CPU model's load: `threads` where given, else DECODEKIT_THREADS, else "auto" once per process unless the
    count was chosen outside decodekit (OMP_NUM_THREADS, torch.set_num_threads): that one is kept."""
    if threads is not None:
        set_threads(threads)
        return
    variable = os.environ.get(VARIABLE, "").strip()
    if variable:
        if _chosen is None:
            set_threads(parse(variable, VARIABLE))
        return
    outside = os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads() != torch_default()
    if _chosen is None and not outside:
        set_threads("auto")
