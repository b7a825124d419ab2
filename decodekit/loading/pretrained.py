"""Finding and loading weights: a local directory, a Hub repository (through huggingface_hub) or a GGUF file.

Loading sits above the model families (decodekit.families) and the facade (decodekit.facade): it builds a family's
module from the files, or has transformers build one (via_transformers.py), and hands it to a facade Model with the
generation config the files carry and the repository's custom_generate/ method where trusted."""

from __future__ import annotations

import functools

import json
import logging
import os
from pathlib import Path

import torch

from ..facade import Model
from ..facade.transformers_model import TRANSFORMERS_EXTRA
from ..facade.transformers_model import installed as transformers_installed
from ..families.config import SUPPORTED_MODEL_TYPES, ModelConfig
from ..kernels import int4pack
from ..kernels.blocks import dequantize, kept_on
from ..sizes import return_freed_memory
from .files import check_backend, check_model_name, resolve_model_dir
from .gguf_file import BlockWeight

logger = logging.getLogger("decodekit")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype, config_dtype: str | None = None) -> torch.dtype:
    """None means float32; "auto" means the dtype config.json records."""
    if dtype is None:
        return torch.float32
    if dtype == "auto":
        dtype = config_dtype or "float32"
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}, 'auto', or the torch dtypes.")


def load_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors weights in {model_dir}.")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def to_native(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face parameter names -> this package's, fusing q/k/v and gate/up into single matrices; `hf_state` is
    emptied."""
    s = {k.removeprefix("model."): v for k, v in hf_state.items()}
    hf_state.clear()  # the parts are dropped as they are fused (the caller's dict held them all until the end)
    out = {"embed.weight": s.pop("embed_tokens.weight"), "norm.weight": s.pop("norm.weight")}
    lm_head = s.pop("lm_head.weight", None)
    out["lm_head.weight"] = out["embed.weight"] if config.tie_word_embeddings or lm_head is None else lm_head
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        return_freed_memory()  # the last layer's parts, freed once fused, handed back before this layer's copies
        out[p + "attn.qkv.weight"] = _rows([s.pop(f"{attn}{n}_proj.weight") for n in "qkv"])
        if config.qkv_bias:
            out[p + "attn.qkv.bias"] = torch.cat([s.pop(f"{attn}{n}_proj.bias") for n in "qkv"])
        out[p + "attn.o.weight"] = s.pop(attn + "o_proj.weight")
        if config.o_bias:
            out[p + "attn.o.bias"] = s.pop(attn + "o_proj.bias")
        if config.qk_norm:
            out[p + "attn.q_norm.weight"] = s.pop(attn + "q_norm.weight")
            out[p + "attn.k_norm.weight"] = s.pop(attn + "k_norm.weight")
        out[p + "mlp.gate_up.weight"] = _rows([s.pop(mlp + "gate_proj.weight"), s.pop(mlp + "up_proj.weight")])
        out[p + "mlp.down.weight"] = s.pop(mlp + "down_proj.weight")
        if config.mlp_bias:
            out[p + "mlp.gate_up.bias"] = torch.cat([s.pop(mlp + "gate_proj.bias"), s.pop(mlp + "up_proj.bias")])
            out[p + "mlp.down.bias"] = s.pop(mlp + "down_proj.bias")
        out[p + "attn_norm.weight"] = s.pop(p + "input_layernorm.weight")
        out[p + "mlp_norm.weight"] = s.pop(p + "post_attention_layernorm.weight")
    leftover = [k for k in s if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"Unexpected weights for a {config.model_type} model: {leftover[:5]}")
    return out


def _rows(parts: list):
    """Weight matrices stacked by rows (a fused q/k/v or gate/up): tensors, or BlockWeights, which stack as their
    blocks: of one layout as they are, of two (a Q4_K_M file's q8 v beside q4 q and k) as q8 blocks (blocks.as_q8:
    exact for Q4_0's, else rounded again, which gguf_file's log line says); blocks beside floats: all float32."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, BlockWeight) for p in parts):
        if len({p.layout for p in parts}) > 1:
            from ..kernels.blocks import as_q8

            parts = [BlockWeight(as_q8(p.data)[0], p.in_features) for p in parts]
        return BlockWeight(torch.cat([p.data for p in parts]), parts[0].in_features)
    return torch.cat([dequantize(p.data) if isinstance(p, BlockWeight) else p for p in parts])


