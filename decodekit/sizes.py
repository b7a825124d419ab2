"""Byte counts as a person reads them, for the messages of every layer, and the host memory still available (it
imports nothing of decodekit)."""

import os


def human_size(n: float) -> str:
    """Bytes as a person reads them: 512 bytes, 12.1 KiB, 3.0 GiB."""
    if n < 1024:
        return f"{n} bytes"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def host_memory_available() -> int | None:
    """Bytes of host memory available now (Linux's MemAvailable, else the free physical pages), or None where
    neither can be read."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def return_freed_memory() -> None:
    """Hands the C heap's freed memory back to the system where the C library can (glibc's malloc_trim): a load's
    transient copies (a GGUF file's q, k and v blocks before they are fused, say) otherwise stay in the process's
    resident memory."""
    import ctypes

    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: glibc's, where it runs
    except OSError:
        return
    if trim is not None:
        trim(0)
