"""The command line's arguments turned into generate()'s: method arguments (--arg), fields, flag files, and
messages that name flags rather than fields."""

from __future__ import annotations

import contextlib
import json


def parse_method_args(pairs: list[str]) -> dict:

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--arg {pair!r} is invalid; expected KEY=VALUE with KEY a Python identifier.")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


class CLIError(ValueError):
    """A problem with the command line itself, found before any model loads."""


def check_method_args(spec: str, trust, extra: dict, fields: dict) -> None:
    """Loads the method (trust gate, requirements) and checks the --arg keys (`extra`) against what it takes: a
    hook-only method's fields with the generation config's, or its generate()'s own parameters unless it takes
    **kwargs; then every value of `fields` (the call's keywords) as generate() will check it, the method's own
    validation included."""
    import inspect

    from ..core.config import GenerationConfig, add_plugin_fields, closest
    from ..core.generate import MODEL_INPUTS
    from ..hub_loader.method import load_method, registered_for_call

    method = load_method(spec, trust)
    if method.generate is not None:
        params = inspect.signature(method.generate).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            check_fields(fields, also_known=set(fields))  # it takes any keyword: the fields' values are still checked
            return
        known = set(params) | set(MODEL_INPUTS)
        checking = contextlib.nullcontext()
    else:
        checking = registered_for_call(method)
    with checking:
        if method.generate is None:
            known = add_plugin_fields(GenerationConfig())
        for key in extra:
            if key not in known:
                close = closest(key, known)
                raise CLIError(
                    f"--arg {key}=... is taken neither by the method {spec!r} nor as a generation config "
                    "field" + (f"; did you mean --arg {close}=...?" if close else "") + "."
                )
        check_fields(fields, also_known=known)


def generation_kwargs(args) -> dict:
    """The generate() keywords the flags and --arg ask for, checked before any model loads: a bad value is reported
    in well under a second, naming the flag."""
    from ..core.config import accepted_fields, closest

    if args.prompt is not None and not args.prompt.strip():  # chat reads its messages later
        raise CLIError('the prompt is empty; give the text to continue, e.g. decodekit generate "Once upon a time".')
    sampling_flags = {"--temperature": args.temperature, "--top-p": args.top_p}
    if args.penalty_alpha is None:
        sampling_flags["--top-k"] = args.top_k
    used = [flag for flag, value in sampling_flags.items() if value is not None]
    if used and not args.do_sample:
        raise CLIError(f"{', '.join(used)} only apply when sampling; add --do-sample.")
    # Each flag of FLAGS stores the generate() keyword it names (argparse dest); unset ones are None.
    kwargs = {name: getattr(args, name) for name in FLAGS if getattr(args, name) is not None}
    if "," in kwargs.get("samplers", ""):  # --samplers top_k,xtc,temperature: names; else llama.cpp's letters
        kwargs["samplers"] = [name.strip() for name in kwargs["samplers"].split(",") if name.strip()]
    if args.penalty_alpha is not None:
        kwargs.setdefault("top_k", 4)
    for name in ("json_schema", "grammar"):  # these flags name a file; generate() takes its text
        if name in kwargs:
            kwargs[name] = _read_flag_file(FLAGS[name], kwargs[name], as_json=name == "json_schema")
    if args.compile:
        kwargs["compile"] = True
    extra = parse_method_args(args.arg)
    known = accepted_fields()
    if not args.custom_generate:  # a method's own keywords are known only once it is loaded
        for key in extra:
            if key not in known:
                close = closest(key, known)
                hint = ""
                if close:
                    hint = f"; did you mean {FLAGS[close]}?" if close in FLAGS else f"; did you mean --arg {close}=...?"
                raise CLIError(
                    f"--arg {key}=... is not a generation config field or a keyword of an installed plugin"
                    f"{hint} (`decodekit list` shows the keywords each plugin takes)."
                )
    kwargs.update(extra)
    if not args.custom_generate:  # with a method, check_method_args checks them once the method is loaded
        check_fields(kwargs)
    return kwargs


