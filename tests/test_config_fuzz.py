"""Property: whatever values generate() is given, the outcome is a result or a ValueError/TypeError whose
message names a field it was given; never another exception, never a hang (hypothesis drives it)."""

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodekit.testing import tiny_model

AWKWARD = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    3,
    7,
    95,
    96,
    10**9,
    10**12,
    10**30,
    -(10**9),
    2**31,
    2**63,
    2**64,
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    -0.5,
    1e-30,
    1e30,
    1e300,
    -1e300,
    math.nan,
    math.inf,
    -math.inf,
    "3",
    "",
    "greedy",
    [],
    [1],
    [[1]],
    [[10**9]],
    [1, 2],
    {},
    {(8,): 1.0},
    {(8,): math.nan},
    {(10**9,): 1.0},
    (5,),
    object(),
    torch.tensor([1, 2]),
    torch.tensor([1.5, 2.0]),
    torch.tensor(3),
    torch.tensor([[1.5, 2.0]]),
]

FIELDS = [
    "max_new_tokens",
    "max_length",
    "min_length",
    "min_new_tokens",
    "max_time",
    "do_sample",
    "num_return_sequences",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "suppress_tokens",
    "sequence_bias",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "eos_token_id",
    "pad_token_id",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "length_penalty",
    "early_stopping",
    "penalty_alpha",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "guidance_scale",
    "dola_layers",
    "stop_strings",
    "seed",
    "use_cache",
    "cache_implementation",
    "output_scores",
    "return_dict_in_generate",
    "compile",
    "num_assistant_tokens",
    "encoder_repetition_penalty",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    # plugins' fields (llama.cpp's samplers, caches, speculative decoding), which the outside fuzzer reached
    "low_memory",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "max_cache_len",
    "assistant_model",
    "dynatemp_range",
    "dynatemp_exponent",
    "smoothing_factor",
    "smoothing_curve",
    "top_n_sigma",
    "xtc_probability",
    "xtc_threshold",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "samplers",
    "epsilon_cutoff",
    "eta_cutoff",
    "assistant_ensemble_weight",
    "watermarking_config",
    "token_healing",
    "prefill_chunk_size",
]
# generate()'s own arguments that take objects; the same awkward values, and callables that return them.
ARGUMENTS = ["streamer", "logits_processor", "stopping_criteria", "past_key_values", "prefix_allowed_tokens_fn"]

# Strategy combinations the values are laid over: each turns on one loop.
BASES = [
    {},
    {"do_sample": True, "seed": 1},
    {"num_beams": 2},
    {"prompt_lookup_num_tokens": 2},
    {"penalty_alpha": 0.5, "top_k": 3},
    {"dola_layers": "high"},
    {"guidance_scale": 1.5},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("fuzz"), "llama")


class Hang(Exception):
    pass


# A bound on work, not on time (a loaded machine stretches time): the tiny model's context is 512 positions and no
# strategy here runs more than two forwards a position, so a call past this many forwards never ends.
FORWARDS = 4 * 512


@pytest.fixture
def counted(model):
    """The model, its forwards counted: the one past FORWARDS raises Hang."""
    calls = []

    def count(module, args):
        calls.append(1)
        if len(calls) > FORWARDS:
            raise Hang()

    handle = model.module.embed.register_forward_pre_hook(count)
    yield model, calls
    handle.remove()


def returning(value):
    def fn(*args):
        return value

    fn.__name__ = f"returns_{type(value).__name__}"
    return fn


CALLABLE_VALUES = [returning(v) for v in (None, 3, [], [1], "x", torch.tensor([1]))]


