"""Green-list watermarking (decodekit/plugins/watermark.py): the processor equals transformers' on the same
scores, watermarked text is detected and plain text is not, the detector agrees with transformers', bad
settings are clear errors."""

import math

import pytest
import torch

from decodekit import SynthIDTextWatermarkDetector, SynthIDTextWatermarkingConfig, WatermarkDetector, WatermarkingConfig
from decodekit.plugins.watermark import WatermarkLogitsProcessor

transformers = pytest.importorskip("transformers")

SETTINGS = [
    WatermarkingConfig(),
    WatermarkingConfig(seeding_scheme="selfhash", context_width=2, bias=1.5),
    WatermarkingConfig(greenlist_ratio=0.5, hashing_key=42, context_width=3),
]


@pytest.mark.parametrize("config", SETTINGS, ids=["lefthash", "selfhash", "lefthash-wide"])
def test_the_processor_equals_transformers_on_the_same_scores(config):
    vocab = 500
    generator = torch.Generator().manual_seed(0)
    ids, scores = torch.randint(0, vocab, (3, 9), generator=generator), torch.randn(3, vocab, generator=generator)
    theirs = transformers.WatermarkLogitsProcessor(vocab_size=vocab, device="cpu", **config.to_dict())
    ours = WatermarkLogitsProcessor(vocab, "cpu", **config.to_dict())  # transformers' arguments
    expected = theirs(ids, scores.clone())
    assert torch.equal(ours(ids, scores.clone()), expected)
    assert int((expected != scores).sum(dim=1).min()) > 0  # every row got a green list


STORY = "Once upon a time, in a small village,"
SAMPLED = dict(max_new_tokens=120, min_new_tokens=120, do_sample=True, seed=0)  # z > 5 here


@pytest.fixture(scope="module")
def plain_story(default_model):
    """The 120 tokens the default model samples after STORY with SAMPLED and no watermark: what no detector flags."""
    model, tok = default_model
    prompt = tok([STORY], return_tensors="pt")["input_ids"]
    return model.generate(prompt, **SAMPLED)[:, prompt.shape[1] :]


@pytest.mark.parametrize("config", SETTINGS[:2], ids=["lefthash", "selfhash"])
def test_watermarked_text_is_detected_and_plain_text_is_not(default_model, plain_story, config):
    model, tok = default_model
    prompt = tok([STORY], return_tensors="pt")["input_ids"]
    n = prompt.shape[1]
    marked = model.generate(prompt, watermarking_config=config, **SAMPLED)[:, n:]
    plain = plain_story
    detector = WatermarkDetector(model.config, "cpu", config)
    found, clean = detector(marked, return_dict=True), detector(plain, return_dict=True)
    assert found.z_score[0] > 4 and found.prediction.tolist() == [True]
    assert clean.z_score[0] < 2 and clean.prediction.tolist() == [False]
    # Without return_dict, as transformers: the predictions alone, a numpy bool array.
    assert detector(torch.cat((marked, plain))).tolist() == [True, False]
    assert found.num_tokens_scored[0] == 120 - (
        config.context_width if config.seeding_scheme == "lefthash" else config.context_width - 1
    )
    their_config = transformers.LlamaConfig(vocab_size=model.config.vocab_size, bos_token_id=model.config.bos_token_id)
    theirs = transformers.WatermarkDetector(
        model_config=their_config, device="cpu", watermarking_config=config.to_dict()
    )
    reference = theirs(torch.cat((marked, plain)), return_dict=True)
    both = detector(torch.cat((marked, plain)), return_dict=True)
    for field in ("z_score", "p_value", "green_fraction", "confidence"):
        assert [math.isclose(a, b, abs_tol=1e-12) for a, b in zip(getattr(reference, field), getattr(both, field))] == [
            True,
            True,
        ], field
    for field in ("num_green_tokens", "num_tokens_scored", "prediction"):
        assert getattr(reference, field).tolist() == getattr(both, field).tolist(), field
    assert theirs(torch.cat((marked, plain))).tolist() == detector(torch.cat((marked, plain))).tolist()


def test_transformers_config_and_dicts_are_accepted(default_model):
    model, tok = default_model
    prompt = tok(["The weather today"], return_tensors="pt")["input_ids"]
    ours = model.generate(prompt, watermarking_config=WatermarkingConfig(bias=4.0), max_new_tokens=8)
    assert torch.equal(model.generate(prompt, watermarking_config={"bias": 4.0}, max_new_tokens=8), ours)
    assert torch.equal(
        model.generate(prompt, watermarking_config=transformers.WatermarkingConfig(bias=4.0), max_new_tokens=8), ours
    )
    assert not torch.equal(model.generate(prompt, max_new_tokens=8), ours)  # a bias of 4 changes greedy text


@pytest.mark.parametrize(
    "value, message",
    [
        ({"bias": float("nan")}, "bias=nan is invalid; expected a finite number"),
        ({"greenlist_ratio": 1.5}, "greenlist_ratio=1.5 is invalid; expected a number in (0, 1)"),
        (
            {"seeding_scheme": "righthash"},
            "seeding_scheme='righthash' is invalid; expected one of ['lefthash', 'selfhash']",
        ),
        ({"context_width": 0}, "context_width=0 is invalid; expected an integer >= 1"),
        ({"hashing_key": 1.5}, "hashing_key=1.5 is invalid; expected an integer"),
        ({"green": 0.3}, "unknown field 'green'"),
        ("strong", "expected a WatermarkingConfig or a dict of its fields"),
    ],
)
def test_bad_settings_are_clear_errors(default_model, value, message):
    model, _ = default_model
    with pytest.raises(ValueError) as error:
        model.generate(torch.tensor([[1, 2, 3]]), watermarking_config=value, max_new_tokens=2)
    assert message in str(error.value)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        WatermarkDetector(model.config, "cpu", WatermarkingConfig())(torch.tensor([[5]]))


