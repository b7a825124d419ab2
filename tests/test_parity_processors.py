"""decodekit's processors against transformers' same-named classes on the same scores: equal outputs, and the scores
handed in left as they were (transformers' processors never write to their input)."""

import pytest
import torch

import decodekit
from decodekit.core import penalties as N

from tiny_transformers import tiny_transformers_model, transformers

INPUT_IDS = torch.tensor([[7, 3, 5, 6, 3], [9, 9, 4, 5, 6]])


def scores():
    return torch.randn(2, 12, generator=torch.Generator().manual_seed(0))


CASES = {
    "no bad words": (
        lambda: N.NoBadWordsLogitsProcessor([[3], [5, 6, 2], [11]], eos_token_id=11),
        lambda: transformers.NoBadWordsLogitsProcessor([[3], [5, 6, 2], [11]], eos_token_id=11),
    ),
    "no repeat ngram": (
        lambda: N.NoRepeatNGramLogitsProcessor(2),
        lambda: transformers.NoRepeatNGramLogitsProcessor(2),
    ),
    "exponential decay": (
        lambda: N.ExponentialDecayLengthPenalty((1, 1.5), eos_token_id=2, input_ids_seq_length=3),
        lambda: transformers.ExponentialDecayLengthPenalty((1, 1.5), eos_token_id=2, input_ids_seq_length=3),
    ),
    "min length": (
        lambda: N.MinLengthLogitsProcessor(8, eos_token_id=[2, 4]),
        lambda: transformers.MinLengthLogitsProcessor(8, eos_token_id=[2, 4]),
    ),
    "forced bos": (lambda: N.ForcedBOSTokenLogitsProcessor(6), lambda: transformers.ForcedBOSTokenLogitsProcessor(6)),
}

# Every class both libraries have, built with transformers' own constructor arguments, passed by name as
# transformers' docs and tests do: {case: (class name, keyword arguments)}. A dict so each case names itself.
ENCODER_IDS = torch.tensor([[7, 3, 5, 2, 9], [4, 4, 5, 6, 1]])
BY_NAME = {
    "top-k filter_value": ("TopKLogitsWarper", dict(top_k=3, filter_value=-10.0, min_tokens_to_keep=2)),
    "top-k keep": ("TopKLogitsWarper", dict(top_k=1, min_tokens_to_keep=4)),
    "top-p filter_value": ("TopPLogitsWarper", dict(top_p=0.7, filter_value=-5.0, min_tokens_to_keep=2)),
    "top-p zero": ("TopPLogitsWarper", dict(top_p=0.0, min_tokens_to_keep=3)),
    "min-p": ("MinPLogitsWarper", dict(min_p=0.2, filter_value=-7.0, min_tokens_to_keep=2)),
    "typical mass": ("TypicalLogitsWarper", dict(mass=0.6, filter_value=-3.0, min_tokens_to_keep=2)),
    "epsilon": ("EpsilonLogitsWarper", dict(epsilon=0.08, filter_value=-2.0, min_tokens_to_keep=2)),
    "eta": ("EtaLogitsWarper", dict(epsilon=0.1, filter_value=-2.0, min_tokens_to_keep=1, device="cpu")),
    "top-h": ("TopHLogitsWarper", dict(top_h=0.5, filter_value=-4.0)),
    "top-h all": ("TopHLogitsWarper", dict(top_h=1.0)),
    "temperature": ("TemperatureLogitsWarper", dict(temperature=0.7)),
    "repetition": ("RepetitionPenaltyLogitsProcessor", dict(penalty=1.5)),
    "repetition ignore int": ("RepetitionPenaltyLogitsProcessor", dict(penalty=1.5, prompt_ignore_length=2)),
    "repetition ignore rows": (
        "RepetitionPenaltyLogitsProcessor",
        dict(penalty=0.5, prompt_ignore_length=torch.tensor([0, 3])),
    ),
    "encoder repetition": ("EncoderRepetitionPenaltyLogitsProcessor", dict(penalty=2.0, encoder_input_ids=ENCODER_IDS)),
    "encoder no repeat": (
        "EncoderNoRepeatNGramLogitsProcessor",
        dict(encoder_ngram_size=2, encoder_input_ids=ENCODER_IDS),
    ),
    "min length": ("MinLengthLogitsProcessor", dict(min_length=4, eos_token_id=2, device="cpu")),
    "min new tokens": (
        "MinNewTokensLengthLogitsProcessor",
        dict(prompt_length_to_skip=1, min_new_tokens=3, eos_token_id=[2, 4], device="cpu"),
    ),
    "forced eos": ("ForcedEOSTokenLogitsProcessor", dict(max_length=6, eos_token_id=[2, 3], device="cpu")),
    "suppress": ("SuppressTokensLogitsProcessor", dict(suppress_tokens=[1, 3], device="cpu")),
    "suppress at begin": (
        "SuppressTokensAtBeginLogitsProcessor",
        dict(begin_suppress_tokens=[1, 5], begin_index=5, device="cpu"),
    ),
    "decay": (
        "ExponentialDecayLengthPenalty",
        dict(exponential_decay_length_penalty=(1, 1.3), eos_token_id=[2, 4], input_ids_seq_length=2),
    ),
    "prefix": (
        "PrefixConstrainedLogitsProcessor",
        dict(prefix_allowed_tokens_fn=lambda batch, ids: [batch, 4, 7], num_beams=1),
    ),
    "sequence bias": ("SequenceBiasLogitsProcessor", dict(sequence_bias=[[[3], 2.0], [[5, 6], -4.0]])),
    "no bad words": ("NoBadWordsLogitsProcessor", dict(bad_words_ids=[[3], [6, 4]], eos_token_id=[11])),
    "no repeat": ("NoRepeatNGramLogitsProcessor", dict(ngram_size=2)),
    "forced bos": ("ForcedBOSTokenLogitsProcessor", dict(bos_token_id=6)),
    "inf nan": ("InfNanRemoveLogitsProcessor", dict()),
    "log softmax": ("LogitNormalization", dict()),
    "watermark": (
        "WatermarkLogitsProcessor",
        dict(
            vocab_size=12,
            device="cpu",
            greenlist_ratio=0.5,
            bias=3.0,
            hashing_key=7,
            seeding_scheme="lefthash",
            context_width=1,
        ),
    ),
}


