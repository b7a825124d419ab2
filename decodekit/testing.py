"""Tiny random Llama-family checkpoints for tests: of decodekit itself and of the methods people write.

from decodekit.testing import tiny_model
model = tiny_model(tmp_path)              # a loaded 3-layer model with a 96-token vocabulary
path = write_tiny_model(tmp_path / "m", "qwen3")   # just the checkpoint directory
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def tiny_config(model_type: str = "llama", **overrides) -> dict:
    config = {
        "model_type": model_type,
        "architectures": [ARCHITECTURES[model_type]],
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 112,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if model_type == "mistral":
        config["sliding_window"] = 8
    if model_type == "qwen3":
        config["head_dim"] = 24  # deliberately not hidden_size / heads
        config["attention_bias"] = False
    config.update(overrides)
    return config


def tiny_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names. Scaled so logits are well spread (no near-ties)."""
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    qkv_bias = config["model_type"] == "qwen2" or config.get("attention_bias", False)

    def w(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else 1.0 / math.sqrt(shape[-1]))

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd = {"model.embed_tokens.weight": w(vocab, h, scale=1.0), "model.norm.weight": norm(h)}
    if not config["tie_word_embeddings"]:
        sd["lm_head.weight"] = w(vocab, h, scale=2.0 / math.sqrt(h))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, out_dim in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
            sd[f"{p}self_attn.{name}_proj.weight"] = w(out_dim, h)
            if qkv_bias:
                sd[f"{p}self_attn.{name}_proj.bias"] = 0.1 * torch.randn(out_dim, generator=g)
        sd[f"{p}self_attn.o_proj.weight"] = w(h, heads * hd)
        if config.get("attention_bias", False):
            sd[f"{p}self_attn.o_proj.bias"] = 0.1 * torch.randn(h, generator=g)
        if config["model_type"] == "qwen3":
            sd[f"{p}self_attn.q_norm.weight"] = norm(hd)
            sd[f"{p}self_attn.k_norm.weight"] = norm(hd)
        sd[f"{p}mlp.gate_proj.weight"] = w(inter, h)
        sd[f"{p}mlp.up_proj.weight"] = w(inter, h)
        sd[f"{p}mlp.down_proj.weight"] = w(h, inter)
        sd[f"{p}input_layernorm.weight"] = norm(h)
        sd[f"{p}post_attention_layernorm.weight"] = norm(h)
    return sd


