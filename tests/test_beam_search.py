"""Beam search, beam sampling and diverse beam search: exhaustive checks on toy models, transformers parity."""

import itertools

import pytest
import torch

from decodekit import AutoModelForCausalLM
from decodekit.core.outputs import CausalLMOutput

from helpers import TableModel, write_tiny_model

V = 4


class TrigramModel(TableModel):
    """logits = table[previous token, last token]: a known distribution that depends on two tokens."""

    def __init__(self, table):
        super().__init__(torch.zeros(table.shape[0], table.shape[0]))
        self.tri = table
        self.generation_config.use_cache = False  # it reads the whole sequence every step

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True):
        prev = torch.cat((input_ids[:, :1], input_ids[:, :-1]), dim=1)
        return CausalLMOutput(logits=self.tri[prev, input_ids], past_key_values=past_key_values)


def toy(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return TrigramModel(torch.randn(V, V, V, generator=g) * 2)


def exhaustive(model, prompt, length, length_penalty):
    results = []
    for continuation in itertools.product(range(V), repeat=length):
        seq = list(prompt) + list(continuation)
        logp = 0.0
        for t in range(len(prompt), len(seq)):
            logits = model(torch.tensor([seq[:t]])).logits[0, -1]
            logp += torch.log_softmax(logits, -1)[seq[t]].item()
        results.append((logp / length**length_penalty, seq))
    return sorted(results, reverse=True)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beam_search_equals_exhaustive_search(length_penalty):
    model, prompt, L = toy(), [1, 2], 3
    beams = V ** (L - 1)  # wide enough to keep every prefix: the search becomes exhaustive
    out = model.generate(
        torch.tensor([prompt]),
        num_beams=beams,
        num_return_sequences=beams,
        max_new_tokens=L,
        length_penalty=length_penalty,
        return_dict_in_generate=True,
        output_scores=True,
    )
    expected = exhaustive(model, prompt, L, length_penalty)[:beams]
    assert out.sequences.tolist() == [seq for _, seq in expected]
    torch.testing.assert_close(out.sequences_scores, torch.tensor([s for s, _ in expected]), atol=1e-5, rtol=1e-5)


def test_narrow_beam_finds_what_greedy_misses():
    model, prompt = toy(seed=4), [1, 2]  # a table where the greedy path is not the best one
    best_score, best = exhaustive(model, prompt, 3, 1.0)[0]
    beam = model.generate(torch.tensor([prompt]), num_beams=4, max_new_tokens=3)[0].tolist()
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=3)[0].tolist()
    assert beam == best
    assert greedy != best  # the toy table is chosen so that greedy is not optimal here


def test_transition_scores_reconstruct_sequence_scores():
    model = toy()
    out = model.generate(
        torch.tensor([[1, 2], [3, 0]]),
        num_beams=4,
        num_return_sequences=2,
        max_new_tokens=3,
        length_penalty=1.5,
        return_dict_in_generate=True,
        output_scores=True,
    )
    transition = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    generated = (transition < 0).sum(dim=1)
    torch.testing.assert_close(transition.sum(dim=1) / generated**1.5, out.sequences_scores)
    greedy = model.generate(torch.tensor([[1, 2]]), max_new_tokens=3, return_dict_in_generate=True, output_logits=True)
    t = model.compute_transition_scores(greedy.sequences, greedy.logits, normalize_logits=True)
    by_hand = [torch.log_softmax(greedy.logits[i][0], -1)[greedy.sequences[0, 2 + i]].item() for i in range(3)]
    assert t[0].tolist() == pytest.approx(by_hand)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = write_tiny_model(tmp_path_factory.mktemp("beam"), "qwen2", pad_token_id=3)
    return (
        AutoModelForCausalLM.from_pretrained(path),
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_beams=4),
        dict(num_beams=4, num_return_sequences=3, length_penalty=0.5),
        dict(num_beams=3, early_stopping=True, sequence_bias={(2,): 3.0}),  # EOS (2) made likely: beams finish early
        dict(num_beams=4, early_stopping="never", length_penalty=2.0, sequence_bias={(2,): 4.0}),
        dict(num_beams=5, early_stopping=False, sequence_bias={(2,): 2.0}, num_return_sequences=5),
    ],
)
def test_beam_search_matches_transformers(pair, kwargs):
    ours, ref = pair
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 96, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 3, 0
    common = dict(
        attention_mask=mask, max_new_tokens=12, return_dict_in_generate=True, output_scores=True, pad_token_id=3
    )
    a = ours.generate(ids, **common, **kwargs)
    b = ref.generate(ids, **common, **kwargs)
    assert a.sequences.tolist() == b.sequences.tolist()
    torch.testing.assert_close(a.sequences_scores, b.sequences_scores, atol=1e-4, rtol=1e-4)
    assert a.beam_indices.tolist() == b.beam_indices.tolist()
    if "sequence_bias" in kwargs and kwargs.get("early_stopping") != "never":
        assert (a.sequences[:, 6:] == 2).any()  # the case really exercised finished hypotheses


