"""`decodekit serve`: the model loaded, the continuous-batching manager made, its step compiled in the background."""

from __future__ import annotations

import atexit
import os
import sys
import time

from .commands import load_model_of
from .terminal import status


def cmd_serve(args) -> int:
    from ..loading.default import DEFAULT_MODEL_NAME
    from ..serve import Server, ServerSettings, allowed_methods, bind

    if args.warm_compile_cache:
        return warm_compile_cache(args)
    try:
        sock = bind(args.host, args.port)  # before the model loads and compiles: a bad address fails at once
    except OSError as error:
        print(f"decodekit serve: {error}", file=sys.stderr)
        return 2
    methods = allowed_methods(args.method)  # likewise a bad --method
    refused = attention_refusal(args)
    if refused:
        sock.close()
        print(f"decodekit serve: {refused}", file=sys.stderr)
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


def attention_refusal(args) -> str | None:
    """Why --paged-attention cannot be taken with the other flags (before the model loads), or None."""
    if args.paged_attention != "auto" and not args.compile:
        return (
            f"--paged-attention {args.paged_attention} chooses the compiled decode step's attention; "
            "drop --no-compile (eager steps keep decodekit's kernel or gathered blocks)"
        )
    if args.paged_attention == "flex" and str(args.device).split(":")[0] == "cpu":
        return (
            "--paged-attention flex is for compiled steps on a GPU (inductor's CPU flex template "
            "gives wrong attention for the paged cache's mask); on --device cpu use auto or gathered"
        )
    return None


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
