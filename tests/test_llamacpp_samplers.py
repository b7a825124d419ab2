"""llama.cpp's samplers as decodekit plugins (plugins/llamacpp_samplers.py): each validates its values by name,
DRY reproduces llama.cpp's own worked example, the chain runs in llama.cpp's order (or the one `samplers` gives),
a seed reproduces a text, continuous batching rows equal generate() alone, and the score-only ones run inside the
fused step with the same tokens. Against llama.cpp itself: tests/test_llamacpp.py (`make test-llamacpp`)."""

import math

import pytest
import torch

from decodekit.batching import RequestStatus
from decodekit.core.sampler_chain import DRYLogitsProcessor, QuadraticSmoothingLogitsWarper, TopNSigmaLogitsWarper
from decodekit.testing import tiny_model
from helpers import PATIENCE

PROMPT = torch.tensor([[5, 9, 14, 9, 14]])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("samplers"), "llama").eval()


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"top_n_sigma": "1"}, "top_n_sigma"),
        ({"xtc_probability": 1.5}, "xtc_probability"),
        ({"xtc_threshold": -0.1}, "xtc_threshold"),
        ({"dry_multiplier": -1}, "dry_multiplier"),
        ({"dry_allowed_length": 1.5}, "dry_allowed_length"),
        ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
        ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
        ({"mirostat": 3}, "mirostat"),
        ({"mirostat": True}, "mirostat"),
        ({"mirostat_tau": float("nan")}, "mirostat_tau"),
        ({"dynatemp_exponent": 0}, "dynatemp_exponent"),
        ({"smoothing_factor": -0.5}, "smoothing_factor"),
        ({"samplers": ["top_k", "nucleus"]}, "samplers"),
        ({"samplers": "kq"}, "samplers"),
        ({"mirostat": 2, "do_sample": False}, "mirostat"),
    ],
)
def test_each_field_is_checked_by_name(model, fields, name):
    with pytest.raises(ValueError, match=name):
        model.generate(PROMPT, max_new_tokens=2, **{"do_sample": True, **fields})


def test_dry_without_a_tokenizer_asks_for_one_unless_there_are_no_breakers(model):
    # The tiny model's folder holds no tokenizer: the call must pass one (the error names the field that asked).
    with pytest.raises(ValueError, match="dry_multiplier=0.8: .* pass tokenizer="):
        model.generate(PROMPT, max_new_tokens=2, dry_multiplier=0.8)
    model.generate(PROMPT, max_new_tokens=2, dry_multiplier=0.8, dry_sequence_breakers=[])


def test_dry_reads_the_models_own_tokenizer_where_its_files_hold_one(default_model):
    # As llama.cpp uses the model's own vocabulary: no tokenizer= needed for a model loaded from files that hold one.
    model, tok = default_model
    ids = tok("one two three, one two three, one two", return_tensors="pt")["input_ids"]
    fields = dict(max_new_tokens=12, dry_multiplier=2.0, dry_allowed_length=1, dry_sequence_breakers=[","])
    without = model.generate(ids, **fields)
    assert torch.equal(without, model.generate(ids, tokenizer=tok, **fields))
    assert not torch.equal(without, model.generate(ids, max_new_tokens=12))  # DRY did act


def test_dry_on_llama_cpps_worked_example():
    # llama.cpp's comment: last tokens a b c c b c y a b c, repeat counts 0 0 3 1 0 2 0 0 0 0: emitting c would
    # extend a repeat of 3, b one of 1, y one of 2. With allowed_length 2, c and y are penalised.
    a, b, c, y = 1, 2, 3, 4
    dry = DRYLogitsProcessor(0.8, 1.75, 2, -1, 100, breakers={})
    assert dry.row_penalties([a, b, c, c, b, c, y, a, b, c]) == {c: 0.8 * 1.75, y: 0.8}
    scores = torch.zeros(1, 6)
    out = dry(torch.tensor([[a, b, c, c, b, c, y, a, b, c]]), scores)
    assert out[0].tolist() == pytest.approx([0, 0, 0, -1.4, -0.8, 0]) and scores.abs().sum() == 0
    # y as a sequence breaker: repeats may reach back to it (3 tokens), and y itself is never penalised.
    breaker = DRYLogitsProcessor(0.8, 1.75, 2, -1, 100, breakers={y: [()]})
    assert breaker.row_penalties([a, b, c, c, b, c, y, a, b, c]) == {c: 0.8 * 1.75}
    assert breaker.row_penalties([a, b, c, a, b, y, c]) == {}  # the breaker one token back leaves no room


