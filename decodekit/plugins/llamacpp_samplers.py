"""llama.cpp's samplers, under the names llama.cpp's server takes, so a request moves between the two unchanged:
top_n_sigma, xtc_probability / xtc_threshold, dry_* (DRY), mirostat / mirostat_tau / mirostat_eta,
dynatemp_range / dynatemp_exponent, smoothing_factor / smoothing_curve (text-generation-webui's), and `samplers`,
the order. Each default leaves its sampler off (core/sampler_chain.py has what each does).

Setting any of them runs llama.cpp's chain instead of transformers' warper order: after decodekit's penalties,
`dry`, `top_n_sigma`, `top_k`, `typical_p`, `top_p`, `min_p`, `xtc`, `temperature` (with dynatemp_range and
quadratic smoothing just before it), as llama.cpp's defaults; temperature is last, where transformers puts it
first. `samplers` changes the order: a list of those names (llama.cpp's `typ_p` and `top_n_sigma` spellings
too) or llama.cpp's letters ("dkypmxt", "s" for top-n-sigma); "penalties" may be named and stays first. DRY is a
penalty and applies to greedy decoding too; the others shape sampling (do_sample=True). mirostat=1 or 2 replaces
the chain with temperature then mirostat, as in llama.cpp (decodekit's penalties still apply), and selects the token
itself (with sampling); under beam sampling it cuts each beam's scores to what it keeps and the beams draw, its
state following each beam (core.sampler_chain.MirostatLogitsProcessor).
"""

from __future__ import annotations

from ..core.warpers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper
from ..core.config import is_int, is_number
from ..core.sampler_chain import (
    DRYLogitsProcessor,
    chain_active,
    DynamicTemperatureLogitsWarper,
    MirostatLogitsProcessor,
    MirostatSelector,
    QuadraticSmoothingLogitsWarper,
    TopNSigmaLogitsWarper,
    XTCLogitsWarper,
    DryBreakers,
)
from ..core.selectors import draw_key
from ..registry import hookimpl

FIELDS = {
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": -1,
    "dry_sequence_breakers": ("\n", ":", '"', "*"),
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "smoothing_factor": 0.0,
    "smoothing_curve": 1.0,
    "samplers": None,
}
ORDER = ("dry", "top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc", "temperature")
NAMES = {
    **{name: name for name in ORDER},
    "typ_p": "typical_p",
    "top-n-sigma": "top_n_sigma",
    "temp": "temperature",
    "penalties": None,
}
LETTERS = {
    "d": "dry",
    "s": "top_n_sigma",
    "k": "top_k",
    "y": "typical_p",
    "p": "top_p",
    "m": "min_p",
    "x": "xtc",
    "t": "temperature",
    "e": None,
}


# How many distinct DRY sequence breakers a call may give: building them scans the whole vocabulary for each one
# (thousands from one request took minutes of CPU). llama.cpp's default has four.
MAX_DRY_BREAKERS = 64


@hookimpl
def decodekit_config_fields():
    return dict(FIELDS)


def order(gc) -> list[str]:
    """The chain's order: `samplers` as names or llama.cpp's letters, else llama.cpp's default."""
    given = gc.samplers
    if given is None:
        return list(ORDER)
    names = [LETTERS.get(c, c) for c in given] if isinstance(given, str) else given
    if not isinstance(names, (list, tuple)) or not names or any(not isinstance(n, str) for n in names):
        raise gc.invalid(
            "samplers", f"expected a list of sampler names {list(ORDER)} or llama.cpp's letters, e.g. 'dkypmxt'"
        )
    out = []
    for name in names:
        if name not in NAMES and name not in LETTERS.values():
            raise gc.invalid(
                "samplers",
                f"{name!r} is not a sampler; expected names from {list(ORDER)} (or "
                f"'penalties', which always runs first) or the letters {''.join(LETTERS)}",
            )
        resolved = NAMES.get(name, name)
        if resolved is not None and resolved not in out:
            out.append(resolved)
    return out


