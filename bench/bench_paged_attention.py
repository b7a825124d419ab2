"""Decode attention over the paged KV cache: decodekit::paged_attention against the path that runs without
decodekit's C++ kernels (each row's keys and values gathered from its blocks, then SDPA), on the default model's
attention shape (9 query heads, 3 kv heads, head_dim 64, blocks of 16 positions) and float32.

Every row decodes one token at the same context length; its blocks sit in random places of the pool, as they
do once requests have come and gone. Reports milliseconds per layer, the cache bytes read per second by the
kernel, and the ratio.

    python bench/bench_paged_attention.py [--rows 32 --contexts 128 600 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace

import torch


def case(rows: int, context: int, heads=9, kv_heads=3, head_dim=64, block_size=16) -> dict:
    from decodekit.batching.paged import PagedBatch, PagedCache, Segment
    from decodekit.models import cpu

    model = SimpleNamespace(  # what PagedCache reads of a model: one layer
        config=SimpleNamespace(num_hidden_layers=1, num_key_value_heads=kv_heads, head_dim=head_dim),
        dtype=torch.float32, device=torch.device("cpu"))
    per_row = -(-(context + 1) // block_size)
    cache = PagedCache(model, rows * per_row, block_size)
    cache.keys[0].normal_(), cache.values[0].normal_()
    order = torch.randperm(rows * per_row).tolist()
    tables = [order[i * per_row:(i + 1) * per_row] for i in range(rows)]
    batch = PagedBatch(cache, tables, [Segment(i, i + 1, i, context) for i in range(rows)])
    q = torch.randn(1, heads, rows, head_dim)
    k, v = torch.randn(1, kv_heads, rows, head_dim), torch.randn(1, kv_heads, rows, head_dim)

    def timed(native: bool) -> float:
        """The best of 5 rounds of 10 calls: on a shared machine noise only adds time."""
        rounds = []
        with cpu.forced(native_kernels=native):
            batch.attend(q, k, v, 0, None)
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(10):
                    batch.attend(q, k, v, 0, None)
                rounds.append((time.perf_counter() - start) / 10)
        return min(rounds)

    kernel, gathered = timed(True), timed(False)
    read = rows * (context + 1) * kv_heads * head_dim * 4 * 2
    return {"rows": rows, "context": context, "kernel_ms": round(kernel * 1e3, 3),
            "gathered_sdpa_ms": round(gathered * 1e3, 3), "kernel_GB_per_s": round(read / kernel / 1e9, 1),
            "gathered_over_kernel": round(gathered / kernel, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 600, 2000])
    args = parser.parse_args()
    from decodekit.models import cpu, native

    if not native.load():
        print("decodekit's C++ kernels are not available on this machine", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    with torch.inference_mode():
        cases = [case(r, c) for r in args.rows for c in args.contexts]
    json.dump({"machine": cpu.describe(), "threads": torch.get_num_threads(), "cases": cases}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