def test_dry_breakers_are_found_for_the_tokens_a_context_holds_with_each_rest_tokenized_once(default_model):
    # The table of 64 breakers of 40 characters was built for the whole vocabulary before the first token: 3.6 s and
    # ~50 MB a request on the default model, a client that left paying it all the same. Now each distinct token of
    # the context is checked once, and each breaker's rest is tokenized once, whatever the vocabulary.
    import random

    from decodekit.core.sampler_chain import DryBreakers, dry_breaker_sequences

    _, tok = default_model
    random.seed(0)
    breakers = tuple("".join(random.choice("etaoinshr :\n") for _ in range(40)) for _ in range(64))
    encoded = []

    class Counting:
        def __len__(self):
            return len(tok)

        def decode(self, ids, **kwargs):
            return tok.decode(ids, **kwargs)

        def encode(self, text, **kwargs):
            encoded.append(text)
            return tok.encode(text, **kwargs)

    counting = Counting()
    table = DryBreakers(counting, breakers)
    context = tok.encode('The story of the long river: told again and again, "in short": rivers run. ' * 8)
    dry = DRYLogitsProcessor(0.8, 1.75, 2, -1, 8192, table)
    penalties = dry.row_penalties(context)
    assert set(table._heads) <= set(context)  # no token the context lacks was looked at
    assert len(encoded) == len(set(encoded)) <= 40 * len(breakers)  # each rest once
    full = dry_breaker_sequences(tok, breakers)  # every token of the vocabulary, as llama.cpp builds it
    assert all(list(table.get(t, ())) == full.get(t, []) for t in set(context))
    assert penalties == DRYLogitsProcessor(0.8, 1.75, 2, -1, 8192, full).row_penalties(context)
    assert any(full.get(t) for t in set(context))  # the context does hold breaker heads


def test_top_n_sigma_and_smoothing_by_hand():
    scores = torch.tensor([[4.0, 3.0, 0.0, -1.0, -float("inf")]])
    finite = scores[0, :4]
    cut = finite.max() - 1.0 * finite.std(unbiased=False)
    kept = TopNSigmaLogitsWarper(1.0)(None, scores)
    assert torch.isfinite(kept[0]).tolist() == (scores[0] >= cut).tolist()
    smoothed = QuadraticSmoothingLogitsWarper(0.5, 1.0)(None, scores)
    assert smoothed[0, :4].tolist() == pytest.approx([4.0, 3.5, -4.0, -8.5]) and smoothed[0, 4] == -float("inf")


@pytest.mark.parametrize("curve", [1.0, 0.5, 2.0, 3.0])
def test_a_huge_smoothing_factor_keeps_the_top_token_and_no_nan(curve):
    # 0 * inf in a term of zero coefficient (the cubic at curve 1) made every score NaN: no token could be chosen.
    scores = torch.tensor([[4.0, 3.0, 0.0, -1.0, -float("inf")]])
    smoothed = QuadraticSmoothingLogitsWarper(1e308, curve)(None, scores)
    assert not smoothed.isnan().any() and smoothed[0, 0] == 4.0 and smoothed[0, 4] == -float("inf")
    assert int(smoothed.argmax()) == 0 or curve < 1  # below 1 the cubic lifts far tokens, as the formula says


def test_the_chain_runs_in_llama_cpps_order_unless_told(model):
    from decodekit.core.generate import merge_config
    from decodekit.plugins.llamacpp_samplers import order

    gc, _ = merge_config(model, None, {"top_n_sigma": 1.0})
    assert order(gc) == ["dry", "top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc", "temperature"]
    gc.samplers = "kxt"
    assert order(gc) == ["top_k", "xtc", "temperature"]
    gc.samplers = ["penalties", "min_p", "typ_p", "temperature"]
    assert order(gc) == ["min_p", "typical_p", "temperature"]
    # top_p before the temperature (llama.cpp) keeps another set than after it (transformers): outputs differ.
    kwargs = dict(do_sample=True, seed=0, max_new_tokens=12, top_p=0.5, temperature=3.0)
    ours = model.generate(PROMPT, samplers="pt", **kwargs)
    assert torch.equal(ours, model.generate(PROMPT, samplers=["top_p", "temperature"], **kwargs))
    assert not torch.equal(ours, model.generate(PROMPT, **kwargs))


