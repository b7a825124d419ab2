"""Hub methods written for transformers, on decodekit's native model against the same method on transformers' model.

Methods from tests/published_methods.py, written the way published methods are, each run unchanged on both models
from the same weights: top-nσ as its repository publishes it (no cache: the whole sequence through model(...) every
step), top-nσ as a loop handed to transformers' generate(), a greedy loop over a DynamicCache it calls model(...)
on (the rollback method, which rolls back when a token repeats), a beam loop driving prepare_inputs_for_generation
and the cache reorder by hand (3 beams), and the rollback over a transformers StaticCache it crops (where the
installed transformers' StaticCache can crop). decodekit runs each eagerly and with compile=True (its one-token
forwards as one compiled step, CUDA graphs on a GPU: facade/view_step.py); the first compiled call, which compiles,
is timed on its own. Ratios are transformers' time over decodekit's (> 1: decodekit faster), medians of per-round
ratios, rounds run round-robin (bench_generate.Timings). Each side's tokens are checked first: compiled against
eager, decodekit against transformers; a method whose sides disagree or fail is printed as such, without a ratio.
One line per method on stderr as it finishes; the JSON at the end.

    python bench/bench_hub_methods.py --runs 3 --new-tokens 64                      # CPU, the default model, fp32
    python bench/bench_hub_methods.py --device cuda --shape llama-1b --dtype bfloat16 --prompt-tokens 128 --runs 3
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from bench_generate import PROMPT, bench_parser, bench_setup, interleaved, random_checkpoint, report

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from methods import write_method  # noqa: E402
from published_methods import BEAM_LOOP, CACHELESS, ROLLBACK, TOP_N_SIGMA  # noqa: E402

METHODS = {
    "cacheless loop (top-n-sigma as published)": (CACHELESS, dict(n_sigma=1.0)),
    "loop handed to generate() (top-n-sigma)": (TOP_N_SIGMA, dict(n_sigma=1.0)),
    "greedy loop over a DynamicCache (rollback)": (ROLLBACK, dict(cache_kind="dynamic")),
    "beam loop (3 beams)": (BEAM_LOOP, dict(num_beams=3)),
    "rollback over a StaticCache": (ROLLBACK, dict(cache_kind="static")),
}


def synced(fn):
    def run():
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    return run


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def models(args, path):
    from decodekit import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    native = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device=args.device)
    theirs = AutoModelForCausalLM.from_pretrained(path, backend="transformers", dtype=dtype, device=args.device).module
    return native, theirs


def method_row(label, source, options, native, theirs, ids, args, root) -> dict:
    """One method's timings and ratios, or {"failed": why} where a side failed or the sides' tokens differ."""
    repo = str(write_method(root / str(abs(hash(label))), source))
    call = dict(input_ids=ids, max_new_tokens=args.new_tokens, eos_token_id=None, custom_generate=repo)
    call.update(trust_remote_code=True, **options)
    sides = {
        "transformers": synced(lambda: theirs.generate(**call)),
        "decodekit eager": synced(lambda: native.generate(**call)),
        "decodekit compiled": synced(lambda: native.generate(**call, compile=True)),
    }
    start = time.perf_counter()
    try:
        compiled = sides["decodekit compiled"]()
        first = time.perf_counter() - start
        eager, reference = sides["decodekit eager"](), sides["transformers"]()
    except Exception as error:  # noqa: BLE001 - a bench reports a method that fails, then goes on
        traceback.print_exc()
        return {"failed": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    expected = ids.shape[1] + args.new_tokens
    for name, out in (("decodekit compiled", compiled), ("decodekit eager", eager), ("transformers", reference)):
        if out.shape[1] != expected:
            return {"failed": f"{name} gave {out.shape[1] - ids.shape[1]} new tokens, not {args.new_tokens}"}
    row = {"first compiled call s": round(first, 2), "compiled equals eager": torch.equal(compiled, eager)}
    row["decodekit equals transformers"] = torch.equal(eager, reference)
    if not row["compiled equals eager"]:
        return {**row, "failed": "decodekit's compiled tokens differ from its eager ones"}
    timings = interleaved(sides, args.runs)
    for name in sides:
        row[f"s {name}"] = round(timings.median(name), 3)
    row["tok/s decodekit compiled"] = round(args.new_tokens / timings.median("decodekit compiled"), 1)
    row["speedup compiled vs transformers"] = round(timings.ratio("transformers", "decodekit compiled"), 2)
    row["speedup eager vs transformers"] = round(timings.ratio("transformers", "decodekit eager"), 2)
    return row


def main() -> int:
    parser = bench_parser(__doc__, new_tokens=64)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=["default", "llama-1b"], default="default")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--prompt-tokens", type=int, default=0, help="a random prompt of this many tokens (0: the text)"
    )
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    if parser.parse_args().shape == "default":
        args, path, tok = bench_setup(parser)
    else:  # random weights of that shape, no tokenizer: nothing is downloaded (a lent GPU machine has no network)
        from bench_cuda import SHAPES

        args = parser.parse_args()
        torch.set_num_threads(args.threads)
        warnings.filterwarnings("ignore")
        path = random_checkpoint(Path(tempfile.mkdtemp(prefix="decodekit-bench-1b-")), SHAPES[args.shape])
        args.prompt_tokens = args.prompt_tokens or 128
    native, theirs = models(args, path)
    if args.prompt_tokens:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, native.config.vocab_size, (1, args.prompt_tokens), generator=g)
    else:
        ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    ids = ids.to(args.device)
    started = time.perf_counter()
    import transformers

    crops = hasattr(transformers.cache_utils.StaticLayer, "crop")
    rows = {}
    reference = synced(lambda: native.generate(ids, max_new_tokens=args.new_tokens, eos_token_id=None, compile=True))
    reference()  # compiles
    t = interleaved({"generate": reference}, args.runs)
    rows["decodekit generate(compile=True) greedy tok/s"] = round(args.new_tokens / t.median("generate"), 1)
    say(f"decodekit generate(compile=True), greedy: {rows['decodekit generate(compile=True) greedy tok/s']} tok/s")
    root = Path(tempfile.mkdtemp(prefix="decodekit-bench-methods-"))
    for label in args.methods:
        source, options = METHODS[label]
        if options.get("cache_kind") == "static" and not crops:
            rows[label] = {"failed": f"transformers {transformers.__version__}'s StaticCache cannot crop (5.24's can)"}
        else:
            rows[label] = method_row(label, source, options, native, theirs, ids, args, root)
        row = rows[label]
        if "tok/s decodekit compiled" in row:
            row["of generate(compile=True)"] = round(
                row["tok/s decodekit compiled"] / rows["decodekit generate(compile=True) greedy tok/s"], 2
            )
        say(f"{label}: {row}")
    return report(args, started, device=args.device, shape=args.shape, dtype=args.dtype, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