def _place_blocks(model, native: dict) -> None:
    """Replaces the layers whose weights `native` holds as BlockWeights by block layers (kernels/blocks.py), taking
    those entries (and their biases) out of `native`; a tied lm_head shares the embedding's blocks."""
    from ..kernels.blocks import BlockEmbedding, BlockLinear

    for key in [k for k, v in native.items() if isinstance(v, BlockWeight)]:
        weight = native.pop(key)
        path = key.removesuffix(".weight")
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        if path == "embed":
            layer = BlockEmbedding(weight.data, weight.in_features)
        else:
            layer = BlockLinear(weight.data, weight.in_features, native.pop(path + ".bias", None))
        setattr(parent, name, layer)
        native[path + ".blocks"] = weight.data  # one tensor for a tied lm_head and the embedding


def build_model(config: ModelConfig, hf_state: dict, dtype: torch.dtype, device):
    """The family's module (decodekit.families.llama) with `hf_state`'s weights, in `dtype` on `device`, eval mode.
    Weights given as BlockWeights stay in their blocks (the model's `quantization` is then "blocks"). `hf_state` is
    emptied: each layer's q, k and v (gate and up) are let go once fused, so a load holds one layer's parts at a time."""
    from ..families.llama import LlamaForCausalLM

    try:
        native = to_native(hf_state, config)
    except KeyError as e:
        raise ValueError(
            f"Weights are missing tensor {e.args[0]!r} that a {config.model_type} config requires."
        ) from None
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    blocks = any(isinstance(v, BlockWeight) for v in native.values())
    if blocks:
        _place_blocks(model, native)
    model.load_state_dict(native, strict=True, assign=True)
    if config.tie_word_embeddings and not blocks:
        model.lm_head.weight = model.embed.weight
    model = model.to(dtype=dtype, device=device).eval()
    if blocks:
        model.quantization = "blocks"
    return model


def choose_backend(backend, model_type, native: bool, label: str) -> str:
    """The backend that loads `label` (whose architecture is `model_type`), with a log line saying why."""
    if backend is None:
        backend = "native" if native else "transformers"
        why = (
            f"model_type {model_type!r} is one of decodekit's native families"
            if native
            else f"model_type {model_type!r} has no native implementation (native: {sorted(SUPPORTED_MODEL_TYPES)})"
        )
    else:
        why = f"backend={backend!r} was passed"
        if backend == "native" and not native:
            raise ValueError(
                f"{label}: model_type {model_type!r} has no native implementation in decodekit (native: "
                f"{sorted(SUPPORTED_MODEL_TYPES)}); load it with backend='transformers' or backend=None."
            )
    if backend == "transformers" and not transformers_installed():
        raise ImportError(
            f"{label}: {why}, so it loads through transformers, which is not installed; install it "
            f"with:\n    {TRANSFORMERS_EXTRA}"
        )
    logger.info("loading %s with the %s backend: %s", label, backend, why)
    return backend


def _architecture(model_dir: Path, gguf_file: str | None) -> tuple[str | None, bool, dict | None]:
    """(architecture, whether decodekit builds it natively, config.json's fields) from config.json, or from the
    GGUF file's metadata (no config.json fields then)."""
    if gguf_file is not None:
        from .gguf_file import architecture

        return (*architecture(model_dir / gguf_file), None)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_dir} has no config.json; a model directory needs config.json and its weights (or pass gguf_file=...)."
        )
    fields = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    model_type = fields.get("model_type")
    return model_type, model_type in SUPPORTED_MODEL_TYPES, fields


def _native_files(name_or_path, gguf_file, config_fields, revision, local_files_only, token, keep_blocks=False):
    """(the model's directory, its ModelConfig, its weights, its GenerationConfig) for a native load: the GGUF file
    (and a generation_config.json beside it; `keep_blocks`: its quantized matrices kept as the file holds them),
    else the safetensors checkpoint."""
    from ..core.config import GenerationConfig
    from .gguf_file import open_gguf

    if gguf_file is not None:
        model_dir = resolve_model_dir(
            name_or_path, revision, local_files_only, token, allow_patterns=[gguf_file, "generation_config.json"]
        )
        gguf = open_gguf(model_dir / gguf_file)
        config = ModelConfig(**gguf.config())
        state = gguf.state_dict(keep_blocks=keep_blocks)
    else:
        model_dir = resolve_model_dir(name_or_path, revision, local_files_only, token)
        config = ModelConfig(**config_fields)
        state = load_safetensors(model_dir)
    gen_path = model_dir / "generation_config.json"
    generation_config = (
        GenerationConfig.from_file(gen_path, config)
        if gen_path.is_file()
        else GenerationConfig.from_model_config(config)
    )
    return model_dir, config, state, generation_config


