"""Tiny random transformers models of architectures outside the Llama family, built in the tests.

Each entry covers something decodekit's loop must get right on a model it did not write: learned absolute
positions (GPT-2, OPT), parallel attention and MLP with partial rotary (GPT-NeoX, Phi), Falcon's fused
multi-query attention, logit soft-capping with alternating sliding-window layers (Gemma 2), a newer hybrid
(Gemma 3 text), mixtures of experts (Mixtral, Qwen3-MoE).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers extra (`make test` installs it)")

VOCAB = 96
PAD, EOS = 0, 95
COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=1)

LLAMA_LIKE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

ARCHITECTURES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_positions=64, n_embd=32, n_layer=2, n_head=4)),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        ),
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            rotary_pct=0.5,
            use_parallel_residual=True,
            max_position_embeddings=64,
        ),
    ),
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            partial_rotary_factor=0.5,
            max_position_embeddings=64,
        ),
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            multi_query=True,
            parallel_attn=True,
            new_decoder_architecture=False,
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=4,
            final_logit_softcapping=5.0,
            attn_logit_softcapping=10.0,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=4,
            max_position_embeddings=64,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            tie_word_embeddings=False,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        ),
    ),
    # The rest of the differential suite (test_differential.py): decoder-only families as transformers 5.23 builds
    # them, each at the smallest size its config accepts.
    **{
        name: (f"{prefix}Config", f"{prefix}ForCausalLM", dict(LLAMA_LIKE, **extra))
        for name, (prefix, extra) in {
            "llama": ("Llama", {}),
            "mistral": ("Mistral", dict(sliding_window=4)),
            "qwen2": ("Qwen2", {}),
            "qwen3": ("Qwen3", dict(head_dim=8)),
            "phi3": ("Phi3", {}),
            "gemma": ("Gemma", dict(head_dim=8)),
            "granite": ("Granite", {}),
            "olmo": ("Olmo", {}),
            "olmo2": ("Olmo2", {}),
            "stablelm": ("StableLm", {}),
            "starcoder2": ("Starcoder2", dict(sliding_window=None)),
            "cohere": ("Cohere", {}),
            "nemotron": ("Nemotron", dict(head_dim=8)),
            "glm": ("Glm", dict(head_dim=8)),
            "helium": ("Helium", dict(head_dim=8)),
            "smollm3": ("SmolLM3", {}),
            "exaone4": ("Exaone4", dict(head_dim=8)),
        }.items()
    },
    "persimmon": (
        "PersimmonConfig",
        "PersimmonForCausalLM",
        dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64
        ),
    ),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64)),
    "codegen": (
        "CodeGenConfig",
        "CodeGenForCausalLM",
        dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, n_ctx=64),
    ),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=32, n_layer=2, n_head=4)),
    "mpt": ("MptConfig", "MptForCausalLM", dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=64)),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True),
    ),
    "gpt_neo": (
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        dict(
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            window_size=4,
            attention_types=[[["global", "local"], 1]],
            max_position_embeddings=64,
        ),
    ),
    "xglm": (
        "XGLMConfig",
        "XGLMForCausalLM",
        dict(d_model=32, num_layers=2, attention_heads=4, ffn_dim=64, max_position_embeddings=64),
    ),
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            lru_width=32,
            attention_window_size=8,
        ),
    ),
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            LLAMA_LIKE,
            num_experts=2,
            num_experts_per_tok=1,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
        ),
    ),
    "mamba": (
        "MambaConfig",
        "MambaForCausalLM",
        dict(hidden_size=32, state_size=8, num_hidden_layers=2, intermediate_size=64, expand=2, conv_kernel=4),
    ),
    "falcon_mamba": (
        "FalconMambaConfig",
        "FalconMambaForCausalLM",
        dict(hidden_size=32, state_size=8, num_hidden_layers=2, intermediate_size=64, expand=2, conv_kernel=4),
    ),
    # A hybrid whose forward derives no positions of its own from the cache (Bamba), a model that takes no cache at
    # all (OpenAI GPT), lightning attention beside full attention (MiniMax), convolution layers beside attention
    # (LFM2-MoE: transformers marks its cache croppable, so speculative decoding runs on it).
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(
            LLAMA_LIKE,
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=16,
        ),
    ),
    "openai-gpt": ("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", dict(n_positions=64, n_embd=32, n_layer=2, n_head=4)),
    "minimax": (
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            num_local_experts=2,
            num_experts_per_tok=1,
            block_size=16,
            layer_types=["linear_attention", "full_attention"],
        ),
    ),
    "lfm2_moe": (
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            num_dense_layers=1,
            layer_types=["conv", "full_attention"],
            max_position_embeddings=64,
        ),
    ),
}


# Where transformers' cached generate() differs from its own run without a cache and decodekit's equals that run
# (docs/transformers.md): MiniMax's lightning-attention cache and RWKV's state in padded batches and beam search. The
# oracle there is transformers with use_cache=False.
CACHE_WRONG_IN_TRANSFORMERS = {"minimax", "rwkv"}


def oracle_arguments(hf, kwargs: dict) -> dict:
    """transformers generate()'s keywords for the oracle run on `hf`: without a cache where its cached run is wrong."""
    return {**kwargs, "use_cache": False} if hf.config.model_type in CACHE_WRONG_IN_TRANSFORMERS else kwargs


# Seeds whose greedy text varies (seed 0 of these repeats one token).
SEEDS = {"qwen3_moe": 1}


def tiny_transformers_model(architecture: str, seed: int | None = None):
    """A tiny random transformers causal LM of `architecture` (a key of ARCHITECTURES), fp32, eval mode."""
    seed = SEEDS.get(architecture, 0) if seed is None else seed
    config_class, model_class, fields = ARCHITECTURES[architecture]
    config = getattr(transformers, config_class)(**COMMON, **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    # Random init leaves some weights at zero or one and logits near flat; spread them so every part of the model
    # changes the output and greedy text does not repeat one token (Gemma's tied, scaled embeddings would).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model
