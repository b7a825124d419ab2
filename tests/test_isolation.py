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


# Processors that declare score_only (so they may run inside a compiled step and in continuous batching's shared
# pass) whose behaviour their key must tell apart. Two methods' classes of one name, their token in the class body:
SAME_NAME = """
from decodekit import hookimpl
from decodekit.core.processors import Processor


class Rule(Processor):
    score_only = True
    token = {token}

    def __call__(self, input_ids, scores):
        {body}
        return scores


@hookimpl
def decodekit_logits_processors(generation_config):
    return [Rule()]
"""
BAN = "scores = scores.clone(); scores[:, self.token] = -float('inf')"
FORCE = "scores = torch.full_like(scores, -float('inf')); scores[:, self.token] = 0.0"

# A class made inside the hook, reading the request's value through a closure.
CLOSURE = """
import torch
from decodekit import hookimpl
from decodekit.core.processors import Processor


@hookimpl
def decodekit_config_fields():
    return {"forced_token": None}


@hookimpl
def decodekit_logits_processors(generation_config):
    token = generation_config.forced_token

    class Force(Processor):
        score_only = True

        def __call__(self, input_ids, scores):
            scores = torch.full_like(scores, -float("inf"))
            scores[:, token] = 0.0
            return scores

    return [] if token is None else [Force()]
"""


def _rules(tmp_path, token):
    ban = write_method(tmp_path / "ban", "import torch\n" + SAME_NAME.format(token=token, body=BAN))
    force = write_method(tmp_path / "force", "import torch\n" + SAME_NAME.format(token=token, body=FORCE))
    return str(ban), str(force)


def test_processors_of_one_name_or_one_closure_are_never_shared_between_requests(tmp_path):
    # Before: the shared pass ran the first request's processors on every row with an equal key (class name and
    # vars), so a client banning a token got another client's forcing of it (answered 200).
    model = tiny_model(tmp_path / "model", "llama").eval()
    prompt = PROMPTS[0]
    token = model.generate(torch.tensor([prompt]), max_new_tokens=1)[0, -1].item()
    ban, force = _rules(tmp_path, token)
    closure = str(write_method(tmp_path / "closure", CLOSURE))
    calls = [
        dict(custom_generate=force),
        dict(custom_generate=ban),
        dict(custom_generate=closure, forced_token=11),
        dict(custom_generate=closure, forced_token=7),
    ]
    for call in calls:
        call.update(max_new_tokens=5, eos_token_id=None, trust_remote_code=True)
    alone = [model.generate(torch.tensor([prompt]), **call)[0, len(prompt) :].tolist() for call in calls]
    assert alone[0] == [token] * 5 and token not in alone[1] and alone[2] == [11] * 5 and alone[3] == [7] * 5
    with model.init_continuous_batching() as manager:
        ids = [manager.add_request(prompt, **call) for call in calls]
        got = [manager.get_result(rid, timeout=PATIENCE) for rid in ids]
    assert [out.generated_tokens for out in got] == alone


def test_a_compiled_step_is_not_reused_for_a_processor_it_cannot_prove_equal(tmp_path):
    # Before: generate(compile=True) forcing token 11 after a call forcing 7 reused the first call's step: [11, 7, 7, 7].
    model = tiny_model(tmp_path / "model", "llama").eval()
    ban, force = _rules(tmp_path, 5)
    closure = str(write_method(tmp_path / "closure", CLOSURE))
    prompt = torch.tensor([PROMPTS[0]])
    call = dict(max_new_tokens=4, eos_token_id=None, trust_remote_code=True, compile=True)
    for method, options, want in [
        (closure, dict(forced_token=7), [7] * 4),
        (closure, dict(forced_token=11), [11] * 4),
        (force, {}, [5] * 4),
    ]:
        out = model.generate(prompt, custom_generate=method, **options, **call)[0, prompt.shape[1] :].tolist()
        assert out == want, (method, options, out)
    out = model.generate(prompt, custom_generate=ban, **call)[0, prompt.shape[1] :].tolist()
    assert 5 not in out
