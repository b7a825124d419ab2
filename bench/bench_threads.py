"""Thread counts on a quiet and on a busy machine: decode tokens/s of the default model (fp32, eager greedy) at each
candidate count, with 0, 1 and 2 CPU-bound processes beside it, in one run; and what `auto` chooses under each load.

The candidates are the ones kernels/threads.py weighs: torch's own (one per CPU), the physical cores, the CPUs other
work leaves free (auto), and 1. Prints one JSON object; rounds interleave the counts, so a slow spell of the machine
falls on every count alike.

    python bench/bench_threads.py [--new-tokens 32] [--rounds 3] [--busy 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from decodekit import AutoModelForCausalLM, AutoTokenizer, default_model_path
from decodekit.kernels import cpu, threads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", default="0,1,2", help="how many CPU-bound processes run beside it, per row")
    args = parser.parse_args()
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, threads="torch")
    ids = tokenizer(["The capital of France is"], return_tensors="pt")
    cpus = len(os.sched_getaffinity(0))
    counts = sorted({1, cpus, threads.physical_cores(set(os.sched_getaffinity(0)))})

    def tokens_per_s(count: int) -> float:
        torch.set_num_threads(count)
        model.generate(**ids, max_new_tokens=2, eos_token_id=None)
        start = time.perf_counter()
        model.generate(**ids, max_new_tokens=args.new_tokens, eos_token_id=None)
        return args.new_tokens / (time.perf_counter() - start)

    tokens_per_s(cpus)  # kernels loaded, routes measured: outside the timed rounds
    rows = []
    for busy in [int(b) for b in args.busy.split(",")]:
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(1.0)  # the scheduler has placed them
            chosen = threads.auto_threads()
            times: dict[int, list[float]] = {c: [] for c in counts}
            for _ in range(args.rounds):
                for count in counts:
                    times[count].append(tokens_per_s(count))
        finally:
            for hog in hogs:
                hog.kill()
        rates = {c: round(statistics.median(t), 2) for c, t in times.items()}
        rows.append(
            {
                "busy_processes": busy,
                "auto_chose": chosen,
                "tokens_per_s": rates,
                "auto_vs_torch_default": round(rates[chosen] / rates[cpus], 2),
                "auto_vs_best": round(rates[chosen] / max(rates.values()), 2),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"machine": cpu.describe(), "cpus": cpus, "new_tokens": args.new_tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
