"""decodekit against transformers on a GPU, on the same random weights, side by side in one run: the default
model's shape (SmolLM2-135M) and Llama 3.2 1B's, bfloat16.

    python bench/bench_cuda.py [--runs 3] [--new-tokens 128] [--shapes smollm2-135m llama-1b] [--skip-transformers]

Rows per shape: batch-1 decode tokens/s after a 128-token prompt, eager, compile=True (the step as a CUDA graph
replay) and compile_config={"mode": "default"} (compiled, no graphs), against transformers' eager
generate() and its static cache (which transformers compiles itself); the time to first token of a 2,048-token
prompt; a batch of 64 prompts decoded together; 64 prompts of 64-256 tokens through continuous batching
(decodekit's manager with its compiled step, CUDA graphs per row bucket, against transformers' generate_batch). The
batch-1 rows are also given as a fraction of the memory-bandwidth bound: the bytes a step reads (weights, the lm_head's
table once, the KV cache at the mean context) over the device's measured copy bandwidth. Each figure is the median of
`runs` rounds run round-robin; ratios are medians of per-round ratios. Prints one JSON line per shape as it finishes
(a stopped run keeps what it has). `--device cpu` runs the same rows on the CPU, a check of the script, not a
measurement to report.
"""

from __future__ import annotations

import argparse
import json
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


def synced(fn):
    def run():
        with torch.inference_mode():
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    return run


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
        "decodekit eager": lambda: ours.generate(prompt, **fixed),
        "decodekit compile=True": lambda: ours.generate(prompt, compile=True, **fixed),  # CUDA graphs
        "decodekit no graphs": lambda: ours.generate(prompt, compile_config={"mode": "default"}, **fixed),
    }
    first = {"decodekit": lambda: ours(long, use_cache=True, logits_to_keep=1)}
    many = {"decodekit": lambda: ours.generate(batch, **fixed)}
    served = {
        "decodekit": lambda: ours.generate_batch(requests, eos_token_id=None, compile=True, progress_bar=False, **fixed)
    }
    if not args.skip_transformers:
        import transformers

        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
        decode["transformers eager"] = lambda: ref.generate(prompt, pad_token_id=0, **fixed)
        decode["transformers static cache"] = lambda: ref.generate(
            prompt, pad_token_id=0, cache_implementation="static", **fixed
        )
        first["transformers"] = lambda: ref(long, use_cache=True, logits_to_keep=1)
        many["transformers"] = lambda: ref.generate(batch, pad_token_id=0, **fixed)
        greedy = transformers.GenerationConfig(pad_token_id=0, eos_token_id=None, **fixed)
        served["transformers"] = lambda: ref.generate_batch(requests, generation_config=greedy, progress_bar=False)
    rows = {}
    t = interleaved({name: synced(fn) for name, fn in decode.items()}, args.runs)
    bound = copy_bandwidth(device) / step_bytes(ours, 128 + n // 2)  # tokens/s if a step only read its bytes
    rows["memory-bandwidth bound, batch-1 tok/s"] = round(bound, 1)
    for name in decode:
        rows[f"decode {name} tok/s"] = round(n / t.median(name), 1)
        rows[f"decode {name} of the bound"] = round(n / t.median(name) / bound, 3)
    for name in [m for m in decode if m.startswith("decodekit")] if not args.skip_transformers else []:
        rows[f"decode {name} vs transformers eager"] = round(t.ratio("transformers eager", name), 2)
        rows[f"decode {name} vs transformers static cache"] = round(t.ratio("transformers static cache", name), 2)
    t = interleaved({name: synced(fn) for name, fn in first.items()}, args.runs)
    for name in first:
        rows[f"first token of 2048 ({name}) ms"] = round(1000 * t.median(name), 2)
    if "transformers" in first:
        rows["first token vs transformers"] = round(t.ratio("transformers", "decodekit"), 2)
    t = interleaved({name: synced(fn) for name, fn in many.items()}, args.runs)
    for name in many:
        rows[f"batch 64 ({name}) tok/s"] = round(64 * n / t.median(name), 1)
    if "transformers" in many:
        rows["batch 64 vs transformers"] = round(t.ratio("transformers", "decodekit"), 2)
    t = interleaved({name: synced(fn) for name, fn in served.items()}, args.runs)
    for name in served:
        rows[f"continuous batching, 64 requests ({name}) tok/s"] = round(64 * n / t.median(name), 1)
    if "transformers" in served:
        rows["continuous batching vs transformers"] = round(t.ratio("transformers", "decodekit"), 2)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
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
