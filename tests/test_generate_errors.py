"""Bad input gets a ValueError that names the argument, the value and what is accepted."""

import pytest
import torch

from decodekit import AutoModelForCausalLM, GenerationConfig

from helpers import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path_factory.mktemp("m")))


PROMPT = torch.tensor([[5, 6, 7]])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": -1}, r"max_new_tokens=-1 is invalid; expected an integer >= 1"),
        ({"max_new_tokens": 0}, r"max_new_tokens=0"),
        ({"max_length": 0}, r"max_length=0"),
        ({"min_new_tokens": -2}, r"min_new_tokens=-2"),
        ({"top_p": 0.0, "do_sample": True}, r"top_p=0.0 is invalid; expected a number in \(0, 1\]"),
        ({"top_p": 1.5, "do_sample": True}, r"top_p=1.5"),
        ({"top_k": -1}, r"top_k=-1"),
        ({"min_p": 2.0}, r"min_p=2.0"),
        ({"typical_p": 0}, r"typical_p=0"),
        ({"temperature": 0.0, "do_sample": True}, r"temperature=0.0 is invalid; sampling needs temperature > 0"),
        ({"temperature": -1.0}, r"temperature=-1.0"),
        ({"repetition_penalty": 0}, r"repetition_penalty=0"),
        ({"no_repeat_ngram_size": -1}, r"no_repeat_ngram_size=-1"),
        ({"do_sample": "yes"}, r"do_sample='yes'"),
        ({"num_return_sequences": 0}, r"num_return_sequences=0"),
        ({"num_return_sequences": 2}, r"num_return_sequences=2 is invalid; greedy decoding"),
        ({"eos_token_id": -3}, r"eos_token_id=-3"),
        ({"eos_token_id": 5000}, r"eos_token_id contains token id 5000, outside the vocabulary \[0, 96\)"),
        ({"bad_words_ids": [3]}, r"bad_words_ids=\[3\]"),
        ({"suppress_tokens": "a"}, r"suppress_tokens='a'"),
        ({"sequence_bias": {"a": 1}}, r"sequence_bias="),
        ({"stop_strings": ""}, r"stop_strings=''"),
        ({"max_time": 0}, r"max_time=0"),
        (
            {"cache_implementation": "paged"},
            r"cache_implementation='paged' is invalid; expected one of \['static', 'dynamic'\]",
        ),
        ({"output_scores": 1}, r"output_scores=1"),
        ({"max_new_tokenz": 5}, r"unknown arguments \['max_new_tokenz'\] \(did you mean 'max_new_tokens'\?\)"),
        # Found by fuzzing: each was a bare TypeError, an ambiguous tensor, an overflow or NaN scores.
        ({"penalty_alpha": []}, r"penalty_alpha=\[\] is invalid; expected a number in \[0, 1\]"),
        (
            {"low_memory": torch.tensor([1, 0])},
            r"low_memory=tensor\(\[1, 0\]\) is invalid; expected True, False or None",
        ),
        ({"mirostat": torch.tensor([1, 2])}, r"mirostat=tensor\(\[1, 2\]\) is invalid; expected 0 \(off\)"),
        (
            {"max_cache_len": 2**63, "cache_implementation": "static"},
            r"max_cache_len=9223372036854775808 is invalid; "
            r"expected an integer from this call's max_length",
        ),
        ({"assistant_model": True}, r"assistant_model=True is invalid: wrap\(\) takes"),
        ({"mirostat": 2, "mirostat_tau": 1e300, "do_sample": True}, r"mirostat_tau=1e\+300 is invalid"),
        ({"dynatemp_range": 1e300, "do_sample": True}, r"dynatemp_range=1e\+300 is invalid; expected a number \[0, "),
    ],
)
def test_invalid_config_fields(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(PROMPT, **kwargs)


def test_invalid_inputs(model):
    with pytest.raises(ValueError, match=r"input_ids is empty"):
        model.generate(torch.zeros((1, 0), dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"input_ids must be 2-D \[batch, seq\], got shape \(3,\)"):
        model.generate(torch.tensor([5, 6, 7]), max_new_tokens=2)
    with pytest.raises(
        ValueError, match=r"attention_mask must be a tensor of the same shape as input_ids \(1, 3\), got \(1, 2\)"
    ):
        model.generate(PROMPT, attention_mask=torch.ones(1, 2, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"only 0 \(padding\) and 1"):
        model.generate(PROMPT, attention_mask=torch.full((1, 3), 2), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 96\)"):
        model.generate(torch.tensor([[5, 500]]), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"integer torch.Tensor"):
        model.generate(torch.tensor([[0.5, 1.0]]), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"nothing to generate"):
        model.generate(PROMPT, max_length=3)
    with pytest.raises(ValueError, match=r"seed='x'"):
        model.generate(PROMPT, max_new_tokens=2, do_sample=True, seed="x")


def test_invalid_call_leaves_the_models_config_untouched(model):
    before = model.generation_config.to_dict()
    with pytest.raises(ValueError):
        model.generate(PROMPT, top_p=7.0, do_sample=True, max_new_tokens=3)
    model.generate(PROMPT, max_new_tokens=3, temperature=0.5, do_sample=True, seed=0)
    assert model.generation_config.to_dict() == before


def test_generation_config_object_and_kwargs_override(model):
    gc = GenerationConfig(max_new_tokens=4, eos_token_id=None)
    assert model.generate(PROMPT, generation_config=gc).shape == (1, 7)
    assert model.generate(PROMPT, generation_config=gc, max_new_tokens=2).shape == (1, 5)
    assert gc.max_new_tokens == 4


def test_model_loading_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    bad = write_tiny_model(tmp_path / "gpt2like", model_type="llama")
    cfg = (bad / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "gpt_neox"')
    (bad / "config.json").write_text(cfg)
    with pytest.raises(
        ValueError, match=r"model_type 'gpt_neox' has no native .*\['llama', 'mistral', 'qwen2', 'qwen3'\]"
    ):
        AutoModelForCausalLM.from_pretrained(bad, backend="native")
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "nope" / "deeper" / "path")
    with pytest.raises(ValueError, match=r"dtype='float8'"):
        AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "ok"), dtype="float8")


def test_sharded_checkpoint_loads_identically(tmp_path):
    one = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "one", seed=3))
    three = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "three", seed=3, shards=3))
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), three.state_dict().values()))


