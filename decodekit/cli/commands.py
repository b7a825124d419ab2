"""The commands that load a model or a method (generate, chat, batch, list, new, check, download, completion)."""

from __future__ import annotations

import json
import sys
import time

from .arguments import (
    CLIError,
    check_fields,
    check_method_args,
    checked_method,
    cli_names,
    generation_kwargs,
    parse_method_args,
)
from .terminal import Spinner, Stats, stats_line, stopped, weights_line


def cmd_completion(args) -> int:
    import argcomplete

    print(argcomplete.shellcode(["decodekit"], shell=args.shell))
    return 0


def load_model_of(args, say: bool = False):
    """(model, tokenizer) that the _model_flags in `args` choose. `say`: on a terminal, a turning mark says that the
    model is loading (a download, a GGUF conversion and int8 packing can take a while), cleared when it is done."""
    from ..loading.default import DEFAULT_MODEL_NAME, load_model

    spinner = None
    if say and sys.stderr.isatty():
        spinner = Spinner(f"decodekit: loading {args.model or DEFAULT_MODEL_NAME}").start()
    try:
        return load_model(
            args.model,
            dtype=args.dtype,
            quantize=args.quantize,
            revision=args.revision,
            gguf_file=args.gguf_file,
            backend=args.backend,
            device=args.device,
            threads=args.threads,
        )
    finally:
        if spinner is not None:
            spinner.stop()


def cmd_batch(args) -> int:
    from ..batch_job import BatchSettings, run_batch

    extra = parse_method_args(args.arg)
    generation = {"max_new_tokens": args.max_new_tokens, **extra}
    if args.custom_generate:  # the method and its --arg fields, checked before the model loads
        from ..hub_loader import trusted_revision

        check_method_args(
            args.custom_generate,
            True if args.trust_remote_code else trusted_revision(args.custom_generate),
            extra,
            generation,
        )
    else:
        check_fields(generation)
    settings = BatchSettings(
        model=args.model,
        gguf_file=args.gguf_file,
        revision=args.revision,
        backend=args.backend,
        dtype=args.dtype,
        quantize=args.quantize,
        device=args.device,
        method=args.custom_generate,
        trust_remote_code=args.trust_remote_code,
        generation=generation,
        chat=args.chat,
        prompt_key=args.prompt_key,
    )
    try:
        runner = None
        if args.ray is not None:
            from ..integrations.ray import on_ray

            runner = on_ray(args.ray, concurrency=args.concurrency)
        counts = run_batch(args.input, args.output, settings, progress=not args.no_progress, runner=runner)
    except KeyboardInterrupt:
        print(
            f"\ndecodekit batch: stopped; the rows written so far are in {args.output}, and the same command goes on "
            "from there.",
            file=sys.stderr,
        )
        return stopped()
    failed = ""
    if counts.failed:
        shown = ", ".join(json.dumps(i) for i in counts.failed[:5]) + (", ..." if len(counts.failed) > 5 else "")
        failed = (
            f', {len(counts.failed)} failed (ids {shown}: their lines carry "error"; delete those lines to '
            "try them again)"
        )
    print(
        f"decodekit batch: {counts.written} rows generated{failed}, {counts.skipped} already in {args.output}",
        file=sys.stderr,
    )
    return 1 if counts.failed else 0


def cmd_new(args) -> int:
    from pathlib import Path

    from ..templates import render

    context = {"name": args.name, "description": args.description, "author": args.author, "hook_point": args.hook_point}
    out = render(args.template, Path(args.output_dir), context, no_input=args.no_input, force=args.force)
    print(f"Created {out}")
    nxt = (
        "decodekit check {0} && python -m pytest {0}/tests"
        if args.template == "hub-repo"
        else "pip install -e '{0}[test]' && python -m pytest {0}/tests"
    )
    print("Next: " + nxt.format(out))
    return 0


def cmd_check(args) -> int:
    from pathlib import Path

    from ..hub_loader.check import check_repo

    problems = check_repo(Path(args.directory))
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} problem(s) in {args.directory}", file=sys.stderr)
        return 1
    from ..hub_loader.source import resolve

    pin = resolve(args.directory).revision  # its files read as a run reads them: nothing imported
    print(f"OK: {args.directory} is a valid custom_generate repository")
    print(f"pin: {args.directory}@{pin}")
    print(
        f"  trust it with generate(..., trust_remote_code={pin!r}) or serve it with --method {args.directory}@{pin};"
        " the pin changes whenever a file under custom_generate/ does"
    )
    return 0


def cmd_download(args) -> int:
    from huggingface_hub import snapshot_download

    from ..hub_loader.reach import hub_download
    from ..hub_loader.source import HUB_PATTERNS, is_hub_id

    if not is_hub_id(args.repo):
        raise CLIError(f"{args.repo!r} is not a Hub repo id; expected org/name.")
    if args.method:
        patterns = HUB_PATTERNS
    elif args.gguf_file:
        patterns = [args.gguf_file, "generation_config.json"]
    else:
        from ..loading.files import MODEL_FILE_PATTERNS
        from ..loading.tokenizer import _TOKENIZER_FILES, _TRANSFORMERS_TOKENIZER_FILES

        patterns = [*MODEL_FILE_PATTERNS, *_TOKENIZER_FILES, *_TRANSFORMERS_TOKENIZER_FILES]
    with hub_download(args.repo, "method" if args.method else "model", downloading=True):
        folder = snapshot_download(args.repo, revision=args.revision, allow_patterns=patterns)
    print(folder)
    print(
        f"decodekit download: {args.repo} is in the local cache; loads of it now work offline (HF_HUB_OFFLINE=1)",
        file=sys.stderr,
    )
    return 0


