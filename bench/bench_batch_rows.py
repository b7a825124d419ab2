"""`decodekit batch`'s rows: one generate() per prompt against RowGenerator.many (continuous batching), on the
default model, greedy, EOS ignored so both generate the same counts; checks that the tokens are the same.

    python bench/bench_batch_rows.py [--rows 32] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    from decodekit.batch_job import BatchSettings, RowGenerator
    from decodekit.kernels import cpu
    from decodekit.loading.default import load_default

    model, tokenizer = load_default()
    prompts = [f"Write a story about the number {i}." for i in range(args.rows)]
    generator = RowGenerator.around(
        BatchSettings(generation={"max_new_tokens": args.new_tokens, "eos_token_id": None}), model, tokenizer
    )
    generator(prompts[0])
    generator.many(prompts[:2])  # warm-up of both paths
    start = time.perf_counter()
    alone = [generator(prompt) for prompt in prompts]
    one_at_a_time = time.perf_counter() - start
    start = time.perf_counter()
    batched = generator.many(prompts)
    many = time.perf_counter() - start
    json.dump(
        {
            "machine": cpu.describe(),
            "rows": args.rows,
            "new_tokens": args.new_tokens,
            "one_at_a_time_s": round(one_at_a_time, 2),
            "batched_s": round(many, 2),
            "speedup": round(one_at_a_time / many, 2),
            "same_tokens": alone == batched,
        },
        sys.stdout,
        indent=2,
    )
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