def check_fields(fields: dict, also_known=frozenset()) -> None:
    """Every value of `fields` checked as generate() will check it, before a model loads (core.generate.preflight):
    the built-in checks and each plugin's (samplers, mirostat, a method's own fields)."""
    from ..core.generate import preflight

    try:
        preflight(fields, also_known)
    except ValueError as error:
        raise CLIError(cli_names(str(error))) from None


def _read_flag_file(flag: str, path: str, as_json: bool):
    from pathlib import Path

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise CLIError(f"{flag} {path}: cannot read the file ({error.strerror or error}).") from None
    if not as_json:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise CLIError(f"{flag} {path}: not JSON ({error}).") from None


# generate() keywords that have a flag of their own, for messages shown on the command line.
LLAMACPP_FLAGS = [
    ("--top-n-sigma", float, "N", "keep tokens scoring at least max - N * std"),
    ("--xtc-probability", float, "P", "XTC: with probability P, drop every likely token but the least likely of them"),
    ("--xtc-threshold", float, "T", "XTC: what counts as likely (default 0.1)"),
    ("--dry-multiplier", float, "M", "DRY: penalise extending a repeated sequence by M * base^(length - allowed)"),
    ("--dry-base", float, "B", "DRY: the base (default 1.75)"),
    ("--dry-allowed-length", int, "N", "DRY: repeats this long go unpenalised (default 2)"),
    ("--dry-penalty-last-n", int, "N", "DRY: how far back to look (default -1: the whole context)"),
    ("--dry-sequence-breaker", str, "TEXT", 'DRY: text that ends a repeat (repeatable; default \\n : " *)'),
    ("--mirostat", int, "V", "mirostat version 1 or 2: sample at a target surprise"),
    ("--mirostat-tau", float, "TAU", "mirostat: the target surprise (default 5.0)"),
    ("--mirostat-eta", float, "ETA", "mirostat: the learning rate (default 0.1)"),
    ("--dynatemp-range", float, "R", "dynamic temperature: temperature +- R by the distribution's entropy"),
    ("--dynatemp-exponent", float, "E", "dynamic temperature: the entropy's exponent (default 1.0)"),
    ("--smoothing-factor", float, "F", "quadratic sampling (smoothing)"),
    ("--smoothing-curve", float, "C", "quadratic sampling's curve (default 1.0)"),
    ("--samplers", str, "ORDER", "the chain's order, llama.cpp's letters (default dskypmxt) or comma-separated names"),
]


FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "do_sample": "--do-sample",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "num_beams": "--num-beams",
    "prompt_lookup_num_tokens": "--prompt-lookup",
    "penalty_alpha": "--penalty-alpha",
    "json_schema": "--json-schema",
    "regex": "--regex",
    "grammar": "--grammar",
    "choice": "--choice",
    **{flag[2:].replace("-", "_"): flag for flag, *_ in LLAMACPP_FLAGS if flag != "--dry-sequence-breaker"},
    "dry_sequence_breakers": "--dry-sequence-breaker",  # a repeatable flag: its field is the plural
}


def cli_names(message: str) -> str:
    """`message` with the keywords that have a flag written as that flag (top_p=2.0 -> --top-p 2.0), and the trust
    gate's advice as the command line takes it: --trust-remote-code, or a pinned revision's line in the trusted
    revisions file."""
    import re

    from ..hub_loader.trust import trusted_revisions_file

    label = re.search(r"`([^`]+)`", message)
    message = re.sub(
        r"trust_remote_code=('[^']*'|\"[^\"]*\")",
        lambda pin: (
            f"the line '{label.group(1) if label else '<method>'} {pin.group(1)[1:-1]}' in {trusted_revisions_file()}"
        ),
        message,
    )
    message = message.replace("trust_remote_code=True", "--trust-remote-code")
    for name, flag in FLAGS.items():
        message = message.replace(f"{name}=", f"{flag} ")
    return message


def checked_method(args, kwargs: dict):
    """--custom-generate's trust (True, or the revision trusted before) with the method and its --arg fields checked
    before the model loads; None without a method."""
    if not args.custom_generate:
        return None
    from ..hub_loader import trusted_revision

    trust = True if args.trust_remote_code else trusted_revision(args.custom_generate)
    check_method_args(args.custom_generate, trust, parse_method_args(args.arg), kwargs)
    return trust
