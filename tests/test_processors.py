"""Each logits processor against values computed by hand."""

import math

import pytest
import torch

from decodekit.core import penalties as N
from decodekit.core import processors as P
from decodekit.core import warpers as W

INF = math.inf


def s(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def ids(*rows):
    return torch.tensor(rows, dtype=torch.long)


def test_temperature_divides():
    out = W.TemperatureLogitsWarper(0.5)(ids([0]), s([1.0, -2.0, 4.0]))
    assert out.tolist() == [[2.0, -4.0, 8.0]]


def test_top_k_keeps_k_highest_and_ties():
    out = W.TopKLogitsWarper(2)(ids([0]), s([1.0, 3.0, 2.0, 0.0]))
    assert out.tolist() == [[-INF, 3.0, 2.0, -INF]]
    tied = W.TopKLogitsWarper(1)(ids([0]), s([3.0, 3.0, 1.0]))
    assert tied.tolist() == [[3.0, 3.0, -INF]]
    assert W.TopKLogitsWarper(10)(ids([0]), s([1.0, 2.0])).tolist() == [[1.0, 2.0]]


def test_top_p_keeps_every_token_tied_with_the_nucleus_edge():
    out = W.TopPLogitsWarper(0.5)(ids([0]), s([2.0, 1.0, 1.0, 1.0, -3.0]))
    # p = [0.47, 0.17, 0.17, 0.17, 0.003]: 0.47 < 0.5, so the nucleus reaches score 1.0 and keeps all three ties.
    assert torch.isfinite(out).tolist() == [[True, True, True, True, False]]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = W.TopPLogitsWarper(0.75)(ids([0]), probs.log())
    # 0.5 + 0.3 = 0.8 >= 0.75: two tokens kept.
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    out = W.TopPLogitsWarper(0.5)(ids([0]), probs.log())
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]
    out = W.TopPLogitsWarper(1.0)(ids([0]), probs.log())
    assert torch.isfinite(out).all()


def test_top_k_top_p_sorts_fewer_scores_with_the_same_result_as_the_two_warpers():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        k = int(torch.randint(1, 30, (1,), generator=gen))
        scores = torch.randn(3, 500, generator=gen) * (0.5 + trial / 10)
        if (
            trial % 4 == 0
        ):  # up to k more scores tie with the k-th: TopK keeps them all, and the short sort must see them
            kth = scores.topk(k, dim=-1).values[:, -1:]
            scores[:, :k] = kth
        top_k = W.TopKLogitsWarper(k)(None, scores)
        for p in (0.3, 0.8, 0.95, 1.0):
            two = W.TopPLogitsWarper(p)(None, top_k)
            assert torch.equal(W.TopKTopPLogitsWarper(k, p)(None, scores), two), (trial, k, p)
    small = torch.randn(2, 7, generator=gen)  # 2k above the vocabulary: the whole row is sorted
    assert torch.equal(
        W.TopKTopPLogitsWarper(5, 0.9)(None, small), W.TopPLogitsWarper(0.9)(None, W.TopKLogitsWarper(5)(None, small))
    )
    with pytest.raises(ValueError, match="top_k=0"):
        W.TopKTopPLogitsWarper(0, 0.9)
    with pytest.raises(ValueError, match="top_p=1.5"):
        W.TopKTopPLogitsWarper(5, 1.5)


def test_min_p_scales_with_top_probability():
    probs = torch.tensor([[0.6, 0.25, 0.1, 0.05]])
    out = W.MinPLogitsWarper(0.2)(ids([0]), probs.log())  # threshold 0.12
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]


def test_typical_p_keeps_tokens_nearest_the_entropy():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    logp = probs.log()
    entropy = -(probs * logp).sum()
    distance = (-logp - entropy).abs()[0]
    order = distance.argsort()
    # Hand computation: take tokens by closeness to the entropy until their mass reaches 0.5.
    kept, mass = set(), 0.0
    for i in order.tolist():
        kept.add(i)
        mass += probs[0, i].item()
        if mass >= 0.5:
            break
    out = W.TypicalLogitsWarper(0.5)(ids([0]), logp.clone())
    assert {i for i in range(4) if math.isfinite(out[0, i].item())} == kept


def test_repetition_penalty_divides_positive_multiplies_negative():
    out = N.RepetitionPenaltyLogitsProcessor(2.0)(ids([0, 1]), s([4.0, -1.0, 3.0]))
    assert out.tolist() == [[2.0, -2.0, 3.0]]


def test_no_repeat_ngram_bans_completions():
    # Sequence 5 6 7 5 6: the bigram (6, 7) and (5, 6) exist; after "6" token 7 is banned (n=2).
    out = N.NoRepeatNGramLogitsProcessor(2)(ids([5, 6, 7, 5, 6]), torch.zeros(1, 9))
    assert [i for i in range(9) if out[0, i] == -INF] == [7]
    out = N.NoRepeatNGramLogitsProcessor(3)(ids([5, 6, 7, 5, 6]), torch.zeros(1, 9))
    assert [i for i in range(9) if out[0, i] == -INF] == [7]
    out = N.NoRepeatNGramLogitsProcessor(3)(ids([5, 6, 7, 6, 5]), torch.zeros(1, 9))
    assert not (out == -INF).any()


