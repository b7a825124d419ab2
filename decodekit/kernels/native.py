"""decodekit's own CPU kernels (csrc/: kernels.cpp and a file per section it includes): products of a few rows and the decoder layer stack of a
fixed-shape decode step.

A batch-1 decode step multiplies one row by every weight matrix, and its speed is how fast the weights
stream from memory. `decodekit::row_product` / `row_product_int8` multiply 1 to MAX_ROWS rows by a
bfloat16, float32 or interleaved int8 weight (four accumulators, a prefetch ahead of the loads); they read
weights faster than inductor's loop for the same product (linear.one_row) and than the library kernels,
and serve the eager loop, the Python layers and the lm_head. `decodekit::decode_layers` runs all decoder
layers of a fixed-shape step (llama.LlamaForCausalLM._forward_fixed) in one call and one OpenMP region,
which removes the per-kernel call and region costs that were most of a token beyond the weights.
`decodekit::prompt_layer_start` / `prompt_layer_end` run a prompt's layer in two calls by the kernels the Python
layers call (llama.LlamaForCausalLM._prompt_layers), without the Python between them; a continuous-batching step
attends through its paged cache between prompt_layer_start and `prompt_layer_finish`.

The kernels are compiled on first use with the C++ compiler inductor uses on CPU ($CXX or g++, about
15 s) against the installed torch's headers, and cached under $DECODEKIT_CACHE_DIR (default
~/.cache/decodekit) by a hash of the source, torch's version and the flags. Where that cannot work (a
CPU without AVX2 and FMA, no compiler, a failed build) decode steps keep the Python layers with
inductor's loops and the library kernels, and a `decodekit` log line says why;
DECODEKIT_NATIVE_KERNELS=0 turns them off.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import weakref
from pathlib import Path

import torch

from . import cpu

logger = logging.getLogger("decodekit")

SOURCES = Path(__file__).with_name("csrc")  # one .cpp per section, built as one translation unit
SOURCE = SOURCES / "kernels.cpp"
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c++20")
ENABLE_VARIABLE = "DECODEKIT_NATIVE_KERNELS"
# Activation dtypes of decodekit::decode_layers, the C++ layer stack of a fixed-shape decode step.
LAYER_DTYPES = (torch.float32, torch.bfloat16)
MAX_ROWS = 16  # kMaxRows in csrc/common.h: decode steps of a few rows (beams, a batch) and short prompts

# None: not tried yet; afterwards whether the operators are registered. Read inside compiled code, where
# it is a constant: load() runs before torch.compile traces a step.
_loaded: bool | None = None


def loaded() -> bool:
    """Whether the operators (row_product, row_product_int8, decode_layers) are registered and may be used
    (the cpu.py probe native_kernels, which a test can force off)."""
    return bool(_loaded) and cpu.has("native_kernels")


def ready(*operands: torch.Tensor | None) -> bool:
    """Whether a call on `operands` may use the kernels now: not where autograd would record it (they have no
    backward), and then load() in eager code or, in code being compiled, whether it has succeeded
    (FusedStep loads before tracing)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in operands):
        return False
    if not torch.compiler.is_compiling():
        load()
    return loaded()


def load() -> bool:
    """Builds (once per machine) and registers the kernels; returns whether they are usable. Never raises."""
    global _loaded
    if _loaded is None:
        reason = _unusable_reason()
        if reason is None:
            try:
                torch.ops.load_library(str(_built_library()))
                _register_fakes()
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                reason = f"building or loading {SOURCE.name} failed: {error}"
        _loaded = reason is None
        if reason is not None:
            logger.info("no C++ kernels, compiled steps run the Python layers with inductor's products (%s)", reason)
    return _loaded


_handles = itertools.count(1)


def weights_handle(owner) -> int:
    """A new handle for decodekit::bind_weights; what is bound to it is released when `owner` is collected."""
    handle = next(_handles)
    weakref.finalize(owner, unbind, handle)
    return handle


def unbind(handle: int) -> None:
    """Releases the weights bound to `handle` (nothing if none are)."""
    if loaded():
        torch.ops.decodekit.unbind_weights(handle)


def cache_dir() -> Path:
    """Where built kernels are kept: $DECODEKIT_CACHE_DIR, else $XDG_CACHE_HOME/decodekit or ~/.cache/decodekit."""
    if os.environ.get("DECODEKIT_CACHE_DIR"):
        return Path(os.environ["DECODEKIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "decodekit"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++")


def _unusable_reason() -> str | None:
    if os.environ.get(ENABLE_VARIABLE, "1") == "0":
        return f"{ENABLE_VARIABLE}=0"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX"):  # "AVX2", "AVX512": both have AVX2 and FMA
        return f"this CPU's vector capability is {capability}, the kernels need AVX2 and FMA"
    if _compiler() is None:
        return "no C++ compiler: set CXX or install g++"
    return None


def _built_library() -> Path:
    from torch.utils import cpp_extension

    compiler = _compiler()
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    command = [compiler, *FLAGS, abi, str(SOURCE)]
    command += [f"-I{path}" for path in cpp_extension.include_paths()]
    command += [f"-L{path}" for path in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu"]
    sources = [path.read_text() for path in sorted(SOURCES.iterdir()) if path.suffix in (".cpp", ".h")]
    key = hashlib.sha256("\0".join([*sources, torch.__version__, compiler, *FLAGS, abi]).encode()).hexdigest()
    target = cache_dir() / f"cpu_kernels-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place, so a process never loads a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        done = subprocess.run([*command, "-o", str(built)], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)
    logger.info("built %s", target)
    return target


def _register_fakes() -> None:
    # Shapes for torch.compile's tracing: the products return [rows, out] float32, the stack x's shape.
    def row_product(rows, weight):
        return rows.new_empty((rows.shape[0], weight.shape[0]), dtype=torch.float32)

    def row_product_int8(rows, weight):
        return rows.new_empty((rows.shape[0], weight.shape[0]), dtype=torch.float32)

    def decode_layers(x, cos, sin, slots, masks, keys, values, weights, heads, kv_heads, eps, rows=None):
        return torch.empty_like(x)

    def tiled_product(rows, weight, scales=None, interleaved=False, blocks=False, wide=False):
        return rows.new_empty((rows.shape[0], weight.shape[0]), dtype=torch.float32)

    torch.library.register_fake("decodekit::tiled_product")(tiled_product)
    torch.library.register_fake("decodekit::prefill_attention")(
        lambda q, k, v, window=0, wide=False: torch.empty_like(q)
    )
    torch.library.register_fake("decodekit::rms_norm")(lambda x, weight, eps: torch.empty_like(x, dtype=torch.float32))
    torch.library.register_fake("decodekit::rotary")(lambda x, cos, sin: torch.empty(x.shape, dtype=torch.float32))
    torch.library.register_fake("decodekit::silu_mul")(
        lambda gate_up: gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=torch.float32)
    )
    torch.library.register_fake("decodekit::split_product")(tiled_product)  # the same shape: [rows, out] float32
    torch.library.register_fake("decodekit::row_product")(row_product)
    torch.library.register_fake("decodekit::row_product_int8")(row_product_int8)
    torch.library.register_fake("decodekit::decode_layers")(decode_layers)
    torch.library.register_fake("decodekit::paged_attention")(
        lambda q, *rest: torch.empty_like(q)
    )  # writes keys, values
