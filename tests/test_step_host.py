"""A model's StepHost: the only holder of its compiled steps, its weight layout and the fallback policy; nothing kept
on the model's __dict__ by a helper or set on a step or a transformers cache from outside."""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch

from decodekit import AutoModelForCausalLM
from decodekit.core.compile import step_options
from decodekit.kernels import StepHost
from helpers import write_tiny_model
from tiny_transformers import transformers


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path_factory.mktemp("host") / "model", "llama"))


def test_a_native_model_declares_its_host_and_a_copy_starts_with_an_empty_one(llama):
    host = StepHost.of(llama)
    assert host is llama.module.step_host is StepHost.of(llama.module)  # the facade's and the module's: one host
    llama.generate(input_ids=torch.tensor([[5, 9, 13]]), max_new_tokens=3, compile=True)
    assert len(host.steps("fused")) >= 1
    assert "_compiled_steps" not in vars(llama.module)
    twin = copy.deepcopy(llama.module)
    assert twin.step_host is not host and not twin.step_host.steps("fused")
    assert twin.step_host.lock is not host.lock


def test_any_other_module_gets_one_host_kept_for_it():
    module = torch.nn.Linear(2, 2)
    assert StepHost.of(module) is StepHost.of(module)
    assert StepHost.of(module) is not StepHost.of(torch.nn.Linear(2, 2))
    assert "step_host" not in vars(module)


def test_a_failed_step_is_dropped_for_good_and_told_once(caplog):
    host = StepHost()
    made = []
    step = host.step("fused", "k", lambda: made.append(1) or "a step")
    assert step == "a step" and host.step("fused", "k", lambda: made.append(1)) == "a step" and made == [1]
    with caplog.at_level(logging.WARNING, logger="decodekit"):
        for _ in range(2):
            why = host.failed("fused", "k", AssertionError("no graph\nmore"), "the step failed", redo=True)
    assert why == "AssertionError: no graph" and host.failure("fused", "k") == why
    assert caplog.text.count("the step failed (AssertionError: no graph)") == 1
    assert host.step("fused", "k", lambda: made.append(1)) is None and made == [1]  # not made again: eager
    assert "k" not in host.steps("fused") and host.failure("fused", "other") is None


def test_a_failure_after_results_were_handed_out_goes_to_the_caller():
    host = StepHost()
    with pytest.raises(ValueError, match="bad input"):
        host.failed("fused", "k", ValueError("bad input"), "the step failed", redo=False)


def test_the_layout_is_held_by_one_thread_and_if_free_never_waits(llama):
    host = StepHost.of(llama)
    seen = []
    with host.layout(llama.module, 1):
        worker = threading.Thread(target=lambda: seen.append(host.if_free().__enter__()))
        worker.start()
        worker.join()
        with host.if_free() as mine:  # the holder's own thread takes it again (reentrant)
            assert mine
    assert seen == [False]
    with host.if_free() as free:
        assert free


def test_a_call_refused_by_another_thread_stays_off_to_its_end(llama):
    host = StepHost.of(llama)
    hold = host.call_hold(llama.module)
    held = threading.Event()
    release = threading.Event()

    def other():
        with host.layout(llama.module, 1):
            held.set()
            release.wait()

    worker = threading.Thread(target=other)
    worker.start()
    held.wait()
    assert hold.hold(1) is None and hold.refused
    release.set()
    worker.join()
    assert hold.hold(1) is None  # one path for the whole call
    hold.close()
    fresh = host.call_hold(llama.module)
    assert fresh.hold(1) is not None and fresh.held
    fresh.close()
    with host.if_free() as free:
        assert free  # closed: the lock is released


def test_a_compiled_method_call_leaves_nothing_on_its_cache_and_gives_it_memory_of_its_own(llama):
    cache = transformers.DynamicCache(config=llama.as_transformers().config)
    before = set(vars(cache))
    with llama.for_method(compile=step_options(None, torch.device("cpu"))) as view:
        out = view(torch.tensor([[5, 9, 13, 2]]), cache=cache)
        for _ in range(3):
            out = view(out.logits[:, -1].argmax(-1, keepdim=True), cache=cache)
        step = next(iter(StepHost.of(llama).steps("method decode").values()))
        assert cache.layers[0].keys.data_ptr() == step.cache.keys[0].data_ptr()  # a view of the step's buffers
    assert set(vars(cache)) == before
    buffers = {t.data_ptr() for t in (*step.cache.keys, *step.cache.values)}
    assert not buffers & {t.data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)}
    assert step.mirror is None and cache.get_seq_length() == 7


def test_an_eager_call_runs_the_fused_step_where_the_layout_is_free_and_never_waits_for_it(llama):
    ids = torch.tensor([[5, 9, 13, 2]])
    host = StepHost.of(llama)
    before = {key for key in host.steps("fused") if key[3] is None}
    free = llama.generate(ids, max_new_tokens=6, do_sample=False)
    assert {key for key in host.steps("fused") if key[3] is None} - before  # its uncompiled step, kept by the host
    done = []
    with host.if_free() as held:  # this thread holds the layout, as another call's step would
        assert held
        worker = threading.Thread(target=lambda: done.append(llama.generate(ids, max_new_tokens=6, do_sample=False)))
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive() and torch.equal(done[0], free)  # ran the eager loop: no wait, the same tokens
