"""Speed choices that no rule of thumb settles, measured on this machine at first use and cached with its CPU.

Which kernel is fastest for a product depends on the CPU (AVX2 only, AVX-512, AVX512-BF16, AMX), the
thread count and the torch build: a choice tuned on one machine is wrong on another. `choose(name,
candidates)` times each candidate on a small representative problem the first time `name` is asked for,
keeps the fastest, logs the choice on the `decodekit` logger, and caches it in memory and in
`choices.json` under the kernels' cache folder, keyed by signature() (cpu.signature(): CPU model, flags, torch
version, threads; and the kernels' source, so a changed kernel is measured again), so the next process on the same
machine does not measure again. A choice measured while other work took this process's CPUs is used but not cached.

    DECODEKIT_CHOICES=measure   measure again now, ignoring the file (it is rewritten)
    clear()                     forget every cached choice (memory and file)
    forced(name=candidate)      a test pins a choice for the duration
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from . import cpu

logger = logging.getLogger("decodekit")

VARIABLE = "DECODEKIT_CHOICES"
# Reentrant: measuring one choice may run code that makes another (eager_layout times plain Linear layers,
# whose prompt products ask many_rows_route); a plain lock deadlocked there on a machine with no cached choices.
_lock = threading.RLock()
_made: dict[str, str] = {}
_forced: dict[str, str] = {}


def cache_file() -> Path:
    from .native import cache_dir

    return cache_dir() / "choices.json"


def _read() -> dict:
    try:
        return json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _key(name: str, candidates, sample: str = "") -> str:
    # The candidates are part of the key: a route added in a later version is measured, not passed over
    # because the winner among the old ones is still offered. So is the sample's name where a later version
    # times another problem: a choice made on the old one is made again.
    return f"{name}{'@' + sample if sample else ''}({','.join(sorted(candidates))})"


def signature() -> str:
    """What a cached choice holds for: this CPU and torch (cpu.signature()), the kernels' source and how choices are
    timed (a choice made by an earlier, less careful timing is made again)."""
    from .native import SOURCE

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return f"{cpu.signature()} kernels {digest} timed {WARM_UP_CALLS}+{ROUNDS}"


def _write(key: str, choice: str) -> None:
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        stored = _read()
        stored.setdefault(signature(), {})[key] = choice
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(stored, indent=1, sort_keys=True))
        os.replace(scratch, path)  # never a half-written file for another process
    except OSError as error:
        logger.info("could not cache the choice %s=%s (%s)", key, choice, error)


def median_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    """The median time of `repeats` calls of `fn`, after one untimed call."""
    fn()  # warm-up: first-call costs (allocation, oneDNN's primitive cache) are not the kernel's
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# Untimed calls of each candidate, then timed rounds, one call of each per round: a product's first calls in a
# process are far slower than its later ones (oneDNN's kernels generated, AMX state granted to each thread), and a
# shared machine's speed moves between seconds (docs/performance.md).
WARM_UP_CALLS, ROUNDS = 4, 7


def fastest(candidates: dict[str, Callable[[], object]]) -> dict[str, float]:
    """{label: median seconds} of the candidates, timed round-robin (one call of each per round) after warm-up
    calls, so a slow spell of the machine falls on every candidate alike."""
    for fn in candidates.values():
        for _ in range(WARM_UP_CALLS):
            fn()
    times: dict[str, list[float]] = {label: [] for label in candidates}
    for _ in range(ROUNDS):
        for label, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) for label, t in times.items()}


# A measurement is trusted only if this process had its CPUs: with another process running on them, statically split
# kernels wait on their slowest thread and lose to the library's dynamically scheduled ones, and a choice cached from
# such a measurement would slow every later process. A choice measured under load is used but not cached: the next
# process measures again.
DISTURBED = 0.1  # the share of this process's threads' CPUs that other work may take
MIN_TICKS = 20  # a measurement shorter than this (clock ticks, all CPUs together) is too short to judge


def cpu_ticks() -> tuple[int, int, int] | None:
    """(busy ticks of the CPUs this process may run on, all their ticks, this process's own ticks) from /proc, or None
    where there is none. Busy counts the hypervisor's steal: a virtual CPU taken away is taken all the same."""
    try:
        names = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        busy = total = 0
        with open("/proc/stat") as stat:
            for line in stat:
                name, *values = line.split()
                if name in names:
                    ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
                    total += sum(ticks)
                    busy += sum(ticks) - ticks[3] - ticks[4]
        own = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        return busy, total, int(own[11]) + int(own[12])  # utime + stime
    except (OSError, AttributeError, ValueError, IndexError):
        return None


def taken_share(before, after, cpus: int, threads: int) -> float:
    """The share of `threads` CPUs that other work took between two cpu_ticks() readings, beyond the `cpus - threads`
    CPUs this process leaves free; 0 where a reading is missing or too short to judge."""
    if before is None or after is None:
        return 0.0
    busy, total, own = (a - b for a, b in zip(after, before))
    if total < MIN_TICKS:
        return 0.0
    others = max(0, busy - own) * cpus / total  # CPUs' worth of other work
    return max(0.0, others - max(0, cpus - threads)) / max(1, threads)


def _taken_since(before) -> float:
    if before is None:  # no /proc (nor sched_getaffinity): nothing to judge by
        return 0.0
    return taken_share(before, cpu_ticks(), len(os.sched_getaffinity(0)), torch.get_num_threads())


def made(name: str) -> str | None:
    """The choice for `name` if it is pinned or already made in this process, else None (nothing is measured)."""
    return _forced.get(name) or _made.get(name)


def choose(name: str, candidates: dict[str, Callable[[], object]], sample: str = "") -> str:
    """The fastest of `candidates` ({label: a call of a representative problem}) for `name` on this machine;
    `sample` names the problem where it changed since choices were first cached (_key)."""
    known = made(name)
    if known is not None:
        return known
    with _lock:
        if name in _made:
            return _made[name]
        remeasure = os.environ.get(VARIABLE) == "measure"
        stored = {} if remeasure else _read().get(signature(), {})
        choice = stored.get(_key(name, candidates, sample))
        if choice not in candidates:
            before = cpu_ticks()
            timings = fastest(candidates)
            taken = _taken_since(before)
            choice = min(timings, key=timings.get)
            logger.info(
                "%s: chose %s on this CPU (%s); measured %s",
                name,
                choice,
                cpu.describe(),
                ", ".join(f"{label} {1000 * t:.2f} ms" for label, t in timings.items()),
            )
            if taken <= DISTURBED:
                _write(_key(name, candidates, sample), choice)
            else:
                logger.info(
                    "%s: not cached, other work took %.0f%% of this process's CPUs while it was measured; "
                    "the next process measures again",
                    name,
                    100 * taken,
                )
        _made[name] = choice
        return choice


def decide(
    name: str, candidates: Callable[[], dict[str, Callable[[], object]]], otherwise: str, sample: str = ""
) -> str:
    """The choice for `name`: pinned or made already, else the fastest of `candidates()` ({label: a call of a
    representative problem}, built only now), measured in inference mode. `otherwise` where nothing can be measured:
    in code being compiled (a trace cannot time anything; an eager call normally decides first), or where
    `candidates()` offers nothing (the kernels a route needs are not built); that answer is not kept. `sample`: as
    in choose."""
    known = made(name)
    if known is not None:
        return known
    if torch.compiler.is_compiling():
        return otherwise
    offered = candidates()
    if not offered:
        return otherwise
    with torch.inference_mode():
        return choose(name, offered, sample)


def clear() -> None:
    """Forgets every choice, in memory and in the cache file: the next use measures again."""
    with _lock:
        _made.clear()
        with contextlib.suppress(OSError):
            cache_file().unlink()


@contextlib.contextmanager
def forced(**pinned: str):
    """Pins choices for the duration: `forced(int8_prefill="float32")`."""
    saved = dict(_forced)
    _forced.update(pinned)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)
