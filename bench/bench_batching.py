"""Continuous batching throughput and time to first token on the default model: decodekit against its own static
batch, transformers' generate_batch on the same weights, and vLLM's CPU build (in its own environment).

Three loads, the same token ids for every engine, greedy, EOS ignored so every engine generates the same counts:
- uniform: 32 requests of 128 new tokens, all at once;
- few: 4 requests of 128 new tokens, all at once (where a compiled step pays most);
- mixed: 32 requests, prompts of 16-1,024 tokens and 16-256 new tokens (seeded), arriving over about 8 s
  (exponential gaps; the same schedule for every engine).

    python bench/bench_batching.py [--vllm-python .venv-vllm/bin/python] [--vllm-compiled] [--skip-transformers]
                                   [--compile] [--max-batch-tokens N] [--repeat N] [--sample] [--itl]

--sample runs decodekit's requests sampled as a chat server's are (do_sample=True, temperature 0.7, top_p 0.9, a
seed each) instead of greedy (the other engines stay greedy: compare it with decodekit's greedy rows).
--itl streams decodekit's requests and adds the time between a request's tokens (p50/p99 over every gap of every
request): how long prompt chunks sharing a step stall the decoding rows (try it with --max-batch-tokens).
--compile adds decodekit with compile=True (decode-only steps compiled, by manager.warm_up() before the clock
starts). --repeat N runs every load N times per engine, one after another in the same process, and reports the
run of median throughput (this machine's run-to-run spread is about 10%); each repeat's prompts start with a
marker of their own, or vLLM would serve the later runs' prompts from its prefix cache. vLLM runs with
enforce_eager=True unless --vllm-compiled (its default: an inductor-compiled model, warmed up before the clock).

The vLLM rows come from running this file with --engine vllm in vLLM's environment (`make test-vllm` builds it),
which runs the loads on vllm's AsyncLLM engine. Prints one JSON object: generated tokens/s, time to first token
p50/p95 (seconds, from arrival) for each engine and load, and the ratios against decodekit.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TEXT = (
    "The history of the city begins with a small settlement on the river, where traders stopped on their way "
    "between the coast and the mountains. Over the centuries it grew into a market town, then a capital. "
)


def loads(tokenizer, run: int = 0) -> dict[str, list[dict]]:
    """{load: [{"ids", "new_tokens", "arrival"}]}: the same requests for every engine. Runs after the first (run > 0)
    begin every prompt with a marker of their own in place of its first tokens, so that no prompt shares a prefix
    with an earlier run's (vLLM caches prefixes across requests by default) and the lengths stay the same."""
    marker = tokenizer.encode(f"Draft {run}.") if run else []

    def marked(ids: list[int]) -> list[int]:
        return (marker + ids[len(marker) :])[: len(ids)]

    base = tokenizer.encode(TEXT * 80)
    uniform = [
        {"ids": marked(tokenizer.encode(f"Write a story about the number {i}.")), "new_tokens": 128, "arrival": 0.0}
        for i in range(32)
    ]
    rng = random.Random(0)
    mixed, at = [], 0.0
    for i in range(32):
        length = int(16 * (64 ** rng.random()))  # 16 to 1,024, log-uniform
        start = rng.randrange(0, len(base) - length)
        mixed.append(
            {"ids": marked(base[start : start + length]), "new_tokens": rng.randint(16, 256), "arrival": round(at, 3)}
        )
        at += rng.expovariate(1 / 0.25)
    return {"uniform": uniform, "few": uniform[:4], "mixed": mixed}


def summary(generated: int, seconds: float, ttfts: list[float]) -> dict:
    ttfts = sorted(ttfts)
    p95 = ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))]
    return {
        "tokens_per_s": round(generated / seconds, 1),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p95_s": round(p95, 3),
        "seconds": round(seconds, 2),
    }


SAMPLED = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}