class AutoModelForCausalLM:
    """Loads a causal LM the way transformers' class of the same name does: decodekit's own model for the Llama
    families, a wrapped transformers model (decodekit.wrap) for every other architecture."""

    @staticmethod
    def from_pretrained(
        name_or_path: str | os.PathLike,
        revision: str | None = None,
        dtype=None,
        device=None,
        gguf_file: str | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
        trust_remote_code=None,
        quantize: str | None = None,
        backend: str | None = None,
        threads=None,
        **transformers_kwargs,
    ):
        """`name_or_path`: a local directory, a Hub repo id or a .gguf file.
        `trust_remote_code` (True, or a revision to pin) lets a repo's custom_generate/ become model.generate (and,
        for the transformers backend, lets the repo's own modeling code run, as in transformers).
        `quantize`: "int8" (native models store linear weights as int8 with per-channel scales: kernels/quantize.py),
        "int4" (in GGUF's 4-bit blocks of 32 with a scale and a minimum each: kernels/blocks.py; PyTorch's int4
        layout on CUDA), or "int4-g64" / "int4-g128" (groups of 64 / 128 in PyTorch's int4 layout, bfloat16
        activations: kernels/int4pack.py).
        `backend`: None picks native for the Llama families and transformers for the rest; "native" or
        "transformers" forces one. `threads`: torch's CPU thread count for the process, an int, "auto" or "torch"
        (None: DECODEKIT_THREADS, else "auto" at the first CPU model a process loads, unless the count was chosen
        outside decodekit; kernels/threads.py). `transformers_kwargs` (device_map, quantization_config, ...) go to
        transformers."""
        _check_load_arguments(name_or_path, quantize, backend, threads, device)
        path = Path(name_or_path).expanduser()
        if gguf_file is None and path.is_file() and path.suffix == ".gguf":
            path, gguf_file = path.parent, path.name
            name_or_path = path
        # First only what decides the backend; each backend then fetches the files it reads.
        probe = [gguf_file] if gguf_file is not None else ["config.json"]
        model_dir = resolve_model_dir(name_or_path, revision, local_files_only, token, allow_patterns=probe)
        model_type, native, config_fields = _architecture(model_dir, gguf_file)
        label = str(name_or_path) + (f" ({gguf_file})" if gguf_file else "")
        if choose_backend(backend, model_type, native, label) == "transformers":
            return _load_with_transformers(
                name_or_path, model_dir, gguf_file, config_fields, label, quantize, dtype, device, revision, token,
                local_files_only, trust_remote_code, transformers_kwargs,
            )  # fmt: skip
        if transformers_kwargs:
            raise TypeError(
                f"from_pretrained() got {sorted(transformers_kwargs)}, which only the transformers backend "
                f"takes; {label} loads natively (pass backend='transformers' to load it with transformers)."
            )
        return _load_natively(
            name_or_path, gguf_file, config_fields, revision, local_files_only, token, dtype, device, quantize,
            trust_remote_code,
        )  # fmt: skip


def _check_load_arguments(name_or_path, quantize, backend, threads, device) -> None:
    """from_pretrained's arguments checked before anything loads (an error naming the argument and what it takes),
    and the process's thread count chosen for a CPU load."""
    from ..kernels.quantize import QUANTIZATIONS
    from ..kernels.threads import parse, threads_for_load

    if isinstance(name_or_path, (torch.nn.Module, Model)):
        raise TypeError(
            f"from_pretrained() loads from a directory, a Hub repo id or a GGUF file, got a "
            f"{type(name_or_path).__name__} object; for a model you already hold use decodekit.wrap(model)."
        )
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize={quantize!r} is not supported; use one of {list(QUANTIZATIONS)} or None.")
    check_backend(backend)
    check_model_name(name_or_path)
    if threads is not None:
        parse(threads)  # a bad value refused before anything loads
    if device is None or torch.device(device).type == "cpu":
        threads_for_load(threads)