def ours_named(name):
    import decodekit.core.penalties as penalties
    import decodekit.core.warpers as warpers
    import decodekit.plugins.guidance as guidance
    import decodekit.plugins.watermark as watermark

    for module in (warpers, penalties, guidance, watermark):
        if hasattr(module, name):
            return getattr(module, name)
    raise AssertionError(f"decodekit has no class {name}")


@pytest.mark.parametrize("case", BY_NAME)
@pytest.mark.parametrize("length", [1, 5])
def test_transformers_constructor_arguments_give_transformers_scores(case, length):
    name, kwargs = BY_NAME[case]
    ours, theirs = ours_named(name)(**kwargs), getattr(transformers, name)(**kwargs)
    ids = INPUT_IDS[:, :length]
    given = scores()
    if case == "inf nan":
        given[0, 2], given[1, 5] = float("nan"), float("inf")
    expected = theirs(ids, given.clone())
    got = ours(ids, given.clone() if case == "inf nan" else given)
    if case != "inf nan":
        assert torch.equal(given, scores()), f"{case} wrote to the scores it was given"
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_batched_guidance_takes_the_doubled_batch_as_transformers():
    ours, theirs = (
        ours_named("ClassifierFreeGuidanceLogitsProcessor")(1.5),
        transformers.ClassifierFreeGuidanceLogitsProcessor(1.5),
    )
    doubled = torch.randn(4, 12, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(INPUT_IDS, doubled), theirs(INPUT_IDS, doubled))
    with pytest.raises(ValueError, match="twice"):
        ours(INPUT_IDS, doubled[:3])
    with pytest.raises(ValueError, match="guidance_scale=1"):
        ours_named("ClassifierFreeGuidanceLogitsProcessor")(1)


def test_unbatched_guidance_equals_transformers_step_by_step():
    hf = tiny_transformers_model("gpt2")
    model = decodekit.wrap(hf)
    negative = torch.tensor([[1, 40, 41]])
    ours = ours_named("UnbatchedClassifierFreeGuidanceLogitsProcessor")(
        2.0, model, unconditional_ids=negative, unconditional_attention_mask=torch.ones_like(negative)
    )
    theirs = transformers.UnbatchedClassifierFreeGuidanceLogitsProcessor(
        2.0, hf, unconditional_ids=negative, unconditional_attention_mask=torch.ones_like(negative)
    )
    ids = torch.tensor([[1, 17, 23]])
    for token in (5, 9, 30):
        raw = hf(ids).logits[:, -1]
        torch.testing.assert_close(ours(ids, raw.clone()), theirs(ids, raw.clone()), rtol=1e-5, atol=1e-5)
        ids = torch.cat((ids, torch.tensor([[token]])), dim=1)


