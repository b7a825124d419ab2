"""decodekit's generate() against transformers' own on every causal-LM architecture transformers registers
(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), each built tiny and random: greedy on one prompt and on a left-padded batch,
and a set of processors. A new transformers release is checked by the suite: an architecture it adds is built and
compared, or skipped with the reason it cannot be built small here.

`make test` runs a representative slice (SLICE: one architecture of each kind the loops treat differently, plus a
sample of the rest); `make test-architectures` (DECODEKIT_ALL_ARCHITECTURES=1) runs every one. The 40 in
tiny_transformers.ARCHITECTURES are built from their hand-set configs here too, and compared in depth by
test_transformers_backend.py.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tiny_transformers import ARCHITECTURES, COMMON, PAD, oracle_arguments, tiny_transformers_model, transformers

from decodekit.facade.transformers_model import OWN_GENERATION_INPUTS  # noqa: E402  (after the importorskip)
from decodekit.integrations.transformers import wrap  # noqa: E402

# A generic tiny config: each field set where the architecture's config has it (by name or through its attribute_map).
SMALL = dict(
    COMMON,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    head_dim=8,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)
MAX_PARAMETERS = 4_000_000  # counted on the meta device before anything is allocated
# Where a model type's name in the mapping differs from ARCHITECTURES' key (the hand-set configs)
HAND_SET = {"openai-gpt": "openai-gpt"}

# make test's slice: the kinds the loops treat differently (absolute positions, ALiBi, multi-query, sliding windows,
# soft-capping, mixtures of experts, multi-head latent attention, state-space and hybrid layers, no cache at all),
# then every seventh of the rest in name order.
KINDS = {
    "gpt2",
    "bloom",
    "falcon",
    "mistral",
    "gemma2",
    "mixtral",
    "deepseek_v2",
    "mamba",
    "jamba",
    "bamba",
    "openai-gpt",
    "minimax",
    "lfm2_moe",
    "llama",
    "qwen3_moe",
    "olmoe",
    "phimoe",
    "granite",
    "nemotron",
    "ernie4_5",
}
ALL = os.environ.get("DECODEKIT_ALL_ARCHITECTURES", "") not in ("", "0")


def registered() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def chosen() -> list[str]:
    names = registered()
    if ALL:
        return names
    rest = [n for n in names if n not in KINDS]
    return sorted({n for n in names if n in KINDS} | set(rest[::7]))


def build(model_type: str):
    """A tiny random transformers model of `model_type`, or pytest.skip with why it cannot be built small here."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if HAND_SET.get(model_type, model_type) in ARCHITECTURES:
        return tiny_transformers_model(HAND_SET.get(model_type, model_type))
    config_class = CONFIG_MAPPING[model_type]
    try:
        defaults = config_class()
        names = set(defaults.to_dict()) | set(getattr(defaults, "attribute_map", {}))
        config = config_class(**{k: v for k, v in SMALL.items() if k in names})
    except Exception as error:  # noqa: BLE001 - the reason is the skip's
        pytest.skip(
            f"{model_type}: its config needs sizes set by hand ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:160]}); add it to tiny_transformers.ARCHITECTURES"
        )
    if getattr(config, "is_encoder_decoder", False):
        pytest.skip(f"{model_type} is an encoder-decoder model; decodekit runs decoder-only ones")
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            parameters = sum(p.numel() for p in model_class(config).parameters())
        except Exception as error:  # noqa: BLE001
            pytest.skip(
                f"{model_type}: not built from a generic tiny config ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:160]}); add it to tiny_transformers.ARCHITECTURES"
            )
    if parameters > MAX_PARAMETERS:
        pytest.skip(
            f"{model_type}: {parameters:,} parameters from the generic tiny config (a vision or audio tower, "
            "or sizes it does not take by these names); add it to tiny_transformers.ARCHITECTURES"
        )
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


PROMPT = torch.tensor([[5, 6, 7, 8, 9]])
BATCH = torch.tensor([[PAD, PAD, 5, 6, 7], [PAD, 8, 9, 10, 11], [12, 13, 14, 15, 16]])
PROCESSORS = dict(
    repetition_penalty=1.3,
    no_repeat_ngram_size=3,
    bad_words_ids=[[20], [21, 22]],
    suppress_tokens=[30, 31],
    sequence_bias={(40,): 3.0},
)
NEW = 8


def theirs(hf, ids, **kwargs):
    """transformers' own generate(); where it fails on the architecture, None (decodekit then needs only to run)."""
    try:
        with torch.no_grad():
            return hf.generate(
                ids,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=PAD,
                max_new_tokens=NEW,
                **oracle_arguments(hf, kwargs),
            )
    except Exception:  # noqa: BLE001 - transformers' own failure on this architecture
        return None


def ours(model, ids, **kwargs):
    return model.generate(ids, eos_token_id=None, max_new_tokens=NEW, **kwargs)


@pytest.fixture(scope="module", params=chosen())
def pair(request):
    hf = build(request.param)
    return hf, wrap(hf)


def agree(hf, model, ids, **kwargs):
    if hf.config.model_type in OWN_GENERATION_INPUTS:  # refused, saying why and what runs it
        with pytest.raises(
            ValueError, match="cannot run under decodekit's decoding loops: .* Run it with transformers"
        ):
            ours(model, ids, **kwargs)
        return
    reference = theirs(hf, ids, **kwargs)
    if reference is None:  # no oracle: the case is transformers' to fix (a random tiny config it cannot run)
        pytest.skip(f"transformers' own generate() fails on {hf.config.model_type} here")
    assert torch.equal(ours(model, ids, **kwargs), reference)


def test_greedy_equals_transformers(pair):
    agree(*pair, PROMPT)


def test_left_padded_batch_equals_transformers(pair):
    hf, model = pair
    agree(hf, model, BATCH, attention_mask=(BATCH != PAD).long())


def test_processors_equal_transformers(pair):
    agree(*pair, PROMPT, **PROCESSORS)


def test_the_slice_covers_each_kind_and_every_registered_name_is_known():
    names = registered()
    assert KINDS - set(names) == set(), "a kind the slice names is no longer registered"
    assert len(names) > 150  # transformers registers this many causal LMs: the mapping was read
