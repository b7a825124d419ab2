"""Compiling decode steps: torch.compile's settings for a step, the guards it keeps, CUDA-graph replays. The fused
decode loops (plugins/fused.py, beam search's), a published method's step (facade/view_step.py) and continuous
batching's step (batching/compiled.py) compile through here.

The compiled steps themselves are kept by the model's StepHost (kernels/step_host.py), by kind and by everything that
decides the compiled code (batch, cache bucket, processors, options, weight layout): a later call with the same key
reuses the step; the least recently used goes when a kind is full (each fused step holds a static cache of its own).
"""

from __future__ import annotations

import types

import torch

from ..families.cache import StaticCache

COMPILE_OPTIONS = ("mode", "fullgraph", "dynamic", "backend", "options")


def check_compile_config(gc) -> None:
    """The compile, disable_compile and compile_config fields of `gc`, checked (ValueError naming the field);
    disable_compile=True turns compiling off whatever else the call says, as transformers' switch does."""
    if not isinstance(gc.compile, bool):
        raise gc.invalid("compile", "expected True or False")
    if not isinstance(gc.disable_compile, bool):
        raise gc.invalid("disable_compile", "expected True or False")
    if gc.disable_compile:  # transformers' switch: nothing is compiled, whatever else the call says
        gc.compile, gc.compile_config = False, None
    cc = gc.compile_config
    if cc is not None and (not isinstance(cc, dict) or set(cc) - set(COMPILE_OPTIONS)):
        raise gc.invalid(
            "compile_config", f"expected a dict with keys among {list(COMPILE_OPTIONS)} (passed to torch.compile)"
        )
    if cc is not None and cc.get("mode") is not None and uses_inductor(cc):
        from torch._inductor import list_mode_options

        if cc["mode"] not in list_mode_options():
            raise gc.invalid("compile_config", f"mode={cc['mode']!r} is not one of {sorted(list_mode_options())}")
    if cc is not None and cc.get("options") is not None:
        validate_backend_options(gc, cc)


def validate_backend_options(gc, cc: dict) -> None:
    options = cc["options"]
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise gc.invalid("compile_config", "options must be a dict of option names to values (torch.compile's options)")
    if not uses_inductor(cc):
        if cc.get("mode") is not None:
            raise gc.invalid(
                "compile_config", "torch.compile takes mode or options, not both, for a backend other than inductor"
            )
        return
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = sorted(k for k in options if k not in known or k == "guard_filter_fn")
    if unknown:
        raise gc.invalid(
            "compile_config",
            f"options {unknown} are not inductor options (see torch._inductor.config; "
            "the step sets guard_filter_fn itself)",
        )


STEP_ARGUMENTS = (
    "tokens",
    "positions",
    "slots",
    "mask",
    "eos_block",
    "noise_key",
    "unfinished",
    "pad",
    "eos_ids",
    "state",
    "go",
    "cur",
    "max_length",
    "prompt_length",
)


def argument_guards_only(entries) -> list[bool]:
    """Keeps dynamo's guards on the step's arguments and the rotary table, drops those on the model's
    weights and the step's own cache: thousands for a 30-layer model, checked at every step.

    A step is keyed by everything the dropped guards would catch (batch, cache bucket, processors, dtype,
    device, packed or quantized weights), so they could fail only where a new step is made anyway. The
    rotary table is kept guarded because a longer generation may rebuild it, and so are the guards on
    dynamic sizes (SHAPE_ENV): a step compiled for a range of row counts (continuous batching's) holds only
    where the code it traced branches the same way, e.g. up to 16 rows for decodekit's row kernel. Not applied
    with a `mode` for a backend other than inductor (see compile_arguments).
    """
    roots = tuple(f"L['{name}']" for name in STEP_ARGUMENTS)
    return [
        entry.guard_type == "SHAPE_ENV"
        or (not entry.is_global and (entry.name.startswith(roots) or ".rotary" in entry.name))
        for entry in entries
    ]


# Inductor inlines a cheap elementwise producer (a norm, a residual sum) into every loop that reads it. A
# one-row matmul written as a broadcast multiply and a sum (linear.one_row, llama.one_query_attention)
# would then recompute its input once per output row (inductor's CPU default of 12 reads: docs/performance.md). At 1,
# though, every product of two tensors is stored, the attention's too:
# q * k over a 256-slot cache became a [3, 3, 256, 64] buffer written and read back, twice a layer. 3 keeps the
# norms stored and the attention products fused, faster than 1 and than 5 (docs/performance.md).
# A norm has three reads, so it was still recomputed in the inner loop of the product after it: for bf16
# three conversions to float32 per weight vector instead of one. realize_opcount_threshold 8 (CPU default
# 50) stores any elementwise result of more than 8 operations, the norms among them.
STEP_INDUCTOR_OPTIONS = {"realize_acc_reads_threshold": 3, "realize_opcount_threshold": 8}


def cpu_isa_checked() -> bool:
    """Whether inductor's check of the CPU's vector instruction sets passed for every set this CPU reports, with this
    torch and C++ compiler: made once per machine and recorded in torch's compile cache folder, where inductor
    would build and load a test library per set, each load in a Python subprocess, at every process's first compile
    (1.3 s of a warm process's 3.3 s first compiled call on the 2-core bench machine). False where it failed (each
    compile checks again, as inductor does) or off x86-64 Linux, where inductor's own check runs."""
    if cpu_isa_checked.answer is None:
        cpu_isa_checked.answer = _recorded_isa_check()
    return cpu_isa_checked.answer


cpu_isa_checked.answer = None