def test_unbatched_guidance_on_a_model_whose_forward_takes_no_positions_as_transformers_own_test_writes_it():
    # transformers' test_classifier_free_guidance hands the processor a function of (input_ids, attention_mask,
    # use_cache, past_key_values): decodekit's passed position_ids to it and failed, the one of transformers' 44
    # processor tests that did not pass.
    class Out(dict):  # what a model output is to both: attributes and get()
        __getattr__ = dict.get

    vocab = 6
    calls = []

    def dummy_model(input_ids, attention_mask, use_cache=True, past_key_values=None, cache=None):  # either name
        calls.append((input_ids.tolist(), attention_mask.tolist(), cache if cache is not None else past_key_values))
        logits = torch.ones(input_ids.shape[0], input_ids.shape[1], vocab) * torch.arange(vocab)
        return Out(logits=logits, past_key_values=f"cache {len(calls)}", cache=f"cache {len(calls)}")

    for make in (
        ours_named("UnbatchedClassifierFreeGuidanceLogitsProcessor"),
        transformers.UnbatchedClassifierFreeGuidanceLogitsProcessor,
    ):
        calls.clear()
        processor = make(1.5, dummy_model)
        ids = torch.tensor([[0, 1, 2]])
        scores = torch.ones(1, vocab)
        first = processor(ids, scores.clone())
        second = processor(torch.cat((ids, torch.tensor([[3]])), dim=1), scores.clone())
        assert calls == [([[2]], [[1]], None), ([[3]], [[1, 1]], "cache 1")], make
        expected = 1.5 * (torch.log_softmax(scores, -1) - torch.log_softmax(torch.arange(vocab.__float__()), -1))
        expected += torch.log_softmax(torch.arange(vocab.__float__()), -1)
        torch.testing.assert_close(first, expected[None] if expected.dim() == 1 else expected)
        torch.testing.assert_close(second, first)


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_unbatched_guidance_on_a_plain_transformers_model_inside_transformers_generate(architecture):
    # transformers' own test builds the processor on its model itself (no decodekit.wrap). It used to be handed
    # decodekit's DynamicCache, which transformers' forward cannot read (get_query_offset): now the processor keeps
    # whatever cache the model's forward returns, as transformers' processor does.
    hf = tiny_transformers_model(architecture)
    ids = torch.tensor([[1, 17, 23, 5]])
    runs = {}
    for name, make in (
        ("ours", ours_named("UnbatchedClassifierFreeGuidanceLogitsProcessor")),
        ("theirs", transformers.UnbatchedClassifierFreeGuidanceLogitsProcessor),
    ):
        processor = make(1.5, hf)
        runs[name] = hf.generate(
            ids,
            logits_processor=transformers.LogitsProcessorList([processor]),
            do_sample=False,
            max_new_tokens=8,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert torch.equal(runs["ours"], runs["theirs"])


def test_stopping_criteria_take_transformers_arguments():
    import time

    from decodekit.core import stopping as S
    from transformers.generation import stopping_criteria as T

    ids = INPUT_IDS[:, :4]
    pairs = [
        (
            S.MaxLengthCriteria(max_length=4, max_position_embeddings=3),
            T.MaxLengthCriteria(max_length=4, max_position_embeddings=3),
        ),
        (
            S.MaxTimeCriteria(max_time=0.5, initial_timestamp=time.time() - 1),
            T.MaxTimeCriteria(max_time=0.5, initial_timestamp=time.time() - 1),
        ),
        (
            S.MaxTimeCriteria(max_time=3600, initial_timestamp=time.time()),
            T.MaxTimeCriteria(max_time=3600, initial_timestamp=time.time()),
        ),
    ]
    for ours, theirs in pairs:
        assert ours(ids, None).tolist() == theirs(ids, None).tolist()
    step = torch.zeros(1, 12)
    step[0, 3] = 5.0  # token 3 is near certain, token 4 is not
    for token in (3, 4):
        last = torch.tensor([[1, token]])
        assert bool(S.ConfidenceCriteria(0.4)(last, (step,)).all()) == bool(T.ConfidenceCriteria(0.4)(last, (step,)))
    listed = S.StoppingCriteriaList([S.MaxTimeCriteria(5)])
    checked = S.validate_stopping_criteria(listed, 9)
    assert checked.max_length == 9 and listed.max_length is None  # a copy, with the length added
    with pytest.warns(UserWarning, match="max_length=9"):
        S.validate_stopping_criteria(checked, 7)


def test_stop_string_tables_equal_transformers():
    import random

    from decodekit.core.stopping import StopStringCriteria as Ours
    from transformers.generation.stopping_criteria import StopStringCriteria as Theirs

    rng = random.Random(0)
    for _ in range(200):
        tokens = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 5))) for _ in range(25)]
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 6))) for _ in range(3)]
        indices = list(range(len(tokens)))
        assert Ours._stop_string_get_matching_positions(
            tokens, indices, stops
        ) == Theirs._stop_string_get_matching_positions(tokens, indices, stops), (tokens, stops)


