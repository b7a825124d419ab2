"""The machine, the paths decodekit chose on it, and decode and prefill speed against transformers, in one run
of a few minutes (the default model, same GGUF weights, same threads).

    python bench/bench_quick.py [--runs 3] [--new-tokens 64] [--threads 2]

Every figure is the median of `runs` rounds run round-robin (order reversed every other round), so the
machine's drift hits both libraries alike; ratios are medians of per-round ratios. Prints a table, then
one JSON object.
"""

from __future__ import annotations

import sys
import time

import torch

from bench_generate import PROMPT, bench_parser, bench_setup, interleaved, report


def prefill_job(model, ids):
    def run():
        with torch.inference_mode():
            model(ids, use_cache=True, logits_to_keep=1) if _takes_logits_to_keep(model) else model(ids, use_cache=True)

    return run


def _takes_logits_to_keep(model) -> bool:
    import inspect

    return "logits_to_keep" in inspect.signature(model.forward).parameters


def decode_job(model, ids, new_tokens, **kwargs):
    def run():
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                **kwargs,
            )

    return run


def chosen_paths(ours_fp32, ours_bf16, ours_int8, long_ids) -> dict:
    from decodekit.kernels import choices, cpu, native
    from decodekit.kernels.packed import PackedLinear

    with torch.inference_mode():
        for model in (ours_fp32, ours_bf16, ours_int8):
            model(long_ids[:, :32], use_cache=False)  # an eager forward decides packing and the int8 route

    def layout(model, plain: str) -> str:
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        if not packed:
            return plain
        return "both (oneDNN packed for prompts, plain for steps)" if packed[0].plain_steps else "oneDNN packed"

    return {
        "cpu": cpu.describe(),
        "native_kernels": native.load() and cpu.has("native_kernels"),
        "fp32_eager_weights": layout(ours_fp32, "plain"),
        "bf16_eager_weights": layout(ours_bf16, "plain (decodekit row kernels / float32 route)"),
        "int8_prefill_route": choices.made("int8_many_rows") or "not chosen yet",
    }


def main() -> int:
    args, path, tok = bench_setup(bench_parser(__doc__, new_tokens=64))

    from decodekit import AutoModelForCausalLM
    from decodekit.loading.tokenizer import prompt_ids

    ours = {"fp32": AutoModelForCausalLM.from_pretrained(path, dtype="float32")}
    ours["bf16"] = AutoModelForCausalLM.from_pretrained(path, dtype="bfloat16")
    ours["int8"] = AutoModelForCausalLM.from_pretrained(path, quantize="int8")
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    text = " The quick brown fox jumps over the lazy dog, and the dog sleeps on." * 120
    long_ids = torch.tensor([tok.encode(text)])
    prompts = {n: long_ids[:, :n] for n in (256, 1024)}
    # Time to first token: a chat prompt of 1,024 tokens through the chat template, generate() of one token.
    question = tok.decode(long_ids[0, :1000]) + "\nSummarize the text above in one sentence."
    chat = prompt_ids(tok, question, chat=True)[:, -1024:]
    paths = chosen_paths(ours["fp32"], ours["bf16"], ours["int8"], long_ids)

    jobs = {}
    for fmt, model in ours.items():
        jobs[f"decode {fmt} eager"] = decode_job(model, ids, args.new_tokens)
        for n, p in prompts.items():
            jobs[f"prefill {n} {fmt}"] = prefill_job(model, p)
        jobs[f"first token, 1024-token chat {fmt}"] = decode_job(model, chat, 1)
    jobs["decode fp32 compiled"] = decode_job(ours["fp32"], ids, args.new_tokens, compile=True)
    if not args.skip_transformers:
        import transformers

        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        ref.generation_config.pad_token_id = tok.pad_token_id
        jobs["decode fp32 eager (transformers)"] = decode_job(ref, ids, args.new_tokens)
        for n, p in prompts.items():
            jobs[f"prefill {n} fp32 (transformers)"] = prefill_job(ref, p)
        jobs["first token, 1024-token chat fp32 (transformers)"] = decode_job(ref, chat, 1)
    start = time.perf_counter()
    timings = interleaved(jobs, args.runs)
    rows = {}
    for name in jobs:
        seconds = timings.median(name)
        per = args.new_tokens if name.startswith("decode") else 1
        rows[name] = {"ms" + ("_per_token" if per > 1 else ""): round(1000 * seconds / per, 2)}
    if not args.skip_transformers:
        for fmt in ours:
            rows[f"decode {fmt} eager"]["speedup_vs_transformers_fp32"] = round(
                timings.ratio("decode fp32 eager (transformers)", f"decode {fmt} eager"), 3
            )
            for row in [f"prefill {n}" for n in prompts] + ["first token, 1024-token chat"]:
                rows[f"{row} {fmt}"]["speedup_vs_transformers_fp32"] = round(
                    timings.ratio(f"{row} fp32 (transformers)", f"{row} {fmt}"), 3
                )
        rows["decode fp32 compiled"]["speedup_vs_transformers_fp32"] = round(
            timings.ratio("decode fp32 eager (transformers)", "decode fp32 compiled"), 3
        )
    for name, row in rows.items():
        extra = (
            f"   {row['speedup_vs_transformers_fp32']:.2f}x transformers fp32"
            if "speedup_vs_transformers_fp32" in row
            else ""
        )
        value = row.get("ms_per_token", row.get("ms"))
        print(f"{name:36s} {value:9.2f} {'ms/token' if 'ms_per_token' in row else 'ms'}{extra}", file=sys.stderr)
    return report(args, start, paths=paths, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