def cmd_list(args) -> int:
    if args.models:
        from ..loading.formats import local_models, render_models

        models = local_models()
        print(json.dumps([m.as_dict() for m in models], indent=2) if args.json else render_models(models))
        return 0
    from ..registry.listing import all_records, render_json, render_table

    records = all_records()
    import shutil

    width = None if args.wide else shutil.get_terminal_size().columns
    print(render_json(records) if args.json else render_table(records, width))
    return 0


def cmd_chat(args) -> int:
    from ..chat import ChatSession, TrustOffer
    from ..hub_loader import UntrustedCodeError, resolve, trusted_revision

    fields = generation_kwargs(args)
    pinned: dict[str, str] = {}  # methods trusted in this chat, at the revision shown

    def trust_for(method: str):
        return True if args.trust_remote_code else pinned.get(method) or trusted_revision(method)

    def check(fields: dict, method: str | None) -> None:
        """The fields and method of the next replies, checked as the flags are (CLIError is a ValueError), errors
        told in the command line's words; the trust gate's refusal of a method as a TrustOffer."""
        try:
            if method is None:
                check_fields(fields)
            else:
                check_method_args(method, trust_for(method), {}, fields)
        except CLIError:
            raise
        except UntrustedCodeError as error:
            if type(error) is not UntrustedCodeError:  # a file refused (MethodFilesError): no trust would do
                raise CLIError(cli_names(str(error))) from None
            raise TrustOffer(cli_names(str(error)), method, resolve(method).revision) from None
        except (ValueError, PermissionError) as error:
            raise CLIError(cli_names(str(error))) from None

    if args.custom_generate:  # the method and its --arg fields, checked before the model loads
        check_method_args(args.custom_generate, trust_for(args.custom_generate), parse_method_args(args.arg), fields)
    model, tokenizer = load_model_of(args, say=True)
    if args.assistant:
        from ..loading import AutoModelForCausalLM

        fields["assistant_model"] = AutoModelForCausalLM.from_pretrained(
            args.assistant, dtype=args.dtype, device=args.device
        )
    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    session = ChatSession(
        model,
        tokenizer,
        fields,
        system=args.system,
        method=args.custom_generate,
        trust_for=trust_for,
        check=check,
        seed=args.seed,
        pin=pinned.__setitem__,
    )
    return session.run()


def cmd_generate(args) -> int:

    import torch

    from ..core.streamers import TextStreamer
    from ..loading import AutoModelForCausalLM
    from ..loading.tokenizer import prompt_ids

    kwargs = generation_kwargs(args)
    stream = not args.no_stream
    if stream and kwargs.get("num_beams", 1) > 1:
        print(
            "decodekit: note: beam search cannot stream (beams change until the last step); the text is printed "
            "at the end.",
            file=sys.stderr,
        )
        stream = False
    began = time.perf_counter()
    trust = checked_method(args, kwargs)
    model, tokenizer = load_model_of(args, say=True)
    if args.assistant:
        kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(
            args.assistant, dtype=args.dtype, device=args.device
        )
    loaded = time.perf_counter()

    input_ids = prompt_ids(tokenizer, args.prompt, chat=args.chat).to(model.device)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    if args.custom_generate:
        kwargs["custom_generate"] = args.custom_generate
        kwargs["trust_remote_code"] = trust
        kwargs["attention_mask"] = torch.ones_like(input_ids)
    out, stats = generate_shown(args, model, tokenizer, input_ids, streamer, kwargs)
    done = time.perf_counter()
    if not isinstance(out, torch.Tensor):
        out = out.sequences if hasattr(out, "sequences") else out
    if not stream:
        text = tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)
        print(text if args.chat else args.prompt + text)
    if args.stats:
        print(stats_line(int(out.shape[1] - input_ids.shape[1]), began, loaded, done, stats), file=sys.stderr)
        print(weights_line(model), file=sys.stderr)
    return 0


def generate_shown(args, model, tokenizer, input_ids, streamer, kwargs: dict):
    """model.generate() with what the terminal shows meanwhile: the prompt echoed where the text streams (not for
    --chat), a turning mark while --compile's first call compiles (the prompt then echoed with the first token), and
    --stats' watch of the tokens. Returns (the output, the watch or None)."""
    echo = streamer is not None and not args.chat
    echoed = False

    def show_prompt() -> None:
        nonlocal echoed
        if spinner is not None:
            spinner.stop()
        if echo and not echoed:
            print(args.prompt, end="", flush=True)  # the prompt as typed, not as re-decoded tokens
            echoed = True

    spinner = None
    if args.compile:
        note = "decodekit: compiling the decode step on first use (this can take a minute)"
        spinner = Spinner(note).start() if sys.stderr.isatty() else print(note, file=sys.stderr)
    stats = None
    if kwargs.get("num_beams", 1) == 1 and (args.stats or spinner is not None):
        stats = Stats(streamer, on_first=show_prompt, hold=1 if spinner is not None else 0)
    if spinner is None:
        show_prompt()
    try:
        out = model.generate(input_ids, streamer=stats or streamer, seed=args.seed, tokenizer=tokenizer, **kwargs)
    except BaseException:
        if spinner is not None:
            spinner.stop()
        if echoed:
            print(flush=True)  # an error goes on its own line, not glued to the echoed prompt
        raise
    if spinner is not None:
        spinner.stop()
    return out, stats
