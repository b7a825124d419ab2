"""The cost of decodekit's processor inside vLLM: the default model on vLLM's CPU build, 32 concurrent greedy
requests of 128 tokens, without a decodekit method and with one whose processor only reads the scores, in
interleaved rounds (run in vLLM's environment: `make test-vllm` builds it).

    .venv-vllm/bin/python bench/bench_vllm.py [--runs 3] [--requests 32] [--new-tokens 128]

The model is converted to a transformers directory first (decodekit.testing.default_model_as_transformers). Prints one JSON
object: generated tokens/s of each, and the ratio (median of per-round ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from methods import SCORE_ONLY, write_method

    from decodekit.hub_loader.source import resolve
    from decodekit.testing import default_model_as_transformers

    root = Path(tempfile.mkdtemp())
    method = write_method(root / "center", SCORE_ONLY)
    os.environ["DECODEKIT_VLLM_METHODS"] = f"{method}@{resolve(str(method)).revision}"
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(default_model_as_transformers(root / "model")),
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        gpu_memory_utilization=0.3,
    )
    prompts = [f"Write a story about the number {i}." for i in range(args.requests)]

    def job(extra):
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True, extra_args=extra)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, [list(o.outputs[0].token_ids) for o in outs]

    jobs = {"plain": None, "decodekit score-only method": {"decodekit": {"method": str(method), "centered": True}}}
    job(None)  # warm-up
    rates = {name: [] for name in jobs}
    same = True
    for i in range(args.runs):
        round_tokens = {}
        for name in list(jobs)[:: -1 if i % 2 else 1]:
            rate, tokens = job(jobs[name])
            rates[name].append(rate)
            round_tokens[name] = tokens
        same &= round_tokens["plain"] == round_tokens["decodekit score-only method"]
    ratio = statistics.median(a / b for a, b in zip(rates["decodekit score-only method"], rates["plain"]))
    result = {
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "tokens_per_s": {k: round(statistics.median(v), 1) for k, v in rates.items()},
        "with_decodekit_over_plain": round(ratio, 3),
        "same_tokens": same,
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