def run_decodekit(
    model, requests: list[dict], compile: bool = False, sample: bool = False, itl: bool = False, **options
) -> dict:
    manager = model.init_continuous_batching(max_cache_bytes=1024 * 2**20, compile=compile, **options)
    manager.warm_up()  # with compile=True: every row bucket compiled before the clock starts, as serve --compile does
    ids, added, stamps = {}, {}, {}
    start = time.monotonic()

    def feed():  # arrivals on schedule, from a thread that does no torch work; the steps run in this thread
        for n, r in enumerate(requests):
            delay = start + r["arrival"] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            added[n] = time.monotonic()
            fields = dict(SAMPLED, seed=n) if sample else {}
            if itl:  # each output is one more token: its time is kept
                stamps[n] = []
                fields.update(streaming=True, listener=lambda output, kept=stamps[n]: kept.append(time.monotonic()))
            ids[n] = manager.add_request(r["ids"], max_new_tokens=r["new_tokens"], eos_token_id=None, **fields)

    feeder = threading.Thread(target=feed)
    feeder.start()
    ended = []
    manager.on_end = lambda output: ended.append(output)
    while len(ended) < len(requests):
        manager.run(until_idle=True)
        if len(ended) < len(requests):
            time.sleep(0.001)  # the next arrival has not come yet
    seconds = time.monotonic() - start
    feeder.join()
    outputs = {o.request_id: o for o in ended}
    generated = sum(len(o.generated_tokens) for o in ended)
    ttfts = [outputs[ids[n]].first_token_time - outputs[ids[n]].created_time for n in range(len(requests))]
    result = summary(generated, seconds, ttfts)
    if itl:
        gaps = sorted(b - a for kept in stamps.values() for a, b in zip(kept, kept[1:]))
        result["itl_p50_s"] = round(statistics.median(gaps), 4)
        result["itl_p99_s"] = round(gaps[min(len(gaps) - 1, int(round(0.99 * (len(gaps) - 1))))], 4)
    return result


def run_static(model, requests: list[dict]) -> dict:
    """The uniform load as one static batch of generate() (left-padded), the speed continuous batching keeps."""
    import torch

    width = max(len(r["ids"]) for r in requests)
    ids = torch.tensor([[0] * (width - len(r["ids"])) + r["ids"] for r in requests])
    mask = torch.tensor([[0] * (width - len(r["ids"])) + [1] * len(r["ids"]) for r in requests])
    start = time.monotonic()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=requests[0]["new_tokens"], eos_token_id=None)
    seconds = time.monotonic() - start
    return {"tokens_per_s": round((out.shape[1] - width) * len(requests) / seconds, 1), "seconds": round(seconds, 2)}


