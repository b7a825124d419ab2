"""Both OpenAI servers measured by a client neither project wrote: vLLM's own serving benchmark (vllm.benchmarks.serve,
from the `make test-vllm` environment) against `decodekit serve` and against vLLM's CPU server, on the default
model's weights (float32), random prompts, at several request rates.

    python bench/bench_serve.py [--vllm-python .venv-vllm/bin/python] [--num-prompts 64] [--rates 1,4,16,inf]
                                [--input-len 256] [--output-len 128] [--rounds 1] [--skip-vllm]

Both servers start and warm up (decodekit: compiled steps, as `decodekit serve` defaults; vLLM: eager, its CPU
build's documented setting, VLLM_CPU_KVCACHE_SPACE=2) and stay up, the one not under load stopped (SIGSTOP to its
process group: an idle vLLM server polls at about a core per process). At each rate one server's run is followed at
once by the other's (the order flips every other round), so a machine whose speed drifts by the minute compares the
two within minutes rather than one whole series after the other. The benchmark client runs with --ignore-eos so
every request generates output-len tokens on both. Prints a table (medians over the rounds) and one JSON object:
output tokens/s, TTFT and ITL p50/p99 per server, rate and round, and per rate the median over the rounds of each
round's decodekit / vLLM ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIENT = (
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args())\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise RuntimeError("the server did not start in time")


def run_client(vllm_python: str, url: str, model_name: str, tokenizer: str, rate: str, args, out_dir: Path) -> dict:
    name = f"{abs(hash((url, rate)))}.json"
    command = [
        vllm_python,
        "-c",
        CLIENT,
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model_name,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--ignore-eos",
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        rate,
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,itl",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    result = json.loads((out_dir / name).read_text())
    return {
        "output_tok_s": result["output_throughput"],
        "ttft_p50_s": result["p50_ttft_ms"] / 1000,
        "ttft_p99_s": result["p99_ttft_ms"] / 1000,
        "itl_p50_ms": result["p50_itl_ms"],
        "itl_p99_ms": result["p99_itl_ms"],
    }


def start(server: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # A session of its own: the server and its workers are paused and resumed together (pause).
    proc = subprocess.Popen(
        server + ["--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
    except BaseException:
        proc.terminate()
        raise
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--rates", default="1,4,16,inf", type=lambda text: text.split(","))
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()
    from decodekit.kernels import cpu
    from decodekit.testing import default_model_as_transformers

    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    model_dir = str(default_model_as_transformers(work / "model"))  # the same weights for both, and the tokenizer
    name = "SmolLM2-135M-Instruct"
    servers = {
        "decodekit": (
            [
                sys.executable,
                "-m",
                "decodekit.cli",
                "serve",
                "--wait-for-compile",  # timed on the compiled steps from the first request
                "--model",
                model_dir,
                "--served-model-name",
                name,
                "--max-tokens-limit",
                str(args.output_len),
            ],
            dict(os.environ),
        )
    }
    if not args.skip_vllm:
        servers["vllm"] = (
            [
                args.vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model_dir,
                "--served-model-name",
                name,
                "--dtype",
                "float32",
                "--enforce-eager",
                "--max-model-len",
                "4096",
            ],
            {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"},
        )

    def pause(server: str, stopped: bool) -> None:
        # An idle vLLM server is not idle: its engine core and worker poll at about a core each. The server not
        # under load is stopped (SIGSTOP to its process group) for the other's run.
        os.killpg(running[server][0].pid, signal.SIGSTOP if stopped else signal.SIGCONT)

    running = {}
    runs = {server: {rate: [] for rate in args.rates} for server in servers}
    try:
        for server, (command, env) in servers.items():
            running[server] = start(command, env)
            pause(server, True)
        for round_ in range(args.rounds):
            for rate in args.rates:
                for server in list(servers) if round_ % 2 == 0 else list(servers)[::-1]:
                    pause(server, False)
                    runs[server][rate].append(
                        run_client(args.vllm_python, running[server][1], name, model_dir, rate, args, work)
                    )
                    pause(server, True)
    finally:
        for server, (proc, _) in running.items():
            pause(server, False)
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    results = {
        "cpu": cpu.describe(),
        "settings": vars(args) | {"rates": args.rates},
        "runs": runs,
        "servers": {
            server: {
                rate: {key: statistics.median(run[key] for run in by_rate[rate]) for key in by_rate[rate][0]}
                for rate in args.rates
            }
            for server, by_rate in runs.items()
        },
    }
    if "vllm" in runs:
        results["ratios"] = {
            rate: {
                "output_tok_s": statistics.median(
                    a["output_tok_s"] / b["output_tok_s"] for a, b in zip(runs["decodekit"][rate], runs["vllm"][rate])
                ),
                "ttft_p99": statistics.median(
                    a["ttft_p99_s"] / b["ttft_p99_s"] for a, b in zip(runs["decodekit"][rate], runs["vllm"][rate])
                ),
            }
            for rate in args.rates
        }
    print(f"{'server':<10} {'rate':>5} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")
    for server, by_rate in results["servers"].items():
        for rate, r in by_rate.items():
            print(
                f"{server:<10} {rate:>5} {r['output_tok_s']:8.1f} {r['ttft_p50_s']:8.2f}s {r['ttft_p99_s']:8.2f}s "
                f"{r['itl_p50_ms']:6.0f}ms {r['itl_p99_ms']:6.0f}ms"
            )
    for rate, ratio in results.get("ratios", {}).items():
        print(
            f"rate {rate}: decodekit / vLLM output tok/s {ratio['output_tok_s']:.2f}x, p99 TTFT {ratio['ttft_p99']:.2f}x"
            f" (median of {args.rounds} paired rounds)"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
