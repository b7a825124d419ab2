"""The rest of transformers' processors (epsilon, eta, exponential decay, begin-suppress, inf/nan removal,
renormalisation, prefix constraints): each against transformers' own on the same scores, and in generate()
against transformers' generate() on the same weights."""

import pytest
import torch

from decodekit.core import penalties as N
from decodekit.core import warpers as W

from tiny_transformers import PAD, tiny_transformers_model, transformers

from decodekit.integrations.transformers import wrap  # noqa: E402  (after the importorskip)

LP = transformers.generation.logits_process


def scores_and_ids(seed=0, rows=3, vocab=50, length=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, length), generator=g), torch.randn(rows, vocab, generator=g) * 3


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lambda: W.EpsilonLogitsWarper(0.02), lambda: LP.EpsilonLogitsWarper(0.02)),
        (
            lambda: W.EpsilonLogitsWarper(0.3, min_tokens_to_keep=3),
            lambda: LP.EpsilonLogitsWarper(0.3, min_tokens_to_keep=3),
        ),
        (lambda: W.EtaLogitsWarper(0.05), lambda: LP.EtaLogitsWarper(0.05)),
        (lambda: W.EtaLogitsWarper(0.9, min_tokens_to_keep=2), lambda: LP.EtaLogitsWarper(0.9, min_tokens_to_keep=2)),
        (
            lambda: N.ExponentialDecayLengthPenalty((2, 1.7), [4, 9], 3),
            lambda: LP.ExponentialDecayLengthPenalty((2, 1.7), [4, 9], 3),
        ),
        (
            lambda: N.SuppressTokensAtBeginLogitsProcessor([1, 5], 7),
            lambda: LP.SuppressTokensAtBeginLogitsProcessor([1, 5], 7),
        ),
        (
            lambda: N.SuppressTokensAtBeginLogitsProcessor([1, 5], 6),
            lambda: LP.SuppressTokensAtBeginLogitsProcessor([1, 5], 6),
        ),
        (lambda: W.LogitNormalization(), lambda: LP.LogitNormalization()),
        (
            lambda: N.PrefixConstrainedLogitsProcessor(lambda b, s: [b, int(s[-1]) % 50], 1),
            lambda: LP.PrefixConstrainedLogitsProcessor(lambda b, s: [b, int(s[-1]) % 50], 1),
        ),
    ],
    ids=[
        "epsilon",
        "epsilon-keep-3",
        "eta",
        "eta-keep-2",
        "exp-decay",
        "begin-suppress",
        "begin-suppress-not-yet",
        "renormalize",
        "prefix",
    ],
)
def test_each_processor_equals_transformers(ours, theirs):
    for seed in range(3):
        ids, scores = scores_and_ids(seed)
        scores[0, 4] = -float("inf")  # a removed token on the way in
        torch.testing.assert_close(ours()(ids, scores.clone()), theirs()(ids, scores.clone()))


def test_inf_nan_removal_equals_transformers():
    ids, scores = scores_and_ids()
    scores[0, 1], scores[1, 2], scores[2, 3] = float("nan"), float("inf"), -float("inf")
    assert torch.equal(
        W.InfNanRemoveLogitsProcessor()(ids, scores.clone()), LP.InfNanRemoveLogitsProcessor()(ids, scores)
    )