def _recorded_isa_check() -> bool:
    import hashlib
    import os
    import platform
    import sys
    from pathlib import Path

    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    flags = cpu_vec_isa.x86_isa_checker()
    candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    try:
        compiler = get_compiler_version_info(get_cpp_compiler())
    except Exception:  # noqa: BLE001 - no usable compiler: inductor's own check says so where it matters
        return False
    key = hashlib.sha256(repr((torch.__version__, compiler, flags, [str(i) for i in candidates])).encode()).hexdigest()
    record = Path(cache_dir()) / f"decodekit-cpu-isa-{key[:24]}"
    if record.is_file():
        return record.read_text() == "passed"
    with inductor_config.patch({"cpp.vec_isa_ok": None}):
        passed = bool(candidates) and all(bool(isa) for isa in candidates)
    record.parent.mkdir(parents=True, exist_ok=True)
    partial = record.with_name(f"{record.name}.{os.getpid()}")
    partial.write_text("passed" if passed else "failed")
    partial.replace(record)  # whole or not at all, whichever process writes it
    return passed


def uses_inductor(compile_config: dict) -> bool:
    """Whether torch.compile runs inductor for this compile_config (its default backend)."""
    return compile_config.get("backend", "inductor") == "inductor"


def compile_arguments(options: dict, guard_filter=argument_guards_only) -> dict:
    """torch.compile's keyword arguments for a step from compile_config (plus fullgraph/dynamic defaults).

    torch.compile takes `mode` or `options`, not both; for inductor a mode is only a set of options, so it
    is merged with the step's own options, then compile_config's `options` (which win), and `guard_filter`
    (None: dynamo keeps every guard). Another backend with a mode gets the mode alone.
    """
    args = dict(options)
    mode = args.pop("mode", None)
    own = args.pop("options", None) or {}
    if uses_inductor(args):
        from torch._inductor import list_mode_options

        own = {**(list_mode_options(mode, args.get("dynamic")) if mode else {}), **STEP_INDUCTOR_OPTIONS, **own}
        if cpu_isa_checked():  # checked once for the machine (cpu_isa_checked), not again in every process
            own = {"cpp.vec_isa_ok": True, **own}
    elif mode is not None:
        return {**args, "mode": mode}
    filtered = {} if guard_filter is None else {"guard_filter_fn": guard_filter}
    return {**args, "options": {**own, **filtered}}


class FusedStep:
    """One compiled step with its own static cache: `make(model, cache)` returns the function to compile; call
    the FusedStep to run it. `options` None: the function runs as it is, not compiled (the same kernels and cache
    as the compiled step's, eagerly)."""

    def __init__(self, model, batch: int, length: int, options: dict | None, make):
        self.compiled_once = False
        self.compiles = options is not None
        self.cache = StaticCache.for_model(model, batch, length)
        model.rotary.ensure(length, model.device, model.dtype)
        self.graphs = self.compiles and model.device.type == "cuda" and replays_graphs(options)
        if self.graphs:
            # A CUDA graph replays fixed addresses; the step writes its cache, an input of the graph, which
            # inductor then replays only if the input is marked as never moving (else it skips the graphs).
            for tensor in (*self.cache.keys, *self.cache.values):
                torch._dynamo.mark_static_address(tensor)
        self.step = compile_own(make(model, self.cache), options) if self.compiles else make(model, self.cache)

    def __call__(self, *args):
        """One step. Replayed as a CUDA graph, its outputs live in the graph's memory, which the next replay
        overwrites: the loop keeps them (tokens, flags) or passes them back in, so they are copied out. After the
        first that returns, `compiled_once`: a later failure is not the compiler's (StepHost.failed)."""
        if not self.graphs:
            out = self.step(*args)
        else:
            torch.compiler.cudagraph_mark_step_begin()
            out = _copied(self.step(*args))
        self.compiled_once = True
        return out


def _copied(outputs):
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_copied(o) for o in outputs)
    return outputs.clone() if isinstance(outputs, torch.Tensor) else outputs


def step_options(compile_config: dict | None, device: torch.device) -> dict:
    """torch.compile's settings for a step on `device`: compile_config over fullgraph, static shapes and, on CUDA,
    mode="reduce-overhead". A batch-1 step of a small model is bound there by its kernel launches, which a CUDA graph
    replay removes (docs/performance.md, the CUDA tables). A
    compile_config with its own mode, backend or options keeps them (mode="default": no graphs)."""
    options = {"fullgraph": True, "dynamic": False}
    config = compile_config or {}
    if device.type == "cuda" and not {"mode", "backend", "options"} & {k for k, v in config.items() if v is not None}:
        options["mode"] = "reduce-overhead"
    return {**options, **config}


def replays_graphs(options: dict) -> bool:
    """Whether a step compiled with compile_config `options` runs as CUDA graph replays on a CUDA device
    (mode="reduce-overhead" or "max-autotune", inductor's triton.cudagraphs option, the cudagraphs backend)."""
    args = compile_arguments(options)
    return bool(
        args.get("options", {}).get("triton.cudagraphs")
        or args.get("backend") == "cudagraphs"
        or args.get("mode") in ("reduce-overhead", "max-autotune")
    )


def compile_own(step, options: dict, guard_filter=argument_guards_only):
    """torch.compile(step) (options: compile_config, see compile_arguments) on a code object of its own: dynamo
    counts recompilations per code object, and a long-lived process with many steps would otherwise hit its
    limit. `guard_filter` as in compile_arguments: a function whose arguments are not the steps' (STEP_ARGUMENTS)
    and that holds no weights passes None, so its graphs stay guarded on the shapes they were specialised to."""
    compile_own.made += 1
    code = step.__code__.replace(co_name=f"decodekit_step_{compile_own.made}")
    own = types.FunctionType(code, step.__globals__, code.co_name, step.__defaults__, step.__closure__)
    return torch.compile(own, **compile_arguments(options, guard_filter))


compile_own.made = 0
