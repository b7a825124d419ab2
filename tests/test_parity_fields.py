"""Generation config fields transformers 5.23 accepts, each implemented or accepted with transformers' behaviour:
token_healing, prefill_chunk_size, max_cache_len / cache_config, disable_compile, low_memory, is_assistant,
assistant_confidence_threshold and the lookbehinds. transformers on the same model is the oracle where it has one."""

import re

import pytest
import torch

import decodekit
from decodekit import AutoModelForCausalLM

from helpers import write_tiny_model
from tiny_transformers import PAD, tiny_transformers_model, transformers

NEW = 6
GREEDY = dict(max_new_tokens=NEW, eos_token_id=None, pad_token_id=PAD, do_sample=False)


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path_factory.mktemp("native")))


@pytest.fixture(scope="module")
def hf():
    return tiny_transformers_model("llama")


def byte_level_tokenizer():
    """A small byte-level BPE tokenizer (GPT-2's kind): "ab" and "abc" are tokens, so a prompt ending in "ab" heals."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = ["a", "b", "c", "d", "e", "f", "Ġ", "ab", "Ġab", "cd", "Ġcd", "ef", "abc", "Ġabcdef", "de", "<s>", "<pad>"]
    merges = [("a", "b"), ("Ġ", "ab"), ("c", "d"), ("Ġ", "cd"), ("e", "f"), ("ab", "c"), ("d", "e")]
    backend = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", pad_token="<pad>")


@pytest.mark.parametrize("text", ["cdab", "fab", "cab", "dab", "eab", "efab", "ab", "d ab"])
def test_token_healing_equals_transformers(hf, text):
    tokenizer = byte_level_tokenizer()
    ids = tokenizer([text], return_tensors="pt").input_ids
    options = dict(GREEDY, pad_token_id=tokenizer.pad_token_id, token_healing=True, tokenizer=tokenizer)
    theirs = hf.generate(ids, **options)
    assert torch.equal(decodekit.wrap(hf).generate(ids, **options), theirs)


def test_token_healing_rewrites_the_last_token_and_needs_the_tokenizer(hf):
    tokenizer = byte_level_tokenizer()
    ids = tokenizer(["cab"], return_tensors="pt").input_ids  # "c" "ab": "abc" extends the tail
    healed = decodekit.wrap(hf).generate(ids, token_healing=True, tokenizer=tokenizer, **dict(GREEDY, pad_token_id=16))
    assert healed[0, 0] == ids[0, 0] and healed[0, 1] != ids[0, 1] and healed.shape[1] == ids.shape[1] + NEW
    with pytest.raises(ValueError, match="token_healing=True re-tokenizes the prompt: pass the model's tokenizer"):
        decodekit.wrap(hf).generate(ids, token_healing=True, max_new_tokens=2)


def test_token_healing_with_decodekits_own_tokenizer(default_model):
    model, tokenizer = default_model
    ids = tokenizer(["The capital of France is Par"], return_tensors="pt")["input_ids"]
    out = model.generate(ids, token_healing=True, tokenizer=tokenizer, max_new_tokens=4)
    assert torch.equal(out[0, : ids.shape[1] - 1], ids[0, :-1]) and out.shape[1] == ids.shape[1] + 4
    assert tokenizer.decode(out[0, ids.shape[1] - 1 : ids.shape[1]]).startswith(" Par")  # "Par" or a longer word


def test_prefill_in_chunks_gives_the_same_tokens(native, hf):
    batch = torch.tensor([[PAD, PAD, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]])
    mask = (batch != PAD).long()
    for model in (native, decodekit.wrap(hf)):
        whole = model.generate(batch, attention_mask=mask, **GREEDY)
        for chunk in (1, 3, 4):
            assert torch.equal(model.generate(batch, attention_mask=mask, prefill_chunk_size=chunk, **GREEDY), whole)
    theirs = hf.generate(batch, attention_mask=mask, prefill_chunk_size=3, **GREEDY)
    assert torch.equal(decodekit.wrap(hf).generate(batch, attention_mask=mask, prefill_chunk_size=3, **GREEDY), theirs)
    with pytest.raises(ValueError, match="prefill_chunk_size=0 is invalid; expected an integer >= 1"):
        native.generate(batch, prefill_chunk_size=0, **GREEDY)


def test_max_cache_len_and_cache_config_size_a_static_cache(native):
    from decodekit.families.cache import new_cache
    from decodekit.plugins import caches

    prompt = torch.tensor([[5, 6, 7, 8]])
    plain = native.generate(prompt, **GREEDY)
    sizes = []
    original = caches.new_cache

    def spy(model, kind, batch_size, max_length):
        sizes.append(max_length)
        return new_cache(model, kind, batch_size, max_length)

    caches.new_cache = spy
    try:
        assert torch.equal(native.generate(prompt, max_cache_len=64, **GREEDY), plain)
        assert torch.equal(native.generate(prompt, cache_config={"max_cache_len": 48}, **GREEDY), plain)
        native.generate(prompt, **GREEDY)
    finally:
        caches.new_cache = original
    assert sizes == [64, 48, 4 + NEW]
    with pytest.raises(
        ValueError, match=r"max_cache_len=5 is invalid; expected an integer from this call's max_length \(10"
    ):
        native.generate(prompt, max_cache_len=5, **GREEDY)
    with pytest.raises(ValueError, match=r"\['nbits'\] configure cache kinds decodekit does not have"):
        native.generate(prompt, cache_config={"nbits": 4}, **GREEDY)


def test_disable_compile_wins_over_compile(native, monkeypatch):
    prompt = torch.tensor([[5, 6, 7, 8]])
    eager = native.generate(prompt, **GREEDY)

    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile was called")

    monkeypatch.setattr(torch, "compile", refuse)
    assert torch.equal(native.generate(prompt, compile=True, disable_compile=True, **GREEDY), eager)
    with pytest.raises(ValueError, match="disable_compile='yes' is invalid; expected True or False"):
        native.generate(prompt, disable_compile="yes", **GREEDY)


def test_hints_are_accepted_and_change_no_token(native):
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])
    contrastive = native.generate(prompt, penalty_alpha=0.6, top_k=4, **GREEDY)
    assert torch.equal(native.generate(prompt, penalty_alpha=0.6, top_k=4, low_memory=True, **GREEDY), contrastive)
    assert torch.equal(native.generate(prompt, is_assistant=True, **GREEDY), native.generate(prompt, **GREEDY))
    for name, value, accepted in (
        ("low_memory", 3, "expected True, False or None"),
        ("assistant_lookbehind", 0, "expected an integer >= 1"),
        ("target_lookbehind", "x", "expected an integer >= 1"),
        ("assistant_confidence_threshold", 1.5, "expected a number in [0, 1]"),
    ):
        with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} is invalid; {accepted}")):
            native.generate(prompt, **{name: value}, **GREEDY)


def test_assistant_confidence_threshold_cuts_drafts_short_and_keeps_the_tokens(tmp_path, native):
    assistant = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "assistant", seed=3))
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])
    greedy = native.generate(prompt, max_new_tokens=12, eos_token_id=None)
    calls = []
    forward = type(assistant.module).forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    drafted = {}
    for threshold in (0.0, 1.0):
        calls.clear()
        type(assistant.module).forward = counted
        try:
            out = native.generate(
                prompt,
                max_new_tokens=12,
                eos_token_id=None,
                assistant_model=assistant,
                num_assistant_tokens=5,
                assistant_confidence_threshold=threshold,
            )
        finally:
            type(assistant.module).forward = forward
        assert torch.equal(out, greedy)
        drafted[threshold] = len(calls)
    assert drafted[1.0] < drafted[0.0]  # below certainty every draft stops after its first token