def run_transformers(directory: Path, requests: list[dict]) -> dict:
    """transformers' own continuous batching (generate_batch), every request at once (it takes no arrivals)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    gc = GenerationConfig(
        max_new_tokens=max(r["new_tokens"] for r in requests), do_sample=False, eos_token_id=None, pad_token_id=0
    )
    start = time.monotonic()  # not under inference_mode: its background thread writes tensors made here
    results = model.generate_batch([r["ids"] for r in requests], generation_config=gc, progress_bar=False)
    seconds = time.monotonic() - start
    failed = [o.error for o in results.values() if getattr(o, "error", None)]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    generated = sum(len(o.generated_tokens) for o in results.values())
    return {
        "tokens_per_s": round(generated / seconds, 1),
        "seconds": round(seconds, 2),
        "note": "all requests at once, each to the load's largest new-token count",
    }


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput, with every run's throughput beside it."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    middle = dict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        middle["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    return middle


def run_vllm(directory: Path, runs: list[dict], dtype: str = "float32", compiled: bool = False) -> dict:
    """Every load of `runs` (loads() of run 0, 1, ...) on vLLM's AsyncLLM engine; the median run per load."""
    import asyncio

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(directory),
            enforce_eager=not compiled,
            dtype=dtype,
            max_model_len=2048,
            gpu_memory_utilization=0.3,
        )
    )

    async def one(n, r, start, firsts, counts):
        await asyncio.sleep(max(0.0, start + r["arrival"] - time.monotonic()))
        added = time.monotonic()
        params = SamplingParams(max_tokens=r["new_tokens"], temperature=0, ignore_eos=True)
        async for out in engine.generate({"prompt_token_ids": r["ids"]}, params, request_id=f"{n}-{start}"):
            if n not in firsts and out.outputs[0].token_ids:
                firsts[n] = time.monotonic() - added
            counts[n] = len(out.outputs[0].token_ids)

    async def load(requests):
        firsts, counts = {}, {}
        start = time.monotonic()
        await asyncio.gather(*(one(n, r, start, firsts, counts) for n, r in enumerate(requests)))
        return summary(sum(counts.values()), time.monotonic() - start, list(firsts.values()))

    # Warm-up prompts reversed: none of the measured prompts may find its prefix cached.
    warm_up = [dict(r, ids=r["ids"][::-1]) for r in runs[0]["uniform"][:4]]

    async def everything():
        await load(warm_up)
        return {name: median_run([await load(run[name]) for run in runs]) for name in runs[0]}

    try:
        return asyncio.run(everything())
    finally:
        engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["all", "vllm"], default="all", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--vllm-python", help="vLLM's environment's python (e.g. .venv-vllm/bin/python)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--compile", action="store_true", help="also decodekit with compile=True")
    parser.add_argument(
        "--max-batch-tokens", type=int, help="decodekit's token budget per step (default: the manager's)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of every load per engine; the median is reported")
    parser.add_argument("--vllm-compiled", action="store_true", help="vLLM with its compiled model, not enforce_eager")
    parser.add_argument("--sample", action="store_true", help="decodekit's requests sampled (see above), not greedy")
    parser.add_argument("--itl", action="store_true", help="decodekit's time between tokens too (see above)")
    parser.add_argument(
        "--weights",
        choices=["float32", "bfloat16", "int8"],
        default="float32",
        help="decodekit's weight format; vLLM runs bfloat16 too for bfloat16, float32 otherwise "
        "(it has no int8 of these weights); transformers runs float32",
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be 1 or more, not {args.repeat}")
    import torch

    from decodekit.loading.default import load_model

    model, tokenizer = load_model(
        dtype=torch.bfloat16 if args.weights == "bfloat16" else None,
        quantize="int8" if args.weights == "int8" else None,
    )
    runs = [loads(tokenizer, run) for run in range(args.repeat)]
    all_loads = runs[0]
    if args.engine == "vllm":
        json.dump(
            run_vllm(
                Path(args.model_dir), runs, "bfloat16" if args.weights == "bfloat16" else "float32", args.vllm_compiled
            ),
            sys.stdout,
        )
        return 0
    from decodekit.kernels import cpu
    from decodekit.testing import default_model_as_transformers

    directory = default_model_as_transformers(Path(tempfile.mkdtemp()) / "model")
    with torch.inference_mode():
        model.generate_batch([r["ids"] for r in all_loads["uniform"][:4]], max_new_tokens=4, progress_bar=False)
    result: dict = {
        "machine": cpu.describe(),
        "threads": torch.get_num_threads(),
        "decodekit weights": args.weights,
        "decodekit": {},
    }
    options = {"max_batch_tokens": args.max_batch_tokens} if args.max_batch_tokens else {}
    options.update(sample=args.sample, itl=args.itl)
    result["decodekit requests"] = "sampled: " + json.dumps(SAMPLED) if args.sample else "greedy"
    for name in all_loads:
        result["decodekit"][name] = median_run([run_decodekit(model, run[name], **options) for run in runs])
    if args.compile:
        result["decodekit compiled"] = {}
        for name in all_loads:
            result["decodekit compiled"][name] = median_run(
                [run_decodekit(model, run[name], compile=True, **options) for run in runs]
            )
    with torch.inference_mode():
        result["decodekit static batch"] = {"uniform": run_static(model, all_loads["uniform"])}
    if not args.skip_transformers:
        try:
            result["transformers generate_batch"] = {"uniform": run_transformers(directory, all_loads["uniform"])}
        except Exception as error:  # noqa: BLE001 - reported, the other rows stand
            result["transformers generate_batch"] = {"error": f"{type(error).__name__}: {error}"[:300]}
    if args.vllm_python:
        done = subprocess.run(
            [
                args.vllm_python,
                __file__,
                "--engine",
                "vllm",
                "--model-dir",
                str(directory),
                "--weights",
                "bfloat16" if args.weights == "bfloat16" else "float32",
                "--repeat",
                str(args.repeat),
            ]
            + (["--vllm-compiled"] if args.vllm_compiled else []),
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            result["vllm cpu"] = json.loads(done.stdout.strip().splitlines()[-1])
        else:
            result["vllm cpu"] = {"error": done.stderr.strip()[-500:]}
    ours = result["decodekit"]
    ratios = {
        "uniform over static batch": ours["uniform"]["tokens_per_s"]
        / result["decodekit static batch"]["uniform"]["tokens_per_s"]
    }
    for engine in ("vllm cpu", "transformers generate_batch"):
        for name, row in result.get(engine, {}).items():
            if isinstance(row, dict) and row.get("tokens_per_s"):
                ratios[f"{name} over {engine}"] = ours[name]["tokens_per_s"] / row["tokens_per_s"]
                if "decodekit compiled" in result:
                    ratios[f"{name} compiled over {engine}"] = (
                        result["decodekit compiled"][name]["tokens_per_s"] / row["tokens_per_s"]
                    )
    for name, row in result.get("decodekit compiled", {}).items():
        ratios[f"{name} compiled over eager"] = row["tokens_per_s"] / ours[name]["tokens_per_s"]
    result["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