def test_stop_string_embedding_table_and_byte_helpers_equal_transformers():
    import random

    from tokenizers import Tokenizer, decoders, models

    from decodekit.core.stopping import StopStringCriteria as Ours
    from transformers.generation.stopping_criteria import StopStringCriteria as Theirs

    rng = random.Random(1)
    for _ in range(50):
        tokens = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 5))) for _ in range(25)]
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 6))) for _ in range(3)]
        indices = rng.sample(range(40), len(tokens))
        mine, theirs = (cls._stop_string_create_embedding_vec(tokens, indices, stops) for cls in (Ours, Theirs))
        assert torch.equal(mine[0], theirs[0]) and mine[1:] == theirs[1:], (tokens, stops)
    with pytest.raises(ValueError, match="no token of the vocabulary can end"):
        Ours._stop_string_create_embedding_vec(["a", "b"], [0, 1], ["z"])
    decoder = Theirs._byte_level_decoder()
    for token in ["Ġab", "âĢĻ", "plain", "<0x0A>", "<0xZZ>", "é"]:
        for mode in ("byte_level", "byte_fallback", None):
            assert Ours._token_to_bytes(token, mode, decoder) == Theirs._token_to_bytes(token, mode, decoder)
    from decodekit.core.stopping import byte_level_decoder

    assert byte_level_decoder() == decoder
    for decoder_of in (
        decoders.ByteLevel(),
        decoders.ByteFallback(),
        decoders.Sequence([decoders.Replace("_", " "), decoders.ByteFallback()]),
        decoders.WordPiece(),
    ):
        backend = Tokenizer(models.BPE({"a": 0, "b": 1}, []))
        backend.decoder = decoder_of
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
        assert Ours._get_stop_string_matching_mode(tokenizer) == Theirs._get_stop_string_matching_mode(tokenizer)


def test_watermark_processor_has_transformers_attributes():
    from decodekit.plugins.watermark import WatermarkLogitsProcessor

    ours = WatermarkLogitsProcessor(vocab_size=100, greenlist_ratio=0.3, bias=1.5, hashing_key=7, context_width=2)
    theirs = transformers.WatermarkLogitsProcessor(
        vocab_size=100, device="cpu", greenlist_ratio=0.3, bias=1.5, hashing_key=7, context_width=2
    )
    for name in ("bias", "greenlist_size", "hash_key", "seeding_scheme", "context_width", "vocab_size"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_clean_vocabulary_equals_transformers():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from decodekit.core.stopping import StopStringCriteria as Ours
    from transformers.generation.stopping_criteria import StopStringCriteria as Theirs

    # A byte-level BPE vocabulary with word-start tokens ("Ġ" is a space), as GPT-2's and SmolLM2's.
    pieces = ["a", "b", "c", "d", "e", "f", "Ġ", "ab", "Ġab", "cd", "Ġcd", "ef", "abc", "Ġabcdef", "de"]
    merges = [("a", "b"), ("Ġ", "ab"), ("c", "d"), ("Ġ", "cd"), ("e", "f"), ("ab", "c"), ("d", "e")]
    backend = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    # The vocabulary's order is the tokenizer's hash order, different between two get_vocab() calls: by id.
    ours, theirs = (dict(zip(*reversed(cls.clean_tokenizer_vocab(tokenizer)))) for cls in (Ours, Theirs))
    assert ours == theirs and ours[8] == " ab" and len(ours) == len(pieces)
    ours, theirs = (
        dict(zip(*reversed(cls.clean_tokenizer_vocab(tokenizer, stop_string_matching_mode="byte_level"))))
        for cls in (Ours, Theirs)
    )
    assert ours == theirs and ours[8] == b" ab"
