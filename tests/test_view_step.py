"""compile=True for a Hub method's own loop on a native model (facade/view_step.py): its one-token forwards run as a
compiled step over a static mirror of the method's transformers cache, with the tokens the eager view gives (and so
transformers'), for every loop style in tests/published_methods.py; what it cannot serve runs eagerly, saying why."""

from __future__ import annotations

import logging

import pytest
import torch

from decodekit import AutoModelForCausalLM
from decodekit.core.compile import FusedStep, step_options
from decodekit.kernels import StepHost
from helpers import write_tiny_model
from methods import TRANSFORMERS_INTERNALS, write_method
from published_methods import BEAM_LOOP, CACHELESS, CONTRASTIVE, ROLLBACK, SINK_CACHE, TOP_N_SIGMA
from tiny_transformers import PAD, transformers

STATIC_CROPS = hasattr(transformers.cache_utils.StaticLayer, "crop")
PROMPT = torch.tensor([[5, 9, 13, 2, 7]])
STUCK = torch.tensor([[3, 3, 3]])
PADDED = torch.tensor([[PAD, PAD, 5, 9, 13], [4, 8, 12, 2, 7]])
PADDED_MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
CPU = step_options(None, torch.device("cpu"))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param) / "model", request.param)


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    root = tmp_path_factory.mktemp("methods")
    sources = dict(
        cacheless=CACHELESS,
        top_n_sigma=TOP_N_SIGMA,
        beams=BEAM_LOOP,
        rollback=ROLLBACK,
        contrastive=CONTRASTIVE,
        sink=SINK_CACHE,
        internals=TRANSFORMERS_INTERNALS,
    )
    return {name: str(write_method(root / name, source)) for name, source in sources.items()}


@pytest.fixture
def steps(monkeypatch):
    """How many compiled steps ran (every compiled FusedStep's call is counted)."""
    calls = []
    original = FusedStep.__call__
    monkeypatch.setattr(
        FusedStep, "__call__", lambda self, *a: (self.compiles and calls.append(1)) or original(self, *a)
    )
    return calls