def test_num_return_sequences_expands_each_prompt(model):
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    out = model.generate(ids, max_new_tokens=4, do_sample=True, num_return_sequences=3, seed=0)
    assert out.shape == (6, 7)
    assert out[:3, :3].tolist() == [[5, 6, 7]] * 3 and out[3:, :3].tolist() == [[8, 9, 10]] * 3


def test_bfloat16_weights_generate(tmp_path):
    path = write_tiny_model(tmp_path / "bf16")
    fp32 = AutoModelForCausalLM.from_pretrained(path)
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        a, b = fp32(ids).logits, bf16(ids).logits.float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75
    assert torch.allclose(a, b, atol=0.15 * a.abs().max().item())
    assert bf16.generate(ids, max_new_tokens=5).shape == (1, 9)


def test_generation_config_json_supplies_defaults(tmp_path):
    path = write_tiny_model(tmp_path / "m")
    (path / "generation_config.json").write_text(
        '{"eos_token_id": [2, 3], "pad_token_id": 0, "max_new_tokens": 5, "do_sample": true, "top_k": 7}'
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    gc = model.generation_config
    assert (gc.eos_token_ids, gc.max_new_tokens, gc.do_sample, gc.top_k, gc.bos_token_id) == ([2, 3], 5, True, 7, 1)
    out = model.generate(PROMPT, seed=0, min_new_tokens=5)
    assert out.shape == (1, 8)  # max_new_tokens=5 came from the file
    assert model.generate(PROMPT, do_sample=False, max_new_tokens=2).shape == (1, 5)


def test_mask_is_inferred_from_left_padding_only(model):
    pad = model.generation_config.pad_token_id
    padded = torch.tensor([[pad, pad, 5, 6, 7], [9, 5, pad, 6, 7]])
    explicit = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = model.generate(padded, max_new_tokens=4, eos_token_id=None)
    assert torch.equal(out, model.generate(padded, attention_mask=explicit, max_new_tokens=4, eos_token_id=None))


def test_sampling_fields_of_a_call_that_does_not_sample_are_said_once(model, caplog, monkeypatch):
    # As transformers warns (and as the command line refuses them): temperature=0.7 without do_sample changed nothing,
    # silently. Said once per field and process; not for the neutral value, nor for contrastive search's top_k.
    from decodekit.core import generate

    monkeypatch.setattr(generate, "_warned_unused", set())
    with caplog.at_level("WARNING", logger="decodekit"):
        model.generate(PROMPT, max_new_tokens=2, temperature=0.7, top_p=1.0)
        model.generate(PROMPT, max_new_tokens=2, temperature=0.5)
        model.generate(PROMPT, max_new_tokens=2, temperature=0.7, do_sample=True, seed=0)
        model.generate(PROMPT, max_new_tokens=2, penalty_alpha=0.5, top_k=4)
    said = [r.getMessage() for r in caplog.records if "only change(s) sampling" in r.getMessage()]
    assert said == [
        "do_sample is False: temperature=0.7 only change(s) sampling and will be ignored; pass "
        "do_sample=True to sample (said once)."
    ]
