"""What each of llama.cpp's samplers costs a decode step: the default model sampling 64 tokens with each sampler on,
against the same step without it (plain sampling), eager and with compile=True, side by side in one process.

    python bench/bench_samplers.py [--runs 5] [--new-tokens 64] [--no-compile]

Every figure is the median over `runs` rounds, the configurations interleaved within a round so the machine's drift
hits them alike; the cost is (step with the sampler / plain step - 1) of the median ms a token. min_new_tokens keeps
every run at the same length. Prints a table, then one JSON object. The issue's target: each score-only sampler
(top-n-sigma, dynamic temperature, smoothing) at most 5% eager and compiled; DRY, XTC and mirostat are reported too
(they read the sequence or keep state, so compile=True runs them in the eager loop).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SAMPLERS = {
    "plain": {},
    "top_n_sigma": {"top_n_sigma": 1.0},
    "dynatemp": {"dynatemp_range": 0.5},
    "smoothing": {"smoothing_factor": 0.3},
    "xtc": {"xtc_probability": 0.5, "xtc_threshold": 0.1},
    "dry": {"dry_multiplier": 0.8},
    "mirostat2": {"mirostat": 2},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    from decodekit import AutoModelForCausalLM, AutoTokenizer
    from decodekit.kernels import cpu
    from decodekit.loading.default import default_model_path

    torch.set_num_threads(2)
    path = default_model_path()
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    ids = tok(["Once upon a time, in a city by the sea,"], return_tensors="pt")["input_ids"]
    modes = [False] if args.no_compile else [False, True]

    def run(fields, compile):
        start = time.perf_counter()
        model.generate(
            ids,
            do_sample=True,
            seed=1,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            tokenizer=tok,
            compile=compile,
            **fields,
        )
        return (time.perf_counter() - start) * 1000 / args.new_tokens

    for compile in modes:  # warm-up: compiles each step once, builds DRY's breaker table
        for fields in SAMPLERS.values():
            run(fields, compile)
    times = {(name, c): [] for name in SAMPLERS for c in modes}
    for round_ in range(args.runs):
        order = list(SAMPLERS) if round_ % 2 == 0 else list(SAMPLERS)[::-1]
        for compile in modes:
            for name in order:
                times[(name, compile)].append(run(SAMPLERS[name], compile))
    result = {"cpu": cpu.describe(), "ms_per_token": {}, "cost_vs_plain": {}}
    print(f"{'sampler':<12} " + " ".join(f"{'compiled' if c else 'eager':>22}" for c in modes))
    for name in SAMPLERS:
        cells = []
        for compile in modes:
            ms = statistics.median(times[(name, compile)])
            plain = statistics.median(times[("plain", compile)])
            key = f"{name}/{'compiled' if compile else 'eager'}"
            result["ms_per_token"][key] = round(ms, 3)
            result["cost_vs_plain"][key] = round(ms / plain - 1, 4)
            cells.append(f"{ms:8.2f} ms ({ms / plain - 1:+6.1%})")
        print(f"{name:<12} " + " ".join(f"{c:>22}" for c in cells))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
