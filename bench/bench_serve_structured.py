"""What response_format json_schema costs `decodekit serve`: the same concurrent requests with and without a schema,
generated tokens per second of the whole load and the mean time per generated token of a request.

    python bench/bench_serve_structured.py [--requests 32] [--max-tokens 128] [--rounds 3]

vLLM's benchmark client sends no response_format, so this file is its own client (threads, the openai package).
The schema allows one long string, so constrained requests run about as long as free ones; each round runs the
free load then the constrained one (order alternating), and the report is the median round. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from bench_serve import free_port, wait_ready

SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "story",
        "schema": {
            "type": "object",
            "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
            "required": ["title", "story"],
            "additionalProperties": False,
        },
    },
}


def load(client, name: str, requests: int, max_tokens: int, structured: bool) -> dict:
    def one(i):
        started = time.perf_counter()
        reply = client.chat.completions.create(
            model=name,
            max_tokens=max_tokens,
            temperature=0.8,
            seed=i,
            messages=[{"role": "user", "content": f"Story {i}: write a long story about a lighthouse, as JSON."}],
            **({"response_format": SCHEMA} if structured else {}),
        )
        return reply.usage.completion_tokens, time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(requests) as pool:
        results = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - started
    tokens = sum(t for t, _ in results)
    return {
        "tok_s": tokens / wall,
        "ms_per_token": statistics.mean(s * 1000 / max(t, 1) for t, s in results),
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import openai

    from decodekit.kernels import cpu

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "decodekit.cli",
            "serve",
            "--wait-for-compile",
            "--port",
            str(port),
            "--served-model-name",
            "smol",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(url, server)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        load(client, "smol", 4, 16, True)  # the grammar engine's first use, outside the measurement
        rounds = []
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            rounds.append({s: load(client, "smol", args.requests, args.max_tokens, s) for s in order})
        ratio = [x[True]["tok_s"] / x[False]["tok_s"] for x in rounds]
        median = rounds[ratio.index(statistics.median(ratio))]
        print(
            json.dumps(
                {
                    "cpu": cpu.describe(),
                    "settings": vars(args),
                    "free": median[False],
                    "json_schema": median[True],
                    "throughput_ratio": statistics.median(ratio),
                    "ratios": ratio,
                }
            )
        )
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
