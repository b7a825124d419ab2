"""decodekit's loop on a wrapped transformers model against transformers' own generate() on the same object.

The default model loaded through transformers (fp32), greedy, batch 1 and a left-padded batch of 8. Both
run the same forward with the same kind of cache (transformers' DynamicCache), so the ratio measures what
decodekit's loop adds or saves around the model: >= 1.0 means no overhead. Round-robin, median of
per-round ratios (see bench_generate.Timings).

    python bench/bench_wrapped.py --runs 5 --new-tokens 128
"""

from __future__ import annotations

import sys
import time

import torch

from bench_generate import PROMPT, bench_parser, bench_setup, interleaved, report

BATCH_PROMPTS = [
    PROMPT,
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4,",
    "The best way to learn a language is",
    "Water boils at",
    "import numpy as np\n",
    "Dear Sir or Madam,",
]


def main() -> int:
    args, path, tok = bench_setup(bench_parser(__doc__, new_tokens=128))

    from decodekit import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, backend="transformers")  # decodekit.wrap of transformers' model
    hf = model.module
    hf.generation_config.pad_token_id = tok.pad_token_id
    one = tok(PROMPT, return_tensors="pt")
    eight = tok(BATCH_PROMPTS, return_tensors="pt", padding=True)
    n = args.new_tokens
    # No EOS, so every run makes exactly n tokens a row; min_new_tokens would add a processor to one side only.
    common = dict(max_new_tokens=n, eos_token_id=None)
    jobs = {}
    for label, inputs in (("batch 1", one), ("batch 8", eight)):
        feed = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        jobs[f"{label} decodekit"] = lambda feed=feed: model.generate(**feed, **common)
        jobs[f"{label} transformers"] = lambda feed=feed: hf.generate(**feed, do_sample=False, **common)
        same = torch.equal(model.generate(**feed, **common), hf.generate(**feed, do_sample=False, **common))
        print(f"{label}: decodekit's tokens {'equal' if same else 'DIFFER FROM'} transformers'", file=sys.stderr)
    start = time.perf_counter()
    timings = interleaved(jobs, args.runs)
    rows = {}
    for label in ("batch 1", "batch 8"):
        ms = {side: round(1000 * timings.median(f"{label} {side}") / n, 2) for side in ("decodekit", "transformers")}
        ratio = round(timings.ratio(f"{label} transformers", f"{label} decodekit"), 3)
        rows[label] = {
            "ms_per_step_decodekit": ms["decodekit"],
            "ms_per_step_transformers": ms["transformers"],
            "speedup_vs_transformers": ratio,
        }
        print(
            f"{label}: decodekit {ms['decodekit']:.2f} ms/step, transformers {ms['transformers']:.2f} ms/step, "
            f"{ratio:.3f}x",
            file=sys.stderr,
        )
    return report(args, start, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