# (repo, options, whether its forwards are compiled steps)
CASES = {
    "cacheless": ("cacheless", dict(input_ids=PROMPT, n_sigma=1.5), True),
    "cacheless padded": ("cacheless", dict(input_ids=PADDED, attention_mask=PADDED_MASK), True),
    "loop handed to generate()": ("top_n_sigma", dict(input_ids=PROMPT, n_sigma=1.5, eos_token_id=None), True),
    "loop handed to generate(), padded": (
        "top_n_sigma",
        dict(input_ids=PADDED, attention_mask=PADDED_MASK, pad_token_id=PAD, eos_token_id=None),
        True,
    ),
    "beam loop": ("beams", dict(input_ids=PROMPT, num_beams=3), True),
    "beam loop padded": ("beams", dict(input_ids=PADDED, attention_mask=PADDED_MASK, num_beams=2), True),
    "rollback, dynamic cache": ("rollback", dict(input_ids=STUCK), True),
    "rollback, static cache": ("rollback", dict(input_ids=STUCK, cache_kind="static"), True),
    "internals loop": ("internals", dict(input_ids=PROMPT, repetition_penalty=1.3, eos_token_id=None), True),
    "contrastive search": ("contrastive", dict(input_ids=PROMPT, penalty_alpha=0.6, top_k=4, eos_token_id=None), False),
    "sink cache": ("sink", dict(input_ids=PROMPT, sink=2, window=8), False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_loop_style_compiled_gives_its_eager_tokens(checkpoint, repos, dtype, steps, caplog):
    native = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(checkpoint) if dtype == torch.float32 else None
    for case, (name, options, compiled) in CASES.items():
        if options.get("cache_kind") == "static" and not STATIC_CROPS:
            continue
        call = dict(max_new_tokens=8, custom_generate=repos[name], trust_remote_code=True, **options)
        eager = native.generate(**call)
        before = len(steps)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="decodekit"):
            got = native.generate(**call, compile=True)
        assert torch.equal(got, eager), (case, eager.tolist(), got.tolist())
        if compiled:
            assert len(steps) - before >= 6, case  # a token a step, the first from the eager prefill
            assert "runs eagerly" not in caplog.text, case
        else:
            assert len(steps) == before and caplog.text.count("a forward runs eagerly") == 1, case
        if theirs is not None:  # and so transformers' own tokens, as the eager view gives them
            assert torch.equal(got, theirs.generate(**call)), case


def test_seeded_sampling_compiled_gives_its_eager_tokens(checkpoint, repos, steps):
    native = AutoModelForCausalLM.from_pretrained(checkpoint)
    for name in ("cacheless", "top_n_sigma"):
        for seed in (0, 1, 2):
            call = dict(input_ids=PROMPT, max_new_tokens=8, do_sample=True, n_sigma=2.0, eos_token_id=None)
            call.update(custom_generate=repos[name], trust_remote_code=True)
            torch.manual_seed(seed)
            eager = native.generate(**call)
            torch.manual_seed(seed)
            assert torch.equal(native.generate(**call, compile=True), eager), (name, seed)
    assert steps


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(
        write_tiny_model(tmp_path_factory.mktemp("llama") / "model", "llama", max_position_embeddings=1024)
    )


def both_views(model):
    """(the plain view: every forward the native module's own, no step and no mirror: the reference; a view whose
    one-token forwards are compiled steps), entered for the test's duration."""
    import contextlib

    return contextlib.nullcontext(model.as_transformers()), model.for_method(compile=CPU)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def same_caches(a, b):
    assert a.get_seq_length() == b.get_seq_length()
    for mine, reference in zip(a.layers, b.layers, strict=True):
        close(mine.keys, reference.keys)
        close(mine.values, reference.values)


def test_the_mirrored_dynamic_cache_answers_every_call_a_method_makes(llama, steps):
    """Each Cache call methods make, on the compiled view's DynamicCache and on the eager view's, alike: the logits
    and the caches' contents agree after every one (crop, reorder, batch_repeat_interleave, batch_select_indices,
    reset, layer reads)."""
    eager_ctx, compiled_ctx = both_views(llama)
    with eager_ctx as eager, compiled_ctx as compiled:
        caches = [transformers.DynamicCache(config=eager.config), transformers.DynamicCache(config=eager.config)]
        prompt = torch.tensor([[5, 9, 13, 2, 7], [4, 8, 12, 2, 6]])

        def forward(ids, **kw):
            outs = [view(ids, cache=cache, **kw) for view, cache in zip((eager, compiled), caches)]
            close(outs[1].logits, outs[0].logits)
            same_caches(caches[1], caches[0])
            return outs[0].logits[:, -1].argmax(-1, keepdim=True)

        def both(call, *args):
            for cache in caches:
                getattr(cache, call)(*args)
            same_caches(caches[1], caches[0])

        token = forward(prompt)
        for _ in range(3):
            token = forward(token)
        both("crop", -2)
        token = forward(token)
        both("reorder_cache", torch.tensor([1, 0]))
        token = forward(token)
        both("batch_repeat_interleave", 2)
        token = forward(token.repeat_interleave(2, dim=0))
        both("batch_select_indices", torch.tensor([0, 3]))
        token = forward(token[[0, 3]])
        forward(torch.cat([token, token], dim=1))  # two tokens: eager, the mirror follows after
        token = forward(token)
        both("reset")
        token = forward(prompt)
        forward(token)
        assert len(steps) >= 9


def test_the_mirror_grows_past_its_first_capacity(llama, steps):
    eager_ctx, compiled_ctx = both_views(llama)
    with eager_ctx as eager, compiled_ctx as compiled:
        caches = [transformers.DynamicCache(config=eager.config) for _ in range(2)]
        ids = torch.arange(3, 3 + 253)[None] % 90 + 3  # the step's first bucket holds 256 positions
        outs = [view(ids, cache=cache) for view, cache in zip((eager, compiled), caches)]
        for _ in range(6):
            token = outs[0].logits[:, -1].argmax(-1, keepdim=True)
            outs = [view(token, cache=cache) for view, cache in zip((eager, compiled), caches)]
            close(outs[1].logits, outs[0].logits)
        same_caches(caches[1], caches[0])
        assert caches[1].get_seq_length() == 259 and len(steps) == 6


def test_two_caches_taking_turns_on_one_step_keep_their_own_contents(llama, steps):
    """Two sequences decoded in turns (a guidance-style method): the step's buffers serve one cache at a time, and the
    one they leave keeps what it held."""
    eager_ctx, compiled_ctx = both_views(llama)
    with eager_ctx as eager, compiled_ctx as compiled:
        pairs = [[transformers.DynamicCache(config=eager.config) for _ in range(2)] for _ in range(2)]
        tokens = []
        for pair, prompt in zip(pairs, (PROMPT, STUCK)):
            outs = [view(prompt, cache=cache) for view, cache in zip((eager, compiled), pair)]
            tokens.append(outs[0].logits[:, -1].argmax(-1, keepdim=True))
        for _ in range(3):
            for index, pair in enumerate(pairs):
                outs = [view(tokens[index], cache=cache) for view, cache in zip((eager, compiled), pair)]
                close(outs[1].logits, outs[0].logits)
                tokens[index] = outs[0].logits[:, -1].argmax(-1, keepdim=True)
        for reference, mine in pairs:
            same_caches(mine, reference)
        assert len(steps) == 6


@pytest.mark.skipif(not STATIC_CROPS, reason="transformers' StaticCache crops from 5.24 on")
def test_a_static_cache_cropped_and_rewritten_eagerly_is_read_as_rewritten(llama, steps):
    """A StaticCache keeps its own buffers, written by the step through its update(). Cropped, then written again by an
    eager multi-token forward, its new positions are what the next compiled step reads, not the mirror's old ones."""
    eager_ctx, compiled_ctx = both_views(llama)
    with eager_ctx as eager, compiled_ctx as compiled:
        caches = [transformers.StaticCache(config=eager.config, max_cache_len=32) for _ in range(2)]

        def forward(ids):
            outs = [view(ids, cache=cache) for view, cache in zip((eager, compiled), caches)]
            close(outs[1].logits, outs[0].logits)
            return outs[0].logits[:, -1].argmax(-1, keepdim=True)

        token = forward(PROMPT)
        for _ in range(3):
            token = forward(token)
        for cache in caches:
            cache.crop(-2)
        forward(torch.tensor([[40, 41]]))  # other tokens at the two positions the mirror held
        forward(token)
        assert int(caches[1].get_seq_length()) == int(caches[0].get_seq_length()) == 9 and len(steps) == 4


def test_a_cacheless_method_is_served_incrementally_with_the_full_forwards_logits(llama, steps, monkeypatch):
    """model(input_ids) on the whole sequence every step: where a call extends the previous one, only its new
    positions run (a compiled step for one token a row, when compiling; eagerly otherwise), and the logits of every
    position are the full forward's (use_cache=False runs it whole: the reference)."""
    lengths = []
    forward = type(llama.module).forward
    monkeypatch.setattr(type(llama.module), "forward", lambda m, *a, **k: lengths.append(
        (k.get("input_ids") if k.get("input_ids") is not None else a[0]).shape[1]) or forward(m, *a, **k))  # fmt: skip
    eager_ctx, compiled_ctx = both_views(llama)
    with eager_ctx as eager, compiled_ctx as compiled:
        for view, expected_steps in ((eager, 0), (compiled, 3)):
            ids, mask = PADDED, PADDED_MASK
            del lengths[:]
            view(ids, attention_mask=mask)
            calls = []
            for grow in (1, 1, 2, 1):  # by one token (a compiled step when compiling) or two (eagerly)
                new = torch.arange(grow)[None].repeat(2, 1) + 20 + ids.shape[1]
                ids, mask = torch.cat([ids, new], dim=1), torch.cat([mask, torch.ones_like(new)], dim=1)
                calls.append((ids, mask, view(ids, attention_mask=mask).logits))
            assert len(steps) == expected_steps
            # The whole prompt once, then only what each call added (a compiled step runs no Python forward).
            assert lengths[0] == 5 and all(n <= 2 for n in lengths[1:]), lengths
            for ids, mask, got in calls:
                real = mask.bool()  # a padding position's logits are nobody's
                close(got[real], eager(ids, attention_mask=mask, use_cache=False).logits[real])
        other = ids.clone()
        other[:, -3] += 1  # not an extension of the previous call: run whole, the same logits
        whole = eager(other, attention_mask=mask, use_cache=False).logits
        close(compiled(other, attention_mask=mask).logits[mask.bool()], whole[mask.bool()])
        assert len(steps) == 3


def test_a_step_that_does_not_compile_runs_eagerly_saying_so(llama, repos, monkeypatch, caplog):
    import decodekit.facade.view_step as view_step

    call = dict(input_ids=PROMPT, max_new_tokens=6, custom_generate=repos["cacheless"], trust_remote_code=True)
    eager = llama.generate(**call)
    made = view_step.one_token_forward

    def untraceable(module, cache):
        step = made(module, cache)

        def broken(*args):
            torch._dynamo.graph_break()  # fullgraph=True refuses it; run eagerly, nothing
            return step(*args)

        return broken

    monkeypatch.setattr(view_step, "one_token_forward", untraceable)
    monkeypatch.setattr(llama.module, "step_host", StepHost())  # steps made and failed here go with the test
    with caplog.at_level(logging.INFO, logger="decodekit"):
        assert torch.equal(llama.generate(**call, compile=True), eager)
    assert caplog.text.count("the step did not compile") == 1


def test_compile_for_a_method_is_asked_for_as_for_generate(llama, repos, steps):
    call = dict(input_ids=PROMPT, max_new_tokens=6, custom_generate=repos["cacheless"], trust_remote_code=True)
    eager = llama.generate(**call)
    assert torch.equal(llama.generate(**call, compile=False), eager) and not steps
    assert torch.equal(llama.generate(**call, compile_config={"mode": "default"}), eager) and steps
    with pytest.raises(ValueError, match="compile"):
        llama.generate(**call, compile="yes")
    with pytest.raises(ValueError, match="compile_config"):
        llama.generate(**call, compile_config={"modes": "default"})


def test_the_cli_compiles_a_methods_steps(tmp_path, repos, steps, capsys):
    from decodekit.cli import main

    argv = ["generate", "The capital of France is", "--max-new-tokens", "4"]
    argv += ["--custom-generate", repos["cacheless"], "--trust-remote-code"]
    assert main(argv) == 0
    eager = capsys.readouterr().out
    assert main([*argv, "--compile"]) == 0
    assert capsys.readouterr().out == eager and steps


def test_a_chat_compiles_its_methods_steps(default_model, repos, steps):
    import io

    from decodekit.chat import ChatSession
    from decodekit.cli.arguments import generation_kwargs
    from decodekit.cli.parser import build_parser

    model, tokenizer = default_model
    fields = generation_kwargs(build_parser().parse_args(["chat", "--compile", "--max-new-tokens", "5"]))
    assert fields["compile"] is True
    replies = []
    for session_fields in ({k: v for k, v in fields.items() if k != "compile"}, fields):
        session = ChatSession(model, tokenizer, session_fields, method=repos["cacheless"], out=io.StringIO())
        session.trust_for = lambda method: True
        replies.append(session.reply("The capital of France is"))
    assert replies[0] == replies[1] and steps


def test_two_threads_running_methods_on_one_model_get_their_own_tokens(llama, repos):
    """The steps' buffers are the model's: methods in two threads take them in turns, each keeping its own cache."""
    import threading

    prompts = [PROMPT, STUCK, torch.tensor([[7, 7, 1, 9]]), torch.tensor([[11, 4]])]
    calls = [dict(input_ids=p, max_new_tokens=12, custom_generate=repos[name], trust_remote_code=True)
             for p in prompts for name in ("cacheless", "rollback")]  # fmt: skip
    alone = [llama.generate(**call) for call in calls]
    got = [None] * len(calls)

    errors = []

    def run(indices):
        try:
            for index in indices:
                got[index] = llama.generate(**calls[index])
        except Exception as error:  # noqa: BLE001 - reported below, with the thread's traceback
            import traceback

            errors.append("".join(traceback.format_exception(error)))

    threads = [threading.Thread(target=run, args=(range(start, len(calls), 2),)) for start in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    assert all(torch.equal(a, b) for a, b in zip(got, alone))


WHOLE_SEQUENCES = """
import torch
from transformers import DynamicCache


def generate(model, input_ids, max_new_tokens=4, hidden=False, **kwargs):
    # As DoLa, SLED and cognitive-compression loops do: every forward runs the whole sequence, none one token a row.
    for _ in range(max_new_tokens):
        out = model(input_ids, past_key_values=DynamicCache(), use_cache=True, output_hidden_states=hidden)
        input_ids = torch.cat([input_ids, out.logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
    return input_ids
"""


@pytest.mark.parametrize(
    "hidden,reason",
    [(False, "every forward of the call ran several tokens a row"), (True, "it asks for hidden states")],
    ids=["several tokens", "hidden states"],
)
def test_a_method_without_one_token_forwards_is_told_once_why_it_ran_eagerly(llama, tmp_path, caplog, hidden, reason):
    repo = str(write_method(tmp_path / "whole", WHOLE_SEQUENCES))
    call = dict(input_ids=PROMPT, custom_generate=repo, trust_remote_code=True, max_new_tokens=4, hidden=hidden)
    eager = llama.generate(**call)
    with caplog.at_level(logging.INFO, logger="decodekit"):
        got = llama.generate(**call, compile=True)
    assert torch.equal(got, eager)
    assert caplog.text.count("a forward runs eagerly") == 1 and reason in caplog.text, caplog.text


@pytest.mark.parametrize("which", [0, -1])
def test_a_cache_missing_a_layer_fails_as_transformers_does_not_carried_on(llama, which):
    # The step's mirror went over the layers the cache had left, and the method carried on with one layer's keys
    # gone; transformers' forward raises IndexError, and so does the view's, compiled or not.
    for view in both_views(llama):
        with view as model:
            cache = transformers.DynamicCache(config=model.config)
            model(PROMPT, past_key_values=cache, use_cache=True)
            model(PROMPT[:, -1:], past_key_values=cache, use_cache=True)  # the step takes the cache
            del cache.layers[which]
            with pytest.raises(IndexError):
                model(PROMPT[:, -1:], past_key_values=cache, use_cache=True)


def test_a_model_repos_own_method_compiles_its_steps_as_custom_generate_does(tmp_path, steps):
    # One Hub route (core.generate.prepare_method_call): before, a method bound at from_pretrained got compile= and
    # compile_config among its own arguments and never a compiled step.
    repo = write_method(write_tiny_model(tmp_path / "model", "llama"), TOP_N_SIGMA)
    model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)
    eager = model.generate(input_ids=PROMPT, max_new_tokens=6)
    assert not steps
    assert torch.equal(model.generate(input_ids=PROMPT, max_new_tokens=6, compile=True), eager) and steps
    with pytest.raises(ValueError, match="compile_config"):
        model.generate(input_ids=PROMPT, max_new_tokens=6, compile_config={"modes": "default"})


@pytest.mark.parametrize("route", ["custom_generate", "bound"])
def test_a_loop_methods_config_is_validated_once_whichever_route(tmp_path, repos, route):
    # Before: the fields were merged into the method's config outside call_config and never checked, so a loop
    # method ran with top_p=3.0 (or failed somewhere inside its loop).
    if route == "bound":
        repo = write_method(write_tiny_model(tmp_path / "model", "llama"), TOP_N_SIGMA)
        model, call = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True), {}
    else:
        model = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "model", "llama"))
        call = dict(custom_generate=repos["top_n_sigma"], trust_remote_code=True)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(input_ids=PROMPT, max_new_tokens=4, top_p=3.0, **call)
