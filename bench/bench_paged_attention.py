"""Decode attention over the paged KV cache: decodekit::paged_attention against the path that runs without decodekit's
C++ kernels (each row's keys and values gathered from its blocks, then SDPA), on the default model's attention shape
(9 query heads, 3 kv heads, head_dim 64, blocks of 16 positions) and float32.

Every row decodes one token at the same context length; its blocks sit in random places of the pool, as they do once
requests have come and gone. A step reads `--layers` layers' pools (30, the default model's: together they leave the
last-level cache, as a model's steps do; 1 reads from cache). Reports milliseconds a step, the cache bytes read per
second by the kernel, and the ratio; the two alternate within each round.

    python bench/bench_paged_attention.py [--rows 4 32] [--contexts 128 600 2000] [--layers 30]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace

import torch


def case(rows: int, context: int, layers: int, heads=9, kv_heads=3, head_dim=64, block_size=16) -> dict:
    from decodekit.batching.paged import PagedBatch, PagedCache, Segment
    from decodekit.kernels import cpu

    model = SimpleNamespace(  # what PagedCache reads of a model
        config=SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=kv_heads, head_dim=head_dim),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    per_row = -(-(context + 1) // block_size)
    cache = PagedCache(model, rows * per_row, block_size)
    for pool in (*cache.keys, *cache.values):
        pool.normal_()
    order = torch.randperm(rows * per_row).tolist()
    tables = [order[i * per_row : (i + 1) * per_row] for i in range(rows)]
    batch = PagedBatch(cache, tables, [Segment(i, i + 1, i, context) for i in range(rows)])
    q = torch.randn(1, heads, rows, head_dim)
    k, v = torch.randn(1, kv_heads, rows, head_dim), torch.randn(1, kv_heads, rows, head_dim)

    def step(native: bool):
        def run():
            with cpu.forced(native_kernels=native):
                for layer in range(layers):
                    batch.attend(q, k, v, layer, None)

        return run

    variants = {"kernel": step(True), "gathered_sdpa": step(False)}
    best = {name: float("inf") for name in variants}
    for run in variants.values():
        run()
    for _ in range(5):  # the best of 5 rounds of 3 steps each, the variants alternating: noise only adds time
        for name, run in variants.items():
            start = time.perf_counter()
            for _ in range(3):
                run()
            best[name] = min(best[name], (time.perf_counter() - start) / 3)
    read = rows * (context + 1) * kv_heads * head_dim * 4 * 2 * layers
    kernel, gathered = best["kernel"], best["gathered_sdpa"]
    return {
        "rows": rows,
        "context": context,
        "layers": layers,
        "kernel_ms": round(kernel * 1e3, 2),
        "gathered_sdpa_ms": round(gathered * 1e3, 2),
        "kernel_GB_per_s": round(read / kernel / 1e9, 1),
        "gathered_over_kernel": round(gathered / kernel, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 600, 2000])
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    from decodekit.kernels import cpu, native

    if not native.load():
        print("decodekit's C++ kernels are not available on this machine", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    with torch.inference_mode():
        cases = [case(r, c, args.layers) for r in args.rows for c in args.contexts]
    json.dump({"machine": cpu.describe(), "threads": torch.get_num_threads(), "cases": cases}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