def _load_natively(
    name_or_path, gguf_file, config_fields, revision, local_files_only, token, dtype, device, quantize, trust
) -> Model:
    """A Model over decodekit's own module, built from the files `from_pretrained` found (safetensors or GGUF)."""
    # A GGUF file's quantized weights stay as the file holds them unless a dtype or another quantization is asked for:
    # in their blocks on CPU, in PyTorch's int4 layout on CUDA (kernels/int4pack.py: bfloat16 activations there).
    as_file = gguf_file is not None and dtype is None and quantize is None
    int4_device = as_file and int4pack.runs_on(device)
    keep_blocks = as_file and (int4_device or kept_on(device))
    model_dir, config, state, generation_config = _native_files(
        name_or_path, gguf_file, config_fields, revision, local_files_only, token, keep_blocks
    )
    built_on = torch.device("cpu" if int4_device else device or "cpu")
    module = build_model(config, state, resolve_dtype(dtype, getattr(config, "torch_dtype", None)), built_on)
    if int4_device:
        int4pack.replace_blocks(module, device)
        module = module.to(device=device, dtype=torch.bfloat16)
    module.name_or_path = str(name_or_path)
    return_freed_memory()  # what the load copied on the way (build_model let it go) is handed back
    if quantize is not None:
        from ..kernels.quantize import quantize as quantize_model

        quantize_model(module, quantize)
    model = Model(module, generation_config, str(name_or_path))
    model.tokenizer_source = functools.partial(_stored_tokenizer, model_dir, gguf_file)
    if gguf_file is None and (model_dir / "custom_generate" / "generate.py").is_file():
        _attach_custom_generate(model, model_dir, str(name_or_path), trust)
    logger.info("loaded %s (%s, %d layers)", name_or_path, config.model_type, config.num_hidden_layers)
    return model


def _stored_tokenizer(model_dir: Path, gguf_file: str | None):
    """The tokenizer in a model's files (model.own_tokenizer), or None where they hold none it can read."""
    from .tokenizer import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir / gguf_file if gguf_file else model_dir, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - no tokenizer there: the caller says what it needed one for
        logger.info("no tokenizer read from %s: %s", model_dir, error)
        return None


def _load_with_transformers(
    name_or_path,
    model_dir: Path,
    gguf_file,
    config_fields: dict | None,
    label: str,
    quantize,
    dtype,
    device,
    revision,
    token,
    local_files_only,
    trust_remote_code,
    transformers_kwargs,
):
    from .via_transformers import load_model

    if quantize is not None:
        raise ValueError(
            f"quantize={quantize!r} applies to decodekit's native models; {label} loads through "
            "transformers: pass its quantization_config=... instead."
        )
    config_dtype = (config_fields.get("dtype") or config_fields.get("torch_dtype")) if config_fields else None
    # A local directory is read where it is; a Hub repo goes through transformers' own download (same cache).
    source = model_dir if Path(name_or_path).expanduser().is_dir() or gguf_file else name_or_path
    module = load_model(
        source,
        dtype=resolve_dtype(dtype, config_dtype),
        device=device,
        revision=revision,
        token=token,
        local_files_only=local_files_only,
        gguf_file=gguf_file,
        trust_remote_code=trust_remote_code,
        **transformers_kwargs,
    )
    model = Model(module, name_or_path=str(name_or_path))
    model.tokenizer_source = functools.partial(_stored_tokenizer, model_dir, gguf_file)
    snapshot = None
    if gguf_file is None:
        snapshot = resolve_model_dir(
            name_or_path, revision, local_files_only, token, allow_patterns=["custom_generate/**"]
        )
    if snapshot is not None and (snapshot / "custom_generate" / "generate.py").is_file():
        _attach_custom_generate(model, snapshot, str(name_or_path), trust_remote_code)
    return model


def _attach_custom_generate(model, model_dir: Path, label: str, trust_remote_code) -> None:
    from ..core.generate import prepare_method_call
    from ..hub_loader import bind_to_model, from_directory, load

    if trust_remote_code in (None, False):
        logger.warning(
            "%s has a custom generation method (custom_generate/generate.py) that was not loaded: it is code from "
            "outside decodekit. Pass trust_remote_code=True to use it as model.generate; the built-in generate is used.",
            label,
        )
        return
    local = Path(label).expanduser().is_dir()
    # A Hub snapshot lives under snapshots/<commit sha>/: that sha is the revision being trusted.
    source = from_directory(model_dir, label, "local" if local else "hub", revision=None if local else model_dir.name)
    bind_to_model(
        model,
        load(source, trust_remote_code),
        prepare=lambda method, kwargs: prepare_method_call(model, method, {}, kwargs),
    )