@pytest.mark.parametrize(
    "fields",
    [
        {"top_n_sigma": 1.0},
        {"xtc_probability": 0.7, "xtc_threshold": 0.05},
        {"mirostat": 2, "mirostat_tau": 3.0},
        {"mirostat": 1},
        {"dynatemp_range": 0.5, "temperature": 0.9},
        {"smoothing_factor": 0.5},
        {"dry_multiplier": 0.8, "dry_sequence_breakers": []},
    ],
)
def test_a_seed_reproduces_and_continuous_batching_rows_equal_generate_alone(model, fields):
    kwargs = dict(do_sample=True, seed=4, max_new_tokens=10, eos_token_id=None, **fields)
    alone = model.generate(PROMPT, **kwargs)[0, PROMPT.shape[1] :].tolist()
    assert model.generate(PROMPT, **kwargs)[0, PROMPT.shape[1] :].tolist() == alone
    with model.init_continuous_batching() as manager:
        request = manager.add_request(PROMPT[0].tolist(), **kwargs)
        other = manager.add_request([3, 4, 5], max_new_tokens=10)
        out = manager.get_result(request, timeout=PATIENCE)
        assert manager.get_result(other, timeout=PATIENCE).status == RequestStatus.FINISHED
    assert out.generated_tokens == alone


@pytest.mark.parametrize(
    "fields",
    [
        {"top_n_sigma": 1.0},
        {"dynatemp_range": 0.5, "temperature": 0.9},
        {"smoothing_factor": 0.5},
        {"xtc_probability": 0.7, "xtc_threshold": 0.05},
    ],
)
def test_compile_gives_the_same_tokens(model, fields):
    from decodekit.kernels import cpu

    if not cpu.has("native_kernels"):
        pytest.skip("decodekit's C++ kernels are off on this machine: the fused step needs them")
    kwargs = dict(do_sample=True, seed=3, max_new_tokens=8, **fields)
    assert torch.equal(model.generate(PROMPT, **kwargs), model.generate(PROMPT, compile=True, **kwargs))


@pytest.mark.parametrize(
    "fields", [{"top_n_sigma": 1.0}, {"smoothing_factor": 0.5}, {"xtc_probability": 0.7, "xtc_threshold": 0.05}]
)
def test_beam_sampling_takes_the_score_shaping_samplers(model, fields):
    kwargs = dict(do_sample=True, num_beams=2, seed=2, max_new_tokens=8, eos_token_id=None)
    out = model.generate(PROMPT, **kwargs, **fields)
    assert torch.equal(out, model.generate(PROMPT, **kwargs, **fields)) and out.shape == (1, PROMPT.shape[1] + 8)
    assert not torch.equal(out, model.generate(PROMPT, **kwargs))  # the sampler shaped what the beams drew from


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_under_beam_sampling_keeps_its_state_per_beam(model, version):
    from decodekit.core.sampler_chain import MirostatLogitsProcessor

    kwargs = dict(
        do_sample=True, num_beams=2, seed=2, max_new_tokens=8, eos_token_id=None, mirostat=version, mirostat_tau=2.0
    )
    out = model.generate(PROMPT, **kwargs)
    assert torch.equal(out, model.generate(PROMPT, **kwargs))
    assert not torch.equal(out, model.generate(PROMPT, **{**kwargs, "mirostat": 0}))
    # The state follows a sequence: a child's mu is its parent's, moved by the surprise of the token appended.
    processor = MirostatLogitsProcessor(2, tau=1.25, eta=0.5, vocab=4)
    scores = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 2))
    first = processor(torch.tensor([[7], [7]]), scores)
    assert torch.isfinite(first).tolist() == [[True, True, False, False]] * 2  # surprise 1, 2 <= mu = 2.5 < 3 bits
    children = torch.tensor([[7, 0], [7, 1]])  # the beams appended tokens 0 and 1 (renormalized p 2/3 and 1/3)
    processor(children, scores)
    mu_a, mu_b = processor.states[(7, 0)][0], processor.states[(7, 1)][0]
    assert mu_a == pytest.approx(2.5 - 0.5 * (-math.log2(2 / 3) - 1.25))
    assert mu_b == pytest.approx(2.5 - 0.5 * (-math.log2(1 / 3) - 1.25)) and mu_a != mu_b
