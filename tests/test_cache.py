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
        kind: model.generate(ids, attention_mask=mask, max_new_tokens=20, cache_implementation=kind, return_dict_in_generate=True)
        for kind in ("static", "dynamic")
    }
    assert isinstance(outs["static"].past_key_values, StaticCache)
    assert isinstance(outs["dynamic"].past_key_values, DynamicCache)
    assert torch.equal(outs["static"].sequences, outs["dynamic"].sequences)
    no_cache = model.generate(ids, attention_mask=mask, max_new_tokens=20, use_cache=False)
    assert torch.equal(outs["static"].sequences, no_cache)


def kv(batch, length, fill):
    return torch.full((batch, 2, length, 4), float(fill))


@pytest.mark.parametrize("make", [DynamicCache, lambda: StaticCache(1, 3, 2, 4, max_cache_len=10)])
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
