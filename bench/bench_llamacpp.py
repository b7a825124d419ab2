"""decodekit against llama.cpp on the same GGUF files, side by side: prefill of 64 and 512 tokens, batch-1 greedy decode,
resident memory, and the bandwidth bound at the file's bytes.

Files: the default model's Q4_1 file, and Llama-3.2-1B-shaped Q4_0 and Q8_0 files of random weights written with the
`gguf` package (the default model's tokenizer, so its vocabulary: 49,152 tokens; cached under $DECODEKIT_CACHE_DIR).
Both libraries run in one process, the same thread count, rounds interleaved (on a shared machine a ratio is the
median of per-round ratios); memory is measured in a fresh process per library and file. llama-cpp-python comes from
`make test-llamacpp`'s environment:

    .venv-llamacpp/bin/python bench/bench_llamacpp.py [--runs 3] [--new-tokens 128] [--threads 2] [--files default,1b-q4_0]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import bench_parser, interleaved, memory_read_job, report  # noqa: E402

# Llama-3.2-1B's shape but the default model's vocabulary (the tokenizer is copied from its file).
ONE_B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8
)
FILES = ("default", "1b-q4_0", "1b-q8_0")


def one_b_file(kind: str) -> Path:
    """A 1B-shaped GGUF file of random weights quantized as `kind` (Q4_0, Q8_0) by the gguf package, written once."""
    from decodekit.kernels.native import cache_dir
    from decodekit.loading.default import default_model_path
    from decodekit.loading.gguf_file import open_gguf
    from decodekit.testing import write_tiny_gguf

    path = cache_dir() / "bench" / f"llama-1b-shape-{kind.lower()}.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = open_gguf(default_model_path()).tokenizer_fields()
    partial = path.with_suffix(".partial")
    write_tiny_gguf(
        partial, kind, vocab_size=len(tokenizer["tokens"]), tie_word_embeddings=True, max_position_embeddings=4096,
        tokenizer=tokenizer, **ONE_B,
    )  # fmt: skip
    partial.rename(path)
    return path


def file_path(name: str) -> Path:
    from decodekit.loading.default import default_model_path

    return default_model_path() if name == "default" else one_b_file(name.split("-")[1].upper())


def llamacpp_model(path: Path, threads: int):
    from llama_cpp import Llama

    return Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False)


def llamacpp_job(llm, prompt: list[int], new_tokens: int):
    """Prefill `prompt`, then `new_tokens` greedy tokens (argmax of the logits llama.cpp returns, as decodekit's
    greedy loop takes them); returns the job and where its last tokens go."""
    n_vocab = llm.n_vocab()
    out: list[int] = []

    def run():
        llm.reset()
        llm.eval(prompt)
        out.clear()
        for _ in range(new_tokens):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
            out.append(int(logits.argmax()))
            if len(out) < new_tokens:
                llm.eval([out[-1]])

    return run, out


def decodekit_job(model, prompt: list[int], new_tokens: int, compile: bool):
    ids = torch.tensor([prompt])
    out: list[int] = []

    def run():
        with torch.inference_mode():
            got = model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, compile=compile
            )
        out[:] = got[0, len(prompt) :].tolist()

    return run, out


def prompt_tokens(count: int) -> list[int]:
    """`count` tokens of ordinary text through the default model's tokenizer (repeated to length)."""
    from decodekit import AutoTokenizer
    from decodekit.loading.default import default_model_path

    text = Path(__file__).with_name("bench_generate.py").read_text()
    ids = AutoTokenizer.from_pretrained(default_model_path())(text).input_ids
    return (ids * (count // len(ids) + 1))[:count]


def resident_mb(library: str, path: Path, threads: int, new_tokens: int) -> float:
    """Resident memory a fresh process gains by loading `path` with `library` and decoding `new_tokens` after a
    64-token prompt (after its imports)."""
    code = f"""
import resource, sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
import bench_llamacpp as b
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
prompt = b.prompt_tokens(64)
before = rss()
if {library!r} == 'llama.cpp':
    import llama_cpp
    before = rss()
    run, _ = b.llamacpp_job(b.llamacpp_model({str(path)!r}, {threads}), prompt, {new_tokens})
else:
    import decodekit
    before = rss()
    run, _ = b.decodekit_job(decodekit.AutoModelForCausalLM.from_pretrained({str(path)!r}), prompt, {new_tokens}, False)
run()
print(rss() - before)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return float(done.stdout.strip().splitlines()[-1])


def interleaved_jobs(args, llm, eager, compiled) -> tuple[dict, dict, int]:
    """({name: job}, {name: the tokens its last run gave}, the bytes the memory job reads) for both libraries: prefill of 64 and 512 tokens (and the
    first token), decode of --new-tokens after 64, decodekit's compiled decode (compiled here), a memory read."""
    short, long = prompt_tokens(64), prompt_tokens(512)
    jobs, outputs = {}, {}
    for label, prompt, tokens in (
        ("prefill_64", short, 1),
        ("prefill_512", long, 1),
        ("decode", short, args.new_tokens),
    ):
        jobs[f"llama.cpp {label}"], outputs[f"llama.cpp {label}"] = llamacpp_job(llm, prompt, tokens)
        jobs[f"decodekit {label}"], outputs[f"decodekit {label}"] = decodekit_job(eager, prompt, tokens, False)
    jobs["decodekit_compiled decode"], outputs["decodekit_compiled decode"] = decodekit_job(
        compiled, short, args.new_tokens, True
    )
    jobs["decodekit_compiled decode"]()  # the first compiled call compiles
    read, read_bytes = memory_read_job()
    jobs["memory_read"] = lambda: [read() for _ in range(5)]
    return jobs, outputs, 5 * read_bytes


def speed_fields(args, timings, jobs, bound_ms: float) -> dict:
    """Decode ms a token (the time past the 64-token prefill and its first token, per further token; the compiled
    model's prefill is the eager one's: prompts run eagerly), against the bound and llama.cpp; prefill ms and ratios."""
    ms = {k: 1000 * timings.median(k) for k in jobs if k != "memory_read"}
    decode_ms = {
        k: (ms[k] - ms[k.split()[0].removesuffix("_compiled") + " prefill_64"]) / (args.new_tokens - 1)
        for k in ms
        if k.endswith(" decode")
    }
    row = {}
    for k, v in decode_ms.items():
        row[f"{k.split()[0]}_decode_ms_per_token"] = round(v, 2)
        row[f"{k.split()[0]}_decode_vs_bound"] = round(v / bound_ms, 2)
    for side in ("decodekit", "decodekit_compiled"):
        row[f"{side}_decode_speed_vs_llama.cpp"] = round(decode_ms["llama.cpp decode"] / decode_ms[f"{side} decode"], 3)
    for label in ("prefill_64", "prefill_512"):
        row[f"llama.cpp_{label}_ms"] = round(ms[f"llama.cpp {label}"], 1)
        row[f"decodekit_{label}_ms"] = round(ms[f"decodekit {label}"], 1)
        row[f"decodekit_{label}_speed_vs_llama.cpp"] = round(
            timings.ratio(f"llama.cpp {label}", f"decodekit {label}"), 3
        )
    return row


def step_profile(module, runs: int) -> dict:
    """Where a decode step's time goes: every matrix the step reads (the layers' and the lm_head's) multiplied by one
    row, alone, as the step's products multiply it (decodekit's row_product, the same kernels), best of `runs`;
    with the products' bytes, their rate, and a float32 matmul's peak (the prompt's products run in float32)."""
    from decodekit.kernels.blocks import BlockLinear

    layers = [m for m in module.modules() if isinstance(m, BlockLinear)]
    rows = {id(m): torch.randn(1, m.in_features) for m in layers}

    def products():
        for m in layers:
            torch.ops.decodekit.row_product(rows[id(m)], m.blocks)

    with torch.inference_mode():
        products()
        best = min(_timed(products) for _ in range(runs))
        a, b = torch.randn(512, 2048), torch.randn(2048, 8192)
        torch.mm(a, b)
        peak = 2 * 512 * 2048 * 8192 / min(_timed(lambda: torch.mm(a, b)) for _ in range(runs))
    read = sum(m.blocks.numel() * m.blocks.element_size() for m in layers)
    return {
        "products_ms_per_token": round(1000 * best, 2),
        "products_GBps": round(read / best / 1e9, 1),
        "float32_matmul_GFLOPs": round(peak / 1e9, 1),
    }


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def file_rows(args, name: str) -> dict:
    from decodekit import AutoModelForCausalLM
    from decodekit.kernels.blocks import BlockLinear, stored_bytes
    from gguf import GGUFReader

    path = file_path(name)
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
    llm = llamacpp_model(path, args.threads)
    eager, compiled = (AutoModelForCausalLM.from_pretrained(path) for _ in range(2))
    jobs, outputs, read_bytes = interleaved_jobs(args, llm, eager, compiled)
    timings = interleaved(jobs, args.runs)
    bandwidth = read_bytes / timings.median("memory_read")
    # A decode step reads every matrix but the embedding table (one row); tied, the table is the lm_head's.
    module = eager.module
    read_per_token = stored_bytes(module) - stored_bytes(module.embed) + stored_bytes(module.lm_head)
    bound_ms = 1000 * read_per_token / bandwidth
    first = min(len(outputs["llama.cpp decode"]), 16)
    row = {
        "file": path.name,
        "file_MB": round(file_bytes / 2**20, 1),
        "decodekit_weights_MB": round(stored_bytes(module) / 2**20, 1),
        "weights_read_per_token_MB": round(read_per_token / 2**20, 1),
        "bandwidth_GBps_in_these_rounds": round(bandwidth / 1e9, 1),
        "bandwidth_bound_ms_per_token": round(bound_ms, 2),
        "same_first_16_greedy_tokens": outputs["llama.cpp decode"][:first] == outputs["decodekit decode"][:first],
        **speed_fields(args, timings, jobs, bound_ms),
        **step_profile(module, args.runs),
    }
    # The prompt's products as a rate: two operations a layer weight a token (the 512-token prefill; the lm_head
    # reads the last token only).
    weights = sum(m.in_features * m.blocks.shape[0] for m in module.layers.modules() if isinstance(m, BlockLinear))
    row["decodekit_prefill_512_GFLOPs"] = round(2 * weights * 512 / (row["decodekit_prefill_512_ms"] / 1000) / 1e9, 1)
    del llm, eager, compiled, module
    if not args.skip_memory:
        mem = {lib: resident_mb(lib, path, args.threads, 16) for lib in ("llama.cpp", "decodekit")}
        row["resident_MB"] = {k: round(v, 1) for k, v in mem.items()}
        row["resident_vs_llama.cpp"] = round(mem["decodekit"] / mem["llama.cpp"], 3)
    return row


def main() -> int:
    parser = bench_parser(__doc__, 128)
    parser.add_argument("--files", default=",".join(FILES), help=f"comma-separated, of {', '.join(FILES)}")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    unknown = sorted(set(args.files.split(",")) - set(FILES))
    if unknown:
        parser.error(f"--files: unknown {unknown}; choose from {list(FILES)}")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    cpu = [line for line in open("/proc/cpuinfo") if line.startswith("flags")][0].split()
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_int8") if f in cpu]
    rows = {}
    for name in args.files.split(","):
        rows[name] = file_rows(args, name)
        print(json.dumps({name: rows[name]}), file=sys.stderr, flush=True)  # each figure as it comes
    import llama_cpp

    return report(args, started, cpu_flags=flags, llama_cpp_python=llama_cpp.__version__, files=rows)


if __name__ == "__main__":
    sys.exit(main())
