"""The two grammar engines decodekit could build structured output on, side by side on the default tokenizer:
llguidance and xgrammar (whichever is installed; both run on CPU).

    python bench/bench_grammar_engines.py [--runs 5]

For one realistic schema (a 10-field object: nested object, bounded array, enum, number ranges, optional
fields, a string pattern) and one regex it reports: building the engine's view of the tokenizer, compiling
the constraint (first time; the engines cache nothing across processes), the masks along a valid document
the first time (what an engine builds lazily is paid there) and later (median, mean, 99th percentile). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "nickname": {"type": "string"},
        "joined": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    },
    "required": ["name", "age", "email", "role", "score", "active", "tags", "address", "joined"],
    "additionalProperties": False,
}
DOCUMENT = (
    '{"name": "Ada Lovelace", "age": 36, "email": "ada@engine.org", "role": "admin", "score": 0.97, '
    '"active": true, "tags": ["math", "poetry"], "address": {"city": "London", "zip": "12345"}, '
    '"joined": "1843-07-10"}'
)
REGEX = r"[A-Z][a-z]{2,9} [0-9]{1,3}(\.[0-9]{1,2})? (km|mi)"
REGEX_TEXT = "Paris 42.5 km"


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def summary(times, per_run):
    first = sum(times[:per_run])  # the first pass over the document pays what the engine builds lazily
    later = sorted(times[per_run:] or times)
    return {
        "first_document_ms": round(1e3 * first, 2),
        "later_median_us": round(1e6 * statistics.median(later), 1),
        "later_mean_us": round(1e6 * statistics.fmean(later), 1),
        "later_p99_us": round(1e6 * later[int(0.99 * (len(later) - 1))], 1),
        "tokens": per_run,
    }


def llguidance_rows(backend, eos, vocab, ids, regex_ids, runs):
    import llguidance
    import llguidance.torch

    tok, build = timed(lambda: llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=eos))
    out = {"version": llguidance.__version__, "tokenizer_s": round(build, 3)}
    for name, grammar, tokens in (
        ("json_schema", llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), ids),
        ("regex", llguidance.LLMatcher.grammar_from_regex(REGEX), regex_ids),
    ):
        matcher, compile_s = timed(lambda: llguidance.LLMatcher(tok, grammar))
        assert not matcher.is_error(), matcher.get_error()
        mask = llguidance.torch.allocate_token_bitmask(1, vocab)
        times = []
        for _ in range(runs):
            m = matcher.deep_copy()
            for t in tokens:
                _, s = timed(lambda: llguidance.torch.fill_next_token_bitmask(m, mask, 0))
                times.append(s)
                assert m.consume_token(t), (name, t, m.get_error())
        out[name] = {"compile_s": round(compile_s, 4), "mask": summary(times, len(tokens))}
    return out


def xgrammar_rows(backend, eos, vocab, ids, regex_ids, runs):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=backend)
    info, build = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos]))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out = {"version": xgr.__version__ if hasattr(xgr, "__version__") else "?", "tokenizer_s": round(build, 3)}
    for name, make, tokens in (
        ("json_schema", lambda: compiler.compile_json_schema(json.dumps(SCHEMA)), ids),
        ("regex", lambda: compiler.compile_regex(REGEX), regex_ids),
    ):
        compiled, compile_s = timed(make)
        mask = xgr.allocate_token_bitmask(1, vocab)
        times = []
        for _ in range(runs):
            m = xgr.GrammarMatcher(compiled)
            for t in tokens:
                _, s = timed(lambda: m.fill_next_token_bitmask(mask))
                times.append(s)
                assert m.accept_token(t), (name, t)
        out[name] = {"compile_s": round(compile_s, 4), "mask": summary(times, len(tokens))}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    from decodekit import AutoTokenizer
    from decodekit.loading.default import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    backend, eos = tok.backend, tok.eos_token_id
    vocab = backend.get_vocab_size(with_added_tokens=True)
    ids, regex_ids = tok.encode(DOCUMENT), tok.encode(REGEX_TEXT)
    result = {"document_tokens": len(ids), "vocab": vocab}
    for name, rows in (("llguidance", llguidance_rows), ("xgrammar", xgrammar_rows)):
        try:
            result[name] = rows(backend, eos, vocab, ids, regex_ids, args.runs)
        except ImportError as error:
            result[name] = f"not installed ({error})"
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
