"""decodekit's llama.cpp samplers against llama.cpp itself, through llama-cpp-python's low-level bindings, on
identical logits: the same kept set and the same transformed scores, and for mirostat the same distribution over
many draws (a chi-square bound a broken sampler fails); and decodekit methods inside llama.cpp
(decodekit.integrations.llamacpp) on the default model's GGUF file. llama-cpp-python is built from source in its
own environment: `make test-llamacpp`."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

llama_cpp = pytest.importorskip(
    "llama_cpp",
    reason="llama-cpp-python is not installed here: `make test-llamacpp` builds "
    "it from source in its own environment and runs these tests",
)

from decodekit.core.sampler_chain import (  # noqa: E402
    DRYLogitsProcessor,
    DynamicTemperatureLogitsWarper,
    MirostatSelector,
    TopNSigmaLogitsWarper,
    XTCLogitsWarper,
    dry_breaker_sequences,
    mirostat_keep,
)

L = llama_cpp.llama_cpp
BREAKERS = ["\n", ":", '"', "*"]


def run(sampler, logits: torch.Tensor, accept=()) -> tuple[dict[int, float], int]:
    """llama.cpp's sampler applied to `logits` [V] (after accepting the tokens `accept`): {id: logit} of the
    candidates it keeps, and the index it selected (-1 for none)."""
    n = logits.shape[0]
    data = (L.llama_token_data * n)(*[L.llama_token_data(i, float(v), 0.0) for i, v in enumerate(logits.tolist())])
    array = L.llama_token_data_array(
        data=ctypes.cast(data, ctypes.POINTER(L.llama_token_data)), size=n, selected=-1, sorted=False
    )
    for token in accept:
        L.llama_sampler_accept(sampler, token)
    L.llama_sampler_apply(sampler, ctypes.byref(array))
    kept = {array.data[i].id: array.data[i].logit for i in range(array.size) if array.data[i].logit != -math.inf}
    selected = array.data[array.selected].id if array.selected >= 0 else -1
    L.llama_sampler_free(sampler)
    return kept, selected


def ours(processor, logits: torch.Tensor, input_ids=None) -> dict[int, float]:
    ids = input_ids if input_ids is not None else torch.zeros(1, 1, dtype=torch.long)
    out = processor(ids, logits[None].clone())[0]
    return {i: v for i, v in enumerate(out.tolist()) if v != -math.inf}


@pytest.fixture(scope="module")
def logits():
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(512, generator=generator) * 3
    base[[5, 17, 40]] = -math.inf  # already banned by an earlier sampler
    return base


@pytest.fixture(scope="module")
def gguf():
    from pathlib import Path

    from decodekit.loading.default import default_model_path

    found = Path(default_model_path())
    path = found if found.suffix == ".gguf" else next(found.glob("*.gguf"))
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, verbose=False, logits_all=False)
    yield llm, path


@pytest.mark.parametrize("n", [0.5, 1.0, 2.0])
def test_top_n_sigma_keeps_the_same_tokens(logits, n):
    kept, _ = run(L.llama_sampler_init_top_n_sigma(n), logits)
    assert set(ours(TopNSigmaLogitsWarper(n), logits)) == set(kept)


@pytest.mark.parametrize("temperature, delta, exponent", [(0.8, 0.0, 1.0), (1.0, 0.5, 1.0), (0.7, 0.6, 2.0)])
def test_dynamic_temperature_gives_the_same_scores(logits, temperature, delta, exponent):
    # On finite logits: llama.cpp normalizes the entropy by its list's size, which keeps the -inf entries
    # top-n-sigma leaves; decodekit counts the finite scores (see DynamicTemperatureLogitsWarper).
    logits = torch.where(torch.isfinite(logits), logits, torch.full_like(logits, -2.0))
    kept, _ = run(L.llama_sampler_init_temp_ext(temperature, delta, exponent), logits)
    mine = ours(DynamicTemperatureLogitsWarper(temperature, delta, exponent), logits)
    assert set(mine) == set(kept)
    assert torch.allclose(
        torch.tensor([mine[i] for i in sorted(kept)]),
        torch.tensor([kept[i] for i in sorted(kept)]),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("threshold", [0.05, 0.1, 0.2])
def test_xtc_removes_the_same_top_choices(threshold):
    peaked = torch.full((64,), -4.0)
    peaked[:6] = torch.tensor([3.0, 2.6, 2.2, 1.8, 1.0, 0.5])  # several tokens above the threshold
    kept, _ = run(L.llama_sampler_init_xtc(1.0, threshold, 1, 1234), peaked)
    warper = XTCLogitsWarper(1.0, threshold, torch.tensor(7, dtype=torch.int32))
    assert set(ours(warper, peaked)) == set(kept) and len(kept) < 64


def test_dry_penalises_the_same_tokens_by_the_same_amounts(gguf):
    from decodekit import AutoTokenizer
    from decodekit.loading.default import default_model_path

    llm, _ = gguf
    tok = AutoTokenizer.from_pretrained(default_model_path())
    context = tok.encode("The cat sat on the mat. The cat sat on the mat. The cat sat on the", add_special_tokens=False)
    logits = torch.randn(llm.n_vocab(), generator=torch.Generator().manual_seed(1))
    breakers = (ctypes.c_char_p * len(BREAKERS))(*[b.encode() for b in BREAKERS])
    vocab = L.llama_model_get_vocab(llm.model)
    # The last 64 tokens on both sides: llama.cpp's C API takes the window as is (its server turns -1 into the
    # context's size before calling it, as decodekit's -1 does).
    sampler = L.llama_sampler_init_dry(vocab, 0.8, 1.75, 2, 64, breakers, len(BREAKERS))
    kept, _ = run(sampler, logits, accept=context)
    processor = DRYLogitsProcessor(0.8, 1.75, 2, 64, 8192, dry_breaker_sequences(tok, tuple(BREAKERS)))
    mine = ours(processor, logits, torch.tensor([context]))
    changed = {i for i in kept if abs(kept[i] - logits[i].item()) > 1e-6}
    assert changed and changed == {i for i in mine if abs(mine[i] - logits[i].item()) > 1e-6}
    assert all(abs(mine[i] - kept[i]) < 1e-4 for i in changed)


def chi_square(counts: dict[int, int], probs: dict[int, float]) -> tuple[float, int]:
    draws = sum(counts.values())
    cells = [i for i in probs if probs[i] * draws >= 5]
    other = 1 - sum(probs[i] for i in cells)
    stat = sum((counts.get(i, 0) - probs[i] * draws) ** 2 / (probs[i] * draws) for i in cells)
    rest = draws - sum(counts.get(i, 0) for i in cells)
    if other * draws >= 5:
        stat += (rest - other * draws) ** 2 / (other * draws)
    return stat, len(cells) - (0 if other * draws >= 5 else 1)


def bound(df: int) -> float:
    """The chi-square value a correct sampler exceeds with probability ~1e-4 (Wilson-Hilferty)."""
    z = 3.72
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_draws_from_the_same_distribution(logits, version):
    finite = torch.where(torch.isfinite(logits), logits, torch.full_like(logits, -1e9))
    draws = 3000
    theirs = {}
    for seed in range(draws):
        sampler = (
            L.llama_sampler_init_mirostat(finite.shape[0], seed, 5.0, 0.1, 100)
            if version == 1
            else L.llama_sampler_init_mirostat_v2(seed, 5.0, 0.1)
        )
        _, token = run(sampler, finite)
        theirs[token] = theirs.get(token, 0) + 1
    mine = {}
    for seed in range(draws):
        selector = MirostatSelector(version, 5.0, 0.1, finite.shape[0], torch.Generator().manual_seed(seed))
        token = int(selector(torch.zeros(1, 1, dtype=torch.long), finite[None].clone())[0])
        mine[token] = mine.get(token, 0) + 1
    # The distribution both should draw from: llama.cpp's kept set at mu = 2 tau, renormalized.
    probs = finite.softmax(-1)
    ranked = probs.argsort(descending=True)
    if version == 2:
        kept = [int(i) for i in ranked if probs[i] > 0 and -math.log2(probs[i]) <= 10.0] or [int(ranked[0])]
    else:
        keep = mirostat_keep(1, probs[ranked][None], torch.tensor([10.0]), finite.shape[0])  # mu = 2 tau at the start
        kept = [int(i) for i in ranked[: int(keep.sum())]]
    total = float(probs[kept].sum())
    expected = {i: float(probs[i]) / total for i in kept}
    for counts in (theirs, mine):
        stat, df = chi_square(counts, expected)
        assert set(counts) <= set(kept) and stat < bound(max(df, 1)), (stat, df)


def test_a_decodekit_method_runs_inside_llama_cpp(gguf, tmp_path):
    from decodekit.integrations.llamacpp import hooks

    from methods import HOOK_METHOD, write_method

    llm, _ = gguf
    method = write_method(tmp_path / "ban", HOOK_METHOD)
    plain = llm("The capital of France is", max_tokens=6, temperature=0, logprobs=None)
    first = llm.tokenize(plain["choices"][0]["text"].encode(), add_bos=False)[0]
    h = hooks(llm, method=str(method), trust_remote_code=True, banned_token=first)
    banned = llm(
        "The capital of France is",
        max_tokens=6,
        temperature=0,
        logits_processor=h.logits_processor,
        stopping_criteria=h.stopping_criteria,
    )
    assert banned["choices"][0]["text"] != plain["choices"][0]["text"]
    assert first not in llm.tokenize(banned["choices"][0]["text"].encode(), add_bos=False)[:1]
    with pytest.raises(ValueError, match="did you mean 'banned_token'"):
        hooks(llm, method=str(method), trust_remote_code=True, bannedtoken=1)


def test_xtc_triggers_at_its_probability_like_llama_cpp():
    # The coin: over many seeds both remove the top choices in a share of draws near xtc_probability.
    peaked = torch.full((64,), -4.0)
    peaked[:4] = torch.tensor([3.0, 2.6, 2.2, 1.8])
    draws, probability = 600, 0.3
    theirs = sum(len(run(L.llama_sampler_init_xtc(probability, 0.1, 1, seed), peaked)[0]) < 64 for seed in range(draws))
    ours_ = sum(
        len(ours(XTCLogitsWarper(probability, 0.1, torch.tensor(seed, dtype=torch.int32)), peaked)) < 64
        for seed in range(draws)
    )
    spread = 4 * math.sqrt(draws * probability * (1 - probability))  # 4 standard deviations of a binomial count
    assert abs(theirs - draws * probability) < spread and abs(ours_ - draws * probability) < spread
