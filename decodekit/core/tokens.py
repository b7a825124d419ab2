"""Helpers on sequences of token ids."""

from __future__ import annotations

from typing import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    if len(a) <= len(b) and b[: len(a)] == a:  # the usual case, a row grown by a few tokens: one comparison in C
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