@hookimpl
def decodekit_validate_config(generation_config, context):
    gc = generation_config
    # Upper bounds where a larger value would overflow float32 in the step (NaN scores, an overflow error) and means
    # nothing more than the bound: a temperature spread of 10,000 or a target surprise of 10,000 bits.
    numbers = {
        "top_n_sigma": (None, None),
        "xtc_probability": (0, 1),
        "xtc_threshold": (0, 1),
        "dry_multiplier": (0, None),
        "dry_base": (0, None),
        "mirostat_tau": (0, 1e4),
        "mirostat_eta": (0, 1e4),
        "dynatemp_range": (0, 1e4),
        "dynatemp_exponent": (0, 1e4),
        "smoothing_factor": (0, None),
        "smoothing_curve": (None, None),
    }
    for name, (low, high) in numbers.items():
        value = getattr(gc, name)
        if not is_number(value) or (low is not None and value < low) or (high is not None and value > high):
            bounds = f"[{low}, {high}]" if high is not None else f">= {low}" if low is not None else "finite"
            raise gc.invalid(name, f"expected a number {bounds} (the default leaves it off: {FIELDS[name]!r})")
    if gc.dynatemp_exponent <= 0:
        raise gc.invalid("dynatemp_exponent", "expected a number > 0")
    for name, low in (("dry_allowed_length", 0), ("dry_penalty_last_n", -1)):
        if not is_int(getattr(gc, name)) or getattr(gc, name) < low:
            raise gc.invalid(name, f"expected an integer >= {low}" + (" (-1: the whole context)" if low == -1 else ""))
    breakers = gc.dry_sequence_breakers
    if not isinstance(breakers, (list, tuple)) or not all(isinstance(b, str) for b in breakers):
        raise gc.invalid("dry_sequence_breakers", "expected a list of strings, e.g. ['\\n', ':', '\"', '*']")
    if len(set(breakers)) > MAX_DRY_BREAKERS:  # each is looked for in every token of the vocabulary
        raise gc.invalid(
            "dry_sequence_breakers", f"expected at most {MAX_DRY_BREAKERS} distinct strings, got {len(set(breakers))}"
        )
    if isinstance(gc.mirostat, bool) or not is_int(gc.mirostat) or gc.mirostat not in (0, 1, 2):
        raise gc.invalid("mirostat", "expected 0 (off), 1 (mirostat) or 2 (mirostat 2.0)")
    if not chain_active(gc):
        return
    order(gc)
    if gc.mirostat:
        if not gc.do_sample:
            raise gc.invalid("mirostat", "mirostat samples the next token: set do_sample=True")


@hookimpl
def decodekit_logits_processors(generation_config, context):
    gc = generation_config
    if not chain_active(gc):
        return []
    if gc.mirostat:  # llama.cpp: temp, then mirostat (the selector below; with beams, its truncation here)
        temperature = DynamicTemperatureLogitsWarper(gc.temperature if gc.temperature is not None else 1.0)
        if gc.number("num_beams", 1) > 1:
            vocab = getattr(getattr(context.model, "config", None), "vocab_size", None) or 0
            return [temperature, MirostatLogitsProcessor(gc.mirostat, gc.mirostat_tau, gc.mirostat_eta, vocab)]
        return [temperature]
    out = []
    for name in order(gc):
        if name == "dry" and gc.dry_multiplier > 0 and gc.dry_base >= 1 and gc.dry_penalty_last_n != 0:
            # The call's tokenizer, else the one stored with the model's files (llama.cpp reads the model's own).
            tokenizer = context.tokenizer
            if (
                tokenizer is None
                and gc.dry_sequence_breakers
                and callable(getattr(context.model, "own_tokenizer", None))
            ):
                tokenizer = context.model.own_tokenizer()
            if gc.dry_sequence_breakers and tokenizer is None:
                raise ValueError(
                    f"dry_multiplier={gc.dry_multiplier}: DRY's sequence breakers are text, tokenized as "
                    "llama.cpp does, and this model was not loaded from files holding a tokenizer: pass "
                    "tokenizer= (decodekit serve, the CLI and the vLLM adapter do), or "
                    "dry_sequence_breakers=[]."
                )
            context_size = getattr(getattr(context.model, "config", None), "max_position_embeddings", None) or 2**31
            breakers = DryBreakers(tokenizer, tuple(gc.dry_sequence_breakers)) if gc.dry_sequence_breakers else {}
            out.append(
                DRYLogitsProcessor(
                    gc.dry_multiplier, gc.dry_base, gc.dry_allowed_length, gc.dry_penalty_last_n, context_size, breakers
                )
            )
        if not gc.do_sample:
            continue  # the rest shape sampling; greedy decoding takes the best token anyway
        if name == "top_n_sigma" and gc.top_n_sigma > 0:
            out.append(TopNSigmaLogitsWarper(gc.top_n_sigma))
        elif name == "top_k" and gc.top_k:
            out.append(TopKLogitsWarper(gc.top_k))
        elif name == "typical_p" and gc.typical_p not in (None, 1.0):
            out.append(TypicalLogitsWarper(gc.typical_p))
        elif name == "top_p" and gc.top_p not in (None, 1.0):
            out.append(TopPLogitsWarper(gc.top_p))
        elif name == "min_p" and gc.min_p:
            out.append(MinPLogitsWarper(gc.min_p))
        elif name == "xtc" and gc.xtc_probability > 0:
            out.append(XTCLogitsWarper(gc.xtc_probability, gc.xtc_threshold, draw_key(context.generator)))
        elif name == "temperature":
            if gc.smoothing_factor > 0:
                out.append(QuadraticSmoothingLogitsWarper(gc.smoothing_factor, gc.smoothing_curve))
            temperature = gc.temperature if gc.temperature is not None else 1.0
            if temperature != 1.0 or gc.dynatemp_range > 0:
                out.append(DynamicTemperatureLogitsWarper(temperature, gc.dynatemp_range, gc.dynatemp_exponent))
    return out


@hookimpl
def decodekit_token_selector(generation_config, context):
    gc = generation_config
    if gc.mirostat not in (1, 2) or not gc.do_sample or gc.number("num_beams", 1) > 1:
        return None
    vocab = getattr(getattr(context.model, "config", None), "vocab_size", None) or 0
    return MirostatSelector(gc.mirostat, gc.mirostat_tau, gc.mirostat_eta, vocab, context.generator)
