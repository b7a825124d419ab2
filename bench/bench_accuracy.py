"""How close a GGUF file's weights kept in blocks compute to the same weights dequantized to float32 (the `gguf`
package's dequantize: the oracle), with llama.cpp's own distance from that oracle beside it as the baseline.

For each of 20 prompts the oracle writes a 64-token greedy continuation; each model then reads prompt and continuation
teacher-forced (decodekit as generation computes them: the prompt in one forward, then one token a forward over the
cache, so the decode steps' products are the ones measured; llama.cpp in one batch), and the bench reports the share of those 64 positions whose argmax equals the oracle's, the
logits' max and mean absolute difference from the oracle's, and perplexity of the oracle's continuations and of a
fixed text (this repository's README). llama.cpp runs when llama-cpp-python is installed (`make test-llamacpp`'s
environment):

    .venv-llamacpp/bin/python bench/bench_accuracy.py [--file PATH] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "To make a cup of tea, first",
    "import numpy as np\n\nx = np.",
    "The mitochondria is the",
    "Write a haiku about autumn:",
    "Q: What is 12 times 7?\nA:",
    "The best way to learn a new language is",
    "In 1969, the Apollo 11 mission",
    "A list of prime numbers: 2, 3, 5,",
    "SELECT name, age FROM users WHERE",
    "The quick brown fox",
    "Photosynthesis converts",
    "My favourite book is",
    "The French Revolution began in",
    "Here is a recipe for pancakes:",
    "The speed of light is approximately",
    "class Stack:\n    def __init__(self):",
]


def continuations(oracle, tok, new_tokens: int) -> list[list[int]]:
    out = []
    for text in PROMPTS:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.inference_mode():
            got = oracle.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        out.append((ids.shape[1], got[0].tolist()))
    return out


def decodekit_logits(model, ids: list[int], start: int | None = None) -> torch.Tensor:
    """Logits at every position of `ids`: in one forward, or with `start` as generation computes them: the first
    `start` tokens as a prompt, then one token a forward over the cache (the decode steps' products)."""
    from decodekit import StaticCache

    with torch.inference_mode():
        if start is None:
            return model.module(torch.tensor([ids])).logits[0].double()
        cache = StaticCache.for_model(model.module, 1, len(ids) + 8)
        rows = [model.module(torch.tensor([ids[:start]]), past_key_values=cache, use_cache=True).logits[0]]
        for token in ids[start:]:
            rows.append(model.module(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0])
        return torch.cat(rows).double()


def llamacpp_logits(llm, ids: list[int]) -> torch.Tensor:
    llm.reset()
    llm.eval(ids)
    return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float64))


def nll(logits: torch.Tensor, ids: list[int], start: int) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[start:] given what precedes each, and how many tokens."""
    logp = torch.log_softmax(logits[start - 1 : len(ids) - 1], dim=-1)
    target = torch.tensor(ids[start:])
    return float(-logp.gather(1, target[:, None]).sum()), len(target)


def compare(logits_of, oracle_logits: dict, sequences, text_ids, stepwise: bool = False) -> dict:
    agree = total = 0
    max_diff, diffs = 0.0, []
    loss = count = 0.0
    for key, (start, ids) in enumerate(sequences):
        got, want = (logits_of(ids, start) if stepwise else logits_of(ids)), oracle_logits[key]
        span = slice(start - 1, len(ids) - 1)  # the positions that chose the continuation
        agree += int((got[span].argmax(-1) == want[span].argmax(-1)).sum())
        total += len(ids) - start
        diff = (got - want).abs()
        max_diff = max(max_diff, float(diff.max()))
        diffs.append(float(diff.mean()))
        part, n = nll(got, ids, start)
        loss, count = loss + part, count + n
    text_loss, text_count = nll(logits_of(text_ids), text_ids, 1)
    return {
        "greedy_agreement_with_dequantized": round(agree / total, 4),
        "logits_max_abs_diff": round(max_diff, 4),
        "logits_mean_abs_diff": round(sum(diffs) / len(diffs), 5),
        "perplexity_of_oracle_continuations": round(math.exp(loss / count), 4),
        "perplexity_of_readme": round(math.exp(text_loss / text_count), 4),
    }


def requantized(source: Path, kind: str) -> Path:
    """The trained weights of a GGUF file quantized again as `kind` (Q4_K_M, Q5_K_M, ...) by llama.cpp's own
    quantizer (llama-cpp-python): written once to float32 with every metadata field copied, then quantized. A file of
    K-quant types with a trained model's distributions, which the `gguf` package cannot write (it has no K-quant
    quantizer); cached beside the llama.cpp bench's files."""
    import gguf
    import llama_cpp
    from gguf.quants import dequantize

    from decodekit.kernels.native import cache_dir

    path = cache_dir() / "bench" / f"{source.stem}-{kind.lower()}.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(source))
    plain = path.with_suffix(".f32.partial")
    writer = gguf.GGUFWriter(str(plain), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kinds = field.types
        sub = kinds[-1] if kinds[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kinds[0], sub_type=sub)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape([int(n) for n in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
    partial = path.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(plain).encode(), str(partial).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {plain} as {kind}")
    plain.unlink()
    partial.rename(path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", help="a GGUF file (default: the default model's)")
    parser.add_argument(
        "--requantize", metavar="KIND",
        help="the file's trained weights quantized again as KIND (Q4_K_M, Q5_K_M, Q6_K) by llama.cpp's quantizer",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N of the 20 prompts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    from decodekit import AutoModelForCausalLM, AutoTokenizer
    from decodekit.loading.default import default_model_path

    path = Path(args.file) if args.file else default_model_path()
    if args.requantize:
        path = requantized(path, args.requantize)
    tok = AutoTokenizer.from_pretrained(path)
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype="float32")  # gguf's dequantize
    kept = AutoModelForCausalLM.from_pretrained(path)
    del PROMPTS[args.prompts :]
    sequences = continuations(oracle, tok, args.new_tokens)
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    text_ids = tok(readme).input_ids[:512]
    oracle_logits = {k: decodekit_logits(oracle, ids) for k, (_, ids) in enumerate(sequences)}
    rows = {"dequantized_float32 (oracle)": compare(lambda ids: decodekit_logits(oracle, ids), oracle_logits,
                                                    sequences, text_ids)}  # fmt: skip
    rows["decodekit_blocks"] = compare(lambda ids, start=None: decodekit_logits(kept, ids, start),
                                       oracle_logits, sequences, text_ids, stepwise=True)  # fmt: skip
    try:
        from llama_cpp import Llama
    except ImportError:
        rows["llama.cpp"] = "not installed here (make test-llamacpp builds it)"
    else:
        llm = Llama(str(path), n_threads=args.threads, n_ctx=1024, n_batch=512, logits_all=True, verbose=False)
        rows["llama.cpp"] = compare(lambda ids: llamacpp_logits(llm, ids), oracle_logits, sequences,
                                    text_ids)  # fmt: skip
    result = {"file": path.name, "prompts": len(PROMPTS), "new_tokens": args.new_tokens, "rows": rows}
    result["seconds"] = round(time.perf_counter() - started, 1)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
