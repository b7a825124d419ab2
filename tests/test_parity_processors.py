"""decodekit's processors against transformers' same-named classes on the same scores: equal outputs, and the scores
handed in left as they were (transformers' processors never write to their input)."""

import pytest
import torch

import decodekit
from decodekit.core import processors as P

from tiny_transformers import EOS, tiny_transformers_model, transformers

INPUT_IDS = torch.tensor([[7, 3, 5, 6, 3], [9, 9, 4, 5, 6]])


def scores():
    return torch.randn(2, 12, generator=torch.Generator().manual_seed(0))


CASES = {
    "no bad words": (lambda: P.NoBadWordsLogitsProcessor([[3], [5, 6, 2], [11]], eos_token_id=11),
                     lambda: transformers.NoBadWordsLogitsProcessor([[3], [5, 6, 2], [11]], eos_token_id=11)),
    "no repeat ngram": (lambda: P.NoRepeatNGramLogitsProcessor(2),
                        lambda: transformers.NoRepeatNGramLogitsProcessor(2)),
    "exponential decay": (lambda: P.ExponentialDecayLengthPenalty((1, 1.5), eos_token_id=2, prompt_length=3),
                          lambda: transformers.ExponentialDecayLengthPenalty((1, 1.5), eos_token_id=2,
                                                                             input_ids_seq_length=3)),
    "min length": (lambda: P.MinLengthLogitsProcessor(8, eos_token_id=[2, 4]),
                   lambda: transformers.MinLengthLogitsProcessor(8, eos_token_id=[2, 4])),
    "forced bos": (lambda: P.ForcedBOSTokenLogitsProcessor(6), lambda: transformers.ForcedBOSTokenLogitsProcessor(6)),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("length", [1, 5])
def test_equal_to_transformers_and_the_input_untouched(name, length):
    ours, theirs = (make() for make in CASES[name])
    ids = INPUT_IDS[:, :length]
    given = scores()
    expected = theirs(ids, given.clone())
    got = ours(ids, given)
    assert torch.equal(given, scores()), f"{name} wrote to the scores it was given"
    assert torch.equal(got, expected)


def test_forced_bos_is_forced_only_after_a_one_token_sequence_as_in_transformers():
    hf = tiny_transformers_model("gpt2")
    model = decodekit.wrap(hf)
    for prompt in (torch.tensor([[1]]), torch.tensor([[1, 17, 23, 5]])):
        options = dict(max_new_tokens=4, do_sample=False, forced_bos_token_id=42, eos_token_id=EOS)
        assert torch.equal(model.generate(prompt, **options), hf.generate(prompt, **options))
    # After a longer prompt nothing is forced: the same tokens as without the field.
    prompt = torch.tensor([[1, 17, 23, 5]])
    assert torch.equal(model.generate(prompt, max_new_tokens=4, forced_bos_token_id=42),
                       model.generate(prompt, max_new_tokens=4))
