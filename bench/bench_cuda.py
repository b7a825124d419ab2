"""decodekit against transformers on a GPU, on the same random weights, side by side in one run: the default
model's shape (SmolLM2-135M) and Llama 3.2 1B's, bfloat16.

    python bench/bench_cuda.py [--runs 3] [--new-tokens 128] [--shapes smollm2-135m llama-1b] [--skip-transformers]

Rows per shape: batch-1 decode tokens/s after a 128-token prompt, eager, compile=True (the step as a CUDA graph
replay) and compile_config={"mode": "default"} (compiled, no graphs), against transformers' eager
generate() and its static cache (which transformers compiles itself); the time to first token of a 2,048-token
prompt; a batch of 64 prompts decoded together; 64 prompts of 64-256 tokens through continuous batching
(decodekit's manager with its compiled step, CUDA graphs per row bucket, its attention over gathered blocks and
through flex attention, paged_attention="flex", against transformers' generate_batch). The
batch-1 rows are also given as a fraction of the memory-bandwidth bound: the bytes a step reads (weights, the lm_head's
table once, the KV cache at the mean context) over the device's measured copy bandwidth. Each figure is the median of
`runs` rounds run round-robin; ratios are medians of per-round ratios. Prints one JSON line per shape as it finishes
(a stopped run keeps what it has), and one line per group of rows as it finishes. Every output is checked
first (rows, and each request's 128 tokens): a side that failed is printed as failed, not timed. `--device cpu` runs the same rows on the CPU, a check of the script, not a
measurement to report.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from bench_generate import DEFAULT_SHAPE, interleaved, random_checkpoint

SHAPES = {
    "smollm2-135m": DEFAULT_SHAPE,
    "llama-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
}


def synced(fn, inference: bool = True):
    """fn run to the end of its device work; inside torch.inference_mode() where `inference` (as decodekit's
    generate() runs), outside where the library's users call it so (transformers' generate_batch updates its
    cache in place, which inference tensors refuse: every one of its requests then fails)."""

    def run():
        with torch.inference_mode(inference):
            out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    return run


def without_fallback(fn):
    """fn, failing where decodekit logged that a compiled step fell back (to eager steps, or flex attention to
    gathered blocks) while it ran: a row must be timed on the route it names."""

    def run():
        said = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: said.append(record.getMessage())
        log = logging.getLogger("decodekit")
        log.addHandler(handler)
        try:
            out = fn()
        finally:
            log.removeHandler(handler)
        fell = [m for m in said if "failed" in m]
        if fell:
            raise RuntimeError(fell[0])
        return out

    return run


def check_tokens(name: str, out, rows: int, new_tokens: int) -> None:
    """ValueError unless `out` (a [rows, prompt + new] tensor, or generate_batch's {id: output}) holds `rows`
    results of `new_tokens` generated tokens each: a library that fails fast must not look fast."""
    if isinstance(out, torch.Tensor):
        counts = [out.shape[1]] * out.shape[0]
        wrong = [] if out.shape[0] == rows else [f"{out.shape[0]} rows"]
        return None if not wrong and len(set(counts)) == 1 else _wrong(name, wrong or counts)
    results = list(out.values())
    counts = [len(getattr(r, "generated_tokens", None) or []) for r in results]
    wrong = [c for c in counts if c != new_tokens]
    if len(results) != rows or wrong:
        errors = {str(getattr(r, "error", "")) for r in results if getattr(r, "error", None)}
        raise ValueError(
            f"{name}: {len(results)} results of {rows}, {len(wrong)} without {new_tokens} tokens "
            f"(counts {sorted(set(counts))}); errors: {sorted(errors)[:2]}"
        )
    return None


def _wrong(name, detail):
    raise ValueError(f"{name}: unexpected output shape {detail}")


def checked_group(title: str, jobs: dict, check, runs: int):
    """The group's jobs each run once and checked (`check(name, output)`), a failing one printed and left out;
    then the others timed round-robin. (timings or None, {name: failure})."""
    failed = {}
    for name in list(jobs):
        try:
            check(name, jobs[name]())
        except Exception as error:  # noqa: BLE001 - the bench prints a failure instead of a number
            failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            print(json.dumps({"group": title, "failed": name, "why": failed[name]}), flush=True)
            del jobs[name]
    return (interleaved(jobs, runs) if jobs else None), failed


def copy_bandwidth(device: str, megabytes: int = 512, runs: int = 5) -> float:
    """Bytes per second a device-to-device copy moves (each byte read once and written once), the best of `runs`."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(runs):
        synced(lambda: None)()
        start = time.perf_counter()
        synced(lambda: target.copy_(source))()
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() / best


def step_bytes(model, context: int) -> int:
    """Bytes one batch-1 decode step must read: every parameter once (a tied lm_head reads the embedding table, which
    the lookup does not), and the keys and values of `context` positions."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.module.parameters())
    cache = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * context * model.dtype.itemsize
    return weights + cache


GROUPS = ("decode", "first", "batch", "served", "profile")


def shape_rows(path: Path, args) -> dict:
    from decodekit import AutoModelForCausalLM

    n, device = args.new_tokens, args.device
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device=device)
    vocab = ours.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, 128), generator=g).to(device)
    long = torch.randint(3, vocab, (1, 2048), generator=g).to(device)
    batch = torch.randint(3, vocab, (64, 128), generator=g).to(device)
    requests = [torch.randint(3, vocab, (int(size),), generator=g).tolist() for size in torch.linspace(64, 256, 64)]
    fixed = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False)
    decode = {
        "decodekit eager": synced(lambda: ours.generate(prompt, **fixed)),
        "decodekit compile=True": synced(lambda: ours.generate(prompt, compile=True, **fixed)),  # CUDA graphs
        "decodekit no graphs": synced(lambda: ours.generate(prompt, compile_config={"mode": "default"}, **fixed)),
    }
    first = {"decodekit": synced(lambda: ours(long, use_cache=True, logits_to_keep=1))}
    many = {"decodekit": synced(lambda: ours.generate(batch, **fixed))}
    served = {
        "decodekit": without_fallback(
            synced(lambda: ours.generate_batch(requests, eos_token_id=None, compile=True, progress_bar=False, **fixed))
        ),
        # The compiled step's attention through flex attention over the block tables instead of gathered blocks
        "decodekit flex": without_fallback(
            synced(
                lambda: ours.generate_batch(
                    requests, eos_token_id=None, compile=True, paged_attention="flex", progress_bar=False, **fixed
                )
            )
        ),
    }
    if not args.skip_transformers:
        import transformers

        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
        decode["transformers eager"] = synced(lambda: ref.generate(prompt, pad_token_id=0, **fixed))
        decode["transformers static cache"] = synced(
            lambda: ref.generate(prompt, pad_token_id=0, cache_implementation="static", **fixed)
        )
        first["transformers"] = synced(lambda: ref(long, use_cache=True, logits_to_keep=1))
        many["transformers"] = synced(lambda: ref.generate(batch, pad_token_id=0, **fixed))
        greedy = transformers.GenerationConfig(pad_token_id=0, eos_token_id=None, **fixed)
        served["transformers"] = synced(
            lambda: ref.generate_batch(requests, generation_config=greedy, progress_bar=False), inference=False
        )
    rows = {}

    def show(group: str, failed: dict) -> None:
        mine = {k: v for k, v in rows.items() if k.startswith(group)} if group else {}
        print(json.dumps({"group": group, **mine, **{f"{k} failed": v for k, v in failed.items()}}), flush=True)

    def throughput(group: str, jobs: dict, label: str) -> None:
        """64 rows of n tokens each: every side's tokens/s, and transformers' time over decodekit's."""
        outputs = {}

        def check(name, out):
            check_tokens(name, out, 64, n)
            outputs[name] = out

        t, failed = checked_group(group, jobs, check, args.runs)
        if "decodekit" in outputs and "decodekit flex" in outputs:  # bf16: attention's rounding may part a few
            same = sum(
                a.generated_tokens == b.generated_tokens
                for a, b in zip(outputs["decodekit"].values(), outputs["decodekit flex"].values())
            )
            rows[f"{label}: flex's tokens equal gathered's, requests of 64"] = same
        for name in jobs:
            rows[f"{label} ({name}) tok/s"] = round(64 * n / t.median(name), 1)
        if "transformers" in jobs and "decodekit" in jobs:
            rows[f"{label} vs transformers"] = round(t.ratio("transformers", "decodekit"), 2)
        if "decodekit flex" in jobs and "decodekit" in jobs:
            rows[f"{label}: flex vs gathered attention"] = round(t.ratio("decodekit", "decodekit flex"), 2)
        show(group, failed)

    if "served" in args.groups:
        throughput("served", served, "served: continuous batching, 64 requests")
    if "batch" in args.groups:
        throughput("batch", many, "batch 64")
    if "decode" in args.groups:
        t, failed = checked_group("decode", decode, lambda name, out: check_tokens(name, out, 1, n), args.runs)
        bound = copy_bandwidth(device) / step_bytes(ours, 128 + n // 2)  # tokens/s if a step only read its bytes
        rows["decode: memory-bandwidth bound, batch-1 tok/s"] = round(bound, 1)
        for name in decode:
            rows[f"decode {name} tok/s"] = round(n / t.median(name), 1)
            rows[f"decode {name} of the bound"] = round(n / t.median(name) / bound, 3)
        for name in [m for m in decode if m.startswith("decodekit")]:
            for other in ("transformers eager", "transformers static cache"):
                if other in decode:
                    rows[f"decode {name} vs {other}"] = round(t.ratio(other, name), 2)
        show("decode", failed)
    if "first" in args.groups:
        t, failed = checked_group("first", first, lambda name, out: None, args.runs)
        for name in first:
            rows[f"first token of 2048 ({name}) ms"] = round(1000 * t.median(name), 2)
        if "transformers" in first and "decodekit" in first:
            rows["first token vs transformers"] = round(t.ratio("transformers", "decodekit"), 2)
        show("first", failed)
    if "profile" in args.groups:
        rows.update(profile_decode(decode, device))
        show("profile", {})
    return rows


def profile_decode(decode: dict, device: str) -> dict:
    """Where a batch-1 compiled step's time goes: torch.profiler over one generate(compile=True) call, its wall time
    against the time the device was busy (the rest: the device waiting for the host), and the call without CUDA
    graphs kernel by kernel (inside a graph replay the profiler may see no kernels): the largest kernels' shares of
    the device's time (the lm_head's product over the vocabulary, attention, the sampler's reductions)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    out = {}
    for name in ("decodekit compile=True", "decodekit no graphs"):
        decode[name]()  # compiled and recorded before the profile
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            decode[name]()
            wall = time.perf_counter() - start
        kernels = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6
        out[f"profile {name}: wall s, device busy s"] = [round(wall, 4), round(busy, 4)]
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
        out[f"profile {name}: largest kernels, share of busy"] = (
            [[e.key[:80], round(e.self_device_time_total / 1e6 / busy, 3)] for e in top] if busy else []
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS), help="row groups to run")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_cuda.py needs a CUDA device (--device cpu checks the script on the CPU)", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (a check of the script, not a measurement)"
    print(json.dumps({"device": name, "torch": torch.__version__}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            start = time.perf_counter()
            rows = shape_rows(random_checkpoint(Path(tmp) / shape, SHAPES[shape], torch.bfloat16), args)
            print(json.dumps({"shape": shape, "seconds": round(time.perf_counter() - start), **rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
