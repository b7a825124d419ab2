"""Compiled steps of a few rows (a batch of prompts, beams) on plain weights against oneDNN's packed ones.

A compiled step of up to kernels.PLAIN_WEIGHTS_ROWS rows holds the model's weights plain so that decodekit's
C++ layer stack and row products multiply them; this measures that choice against keeping the packed
weights (PLAIN_WEIGHTS_ROWS = 0), with the eager loop beside them, on the default model in fp32. Each
compiled output is checked equal to the eager one. Rounds alternate the order; ms per token are medians.

    python bench/bench_few_rows.py [--runs 3] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch

PROMPTS = ["The capital of France is", "Hi", "One, two, three,", "Paris is"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    import decodekit.kernels as kernels
    from decodekit import AutoModelForCausalLM, AutoTokenizer
    from decodekit.loading.default import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    # One model per layout, so that no timed call switches a model between packed and plain weights.
    models = {
        "eager": AutoModelForCausalLM.from_pretrained(path, dtype="float32"),
        "plain": AutoModelForCausalLM.from_pretrained(path, dtype="float32"),
        "packed": AutoModelForCausalLM.from_pretrained(path, dtype="float32"),
    }
    four = tok(PROMPTS, return_tensors="pt", padding=True)
    three = tok(PROMPTS[:3], return_tensors="pt", padding=True)
    twelve = {k: v.repeat(4, 1) for k, v in three.items()}
    n = args.new_tokens
    settings = {
        "greedy, 4 prompts": (four, {}),
        "beam search, 1 prompt x 4 beams": ({k: v[:1] for k, v in four.items()}, {"num_beams": 4}),
        "greedy, 12 prompts": (twelve, {}),
        "beam search, 3 prompts x 4 beams": (three, {"num_beams": 4}),
    }
    plain_rows = kernels.PLAIN_WEIGHTS_ROWS

    def job(setting, layout):
        inputs, kwargs = settings[setting]

        def run():
            kernels.PLAIN_WEIGHTS_ROWS = 0 if layout == "packed" else plain_rows
            with torch.inference_mode():
                return models[layout].generate(
                    **inputs, **kwargs, max_new_tokens=n, min_new_tokens=n, compile=layout != "eager"
                )

        return run

    jobs = {(s, layout): job(s, layout) for s in settings for layout in models}
    same = {}
    for (s, layout), run in jobs.items():  # first calls: compile, and check the output
        same.setdefault(s, []).append(run())
    samples = {key: [] for key in jobs}
    for i in range(args.runs):
        for key in list(jobs)[:: -1 if i % 2 else 1]:
            start = time.perf_counter()
            jobs[key]()
            samples[key].append(1000 * (time.perf_counter() - start) / n)
    result = {
        "model": "SmolLM2-135M-Instruct, fp32",
        "new_tokens": n,
        "runs": args.runs,
        "torch": torch.__version__,
        "plain_weights_rows": plain_rows,
        "rows": {},
    }
    for s in settings:
        ms = {layout: round(statistics.median(samples[(s, layout)]), 1) for layout in models}
        result["rows"][s] = {f"{layout}_ms_per_token": v for layout, v in ms.items()}
        result["rows"][s]["plain_vs_packed"] = round(ms["packed"] / ms["plain"], 2)
        result["rows"][s]["outputs_equal"] = all(torch.equal(same[s][0], out) for out in same[s][1:])
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
