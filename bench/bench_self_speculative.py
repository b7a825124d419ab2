"""Self-speculative decoding (assistant_early_exit) on the default model against plain greedy, same output.

The model's first N of its 30 layers draft, the whole model verifies; on the input-grounded prompt of
bench_generate (rename a variable in a function, through the chat template). Prints tokens/s of both, the
ratio (median of per-round ratios), whether the output is identical, and the acceptance rate: drafted
tokens the target kept, over drafted tokens (counted from the target's verification forwards; constant
schedule, so each verification checks `num_assistant_tokens` drafts unless the end is near).

    python bench/bench_self_speculative.py --runs 3 --new-tokens 64 --layers 4
"""

from __future__ import annotations

import json
import sys
import time

import torch

from bench_generate import GROUNDED_CODE, GROUNDED_MESSAGE, bench_parser, bench_setup, interleaved


def main() -> int:
    parser = bench_parser(__doc__, new_tokens=64)
    parser.add_argument("--layers", type=int, default=4, help="draft layers (assistant_early_exit)")
    parser.add_argument("--draft-tokens", type=int, default=4, help="num_assistant_tokens (constant schedule)")
    args, path, tok = bench_setup(parser)

    from decodekit import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": GROUNDED_MESSAGE + GROUNDED_CODE}], add_generation_prompt=True, return_tensors="pt"
    )
    common = dict(max_new_tokens=args.new_tokens, eos_token_id=None)
    early = dict(
        assistant_early_exit=args.layers,
        num_assistant_tokens=args.draft_tokens,
        num_assistant_tokens_schedule="constant",
    )
    verifications = []

    def count(module, positional, kwargs):
        if kwargs.get("exit_layer") is None:
            verifications[-1] += 1

    hook = model.register_forward_pre_hook(count, with_kwargs=True)
    verifications.append(0)
    plain = model.generate(ids, **common)
    verifications.append(0)
    fast = model.generate(ids, **common, **early)
    hook.remove()
    # The first verification forward holds the prompt; each later one checks drafts and keeps accepted + 1 tokens.
    steps = verifications[1] - 1
    accepted = args.new_tokens - steps
    acceptance = accepted / max(steps * args.draft_tokens, 1)

    jobs = {
        "greedy": lambda: model.generate(ids, **common),
        "self_speculative": lambda: model.generate(ids, **common, **early),
    }
    start = time.perf_counter()
    timings = interleaved(jobs, args.runs)
    tps = {name: round(args.new_tokens / timings.median(name), 2) for name in jobs}
    result = {
        "threads": args.threads,
        "torch": torch.__version__,
        "runs": args.runs,
        "new_tokens": args.new_tokens,
        "draft_layers": args.layers,
        "draft_tokens": args.draft_tokens,
        "tokens_per_s": tps,
        "speedup_vs_greedy": round(timings.ratio("greedy", "self_speculative"), 3),
        "identical_output": bool(torch.equal(plain, fast)),
        "verification_steps": steps,
        "acceptance_rate": round(acceptance, 3),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(
        f"greedy {tps['greedy']} tokens/s, self-speculative ({args.layers} layers) {tps['self_speculative']} tokens/s, "
        f"{result['speedup_vs_greedy']}x, identical {result['identical_output']}, acceptance {result['acceptance_rate']}",
        file=sys.stderr,
    )
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
