"""Byte counts as a person reads them, for the messages of every layer (it imports nothing of decodekit)."""


def human_size(n: float) -> str:
    """Bytes as a person reads them: 512 bytes, 12.1 KiB, 3.0 GiB."""
    if n < 1024:
        return f"{n} bytes"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"
