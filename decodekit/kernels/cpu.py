"""What this CPU can do, asked in one place, and a way to force each answer.

Every speed path choice on CPU (oneDNN-packed weights or plain ones, decodekit's C++ kernels or the
library's, bf16 products in bf16 or through float32) reads a probe here instead of asking torch or
/proc/cpuinfo itself, so a test can force a probe off (or on, where the hardware has it) and exercise on
one machine the path another machine would take:

    with cpu.forced(onednn_bf16=False):     # as on an AVX2-only CPU
        ...

The same from outside a process: DECODEKIT_CPU_FORCE="onednn_bf16=0,native_kernels=0".

Probes:
  avx2, avx512f, avx512_bf16, avx512_vnni, amx_bf16, amx_int8   the CPU's flags (/proc/cpuinfo on Linux)
  onednn_bf16, onednn_fp16   oneDNN runs bf16 / fp16 matmuls with native instructions (torch's own probe)
  native_kernels             decodekit's C++ kernels may be used (native.py still has to build them, and
                             DECODEKIT_NATIVE_KERNELS=0 turns them off there)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
from pathlib import Path

import torch

FORCE_VARIABLE = "DECODEKIT_CPU_FORCE"
FLAG_PROBES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
PROBES = FLAG_PROBES + ("onednn_bf16", "onednn_fp16", "native_kernels")


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; ("", {}) where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor(), frozenset()
    name, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return name, flags


MODEL_NAME, FLAGS = _cpuinfo()


def _measured() -> dict[str, bool]:
    answers = {flag: flag in FLAGS for flag in FLAG_PROBES}
    if not FLAGS:  # no /proc/cpuinfo (macOS, say): torch's vector capability still tells AVX2 / AVX-512
        capability = torch.backends.cpu.get_cpu_capability()
        answers["avx2"] = capability.startswith("AVX")
        answers["avx512f"] = capability.startswith("AVX512")
    mkldnn = torch.backends.mkldnn.is_available()
    answers["onednn_bf16"] = mkldnn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    answers["onednn_fp16"] = mkldnn and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    answers["native_kernels"] = True  # allowed; native.py reads DECODEKIT_NATIVE_KERNELS and whether they build
    return answers


def _parse_force(text: str) -> dict[str, bool]:
    forced = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in PROBES or value.strip() not in ("0", "1"):
            raise ValueError(
                f"{FORCE_VARIABLE}={text!r}: {item!r} should be PROBE=0 or PROBE=1 with PROBE one of {list(PROBES)}."
            )
        forced[name.strip()] = value.strip() == "1"
    return forced


# What the machine has, and what is forced over it. A compiled step reads has() as a constant (dynamo guards
# on these dicts, so forcing an answer later recompiles rather than running a stale path).
MACHINE = _measured()
_answers = {**MACHINE, **_parse_force(os.environ.get(FORCE_VARIABLE, ""))}


def has(probe: str) -> bool:
    """The answer of `probe` (one of PROBES), forced or measured."""
    return _answers[probe]


@contextlib.contextmanager
def forced(**answers: bool):
    """Forces probes for the duration: `forced(onednn_bf16=False)`. Forcing one on where the machine lacks it
    raises ValueError, since the instructions it stands for would not run here."""
    for name, value in answers.items():
        if name not in PROBES:
            raise ValueError(f"cpu.forced: unknown probe {name!r}; probes are {list(PROBES)}.")
        if value and not MACHINE[name]:
            raise ValueError(f"cpu.forced: {name}=True, but this machine lacks {name}.")
    saved = dict(_answers)
    _answers.update(answers)
    try:
        yield
    finally:
        _answers.clear()
        _answers.update(saved)


# Variables that hold the libraries under this process to fewer instructions than the CPU has (with the probes forced
# off, the way to measure on an AVX-512 machine what an AVX2-only one would do): their speed differs, so must the
# cached choices.
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
# How OpenMP's idle threads wait (OMP_WAIT_POLICY=PASSIVE makes them sleep rather than spin): a choice timed one way
# is not reused by a process that waits the other.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def signature() -> str:
    """A short key for this CPU and torch build, the probes forced here, the instruction limits set for the
    libraries (ISA_VARIABLES) and OpenMP's wait policy (WAIT_VARIABLES): measurements cached under it are not reused
    elsewhere."""
    forced_here = sorted(f"{name}={value}" for name, value in _answers.items() if value != MACHINE[name])
    limits = [f"{name}={os.environ[name]}" for name in (*ISA_VARIABLES, *WAIT_VARIABLES) if os.environ.get(name)]
    key = "\0".join(
        [MODEL_NAME, " ".join(sorted(FLAGS)), torch.__version__, str(torch.get_num_threads()), *forced_here, *limits]
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


DEFAULT_CACHE_BYTES = 32 << 20  # where the kernel does not say: a common last-level cache of a server CPU
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs writes cache sizes as "32768K"


def last_level_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The size of the largest (last-level) cache CPU 0 sees, from Linux's sysfs (`caches`); DEFAULT_CACHE_BYTES
    where it says nothing."""
    sizes = []
    for index in caches.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        number, unit = (text[:-1], _SIZE_UNITS[text[-1]]) if text[-1:] in _SIZE_UNITS else (text, 1)
        if number.isdigit():
            sizes.append(int(number) * unit)
    return max(sizes, default=DEFAULT_CACHE_BYTES)


def describe() -> str:
    """One line for logs and `decodekit bench`: the CPU and the probes' answers."""
    on = [name for name in PROBES if has(name)]
    return f"{MODEL_NAME or platform.machine()}; {torch.get_num_threads()} threads; " + (
        ", ".join(on) or "no probe true"
    )