def test_bad_words_single_and_multi_token():
    proc = N.NoBadWordsLogitsProcessor([[3], [4, 5], [2]], eos_token_id=2)
    out = proc(ids([1, 4], [1, 1]), torch.zeros(2, 6))
    assert out[0].tolist() == [0, 0, 0, -INF, 0, -INF]  # row ends with 4: 5 banned
    assert out[1].tolist() == [0, 0, 0, -INF, 0, 0]  # EOS (2) is never banned


def test_suppress_tokens():
    out = N.SuppressTokensLogitsProcessor([0, 2])(ids([1]), torch.ones(1, 4))
    assert out.tolist() == [[-INF, 1.0, -INF, 1.0]]


def test_sequence_bias_single_and_conditional():
    proc = N.SequenceBiasLogitsProcessor({(3,): -1.0, (1, 2): 5.0})
    out = proc(ids([0, 1], [0, 0]), torch.zeros(2, 4))
    assert out.tolist() == [[0.0, 0.0, 5.0, -1.0], [0.0, 0.0, 0.0, -1.0]]
    as_list = N.SequenceBiasLogitsProcessor([[[1, 2], 5.0]])
    assert as_list(ids([0, 1]), torch.zeros(1, 4)).tolist() == [[0.0, 0.0, 5.0, 0.0]]


def test_min_length_and_min_new_tokens_block_eos():
    proc = N.MinLengthLogitsProcessor(3, eos_token_id=[1, 2])
    assert proc(ids([0, 0]), torch.zeros(1, 4)).tolist() == [[0, -INF, -INF, 0]]
    assert proc(ids([0, 0, 0]), torch.zeros(1, 4)).tolist() == [[0, 0, 0, 0]]
    new = N.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=1, eos_token_id=2)
    assert new(ids([0, 0]), torch.zeros(1, 4))[0, 2] == -INF
    assert new(ids([0, 0, 3]), torch.zeros(1, 4))[0, 2] == 0


def test_forced_bos_and_eos():
    # As transformers: forced after a one-token sequence (a decoder start), not after a longer prompt.
    bos = N.ForcedBOSTokenLogitsProcessor(1)
    assert bos(ids([0]), torch.zeros(1, 3)).tolist() == [[-INF, 0, -INF]]
    assert bos(ids([0, 0]), torch.zeros(1, 3)).tolist() == [[0, 0, 0]]
    eos = N.ForcedEOSTokenLogitsProcessor(max_length=4, eos_token_id=2)
    assert eos(ids([0, 0, 0]), torch.zeros(1, 3)).tolist() == [[-INF, -INF, 0]]
    assert eos(ids([0, 0]), torch.zeros(1, 3)).tolist() == [[0, 0, 0]]


def test_processor_list_applies_in_order():
    procs = P.LogitsProcessorList([W.TemperatureLogitsWarper(2.0), W.TopKLogitsWarper(1)])
    assert procs(ids([0]), s([2.0, 4.0])).tolist() == [[-INF, 2.0]]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: W.TemperatureLogitsWarper(0), "temperature=0"),
        (lambda: W.TopKLogitsWarper(0), "top_k=0"),
        (lambda: W.TopPLogitsWarper(1.5), "top_p=1.5"),
        (lambda: W.MinPLogitsWarper(-0.1), "min_p=-0.1"),
        (lambda: W.TypicalLogitsWarper(0), "typical_p=0"),
        (lambda: N.RepetitionPenaltyLogitsProcessor(0), "repetition_penalty=0"),
        (lambda: N.NoRepeatNGramLogitsProcessor(0), "no_repeat_ngram_size=0"),
    ],
)
def test_processors_reject_bad_values(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("vocab", [49152, 50001, 300])
def test_top_values_are_topk_values_ties_and_padding_included(vocab):
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(12):
        scores = torch.randn(2, vocab, generator=gen) * 3
        if trial % 3 == 0:
            scores = scores.round()  # thousands of ties
        if trial % 3 == 1:
            scores[:, ::7] = scores.max()  # more ties at the top than m
        scores[0, :5] = -math.inf
        for m in (1, 50, 100, 400):
            assert torch.equal(W.top_values(scores, m), torch.topk(scores, min(m, vocab)).values), (trial, m)


def test_a_processors_declarations_are_read_one_way_into_one_record():
    # core.processors.capabilities: the flags, the stage, the EOS ban and the key in one record, each read as an
    # attribute of the object (its class's or its own); Pipeline.capabilities gives one per processor, in order.
    from decodekit.core.pipeline import Pipeline

    top_k = W.TopKLogitsWarper(4)
    record = P.capabilities(top_k)
    assert record.score_only and not record.host_mask and record.stage == "samplers"
    assert record.key == P.processor_key(top_k) and record.blocks_eos_until is None and record.eos == frozenset()
    banned = P.capabilities(N.MinLengthLogitsProcessor(9, [2, 3]))
    assert banned.blocks_eos_until == 9 and banned.eos == {2, 3} and not banned.score_only

    class OnTheObject:
        def __call__(self, input_ids, scores):
            return scores

    own = OnTheObject()
    own.score_only, own.stage = True, "post"
    assert P.capabilities(own)[:4] == (True, False, False, "post")
    own.score_only = "yes"  # only True declares
    assert not P.capabilities(own).score_only
    pipeline = Pipeline(processors=[top_k, own], selector=None, stopping=[], cache=None)
    assert pipeline.capabilities == (record, P.capabilities(own))
