"""How long a process waits for its first compiled token: decodekit's generate(compile=True) against transformers'
static cache compiled on every device, on the default model's weights, each in fresh processes.

Each library runs in a process of its own, twice per round over one compile cache folder made empty for the round:
the first process compiles from nothing, the second finds what the first left (torch's on-disk caches). A process
reports its load time and its first compiled call (4 new tokens), then a second call (the compiled step reused).

    python bench/bench_startup.py [--runs 2] [--threads 2] [--skip-transformers]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_generate import bench_parser, report

CHILD = r"""
import json, sys, time
began = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[2]))
library = sys.argv[1]
from decodekit import default_model_path
path = default_model_path()
ids = torch.tensor([[1, 504, 3575, 282, 4649, 314]])
if library == "decodekit":
    from decodekit import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path)
    call = lambda: model.generate(ids, max_new_tokens=4, eos_token_id=None, compile=True)
else:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    config = transformers.CompileConfig()
    config._compile_all_devices = True  # transformers compiles its forward only on accelerators unless told
    call = lambda: model.generate(
        ids, max_new_tokens=4, do_sample=False, cache_implementation="static", compile_config=config,
        pad_token_id=0, eos_token_id=None,
    )
loaded = time.perf_counter()
first = call()
compiled = time.perf_counter()
call()
again = time.perf_counter()
print(json.dumps({"load_s": loaded - began, "first_call_s": compiled - loaded, "second_call_s": again - compiled}))
"""


def child(library: str, cache: Path, threads: int) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, library, str(threads)], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{library} process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = bench_parser(__doc__, new_tokens=4)
    parser.set_defaults(runs=2)
    args = parser.parse_args()
    started = time.perf_counter()
    libraries = ["decodekit"] + ([] if args.skip_transformers else ["transformers"])
    samples: dict[str, dict[str, list[float]]] = {
        f"{lib}_{which}": {} for lib in libraries for which in ("cold", "warm")
    }
    for round_ in range(args.runs):
        for lib in libraries if round_ % 2 == 0 else reversed(libraries):
            with tempfile.TemporaryDirectory(prefix="decodekit-startup-") as folder:
                for which in ("cold", "warm"):
                    for key, value in child(lib, Path(folder), args.threads).items():
                        samples[f"{lib}_{which}"].setdefault(key, []).append(value)
    rows = {
        name: {key: round(statistics.median(values), 2) for key, values in fields.items()}
        for name, fields in samples.items()
    }
    ratios = {}
    if "transformers_warm" in rows:
        for which in ("cold", "warm"):
            ours, theirs = rows[f"decodekit_{which}"], rows[f"transformers_{which}"]
            ratios[f"first_call_{which}_transformers_over_decodekit"] = round(
                theirs["first_call_s"] / ours["first_call_s"], 2
            )
    return report(args, started, processes=rows, ratios=ratios)


if __name__ == "__main__":
    sys.exit(main())