def test_beam_sampling_is_seeded_and_valid(pair):
    ours, _ = pair
    ids = torch.tensor([[5, 6, 7]])
    a = ours.generate(ids, num_beams=3, do_sample=True, max_new_tokens=8, seed=1, num_return_sequences=3)
    b = ours.generate(ids, num_beams=3, do_sample=True, max_new_tokens=8, seed=1, num_return_sequences=3)
    c = ours.generate(ids, num_beams=3, do_sample=True, max_new_tokens=8, seed=2, num_return_sequences=3)
    assert torch.equal(a, b) and a.shape == (3, 11)
    assert not torch.equal(a, c)


def best_of_sample_without_replacement(p: torch.Tensor, k: int) -> torch.Tensor:
    """Exact distribution of the most probable token in a k-sample drawn without replacement from p."""
    out = torch.zeros_like(p)
    for order in itertools.permutations(range(len(p)), k):
        prob, left = 1.0, 1.0
        for i in order:
            prob *= p[i].item() / left
            left -= p[i].item()
        out[max(order, key=lambda i: p[i].item())] += prob
    return out


def test_beam_sampling_draws_from_the_accumulated_distribution():
    # One step, two beams: continuations are sampled without replacement from softmax(logits); the first
    # num_beams=2 drawn may finish, and the better of them is returned first. Its frequencies must follow
    # that exact distribution (as in transformers, where candidates keep their draw order).
    from helpers import chi_square, chi_square_critical

    table = torch.randn(6, 6, generator=torch.Generator().manual_seed(1)) * 0.5
    model = TableModel(table)
    prompt = torch.full((4000, 1), 2, dtype=torch.long)
    out = model.generate(prompt, num_beams=2, do_sample=True, max_new_tokens=1, seed=5, top_k=0)
    counts = torch.bincount(out[:, -1], minlength=6).float()
    p = torch.softmax(table[2], -1)
    stat, df = chi_square(counts, best_of_sample_without_replacement(p, 2))
    assert df >= 2 and stat < chi_square_critical(df)
    wrong, wdf = chi_square(counts, p)  # plain sampling would look different
    assert wrong > chi_square_critical(wdf)


def test_diverse_beam_search_spreads_the_groups():
    model = toy()
    prompt = torch.tensor([[1, 2]])
    plain = model.generate(prompt, num_beams=4, num_return_sequences=4, max_new_tokens=3)
    diverse = model.generate(
        prompt, num_beams=4, num_beam_groups=4, diversity_penalty=100.0, num_return_sequences=4, max_new_tokens=3
    )
    # A huge penalty forces every group to start with a different token; plain beam search does not.
    assert len(set(diverse[:, 2].tolist())) == 4
    assert len(set(plain[:, 2].tolist())) < 4
    one_group = model.generate(prompt, num_beams=4, num_beam_groups=1, diversity_penalty=5.0, max_new_tokens=3)
    assert torch.equal(one_group, plain[:1])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(num_beams=2, num_return_sequences=3),
            r"num_return_sequences=3 is invalid; beam search returns at most num_beams=2",
        ),
        (
            dict(num_beams=4, num_beam_groups=3, diversity_penalty=1.0),
            r"num_beams=4 must be divisible by num_beam_groups",
        ),
        (dict(num_beams=0), r"num_beams=0 is invalid"),
        (
            dict(num_beams=2, early_stopping="sometimes"),
            r"early_stopping='sometimes' is invalid; expected True, False or 'never'",
        ),
        (dict(num_beams=4, num_beam_groups=2), r"needs diversity_penalty > 0"),
        (
            dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0, do_sample=True),
            r"cannot be combined with do_sample",
        ),
    ],
)
def test_bad_beam_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        toy().generate(torch.tensor([[1, 2]]), max_new_tokens=2, **kwargs)


def test_streamer_with_beams_is_refused():
    class Sink:
        def put(self, x):
            pass

        def end(self):
            pass

    with pytest.raises(ValueError, match="streamer is not supported with beam search"):
        toy().generate(torch.tensor([[1, 2]]), max_new_tokens=2, num_beams=2, streamer=Sink())


def test_wrong_type_is_a_validation_error_not_a_crash():
    with pytest.raises(ValueError, match=r"num_beams='4' is invalid"):
        toy().generate(torch.tensor([[1, 2]]), max_new_tokens=2, num_beams="4")
