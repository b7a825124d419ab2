"""Structured output's cost per token: a 10-field JSON object on the default model, constrained against
unconstrained decoding of the same number of tokens, eager and compiled, with transformers' unconstrained
greedy decoding on the same weights as the reference, in one interleaved run.

    python bench/bench_structured.py [--runs 3] [--threads 2]

The constrained call is run first to learn how many tokens the object takes; every other row generates
exactly that many (min_new_tokens). Also reported: the first call's cost of the constraint (building the
engine's view of the tokenizer, compiling the schema) and the rows' outputs checked with jsonschema where
it is installed. Prints a table, then one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from bench_generate import bench_parser, bench_setup, interleaved
from bench_grammar_engines import SCHEMA


def main() -> int:
    args, path, tok = bench_setup(bench_parser(__doc__, new_tokens=0))
    from decodekit import AutoModelForCausalLM
    from decodekit.loading.tokenizer import prompt_ids
    from decodekit.plugins import structured

    eager = AutoModelForCausalLM.from_pretrained(path)
    compiled = AutoModelForCausalLM.from_pretrained(path)
    request = "Reply with JSON for a user of a web site: name, age, email, role, score, active, tags, address, joined."
    prompt = prompt_ids(tok, request, chat=True)

    def constrained(model, **kw):
        return model.generate(prompt, json_schema=SCHEMA, tokenizer=tok, max_new_tokens=200, **kw)

    start = time.perf_counter()
    with torch.inference_mode():
        first = constrained(eager)
    first_call_s = time.perf_counter() - start
    structured._tokenizers.clear(), structured._grammars.clear()
    vocab = eager.config.vocab_size
    eos = tuple(eager.generation_config.eos_token_ids or ())
    tokenizer_s = _seconds(lambda: structured.llg_tokenizer(tok, vocab, eos))
    schema_s = _seconds(
        lambda: structured.compiled(
            structured.llg_tokenizer(tok, vocab, eos),
            structured.require_engine().LLMatcher.grammar_from_json_schema(SCHEMA),
        )
    )
    n = first.shape[1] - prompt.shape[1]
    text = tok.decode(first[0, prompt.shape[1] :], skip_special_tokens=True)
    valid = _valid(text)

    def job(model, constrain, **kw):
        def run():
            with torch.inference_mode():
                if constrain:
                    out = constrained(model, **kw)
                else:
                    out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)
            assert out.shape[1] - prompt.shape[1] == n or constrain

        return run

    jobs = {
        "eager unconstrained": job(eager, False),
        "eager constrained": job(eager, True),
        "compiled unconstrained": job(compiled, False, compile=True),
        "compiled constrained": job(compiled, True, compile=True),
    }
    if not args.skip_transformers:
        import transformers

        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        ref.generation_config.pad_token_id = tok.pad_token_id

        def reference():
            with torch.inference_mode():
                ref.generate(
                    prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n, do_sample=False
                )

        jobs["transformers unconstrained"] = reference
    timings = interleaved(jobs, args.runs)
    rows = {name: round(1000 * timings.median(name) / n, 2) for name in jobs}
    ratios = {
        "eager constrained / unconstrained": round(timings.ratio("eager constrained", "eager unconstrained"), 3),
        "compiled constrained / unconstrained": round(
            timings.ratio("compiled constrained", "compiled unconstrained"), 3
        ),
    }
    if not args.skip_transformers:
        ratios["transformers unconstrained / decodekit eager constrained"] = round(
            timings.ratio("transformers unconstrained", "eager constrained"), 3
        )
    for name, ms in rows.items():
        print(f"{name:30s} {ms:8.2f} ms/token", file=sys.stderr)
    for name, ratio in ratios.items():
        print(f"{name:58s} {ratio:.3f}", file=sys.stderr)
    json.dump(
        {
            "tokens": n,
            "output_valid": valid,
            "first_call_s": round(first_call_s, 3),
            "tokenizer_s": round(tokenizer_s, 3),
            "schema_compile_s": round(schema_s, 4),
            "ms_per_token": rows,
            "ratios": ratios,
            "runs": args.runs,
            "threads": args.threads,
            "torch": torch.__version__,
        },
        sys.stdout,
        indent=2,
    )
    print()
    return 0


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _valid(text: str):
    try:
        import jsonschema
    except ImportError:
        return "jsonschema not installed"
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError) as error:
        return f"invalid: {error}"


if __name__ == "__main__":
    sys.exit(main())