@settings(
    max_examples=int(os.environ.get("DECODEKIT_FUZZ_EXAMPLES", 300)),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
@given(
    base=st.sampled_from(BASES),
    values=st.dictionaries(
        st.sampled_from(FIELDS + ARGUMENTS), st.sampled_from(AWKWARD + CALLABLE_VALUES), min_size=1, max_size=3
    ),
)
def test_every_outcome_is_a_result_or_an_error_naming_a_field(counted, base, values):
    model, calls = counted
    kwargs = {"max_new_tokens": 4, **base, **values}
    if kwargs.get("compile") is True:
        kwargs["compile"] = False  # compiling is covered elsewhere; here it would only slow the search
    prompt = torch.tensor([[5, 9, 14]])
    calls.clear()
    try:
        model.generate(prompt, **kwargs)
    except (ValueError, TypeError) as error:
        message = str(error)
        named = [name for name in kwargs if name in message] + (["seed"] if "seed" in message else [])
        assert named, f"{type(error).__name__} names none of {sorted(kwargs)}: {message}"
        # A config field's bad value is a ValueError; TypeError is for an object argument of the wrong kind.
        assert isinstance(error, ValueError) or any(name in ARGUMENTS for name in named), message
    except Hang:
        pytest.fail(f"generate() ran over {FORWARDS} forwards with {kwargs}")


# The outcomes the issue reproduced (an IndexError deep inside, an allocator's error, a silent nan), each now a
# ValueError naming the field.
@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"forced_eos_token_id": 10**9}, "forced_eos_token_id"),
        ({"sequence_bias": {(10**9,): 1.0}}, "sequence_bias"),
        ({"num_beams": 10**9}, "num_beams"),
        ({"num_return_sequences": 10**9, "do_sample": True}, "num_return_sequences"),
        ({"max_new_tokens": 10**12}, "max_new_tokens"),
        ({"seed": 10**30}, "seed"),
        ({"prompt_lookup_num_tokens": 2, "num_beams": "3"}, "num_beams"),
        ({"guidance_scale": math.nan}, "guidance_scale"),
        ({"sequence_bias": {(8,): math.nan}}, "sequence_bias"),
        ({"num_beams": 2, "length_penalty": math.nan}, "length_penalty"),
        ({"num_beams": 2, "num_beam_groups": 2, "diversity_penalty": math.nan}, "diversity_penalty"),
        ({"max_time": math.nan}, "max_time"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"temperature": math.inf, "do_sample": True}, "temperature"),
        # The second hardening pass's classes.
        ({"num_beams": 2, "early_stopping": torch.tensor([1, 2])}, "early_stopping"),
        ({"encoder_repetition_penalty": torch.tensor([1.0, 2.0])}, "encoder_repetition_penalty"),
        ({"sequence_bias": torch.tensor([1, 2])}, "sequence_bias"),
        (
            {"guidance_scale": 1.5, "negative_prompt_ids": torch.tensor([[1, 2]]), "negative_prompt_attention_mask": 0},
            "negative_prompt_attention_mask",
        ),
        ({"guidance_scale": 1.5, "negative_prompt_ids": torch.tensor([[1.5, 2.0]])}, "negative_prompt_ids"),
        ({"penalty_alpha": 0.5, "top_k": 2**31}, "top_k"),
        ({"num_beams": 2, "length_penalty": 2**64}, "length_penalty"),
    ],
)
def test_reproduced_bad_values_are_errors_naming_the_field(model, kwargs, field):
    with pytest.raises(ValueError, match=field):
        model.generate(torch.tensor([[5, 9, 14]]), max_new_tokens=kwargs.pop("max_new_tokens", 4), **kwargs)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"prefix_allowed_tokens_fn": lambda batch, ids: None}, "prefix_allowed_tokens_fn"),
        ({"streamer": True}, "streamer"),
        ({"past_key_values": True}, "past_key_values"),
        ({"logits_processor": True}, "logits_processor"),
        ({"logits_processor": torch.tensor([1])}, "logits_processor"),
        ({"stopping_criteria": True}, "stopping_criteria"),
    ],
)
def test_objects_of_the_wrong_kind_are_type_errors_naming_the_argument(model, kwargs, argument):
    with pytest.raises(TypeError, match=argument):
        model.generate(torch.tensor([[5, 9, 14]]), max_new_tokens=4, **kwargs)


def test_top_k_past_any_vocabulary_samples_as_top_k_off(model):
    prompt = torch.tensor([[5, 9, 14]])
    huge = model.generate(prompt, max_new_tokens=4, do_sample=True, seed=3, top_k=2**63)
    assert torch.equal(huge, model.generate(prompt, max_new_tokens=4, do_sample=True, seed=3, top_k=0))


def test_an_absurd_model_path_and_request_size_are_named(model):
    from decodekit import AutoModelForCausalLM

    with pytest.raises(ValueError, match="pretrained_model_name_or_path is 100000 characters long"):
        AutoModelForCausalLM.from_pretrained("x" * 100_000)
    manager = model.init_continuous_batching(max_cache_bytes=2**20)
    with pytest.raises(ValueError, match="past the model's context"):  # before: an allocation of 274 GB attempted
        manager.add_request([1, 2, 3], max_new_tokens=2**31)


def test_input_warnings_for_right_padding_without_a_mask_and_prompts_past_the_context(model, caplog):
    right_padded = torch.tensor([[5, 9, 14], [7, 8, 0]])
    with caplog.at_level("WARNING", logger="decodekit"):
        model.generate(right_padded, max_new_tokens=2, pad_token_id=0)
        model.generate(torch.randint(3, 90, (1, 520)), max_new_tokens=2)
    assert "ends with the pad token 0 and no attention_mask was given" in caplog.text
    assert "The prompt has 520 tokens, more than the model's context of 512" in caplog.text