PROMPT = torch.tensor([[5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def pair():
    hf = tiny_transformers_model("opt")
    return hf, wrap(hf)


@pytest.mark.parametrize(
    "options",
    [
        dict(
            exponential_decay_length_penalty=(2, 3.0),
            eos_token_id=[11, 12],
            renormalize_logits=True,
            output_scores=True,
        ),
        dict(begin_suppress_tokens=[47, 44], remove_invalid_values=True, output_scores=True),
        dict(prefix_allowed_tokens_fn=lambda b, s: [3 + b, 10 + int(s[-1]) % 7, 20]),
        dict(
            prefix_allowed_tokens_fn=lambda b, s: [3 + b, 10 + int(s[-1]) % 7, 20], num_beams=3, num_return_sequences=2
        ),
    ],
    ids=["decay-renormalize", "begin-suppress-inf-nan", "prefix-greedy", "prefix-beams"],
)
def test_generate_equals_transformers(pair, options):
    hf, model = pair
    batch = torch.tensor([[PAD, 5, 6, 7], [8, 9, 10, 11]])
    mask = (batch != PAD).long()
    options = dict(max_new_tokens=8, return_dict_in_generate=True, **options)
    options.setdefault("eos_token_id", None)
    theirs = hf.generate(batch, attention_mask=mask, do_sample=False, pad_token_id=PAD, **options)
    mine = model.generate(batch, attention_mask=mask, **options)
    assert torch.equal(mine.sequences, theirs.sequences)
    if options.get("output_scores"):
        torch.testing.assert_close(torch.stack(mine.scores), torch.stack(theirs.scores))


def test_prefix_constraint_holds_for_sampling_and_beam_sampling(pair):
    _, model = pair
    allowed = {3, 17, 29}
    for options in (dict(do_sample=True), dict(do_sample=True, num_beams=2)):
        out = model.generate(
            PROMPT,
            max_new_tokens=10,
            eos_token_id=None,
            seed=1,
            top_k=0,
            prefix_allowed_tokens_fn=lambda b, s: sorted(allowed),
            **options,
        )
        assert set(out[0, PROMPT.shape[1] :].tolist()) <= allowed


def test_epsilon_and_eta_sampling_draw_only_kept_tokens(pair):
    _, model = pair
    out = model.generate(
        PROMPT,
        max_new_tokens=10,
        do_sample=True,
        top_k=0,
        epsilon_cutoff=0.05,
        seed=0,
        return_dict_in_generate=True,
        output_scores=True,
        eos_token_id=None,
    )
    for step, token in zip(out.scores, out.sequences[0, PROMPT.shape[1] :]):
        assert torch.isfinite(step[0, token])


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("epsilon_cutoff", 1.5, "epsilon_cutoff=1.5 is invalid; expected a number in (0, 1)"),
        ("eta_cutoff", float("nan"), "eta_cutoff=nan is invalid"),
        ("exponential_decay_length_penalty", (2, -1.0), "expected (start: int >= 0, decay factor: number > 0)"),
        ("begin_suppress_tokens", [-1], "begin_suppress_tokens=[-1] is invalid"),
        ("begin_suppress_tokens", [10_000], "begin_suppress_tokens contains token id 10000, outside the vocabulary"),
        ("renormalize_logits", "yes", "renormalize_logits='yes' is invalid; expected True or False"),
        ("encoder_repetition_penalty", 1.3, "decodekit runs decoder-only models; use repetition_penalty"),
        ("prefix_allowed_tokens_fn", [1, 2], "expected a function (batch_id, input_ids)"),
    ],
)
def test_bad_values_are_clear_errors(pair, field, value, message):
    _, model = pair
    with pytest.raises(ValueError) as error:
        model.generate(PROMPT, max_new_tokens=2, **{field: value})
    assert message in str(error.value)


def test_an_empty_allowed_list_is_a_clear_error(pair):
    _, model = pair
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn returned no allowed token for prompt 0"):
        model.generate(PROMPT, max_new_tokens=2, prefix_allowed_tokens_fn=lambda b, s: [])


def test_generation_config_round_trips_with_transformers(tmp_path, pair, hub):
    from decodekit import GenerationConfig

    ours = GenerationConfig(
        max_new_tokens=7,
        do_sample=True,
        top_p=0.8,
        eos_token_id=[2, 3],
        num_beams=2,
        epsilon_cutoff=0.01,
        my_plugin_field={"a": 1},
    )
    ours.save_pretrained(tmp_path / "ours")
    theirs = transformers.GenerationConfig.from_pretrained(tmp_path / "ours")
    assert (theirs.max_new_tokens, theirs.top_p, theirs.eos_token_id, theirs.num_beams) == (7, 0.8, [2, 3], 2)
    assert theirs.epsilon_cutoff == 0.01 and theirs.my_plugin_field == {"a": 1}
    theirs.save_pretrained(tmp_path / "theirs")
    back = GenerationConfig.from_pretrained(tmp_path / "theirs")
    assert (back.max_new_tokens, back.do_sample, back.top_p, back.eos_token_ids, back.my_plugin_field) == (
        7,
        True,
        0.8,
        [2, 3],
        {"a": 1},
    )
    hub.repos.push_dir("acme/config", tmp_path / "ours")
    assert GenerationConfig.from_pretrained("acme/config").max_new_tokens == 7
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn holds a function"):
        GenerationConfig(prefix_allowed_tokens_fn=lambda b, s: [1]).save_pretrained(tmp_path / "bad")
    assert not (tmp_path / "bad" / "generation_config.json").exists()


def test_no_prompt_starts_from_bos(pair):
    hf, model = pair
    out = model.generate(max_new_tokens=4, eos_token_id=None)
    assert out[0, 0] == model.generation_config.bos_token_id and out.shape == (1, 5)
    assert torch.equal(out, hf.generate(max_new_tokens=4, eos_token_id=None, do_sample=False, pad_token_id=PAD))


@pytest.mark.parametrize(
    "lengths, config, total",
    [
        ({}, {}, 25),
        ({"max_length": 9}, {}, 9),
        ({"max_new_tokens": 3}, {}, 8),
        ({"max_length": 9, "max_new_tokens": 3}, {}, 8),
        ({"max_length": 9}, {"max_new_tokens": 6}, 11),
        ({}, {"max_length": 7}, 7),
    ],
    ids=["defaults", "max-length", "max-new-tokens", "both", "config-max-new-tokens", "config-max-length"],
)
def test_length_precedence_equals_transformers(pair, lengths, config, total):
    # Neither set: 20 new tokens; max_new_tokens wins wherever it is set (the call or the model's config), with a
    # warning when max_length was passed too; max_length otherwise.
    hf, model = pair
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    saved = (
        hf.generation_config.max_new_tokens,
        hf.generation_config.max_length,
        model.generation_config.max_new_tokens,
        model.generation_config.max_length,
    )
    try:
        for gc in (hf.generation_config, model.generation_config):
            for name, value in config.items():
                setattr(gc, name, value)
        theirs = hf.generate(prompt, eos_token_id=None, do_sample=False, pad_token_id=PAD, **lengths)
        assert torch.equal(model.generate(prompt, eos_token_id=None, **lengths), theirs)
    finally:
        (
            hf.generation_config.max_new_tokens,
            hf.generation_config.max_length,
            model.generation_config.max_new_tokens,
            model.generation_config.max_length,
        ) = saved
    assert theirs.shape[1] == total  # the prompt has 5 tokens


def test_hidden_states_and_attentions_in_dict_outputs_equal_transformers():
    hf = tiny_transformers_model("gpt2")
    hf.config._attn_implementation = "eager"  # attention weights need the eager kernel, in transformers too
    model = wrap(hf)
    batch = torch.tensor([[PAD, 5, 6, 7], [8, 9, 10, 11]])
    options = dict(
        attention_mask=(batch != PAD).long(),
        max_new_tokens=4,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_hidden_states=True,
        output_attentions=True,
    )
    theirs = hf.generate(batch, do_sample=False, pad_token_id=PAD, **options)
    mine = model.generate(batch, **options)
    assert torch.equal(mine.sequences, theirs.sequences) and len(mine.hidden_states) == len(theirs.hidden_states) == 4
    for ours_step, their_step in zip(mine.hidden_states, theirs.hidden_states):
        for a, b in zip(ours_step, their_step):
            torch.testing.assert_close(a, b)
    for ours_step, their_step in zip(mine.attentions, theirs.attentions):
        for a, b in zip(ours_step, their_step):
            torch.testing.assert_close(a, b)


def test_hidden_states_from_native_models_and_what_is_refused(tmp_path):
    from decodekit.testing import tiny_model

    native = tiny_model(tmp_path)
    out = native.generate(PROMPT, max_new_tokens=3, return_dict_in_generate=True, output_hidden_states=True)
    layers = native.config.num_hidden_layers + 1
    assert [len(step) for step in out.hidden_states] == [layers] * 3
    assert out.hidden_states[0][0].shape[1] == PROMPT.shape[1] and out.hidden_states[1][0].shape[1] == 1
    with pytest.raises(ValueError, match="decodekit's native models do not"):
        native.generate(PROMPT, max_new_tokens=2, output_attentions=True)
    with pytest.raises(ValueError, match="output_hidden_states=True is supported by greedy decoding and sampling"):
        native.generate(PROMPT, max_new_tokens=2, output_hidden_states=True, num_beams=2)