# ---- SynthID Text ----

SYNTHID = dict(keys=[654, 400, 836, 123, 340, 443, 597, 160, 57], ngram_len=4, context_history_size=16)


def test_synthid_scores_and_g_values_equal_transformers():
    from decodekit.plugins.watermark import SynthIDGValues, SynthIDTextWatermarkLogitsProcessor

    config = SynthIDTextWatermarkingConfig(**SYNTHID)
    theirs = transformers.SynthIDTextWatermarkingConfig(**SYNTHID).construct_processor(300, "cpu")
    ours = SynthIDTextWatermarkLogitsProcessor(device="cpu", **config.to_dict())  # transformers' arguments
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (2, 5), generator=generator)
    for step in range(6):  # the state moves along; a repeated context appears by step 5
        scores = torch.randn(2, 300, generator=generator)
        if step == 4:
            ids = torch.cat((ids, ids[:, -3:]), dim=1)  # repeat a context
        expected = theirs(ids, scores.clone())
        assert torch.equal(ours(ids, scores.clone()), expected)
        ids = torch.cat((ids, torch.randint(0, 300, (2, 1), generator=generator)), dim=1)
    assert torch.equal(SynthIDGValues(config).of_sequences(ids), theirs.compute_g_values(ids))
    assert torch.equal(ours.compute_g_values(ids), theirs.compute_g_values(ids))
    assert ours.state.num_calls == theirs.state.num_calls and torch.equal(ours.state.context, theirs.state.context)
    assert torch.equal(ours.state.context_history, theirs.state.context_history)


def test_synthid_text_is_detected_and_plain_text_is_not(default_model, plain_story):
    model, tok = default_model
    prompt = tok([STORY], return_tensors="pt")["input_ids"]
    n = prompt.shape[1]
    config = SynthIDTextWatermarkingConfig(**SYNTHID)
    marked = model.generate(prompt, watermarking_config=config, **SAMPLED)[:, n:]
    plain = plain_story
    detector = SynthIDTextWatermarkDetector(config, eos_token_id=tok.eos_token_id)
    found, clean = detector(marked), detector(plain)
    assert found.mean_g_value[0] > 0.52 and found.z_score[0] > 4 and found.prediction == [True]
    assert abs(clean.z_score[0]) < 3 and clean.prediction == [False]
    # transformers' config is taken as it is: the same first tokens (the seed and EOS ban as above, fewer tokens)
    theirs = transformers.SynthIDTextWatermarkingConfig(**SYNTHID)
    first = model.generate(
        prompt, watermarking_config=theirs, **{**SAMPLED, "max_new_tokens": 16, "min_new_tokens": 16}
    )
    assert torch.equal(first[:, n:], marked[:, :16])


@pytest.mark.parametrize(
    "value, others, message",
    [
        ({"keys": []}, {}, "keys=[] is invalid; expected a non-empty list of integers"),
        ({"keys": [1, 2], "ngram_len": 1}, {}, "ngram_len=1 is invalid; expected an integer >= 2"),
        ({"keys": [1], "sampling_table_size": 2**25}, {}, "sampling_table_size=33554432 is invalid"),
        ({"keys": [1, 2]}, {"num_beams": 2}, "SynthID keeps one state per generated token"),
        ({"keys": [1, 2]}, {"prompt_lookup_num_tokens": 2}, "not prompt_lookup_num_tokens"),
    ],
)
def test_bad_synthid_settings_are_clear_errors(default_model, value, others, message):
    model, _ = default_model
    with pytest.raises(ValueError) as error:
        model.generate(torch.tensor([[1, 2, 3]]), watermarking_config=value, max_new_tokens=2, **others)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: WatermarkingConfig(bias=3.0, seeding_scheme="selfhash", context_width=2),
        lambda: SynthIDTextWatermarkingConfig(**SYNTHID),
    ],
    ids=["green-list", "synthid"],
)
def test_a_wrapped_transformers_model_watermarks_as_transformers_does(make):
    # decodekit's loop on a transformers model and transformers' own generate(), same config, same greedy text.
    import decodekit
    from tiny_transformers import PAD, tiny_transformers_model

    hf = tiny_transformers_model("opt")
    config = make()
    theirs_config = (
        transformers.WatermarkingConfig
        if isinstance(config, WatermarkingConfig)
        else transformers.SynthIDTextWatermarkingConfig
    )(**config.to_dict())
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    ours = decodekit.wrap(hf).generate(prompt, watermarking_config=config, max_new_tokens=12, eos_token_id=None)
    theirs = hf.generate(
        prompt,
        watermarking_config=theirs_config,
        max_new_tokens=12,
        eos_token_id=None,
        do_sample=False,
        pad_token_id=PAD,
    )
    assert torch.equal(ours, theirs)
    plain = hf.generate(prompt, max_new_tokens=12, eos_token_id=None, do_sample=False, pad_token_id=PAD)
    assert not torch.equal(theirs, plain)  # the watermark changed the greedy text
