"""Static and dynamic caches: same greedy output, and the crop / reorder contract."""

import pytest
import torch

from decodekit import AutoModelForCausalLM, DynamicCache, StaticCache

from helpers import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path_factory.mktemp("m"), "mistral"))


def test_static_and_dynamic_give_identical_greedy_output(model):
    ids = torch.tensor([[5, 9, 14, 3, 7], [0, 0, 11, 12, 13]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    outs = {
        kind: model.generate(
            ids, attention_mask=mask, max_new_tokens=20, cache_implementation=kind, return_dict_in_generate=True
        )
        for kind in ("static", "dynamic")
    }
    assert isinstance(outs["static"].past_key_values, StaticCache)
    assert isinstance(outs["dynamic"].past_key_values, DynamicCache)
    assert torch.equal(outs["static"].sequences, outs["dynamic"].sequences)
    no_cache = model.generate(ids, attention_mask=mask, max_new_tokens=20, use_cache=False)
    assert torch.equal(outs["static"].sequences, no_cache)


def kv(batch, length, fill):
    return torch.full((batch, 2, length, 4), float(fill))


def shared_rows_cache():
    cache = StaticCache(1, 3, 2, 4, max_cache_len=10)
    cache.share_rows()
    return cache


@pytest.mark.parametrize("make", [DynamicCache, lambda: StaticCache(1, 3, 2, 4, max_cache_len=10), shared_rows_cache])
def test_cache_contract(make):
    cache = make()
    k, v = cache.update(kv(3, 4, 1), kv(3, 4, 2), 0)
    assert k.shape == (3, 2, 4, 4) and cache.get_seq_length() == 4
    k, v = cache.update(kv(3, 2, 3), kv(3, 2, 4), 0)
    assert k.shape == (3, 2, 6, 4) and k[0, 0, :, 0].tolist() == [1, 1, 1, 1, 3, 3]
    cache.crop(5)
    assert cache.get_seq_length() == 5
    cache.crop(-2)
    assert cache.get_seq_length() == 3
    k, _ = cache.update(kv(3, 1, 9), kv(3, 1, 9), 0)
    assert k[0, 0, :, 0].tolist() == [1, 1, 1, 9]
    # Reorder rows: make row i carry a distinct value, then permute.
    rows = torch.arange(3, dtype=torch.float32)[:, None, None, None]
    cache.crop(0)
    cache.update(kv(3, 2, 0) + rows, kv(3, 2, 0) + rows, 0)
    cache.reorder(torch.tensor([2, 2, 0]))
    k, _ = cache.update(kv(3, 1, 7), kv(3, 1, 7), 0)
    assert k[:, 0, 0, 0].tolist() == [2, 2, 0]


def test_a_shared_rows_cache_reorders_as_copying_does():
    # Random reorders and fixed-shape writes: every row sees the same entries with either cache.
    g = torch.Generator().manual_seed(0)
    copying, shared = StaticCache(2, 4, 2, 3, max_cache_len=12), StaticCache(2, 4, 2, 3, max_cache_len=12)
    shared.share_rows()
    prompt = torch.randn(4, 2, 5, 3, generator=g)
    for cache in (copying, shared):
        cache.update(prompt, -prompt, 0)
        cache.update(prompt, prompt, 1)
    for slot in range(5, 12):
        order = torch.randint(0, 4, (4,), generator=g)
        key, value = torch.randn(4, 2, 1, 3, generator=g), torch.randn(4, 2, 1, 3, generator=g)
        slots = torch.tensor([slot])
        seen = []
        for cache in (copying, shared):
            cache.reorder(order)
            if cache.rows is not None:
                cache.claim(slots)
            seen.append([t[:, :, : slot + 1] for layer in (0, 1) for t in cache.write(key, value, layer, slots)])
        for a, b in zip(*seen):
            assert torch.equal(a, b)
    assert not torch.equal(shared.keys[0], copying.keys[0])  # the buffers themselves were never moved


def test_static_cache_overflow_is_a_clear_error():
    cache = StaticCache(1, 1, 2, 4, max_cache_len=3)
    with pytest.raises(ValueError, match="max_cache_len is 3"):
        cache.update(kv(1, 4, 0), kv(1, 4, 0), 0)


def test_generate_continues_from_a_given_cache(model):
    ids = torch.tensor([[5, 9, 14, 3, 7, 8]])
    full = model.generate(ids, max_new_tokens=8)
    cache = DynamicCache()
    model(ids[:, :4], past_key_values=cache)
    resumed = model.generate(ids, max_new_tokens=8, past_key_values=cache)
    assert torch.equal(full, resumed)
