"""decodekit's weight formats on Llama-3.2-1B-shaped layers, side by side with PyTorch's float32 product of the same
weights: one row (a decode step's products) and 512 rows (a prompt's), per format: float32 (`F.linear`, the
reference), int8 (`quantize="int8"`), q4 blocks of 32 (`quantize="int4"`: decodekit's kernels, float32 products) and
PyTorch's int4 layout in groups of 32 / 64 / 128 (`quantize="int4-g64"` / `"int4-g128"`: `_weight_int4pack_mm_for_cpu`,
bfloat16 activations). Four layers of random weights (more than any cache holds), each format's layers made from the
same float weights; medians of rounds that alternate the formats' order; bytes held, and the rate they are read at.

    python bench/bench_int4.py [--runs 5] [--layers 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch import nn

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def layers_of(kind: str, floats: list[nn.Linear]) -> list[nn.Module]:
    from decodekit.kernels.blocks import BlockLinear
    from decodekit.kernels.int4pack import Int4PackLinear
    from decodekit.kernels.quantize import Int8Linear

    if kind == "float32":
        return floats
    if kind == "int8":
        return [Int8Linear(f) for f in floats]
    if kind == "q4 blocks":
        return [BlockLinear.from_linear(f, "q4") for f in floats]
    return [Int4PackLinear.from_linear(f, int(kind.rsplit(" ", 1)[1])) for f in floats]


def held_bytes(layers) -> int:
    from decodekit.kernels.blocks import weight_formats

    return sum(sum(weight_formats(layer).values()) for layer in layers)


def timed(layers, rows: torch.Tensor | dict) -> float:
    start = time.perf_counter()
    for layer in layers:
        layer(rows[layer.in_features])
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    floats = [nn.Linear(k, n, bias=False).requires_grad_(False) for _ in range(args.layers) for n, k in SHAPES.values()]
    kinds = ["float32", "int8", "q4 blocks", "int4 groups of 32", "int4 groups of 64", "int4 groups of 128"]
    formats = {kind: layers_of(kind, floats) for kind in kinds}
    results = {}
    with torch.inference_mode():
        for count in (1, 512):
            rows = {k: torch.randn(count, k) for k in {k for _, k in SHAPES.values()}}
            times = {kind: [] for kind in kinds}
            for layers in formats.values():
                timed(layers, rows)  # warm: choices measured, kernels loaded
            for run in range(args.runs):
                for kind in kinds if run % 2 == 0 else reversed(kinds):
                    times[kind].append(timed(formats[kind], rows))
            reference = statistics.median(times["float32"])
            for kind in kinds:
                ms = statistics.median(times[kind])
                row = results.setdefault(kind, {"held_MB": round(held_bytes(formats[kind]) / 2**20, 1)})
                row[f"{count}_rows_ms"] = round(1000 * ms, 2)
                row[f"{count}_rows_speed_vs_float32"] = round(reference / ms, 2)
                if count == 1:
                    row["1_row_GBps"] = round(held_bytes(formats[kind]) / ms / 1e9, 1)
    flags = [line for line in open("/proc/cpuinfo") if line.startswith("flags")][0].split()
    report = {
        "threads": args.threads,
        "torch": torch.__version__,
        "cpu_flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_int8") if f in flags],
        "layers": f"{args.layers} x Llama-3.2-1B's (qkv, o, gate_up, down)",
        "formats": results,
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
