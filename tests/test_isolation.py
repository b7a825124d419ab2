"""A method's hooks apply to its own call only: a per-call plugin set (a context variable), never the process's
registry, so threads running other methods, or none, never see them."""

from __future__ import annotations

import threading

import torch

from decodekit.batching import RequestStatus
from decodekit.testing import tiny_model

from helpers import PATIENCE
from methods import write_method

BANS = '''
"""Bans token {token} at every step, whatever the config says."""
from decodekit import hookimpl


@hookimpl
def decodekit_logits_processors(generation_config):
    def ban(input_ids, scores):
        scores = scores.clone()
        scores[:, {token}] = -float("inf")
        return scores

    return [ban]
'''

PROMPTS = [[1, 2, 3], [7, 8, 9, 10], [4, 4, 5]]


def test_methods_in_four_threads_stay_in_their_own_calls(tmp_path):
    model = tiny_model(tmp_path / "model", "llama").eval()
    plain = {
        tuple(p): model.generate(torch.tensor([p]), max_new_tokens=6, eos_token_id=None)[0, len(p) :].tolist()
        for p in PROMPTS
    }
    # Each method bans the first token plain greedy gives for the first prompt / the second: a leak shows.
    methods = [write_method(tmp_path / f"ban{i}", BANS.format(token=plain[tuple(PROMPTS[i])][0])) for i in range(2)]
    expected = {}
    for i, method in enumerate([None, *methods]):
        for p in PROMPTS:
            kwargs = {"custom_generate": str(method), "trust_remote_code": True} if method else {}
            expected[(i, tuple(p))] = model.generate(torch.tensor([p]), max_new_tokens=6, eos_token_id=None, **kwargs)[
                0, len(p) :
            ].tolist()
    assert expected[(1, tuple(PROMPTS[0]))] != plain[tuple(PROMPTS[0])]
    assert expected[(2, tuple(PROMPTS[1]))] != plain[tuple(PROMPTS[1])]

    got, errors, start = [], [], threading.Barrier(4)

    def worker(which: int):
        try:
            start.wait()
            for round in range(6):
                p = PROMPTS[round % len(PROMPTS)]
                method = methods[which - 1] if which else None
                kwargs = {"custom_generate": str(method), "trust_remote_code": True} if method else {}
                out = model.generate(torch.tensor([p]), max_new_tokens=6, eos_token_id=None, **kwargs)
                got.append(((which, tuple(p)), out[0, len(p) :].tolist()))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(which,)) for which in (0, 0, 1, 2)]  # two plain, two methods
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == 24 and all(tokens == expected[key] for key, tokens in got)


def test_a_method_in_continuous_batching_stays_in_its_own_request(tmp_path):
    model = tiny_model(tmp_path / "model", "llama").eval()
    prompt = PROMPTS[0]
    plain = model.generate(torch.tensor([prompt]), max_new_tokens=5, eos_token_id=None)[0, len(prompt) :].tolist()
    method = write_method(tmp_path / "ban", BANS.format(token=plain[0]))
    with model.init_continuous_batching() as manager:
        banned = manager.add_request(
            prompt, max_new_tokens=5, eos_token_id=None, custom_generate=str(method), trust_remote_code=True
        )
        alone = manager.add_request(prompt, max_new_tokens=5, eos_token_id=None)
        out_banned, out_alone = (
            manager.get_result(banned, timeout=PATIENCE),
            manager.get_result(alone, timeout=PATIENCE),
        )
    assert out_alone.status == out_banned.status == RequestStatus.FINISHED
    assert out_alone.generated_tokens == plain and plain[0] not in out_banned.generated_tokens