def write_tiny_model(path: Path, model_type: str = "llama", seed: int = 0, shards: int = 1, **overrides) -> Path:
    """A complete checkpoint directory: config.json, generation_config.json, safetensors (optionally sharded)."""
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(model_type, **overrides)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    sd = tiny_state_dict(config, seed)
    if shards == 1:
        save_file(sd, str(path / "model.safetensors"))
        return path
    names = sorted(sd)
    weight_map = {}
    for s in range(shards):
        shard_name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: sd[n] for n in names[s::shards]}
        save_file(part, str(path / shard_name))
        weight_map.update({n: shard_name for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


# Hugging Face names -> GGUF's (gguf_file._TENSOR_NAMES, the other way).
_GGUF_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


# K-quant super-blocks of 256 weights: bytes each, and where their float16 scales sit (scale, minimum scale).
K_QUANT_SCALES = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def random_k_quant(kind: str, rows: int, width: int, seed: int = 0) -> np.ndarray:
    """Random `kind` (Q4_K, Q5_K, Q6_K) rows [rows, width / 256 * bytes]: any bytes are valid values once the float16
    scales are set to small ones (0.001-0.02), so that the weights come out near the scale of a trained model's."""
    size, scales = K_QUANT_SCALES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, width // 256 * size), dtype=np.uint8)
    supers = raw.reshape(-1, size)
    for at in scales:
        values = rng.uniform(0.001, 0.02, (len(supers), 1)).astype(np.float16)
        supers[:, at : at + 2] = values.view(np.uint8)
    return raw


def _write_gguf_fields(writer, config: dict, tokenizer: dict | None) -> None:
    """The llama metadata of `config` (and `tokenizer`'s fields, whose BOS and EOS ids then win) on a GGUFWriter."""
    heads = config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    if tokenizer:
        writer.add_tokenizer_model(tokenizer["model"])
        if tokenizer.get("pre"):
            writer.add_tokenizer_pre(tokenizer["pre"])
        writer.add_token_list(tokenizer["tokens"])
        writer.add_token_types(tokenizer["token_type"])
        if tokenizer.get("merges"):
            writer.add_token_merges(tokenizer["merges"])
        bos, eos = tokenizer["bos_token_id"], tokenizer["eos_token_id"]
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)


def write_tiny_gguf(
    path: Path, matrices: str = "Q4_1", embedding: str | None = None, seed: int = 0, types: dict | None = None,
    tokenizer: dict | None = None, **overrides,
) -> Path:  # fmt: skip
    """A tiny llama model as one GGUF file, its random weights (tiny_state_dict) quantized by the `gguf` package's own
    quantizers (random valid super-blocks for Q4_K and Q6_K, which it cannot quantize: random_k_quant): the layers'
    matrices as `matrices` (a GGMLQuantizationType name: Q4_0, Q4_1, Q8_0, Q4_K, F32, ...), the
    embedding as `embedding` (default: the same), `types` naming another for a GGUF part ("attn_v": "Q8_0").
    Widths are multiples of 32 (the block size). The q and k rows are permuted as llama.cpp's converter writes them.
    `tokenizer`: another GGUF file's tokenizer fields (gguf_file.GGUFModel.tokenizer_fields) to write beside."""
    import gguf
    from gguf.quants import quantize

    config = tiny_config("llama", **{"intermediate_size": 128, **overrides})
    sd = tiny_state_dict(config, seed)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_gguf_fields(writer, config, tokenizer)
    for name, tensor in sd.items():
        stem = name.removeprefix("model.").removesuffix(".weight")
        if stem == "embed_tokens":
            gguf_name, kind = "token_embd", embedding or matrices
        elif stem in ("norm", "lm_head"):
            gguf_name, kind = ("output_norm", "F32") if stem == "norm" else ("output", matrices)
        else:
            _, layer, part = stem.split(".", 2)
            gguf_name = f"blk.{layer}.{_GGUF_PARTS[part]}"
            kind = (types or {}).get(_GGUF_PARTS[part], matrices if tensor.dim() == 2 else "F32")
        data = tensor.float().numpy()
        if gguf_name.endswith(("attn_q", "attn_k")):  # llama.cpp's rotary layout (gguf_file._unpermute undoes it)
            n = heads if gguf_name.endswith("attn_q") else kv
            data = data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        qtype = gguf.GGMLQuantizationType[kind]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name + ".weight", data)
        elif kind in K_QUANT_SCALES:  # the gguf package has no K-quant quantizer: valid random super-blocks
            writer.add_tensor(gguf_name + ".weight", random_k_quant(kind, *data.shape, seed=seed), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name + ".weight", quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_model(directory: Path, model_type: str = "llama", seed: int = 0, **overrides):
    """A loaded tiny model, its checkpoint written under `directory`."""
    from .loading import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        write_tiny_model(Path(directory) / f"tiny-{model_type}", model_type, seed, **overrides)
    )


def cpu_path_settings(*probes: str) -> list:
    """pytest parameters forcing each combination of the cpu.py `probes` off and on, for tests that check a
    speed path: one machine then runs the checks of the paths other machines take. A setting that forces a
    probe on where this machine lacks it is skipped with the missing feature as the reason. Use with
    `decodekit.kernels.cpu.forced(**setting)`."""
    import itertools

    import pytest

    from .kernels import cpu

    params = []
    for values in itertools.product((False, True), repeat=len(probes)):
        setting = dict(zip(probes, values))
        label = ",".join(f"{name}={'on' if on else 'off'}" for name, on in setting.items())
        missing = [name for name, on in setting.items() if on and not cpu.MACHINE[name]]
        marks = [pytest.mark.skip(reason=f"this CPU lacks {', '.join(missing)}")] if missing else []
        params.append(pytest.param(setting, id=label, marks=marks))
    return params


def default_model_as_transformers(path: Path) -> Path:
    """The default model written to `path` as a plain fp32 transformers checkpoint, for engines that read neither
    its GGUF Q4 file nor decodekit's (vLLM). Needs transformers, accelerate and gguf."""
    import transformers

    from .loading.default import default_model_path

    gguf = default_model_path()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    config = transformers.LlamaConfig(
        **{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    )
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict(), strict=False)
    plain.tie_weights()
    plain.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(path)
    loaded.generation_config.save_pretrained(path)
    return path
