"""Hub methods written for transformers, on decodekit's native model against the same method on transformers' model.

Three methods from tests/published_methods.py, written the way published methods are: a plain loop handed to
transformers' generate() (top-nσ, greedy), a beam-family loop driving prepare_inputs_for_generation and the cache
reorder by hand (3 beams), and a cache-heavy one (greedy that rolls back when stuck, over a transformers
StaticCache it builds and crops). The default model, fp32, batch 1, the same weights on both sides: decodekit's
native model (what from_pretrained returns) and transformers' model (backend='transformers'). Each method
runs unchanged on both; the ratio is transformers' time over decodekit's (> 1: decodekit faster). Round-robin,
median of per-round ratios (bench_generate.Timings).

    python bench/bench_hub_methods.py --runs 3 --new-tokens 64
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_generate import PROMPT, bench_parser, bench_setup, interleaved, report

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from methods import write_method  # noqa: E402
from published_methods import BEAM_LOOP, ROLLBACK, TOP_N_SIGMA  # noqa: E402

METHODS = {
    "plain loop (top-n-sigma)": (TOP_N_SIGMA, dict(n_sigma=1.0)),
    "beam loop (3 beams)": (BEAM_LOOP, dict(num_beams=3)),
    "cache-heavy (rollback, static cache)": (ROLLBACK, dict(cache_kind="static")),
}


def main() -> int:
    args, path, tok = bench_setup(bench_parser(__doc__, new_tokens=64))

    from decodekit import AutoModelForCausalLM

    native = AutoModelForCausalLM.from_pretrained(path)
    theirs = AutoModelForCausalLM.from_pretrained(path, backend="transformers").module
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    root = Path(tempfile.mkdtemp(prefix="decodekit-bench-methods-"))
    jobs = {}
    for label, (source, options) in METHODS.items():
        repo = str(write_method(root / str(len(jobs)), source))
        call = dict(
            input_ids=ids,
            max_new_tokens=args.new_tokens,
            eos_token_id=None,
            custom_generate=repo,
            trust_remote_code=True,
            **options,
        )
        jobs[f"{label} decodekit"] = lambda call=call: native.generate(**call)
        jobs[f"{label} transformers"] = lambda call=call: theirs.generate(**call)
        same = torch.equal(native.generate(**call), theirs.generate(**call))
        print(f"{label}: decodekit's tokens {'equal' if same else 'DIFFER FROM'} transformers'", file=sys.stderr)
    start = time.perf_counter()
    timings = interleaved(jobs, args.runs)
    rows = {}
    for label in METHODS:
        seconds = {side: timings.median(f"{label} {side}") for side in ("decodekit", "transformers")}
        ratio = round(timings.ratio(f"{label} transformers", f"{label} decodekit"), 3)
        rows[label] = {
            "s_decodekit": round(seconds["decodekit"], 3),
            "s_transformers": round(seconds["transformers"], 3),
            "speedup_vs_transformers": ratio,
        }
        print(
            f"{label}: decodekit {seconds['decodekit']:.3f} s, transformers {seconds['transformers']:.3f} s, "
            f"{ratio:.3f}x",
            file=sys.stderr,
        )
    return report(args, start, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
