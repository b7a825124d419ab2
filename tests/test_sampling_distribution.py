"""Sampling against a toy model whose next-token distribution is known exactly (chi-square, p = 1e-4)."""

import math

import pytest
import torch

from decodekit.core.selectors import draw_key, race_noise
from helpers import TableModel, chi_square, chi_square_critical

V = 12
N = 20000


def table() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(V, V, generator=g) * 1.5


def first_token_counts(model, **kwargs) -> torch.Tensor:
    prompt = torch.full((N, 1), 3, dtype=torch.long)
    out = model.generate(prompt, max_new_tokens=1, do_sample=True, seed=1234, **kwargs)
    return torch.bincount(out[:, -1], minlength=V).float()


def expected(logits: torch.Tensor, keep: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    p = torch.softmax(logits / temperature, -1) * keep
    return p / p.sum()


CASES = {
    "plain": (dict(top_k=0), lambda z: torch.ones(V, dtype=torch.bool), 1.0),
    "temperature": (dict(top_k=0, temperature=0.6), lambda z: torch.ones(V, dtype=torch.bool), 0.6),
    "top_k": (dict(top_k=4), lambda z: z >= z.sort(descending=True).values[3], 1.0),
    "top_p": (dict(top_k=0, top_p=0.8), None, 1.0),
    "top_k_top_p": (dict(top_k=8, top_p=0.9), None, 1.0),
    "min_p": (dict(top_k=0, min_p=0.05), lambda z: torch.softmax(z, -1) >= 0.05 * torch.softmax(z, -1).max(), 1.0),
}


def nucleus_keep(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of most likely tokens with mass >= top_p, computed by hand."""
    p = torch.softmax(z, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    mass = 0.0
    for i in order.tolist():
        keep[i] = True
        mass += p[i].item()
        if mass >= top_p:
            break
    return keep


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_frequencies_follow_the_distribution(case):
    kwargs, keep_fn, temperature = CASES[case]
    t = table()
    z = t[3]
    if case == "top_p":
        keep = nucleus_keep(z, 0.8)
    elif (
        case == "top_k_top_p"
    ):  # the nucleus of the eight most likely tokens: 5 tokens, where either warper alone keeps 8 or 6
        keep = nucleus_keep(z.masked_fill(z < z.sort(descending=True).values[7], -math.inf), 0.9)
    else:
        keep = keep_fn(z / temperature if case == "top_k" else z)
    probs = expected(z, keep, temperature)
    counts = first_token_counts(TableModel(t), **kwargs)
    stat, df = chi_square(counts, probs)
    assert df >= 2, "the case must leave several tokens to be a real test"
    assert stat < chi_square_critical(df), f"{case}: chi2={stat:.1f} df={df} counts={counts.tolist()}"
    if case != "plain":
        # The check has teeth: the unfiltered distribution is rejected.
        wrong, wdf = chi_square(counts, torch.softmax(z, -1))
        assert wrong > chi_square_critical(wdf)


def test_sampling_over_several_steps_uses_the_last_token():
    t = table()
    model = TableModel(t)
    prompt = torch.full((N, 1), 5, dtype=torch.long)
    out = model.generate(prompt, max_new_tokens=2, do_sample=True, top_k=0, seed=7)
    first, second = out[:, 1], out[:, 2]
    rows = first == first.mode().values  # condition on the most common first token
    counts = torch.bincount(second[rows], minlength=V).float()
    stat, df = chi_square(counts, torch.softmax(t[first.mode().values], -1))
    assert stat < chi_square_critical(df)


def test_seed_reproduces_and_differs():
    model = TableModel(table())
    prompt = torch.full((8, 1), 3, dtype=torch.long)
    a = model.generate(prompt, max_new_tokens=10, do_sample=True, seed=11)
    b = model.generate(prompt, max_new_tokens=10, do_sample=True, seed=11)
    c = model.generate(prompt, max_new_tokens=10, do_sample=True, seed=12)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    g = torch.Generator().manual_seed(11)
    assert torch.equal(a, model.generate(prompt, max_new_tokens=10, do_sample=True, generator=g))


def test_chi_square_critical_value_is_sane():
    # Against the tabulated chi-square quantile for df=10 at p=1e-4 (35.56).
    assert math.isclose(chi_square_critical(10), 35.56, rel_tol=0.02)


def test_race_noise_is_exponential_pure_and_the_same_compiled():
    key = draw_key(torch.Generator().manual_seed(0))
    noise = race_noise(key, 37, 4, 49152)
    assert torch.equal(noise, race_noise(key, 37, 4, 49152))  # a function of its arguments, no state
    flat = noise.flatten()
    assert abs(flat.mean().item() - 1) < 0.01 and abs(flat.var().item() - 1) < 0.03
    assert abs((flat > 2).float().mean().item() - math.exp(-2)) < 0.004
    # Rows, positions and keys each give other noise, uncorrelated.
    others = [noise[1], race_noise(key, 38, 4, 49152)[0], race_noise(key + 1, 37, 4, 49152)[0]]
    for other in others:
        assert abs(torch.corrcoef(torch.stack([noise[0], other]))[0, 1].item()) < 0.02
    for vocab in (101, 49152):  # 101: a vocabulary that leaves a remainder to the vector loop
        compiled = torch.compile(lambda k, p: race_noise(k, p, 4, vocab), fullgraph=True, dynamic=False)
        torch.testing.assert_close(
            compiled(key, torch.tensor([37], dtype=torch.int32)), race_noise(key, 37, 4, vocab), rtol=3e-7, atol=0
        )
