"""Continuous batching: the paged cache's attention, and the manager's results against generate() run alone."""

from __future__ import annotations

import logging
import random
import re
import threading
import time

import pytest
import torch

from decodekit.batching import QueueFull, RequestStatus
from decodekit.batching.paged import PagedBatch, PagedCache, Segment
from decodekit.kernels import StepHost
from decodekit.kernels import cpu, native
from decodekit.testing import tiny_model

from methods import HOOK_METHOD, write_method
from helpers import PATIENCE


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("batching"), "llama").eval()


def alone(model, prompt, **kwargs) -> list[list[int]]:
    """generate() on one prompt: its rows' generated tokens, the padding after an EOS dropped."""
    out = model.generate(torch.tensor([prompt]), **kwargs)[:, len(prompt) :].tolist()
    eos = model.generation_config.eos_token_ids
    return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in out]


def each_as_alone(manager, model, requests) -> None:
    """Adds `requests` ((prompt, fields) each), runs the manager until idle and checks every result: finished, with
    the sequences generate() gives that request alone."""
    ids = [manager.add_request(prompt, **fields) for prompt, fields in requests]
    manager.run(until_idle=True)
    for (prompt, fields), rid in zip(requests, ids):
        out = manager.get_result(rid, timeout=0)
        assert out.status == RequestStatus.FINISHED, out.error
        assert out.sequences == alone(model, prompt, **fields), fields


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3"])  # mistral's tiny config has a sliding window
@pytest.mark.parametrize("native", [True, False], ids=["cpp-kernel", "gathered-sdpa"])
def test_chunked_paged_forward_equals_one_forward(tmp_path, model_type, native):
    if native and not cpu.has("native_kernels"):
        pytest.skip("decodekit's C++ kernels are off on this machine")
    m = tiny_model(tmp_path, model_type).eval()
    ids = torch.randint(0, m.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), cpu.forced(native_kernels=native):
        expected = m(ids).logits[0]
        cache = PagedCache(m, num_blocks=16, block_size=4)
        table = cache.allocator.allocate(6)[::-1]  # blocks out of order: positions go through the table
        chunks = []
        for a, b in [(0, 7), (7, 14), (14, 20), (20, 21)]:
            batch = PagedBatch(cache, [table], [Segment(0, b - a, 0, a)])
            chunks.append(m(ids[:, a:b], position_ids=batch.position_ids, past_key_values=batch).logits[0])
    torch.testing.assert_close(torch.cat(chunks), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("native", [True, False], ids=["cpp-kernel", "torch-attention"])
def test_a_mixed_step_of_prompt_chunks_and_decode_rows_equals_each_rows_own_forward(tmp_path, model_type, native):
    # One forward holding two requests' decode rows around a third's prompt chunk (what a step admitting a request
    # runs): each token's logits equal its sequence's own full forward. Without the C++ kernel (CUDA, other dtypes)
    # the decode rows attend in one decode_attention call beside the chunk's gathered attention.
    if native and not cpu.has("native_kernels"):
        pytest.skip("decodekit's C++ kernels are off on this machine")
    m = tiny_model(tmp_path, model_type).eval()
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, m.config.vocab_size, (n,), generator=gen) for n in (14, 10, 7)]
    with torch.inference_mode(), cpu.forced(native_kernels=native):
        expected = [m(s[None]).logits[0] for s in seqs]
        cache = PagedCache(m, num_blocks=24, block_size=4)
        tables = [cache.allocator.allocate(4)[::-1] for _ in seqs]
        first = PagedBatch(cache, tables[:2], [Segment(0, 12, 0, 0), Segment(12, 20, 1, 0)])
        m(torch.cat((seqs[0][:12], seqs[1][:8]))[None], position_ids=first.position_ids, past_key_values=first)
        logits = []
        for a, b in ((12, 13), (13, 14)):  # the first request decodes twice, beside a chunk, then beside a row
            other = [(seqs[2][:6], Segment(1, 7, 2, 0)), (seqs[2][6:7], Segment(1, 2, 2, 6))][a - 12]
            segments = [Segment(0, 1, 0, a), other[1], Segment(other[1].end, other[1].end + 1, 1, a - 4)]
            ids = torch.cat((seqs[0][a:b], other[0], seqs[1][a - 4 : b - 4]))[None]
            batch = PagedBatch(cache, tables, segments)
            logits.append(m(ids, position_ids=batch.position_ids, past_key_values=batch).logits[0])
    torch.testing.assert_close(logits[0][0], expected[0][12], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[0][1:7], expected[2][:6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[0][7], expected[1][8], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1][0], expected[0][13], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1][1], expected[2][6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1][2], expected[1][9], atol=1e-4, rtol=1e-4)


def paged_case(dtype, tokens, head_dim, seed=1, H=6, KV=3):
    """Tokens of `tokens` rows at different positions (up to 48: runs of 8 and a part), blocks of 4 out of order and
    one shared, over H query and KV kv heads: the operands of decodekit::paged_attention but the window."""
    gen = torch.Generator().manual_seed(seed)
    bs, blocks = 4, 60
    keys, values = (torch.randn(blocks * bs, KV, head_dim, generator=gen).to(dtype) for _ in range(2))
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:12] for _ in range(tokens)])
    tables[-1, :2] = tables[0, :2]  # a shared prompt block
    positions = torch.randint(0, 12 * bs, (tokens,), generator=gen)
    owner = torch.arange(tokens).flip(0)
    positions[0] = 0  # a row's first token sees only itself
    positions[-1] = 12 * bs - 1  # and one sees six whole runs
    slots = tables[owner, positions // bs] * bs + positions % bs
    q = torch.randn(tokens, H, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(tokens, KV, head_dim, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, keys, values, slots, tables, owner, positions, bs


def paged_kernel(case, window, threads=1):
    """decodekit::paged_attention on copies of the case's pools (it writes the tokens' keys and values there)."""
    q, k, v, keys, values, *rest = case
    keys, values = keys.clone(), values.clone()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.ops.decodekit.paged_attention(q, k, v, keys, values, *rest, window)
    finally:
        torch.set_num_threads(saved)
    return out, keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [2, 9], ids=["split-by-kv-head", "whole-token"])
@pytest.mark.parametrize("window", [0, 5, 21])
@pytest.mark.parametrize("head_dim", [16, 20, 64])
def test_paged_attention_kernel_equals_attention_over_each_rows_positions(dtype, tokens, window, head_dim):
    # With one thread, 2 tokens split each token's kv heads into tasks and 9 keep them whole (the kernel's two
    # task layouts); rows at different positions, blocks out of order and shared, keys written by the call. The
    # kernel reads runs of 8 positions, keys and values in one pass: windows that start inside a run, runs cut short
    # at the end, and a head_dim (20) whose last columns are summed one at a time.
    if not cpu.has("native_kernels"):
        pytest.skip("decodekit's C++ kernels are off on this machine")
    from decodekit.kernels import native

    native.load()
    assert_paged_kernel_is_attention(paged_case(dtype, tokens, head_dim), window)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 2), (10, 2)])
@pytest.mark.parametrize("tokens", [2, 9], ids=["split-by-kv-head", "whole-token"])
def test_paged_attention_takes_any_number_of_query_heads_a_kv_head(heads, kv_heads, tokens):
    # The query heads of a kv head are scored together, up to 3 at a time: one each (4 of 4), three (9 of 3), and
    # groups of 4 and 5 taken in parts (3 + 1, 3 + 2).
    if not cpu.has("native_kernels"):
        pytest.skip("decodekit's C++ kernels are off on this machine")
    from decodekit.kernels import native

    native.load()
    assert_paged_kernel_is_attention(paged_case(torch.float32, tokens, 20, H=heads, KV=kv_heads), 5)


def assert_paged_kernel_is_attention(case, window):
    from decodekit.families.llama import visible

    q, k, v, keys, values, slots, tables, owner, positions, bs = case
    tokens, head_dim, dtype = q.shape[0], q.shape[2], q.dtype
    H, KV = q.shape[1], keys.shape[1]
    out, written_keys, written_values = paged_kernel(case, window)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys[slots], expected_values[slots] = k, v
    assert torch.equal(written_keys, expected_keys) and torch.equal(written_values, expected_values)
    for i in range(tokens):
        p = int(positions[i])
        j = torch.arange(p + 1)
        at = tables[owner[i], j // bs] * bs + j % bs
        kk, vv = (
            pool[at].transpose(0, 1).float().repeat_interleave(H // KV, 0) for pool in (expected_keys, expected_values)
        )
        scores = (q[i].float()[:, None] @ kk.transpose(1, 2))[:, 0] / head_dim**0.5  # [H, p + 1]
        scores[:, ~visible(torch.tensor(p), j, window or None)] = float("-inf")
        want = (scores.softmax(-1)[:, None] @ vv)[:, 0]
        torch.testing.assert_close(out[i].float(), want, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)


@pytest.mark.parametrize("tokens", [2, 9], ids=["split-by-kv-head", "whole-token"])
def test_paged_attention_gives_the_same_bits_on_any_thread_count(tokens):
    # A task's sums are its own, whichever thread runs it: a step's tokens come out the same with 1, 2 or 3 threads.
    if not cpu.has("native_kernels"):
        pytest.skip("decodekit's C++ kernels are off on this machine")
    from decodekit.kernels import native

    native.load()
    case = paged_case(torch.float32, tokens, 64, seed=3)
    one = paged_kernel(case, 0)[0]
    assert all(torch.equal(paged_kernel(case, 0, threads=n)[0], one) for n in (2, 3))


def test_allocator_reuses_freed_blocks_and_counts_shares():
    from decodekit.batching.paged import BlockAllocator, OutOfBlocks

    alloc = BlockAllocator(4)
    first = alloc.allocate(3)
    alloc.share(first[:1])
    with pytest.raises(OutOfBlocks):
        alloc.allocate(2)
    alloc.free(first)
    assert alloc.free_blocks == 3  # the shared block is still held once
    alloc.free(first[:1])
    assert alloc.free_blocks == 4 and sorted(alloc.allocate(4)) == [0, 1, 2, 3]


CONFIGS = [
    {},
    {"do_sample": True, "seed": 11},
    {"do_sample": True, "seed": 12, "temperature": 0.7, "top_k": 20},
    {"repetition_penalty": 1.3},
    {"do_sample": True, "seed": 13, "num_return_sequences": 2},
    {"no_repeat_ngram_size": 2},
    {"min_new_tokens": 5, "do_sample": True, "seed": 14, "top_p": 0.9},
]


def test_twenty_requests_arriving_over_time_equal_generate_alone(model, tmp_path):
    method = write_method(tmp_path / "ban", HOOK_METHOD)
    rng = random.Random(0)
    requests = []
    for i in range(20):
        prompt = [rng.randrange(1, model.config.vocab_size) for _ in range(rng.randrange(1, 40))]
        fields = dict(CONFIGS[i % len(CONFIGS)], max_new_tokens=rng.randrange(1, 24))
        if i % 5 == 4:  # a hook-only method of its own for some requests
            fields.update(custom_generate=str(method), trust_remote_code=True, banned_token=prompt[0])
        requests.append((prompt, fields))
    manager = model.init_continuous_batching(block_size=4, max_batch_tokens=24, min_prefill=8)
    blocks = manager.free_blocks
    ids = {}

    def feed():  # arrivals spread over the run, while earlier requests are running
        for n, (prompt, fields) in enumerate(requests):
            ids[n] = manager.add_request(prompt, request_id=f"r{n}", **fields)
            time.sleep(0.002 * (n % 4))

    feeder = threading.Thread(target=feed)
    feeder.start()
    with manager:  # steps in a background thread here; results are the same in run()
        feeder.join()
        results = {n: manager.get_result(rid, timeout=PATIENCE) for n, rid in ids.items()}
    assert manager.steps > 1
    for n, (prompt, fields) in enumerate(requests):
        out = results[n]
        assert out.status == RequestStatus.FINISHED, out.error
        assert out.sequences == alone(model, prompt, **fields), (n, fields)
        assert out.finish_reason in ("stop", "length") and out.prompt_ids == prompt
    assert manager.free_blocks == blocks  # every block came back


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "torch-attention"])
def test_compiled_decode_steps_equal_generate_alone(model, native, caplog, monkeypatch):
    # compile=True on the manager: steps whose rows all decode run compiled, one function for every row count; as
    # requests end, the rows fall from 6 to 1. Without decodekit's C++ kernels the compiled step attends through
    # torch operations (paged.decode_attention), the path it takes on CUDA. Between joins and finishes the block
    # table stays on the device, step to step, its positions advanced there.
    from decodekit.batching.compiled import CompiledDecode

    tables = []
    kept = CompiledDecode._rows_state

    def recorded(self, *args):
        state = kept(self, *args)
        tables.append(state[0])
        return state

    monkeypatch.setattr(CompiledDecode, "_rows_state", recorded)
    if native and not cpu.has("native_kernels"):
        pytest.skip("decodekit's C++ kernels are off on this machine: the compiled step needs them")
    requests = [
        ([5, 6, 7], {"max_new_tokens": 3}),
        ([9] * 13, {"max_new_tokens": 17}),
        ([4, 2], {"max_new_tokens": 9, "do_sample": True, "seed": 3}),
        ([8, 1, 8, 1, 3], {"max_new_tokens": 6, "num_return_sequences": 2, "do_sample": True, "seed": 4}),
        ([3] * 21, {"max_new_tokens": 12, "repetition_penalty": 1.3}),
    ]
    with cpu.forced(native_kernels=native), caplog.at_level(logging.INFO, logger="decodekit"):
        manager = model.init_continuous_batching(compile=True, block_size=4)
        blocks = manager.free_blocks
        ids = [manager.add_request(prompt, **fields) for prompt, fields in requests]
        manager.run(until_idle=True)
        results = [manager.get_result(rid, timeout=0) for rid in ids]
    for (prompt, fields), out in zip(requests, results):
        assert out.status == RequestStatus.FINISHED, out.error
        assert out.sequences == alone(model, prompt, **fields), fields
    compiled = manager.runner.compiled
    assert compiled.broken is None and manager.free_blocks == blocks
    assert compiled.steps > 10
    reused = sum(a is b for a, b in zip(tables, tables[1:]))
    assert reused >= 5 and len({id(t) for t in tables}) >= 4  # kept while the rows stay, rebuilt as they change
    torch_attention = "compiled decode steps attend through torch operations (decode_attention)"
    assert (torch_attention in caplog.text) is (not native)  # said where the C++ kernel cannot serve (CUDA, off)


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "torch-attention"])
def test_compiled_steps_carry_rows_on_the_device_as_requests_finish_and_join(model, native, monkeypatch):
    # Three requests run at a time: as each ends another joins. The rows still running are carried from the previous
    # step's table on the device (gathered by index), the joining one's built from its list; every request's tokens
    # equal generate() alone.
    from decodekit.batching.compiled import CompiledDecode

    if native and not cpu.has("native_kernels"):
        pytest.skip("decodekit's C++ kernels are off on this machine: the compiled step needs them")
    gathered = []
    gather = CompiledDecode._gathered

    def recorded(self, kept, places, at, *args):
        gathered.append((sum(a is not None for a in at), sum(a is None for a in at)))
        return gather(self, kept, places, at, *args)

    monkeypatch.setattr(CompiledDecode, "_gathered", recorded)
    requests = [([3 + i, 7, 2 + i], {"max_new_tokens": 6 + (3 * i) % 4}) for i in range(7)]  # tables of 3 blocks
    requests[2][1].update(do_sample=True, seed=2)
    with cpu.forced(native_kernels=native):
        manager = model.init_continuous_batching(compile=True, block_size=4, max_running=3)
        each_as_alone(manager, model, requests)
    assert any(joined == 0 and kept for kept, joined in gathered)  # a request ended: the others carried
    assert any(joined and kept for kept, joined in gathered)  # one joined beside carried rows
    assert manager.runner.compiled.broken is None


@pytest.mark.parametrize("weights", [{"dtype": torch.bfloat16}, {"quantize": "int8"}], ids=["bf16", "int8"])
def test_compiled_decode_steps_of_bf16_and_int8_models(tmp_path, weights):
    from decodekit import AutoModelForCausalLM
    from decodekit.testing import write_tiny_model

    if not cpu.has("native_kernels"):
        pytest.skip("decodekit's C++ kernels are off on this machine: the compiled step needs them")
    m = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "tiny", "llama", 0), **weights).eval()
    requests = [([5, 6, 7], 3), ([9] * 13, 10), ([4, 2], 6)]
    manager = m.init_continuous_batching(compile=True, block_size=4)
    ids = [manager.add_request(prompt, max_new_tokens=n) for prompt, n in requests]
    manager.run(until_idle=True)
    for (prompt, n), rid in zip(requests, ids):
        assert manager.get_result(rid, timeout=0).generated_tokens == alone(m, prompt, max_new_tokens=n)[0]
    assert manager.runner.compiled.broken is None and manager.runner.compiled.steps > 0


@pytest.mark.parametrize("weights", ["packed", "plain"])
def test_warm_up_compiles_the_step_for_every_row_count_before_any_request(tmp_path, weights):
    # Plain weights (the eager choice where oneDNN's packing does not pay, e.g. AVX2-only CPUs) take decodekit's row
    # kernel up to 16 rows and the library's product beyond: the step compiles once on each side, both in warm-up.
    from torch._dynamo.utils import counters

    from decodekit.kernels import choices

    if not cpu.has("native_kernels"):
        pytest.skip("decodekit's C++ kernels are off on this machine: the compiled step needs them")
    with choices.forced(eager_weights_float32=weights):
        model = tiny_model(tmp_path, "llama").eval()
        manager = model.init_continuous_batching(compile=True, max_running=18, block_size=4)
        blocks = manager.free_blocks
        assert manager.warm_up() == [1, 18]
        steps, graphs = dict(StepHost.of(model).steps("paged decode")), counters["stats"]["unique_graphs"]
        ids = [manager.add_request([7, i + 1], max_new_tokens=3 + i) for i in range(18)]
        manager.run(until_idle=True)  # decode steps of 18, 17, ..., 1 rows
        assert dict(StepHost.of(model).steps("paged decode")) == steps and manager.runner.compiled.steps > 2 + 16
        assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled after the warm-up, for any row count
        for i, rid in enumerate(ids):
            assert (
                manager.get_result(rid, timeout=0).generated_tokens == alone(model, [7, i + 1], max_new_tokens=3 + i)[0]
            )
        assert manager.free_blocks == blocks
        assert model.init_continuous_batching().warm_up() == []  # eager steps: nothing to compile


def test_requests_sampled_together_draw_the_tokens_each_draws_alone(model, monkeypatch):
    # The next tokens of requests whose step needs nothing of its own (one row, score-only processors, a built-in
    # selector, stopping by length and EOS) are chosen in one pass over their stacked logits, processors applied once
    # per group of equal settings (the manager's step does this), eagerly and compiled; each equals the token its
    # request's own step chooses.
    from decodekit.batching.manager import MethodCache
    from decodekit.batching.request import prepare_request
    from decodekit.batching import sampler
    from decodekit.batching.sampler import race_in_parts, sample_together
    from decodekit.core.selectors import race_rows
    from decodekit.core.compile import compile_own

    fields = (
        [dict(do_sample=True, top_k=0, seed=s) for s in range(6)]
        + [{}, {}, dict(do_sample=True, seed=9)]  # greedy twice; top_k=50 (the default)
        + [dict(do_sample=True, temperature=0.7, top_p=0.9, seed=s) for s in (3, 4)]  # one group of two
        + [dict(do_sample=True, temperature=0.7, min_p=0.05, seed=5)]
        + [dict(max_time=3600.0), dict(do_sample=True, num_return_sequences=2, seed=1)]  # a time limit never reached
        + [dict(logprobs=True), dict(do_sample=True, temperature=0.7, top_p=0.9, seed=6, logprobs=True, top_logprobs=3)]
    )
    requests = [
        prepare_request(model, [3 + i] * (i + 2), None, f"r{i}", False, dict(f, max_new_tokens=4), MethodCache())
        for i, f in enumerate(fields)
    ]
    alone = {"r12", "r13"}  # a time limit, two rows: their own steps
    assert {r.id for r in requests if r.together is None} == alone
    generator = torch.Generator().manual_seed(0)
    logits = {r.id: 3 * torch.randn(r.rows, model.config.vocab_size, generator=generator) for r in requests}
    processed = {r.id: r.pipeline.processors(r.sequences, logits[r.id]) for r in requests}
    own = {r.id: r.pipeline.selector(r.sequences, processed[r.id]) for r in requests}
    assert len({int(t[0]) for t in own.values()}) > 5  # the draws differ: the test can tell rows apart
    monkeypatch.setattr(sampler, "CACHED_ELEMENTS", 2 * model.config.vocab_size)  # the eager CPU race: 2 rows a part
    for race in (race_rows, race_in_parts, compile_own(race_rows, {"dynamic": True})):
        chosen = sample_together(requests, logits, race)
        assert set(chosen) == {r.id for r in requests} - alone
        assert all(chosen[rid].token == int(own[rid][0]) for rid in chosen)
        for rid, top in (("r14", 0), ("r15", 3)):  # logprobs from the same pass, as the request's own step takes them
            logp = torch.log_softmax(processed[rid][0], dim=-1)
            assert chosen[rid].logprob == pytest.approx(float(logp[own[rid][0]]), abs=1e-6)
            assert chosen[rid].top == (
                None if not top else [(int(i), pytest.approx(float(v), abs=1e-6)) for v, i in zip(*logp.topk(top))]
            )
        assert chosen["r0"].logprob is None and chosen["r0"].top is None
        for alone_in_pass in ("r0", "r6", "r9"):  # one request alone in the pass: sampled, greedy, with processors
            lone = sample_together([next(r for r in requests if r.id == alone_in_pass)], logits, race)
            assert lone[alone_in_pass].token == int(own[alone_in_pass][0])
    logits["r0"][0, :] = float("nan")  # a bad row: no shared choice, so each request's own step names the fault
    assert sample_together(requests, logits, race_rows) == {}


def test_a_request_chosen_together_ends_where_its_own_step_would(model):
    # Stopping is decided on the host for requests chosen together (EOS, the length): every request's tokens, finish
    # reason and EOS equal generate() alone, for greedy and sampled requests of mixed settings in one batch.
    prompts = [[3 + i, 9, 4 + 2 * i] for i in range(8)]
    fields = [dict(do_sample=bool(i % 2), temperature=0.8 if i % 4 == 1 else 1.0, seed=i) for i in range(8)]
    eos = model.generate(torch.tensor([prompts[0]]), max_new_tokens=3, eos_token_id=None)[0, -1].item()
    manager = model.init_continuous_batching(eos_token_id=eos)
    ids = [manager.add_request(p, max_new_tokens=6 + i, **f) for i, (p, f) in enumerate(zip(prompts, fields))]
    assert all(r.together is not None for r in manager._incoming)
    manager.run(until_idle=True)
    reasons = set()
    for i, rid in enumerate(ids):
        result = manager.get_result(rid, timeout=0)
        expected = model.generate(torch.tensor([prompts[i]]), max_new_tokens=6 + i, eos_token_id=eos, **fields[i])[
            0, 3:
        ].tolist()
        expected = expected[: expected.index(eos) + 1] if eos in expected else expected
        assert result.generated_tokens == expected
        assert result.finish_reason == ("stop" if expected[-1] == eos else "length")
        reasons.add(result.finish_reason)
    assert reasons == {"stop", "length"}  # both ends were decided on the host


class LetterTokenizer:
    """Each id one letter: a stop string spans several tokens."""

    def decode(self, ids, **kwargs):
        return "".join(chr(97 + i % 26) for i in ids)


def test_requests_with_stop_strings_are_chosen_together_and_stop_where_generate_stops(model):
    # Stop strings are decided on the host from the request's tokens (StopStringCriteria.ends_row) for requests
    # chosen together: each ends where generate() alone ends, greedy and sampled.
    tok = LetterTokenizer()
    prompts = [[3 + i, 9, 4 + i] for i in range(6)]
    first = model.generate(torch.tensor([prompts[0]]), max_new_tokens=12, eos_token_id=None)[0, 3:].tolist()
    stop = tok.decode(first)[4:6]  # met by the first request at its sixth token at the latest
    fields = [dict(do_sample=bool(i % 2), top_p=0.9, seed=i) for i in range(6)]
    manager = model.init_continuous_batching()
    ids = [
        manager.add_request(p, max_new_tokens=12, eos_token_id=None, stop_strings=[stop], tokenizer=tok, **f)
        for p, f in zip(prompts, fields)
    ]
    assert all(r.together is not None and r.together.texts for r in manager._incoming)
    manager.run(until_idle=True)
    reasons = []
    for prompt, f, rid in zip(prompts, fields, ids):
        result = manager.get_result(rid, timeout=0)
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, eos_token_id=None, stop_strings=[stop], tokenizer=tok, **f
        )[0, 3:].tolist()
        assert result.generated_tokens == expected
        reasons.append(result.finish_reason)
    assert reasons[0] == "stop"  # the stop string ended the first one


def test_a_compiled_step_runs_the_product_route_this_cpu_chose_before_any_eager_call(tmp_path, monkeypatch):
    # A trace cannot measure, so a route first asked for inside one was the fallback, compiled in for good: the
    # decode step of continuous batching multiplied its 17-64 rows by the library's matmul though this CPU had
    # chosen tiles (0.3-0.7x their speed). The choice is read before the step is traced now.
    from torch.profiler import profile

    from decodekit.kernels import choices

    if not cpu.has("native_kernels"):
        pytest.skip("decodekit's C++ kernels are off on this machine: the compiled step needs them")
    from decodekit.kernels.linear import STEP_SAMPLE, many_rows_routes
    from decodekit.kernels.packed import LAYOUT_SAMPLE

    # Plain weights too: a step of 17 rows or more runs on oneDNN-packed weights where packing measures faster (a
    # close call on the AMD EPYC machine, which then ran no tiled_product here). The decode class's key names the
    # sample it was measured on: without it the file held nothing for this choice, the step measured it afresh, and
    # a CPU where the library's matmul measured fastest (the AMX Xeon) ran no tiled_product.
    on_disk = {
        choices.signature(): {
            choices._key("float32_rows_32", many_rows_routes(), STEP_SAMPLE): "blocks",
            choices._key("eager_weights_float32", ("packed", "plain"), LAYOUT_SAMPLE): "plain",
        }
    }
    monkeypatch.setattr(choices, "_made", {})  # a fresh process: the choice is in the cache file only
    monkeypatch.setattr(choices, "_read", lambda: on_disk)
    monkeypatch.setattr(choices, "_write", lambda key, choice: None)
    # Whatever is measured, the library's matmul wins, as it may on some CPU: only the cached choice is "blocks".
    monkeypatch.setattr(choices, "fastest", lambda offered: {label: float(label != "library") for label in offered})
    fresh = tiny_model(tmp_path, "llama").eval()  # no step compiled for it yet
    from torch._dynamo.utils import counters

    manager = fresh.init_continuous_batching(compile=True, block_size=4, max_running=70)
    # Traced here, on both sides of the route classes' bound at 64 rows, so no step compiles while serving.
    assert manager.warm_up() == [1, 64, 70]
    graphs, rows = counters["stats"]["unique_graphs"], 20
    tables = [manager.runner.cache.allocator.allocate(2) for _ in range(rows)]
    with torch.inference_mode():
        with profile() as run:
            manager.runner.compiled([1] * rows, tables, [3] * rows)
    assert manager.runner.compiled.broken is None and counters["stats"]["unique_graphs"] == graphs
    assert "decodekit::tiled_product" in {event.key for event in run.key_averages()}


def test_compiled_sampling_first_made_for_one_row_serves_steps_of_several(model):
    # serve's default: the manager's sampling race compiled. Its first graph was made for a step with one sampled row
    # (beside a greedy one); a later step with four sampled rows replayed it (its shape guards had been dropped) and
    # inductor's AssertionError ended manager.run() for every client.
    from decodekit.core.selectors import race_rows

    manager = model.init_continuous_batching(compile=True, block_size=4)
    first = [([4, 2], {"max_new_tokens": 3, "do_sample": True, "top_k": 0, "seed": 1}), ([5, 6], {"max_new_tokens": 3})]
    later = [([i + 3, 1], {"max_new_tokens": 5, "do_sample": True, "top_k": 0, "seed": i}) for i in range(4)]
    for batch in (first, later):
        each_as_alone(manager, model, batch)
    assert manager._race is not race_rows  # still compiled: no fallback was needed


def test_a_compiled_step_or_sampling_that_raises_falls_back_to_eager_and_says_so(model, caplog, monkeypatch):
    # Any exception from compiled code (inductor raises AssertionErrors, not dynamo's exceptions) runs that step
    # eagerly and is logged; the loop goes on and every request gets the tokens it gets alone.
    # The model's host records the failure for good: one of the test's own, so other tests' steps compile.
    monkeypatch.setattr(getattr(model, "module", model), "step_host", StepHost(), raising=False)
    manager = model.init_continuous_batching(compile=True, block_size=4)

    def broken(*args):
        raise AssertionError("a graph replayed for the wrong shape")

    manager._race = broken
    if manager.runner.compiled is not None:
        manager.runner.compiled._step = lambda: broken
    requests = [
        ([4, 2], {"max_new_tokens": 4, "do_sample": True, "top_k": 0, "seed": 2}),
        ([9, 9, 9], {"max_new_tokens": 5}),
    ]
    with caplog.at_level(logging.WARNING, logger="decodekit"):
        ids = [manager.add_request(prompt, **fields) for prompt, fields in requests]
        manager.run(until_idle=True)
    for (prompt, fields), rid in zip(requests, ids):
        out = manager.get_result(rid, timeout=0)
        assert out.status == RequestStatus.FINISHED, out.error
        assert out.sequences == alone(model, prompt, **fields)
    assert manager._race is manager._eager_race
    assert "the compiled sampling failed (AssertionError: a graph replayed for the wrong shape)" in caplog.text
    if manager.runner.compiled is not None and cpu.has("native_kernels"):
        assert manager.runner.compiled.broken == "AssertionError: a graph replayed for the wrong shape"
        assert "the compiled decode step failed" in caplog.text


def test_warm_up_writes_every_page_of_the_cache_before_any_step(model):
    # Writing the pools is what takes their memory now (an untouched page is not resident until a step writes
    # it); whatever they held before (NaN here) is overwritten everywhere.
    manager = model.init_continuous_batching(max_cache_bytes=8 * 2**20)
    pools = manager.runner.cache.keys + manager.runner.cache.values
    for pool in pools:
        pool.fill_(float("nan"))
    manager.warm_up()
    assert all(not pool.isnan().any() for pool in pools)


def test_compile_settings_are_checked_when_the_manager_is_made(model):
    with pytest.raises(ValueError, match="compile_config"):
        model.init_continuous_batching(compile=True, compile_config={"modes": "max-autotune"})


def test_generate_batch_returns_results_in_input_order_and_fails_bad_prompts_alone(model):
    prompts = [[5, 6, 7], [], [8] * 30, [model.config.vocab_size + 3]]
    results = list(model.generate_batch(prompts, max_new_tokens=6, progress_bar=False).values())
    assert [r.status for r in results] == [
        RequestStatus.FINISHED,
        RequestStatus.FAILED,
        RequestStatus.FINISHED,
        RequestStatus.FAILED,
    ]
    assert "empty" in results[1].error and "outside the vocabulary" in results[3].error
    assert results[0].generated_tokens == alone(model, [5, 6, 7], max_new_tokens=6)[0]
    assert results[2].generated_tokens == alone(model, [8] * 30, max_new_tokens=6)[0]


def test_cancelling_frees_the_blocks_and_returns_the_tokens_so_far(model):
    manager = model.init_continuous_batching(block_size=4)
    start = manager.free_blocks
    with manager:
        rid = manager.add_request([1, 2, 3], max_new_tokens=400, streaming=True, eos_token_id=None)
        first = next(manager.request_id_iter(rid))
        assert manager.free_blocks < start and not first.is_finished()
        manager.cancel_request(rid)
        last = list(manager.request_id_iter(rid))[-1]
    assert last.status == RequestStatus.CANCELLED and 1 <= len(last.generated_tokens) < 400
    assert manager.free_blocks == start


def test_streaming_yields_every_token_in_order(model):
    with model.init_continuous_batching() as manager:
        rid = manager.add_request([4, 5, 6], max_new_tokens=8, streaming=True, eos_token_id=None)
        outputs = list(manager.request_id_iter(rid))
    lengths = [len(o.generated_tokens) for o in outputs]
    assert lengths == list(range(1, 9)) and outputs[-1].is_finished() and outputs[-1].finish_reason == "length"
    assert outputs[-1].generated_tokens == alone(model, [4, 5, 6], max_new_tokens=8, eos_token_id=None)[0]


def test_a_request_failing_mid_generation_fails_alone(model):
    calls = []

    def breaks_on_third_step(input_ids, scores):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("processor broke")
        return scores

    with model.init_continuous_batching() as manager:
        bad = manager.add_request([1, 2], max_new_tokens=6, logits_processor=[breaks_on_third_step])
        good = manager.add_request([3, 4], max_new_tokens=6)
        bad_out, good_out = manager.get_result(bad, timeout=PATIENCE), manager.get_result(good, timeout=PATIENCE)
    assert bad_out.status == RequestStatus.FAILED and "processor broke" in bad_out.error
    assert (
        good_out.status == RequestStatus.FINISHED
        and good_out.generated_tokens == alone(model, [3, 4], max_new_tokens=6)[0]
    )
    assert manager.free_blocks == manager.total_blocks


@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt, GeneratorExit])
def test_a_base_exception_from_a_requests_own_code_fails_that_request_alone(model, raised):
    def exits_on_second_step(input_ids, scores):
        if input_ids.shape[1] == 4:
            raise raised("the method gave up")
        return scores

    manager = model.init_continuous_batching()
    bad = manager.add_request([1, 2], max_new_tokens=6, logits_processor=[exits_on_second_step])
    good = manager.add_request([3, 4], max_new_tokens=6)
    manager.run(until_idle=True)  # returns: the manager did not stop on the request's exception
    bad_out, good_out = manager.get_result(bad, timeout=0), manager.get_result(good, timeout=0)
    assert bad_out.status == RequestStatus.FAILED and raised.__name__ in bad_out.error
    assert (
        good_out.status == RequestStatus.FINISHED
        and good_out.generated_tokens == alone(model, [3, 4], max_new_tokens=6)[0]
    )
    assert manager.free_blocks == manager.total_blocks


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_token_outside_the_vocabulary_fails_its_request_before_it_reaches_the_step(model, compile):
    from decodekit.kernels import cpu

    if compile and not cpu.has("native_kernels"):
        pytest.skip("decodekit's C++ kernels are off on this machine: the compiled step needs them")

    def strays_on_third_step(input_ids, scores):
        chosen = scores.argmax(dim=-1)
        return chosen + 10_000 if input_ids.shape[1] >= 5 else chosen

    from decodekit.registry import hookimpl, register, unregister

    class Strays:
        @hookimpl
        def decodekit_config_fields(self):
            return {"strays": False}

        @hookimpl
        def decodekit_token_selector(self, generation_config, context):
            return strays_on_third_step if generation_config.strays else None

    from decodekit.registry.manager import get_plugin_manager

    plugin = register(Strays(), name="strays")
    try:
        manager = model.init_continuous_batching(compile=compile)
        bad = manager.add_request([1, 2], max_new_tokens=6, strays=True)
        good = manager.add_request([3, 4], max_new_tokens=6)
        manager.run(until_idle=True)
        # The request fails alone and the plugin stays: a served request's fault (one client's field) must not take
        # the plugin from every later client, whose fields would then be unknown arguments.
        assert get_plugin_manager().get_plugin(plugin) is not None
        later = manager.add_request([1, 2], max_new_tokens=2, strays=False)
        manager.run(until_idle=True)
        assert manager.get_result(later, timeout=0).status == RequestStatus.FINISHED
    finally:
        if get_plugin_manager().get_plugin(plugin) is not None:
            unregister(plugin)
    bad_out, good_out = manager.get_result(bad, timeout=0), manager.get_result(good, timeout=0)
    assert bad_out.status == RequestStatus.FAILED and "outside the vocabulary" in bad_out.error
    assert good_out.generated_tokens == alone(model, [3, 4], max_new_tokens=6)[0]


def test_a_failed_shared_forward_is_retried_request_by_request(model, monkeypatch):
    manager = model.init_continuous_batching()
    forward = manager.runner.forward

    def fails_with_a_poisoned_request(works):
        if any(w.request.id == "poisoned" for w in works):
            raise RuntimeError("index out of range in the poisoned request's rows")
        return forward(works)

    monkeypatch.setattr(manager.runner, "forward", fails_with_a_poisoned_request)
    manager.add_request([1, 2], request_id="poisoned", max_new_tokens=4)
    good = manager.add_request([3, 4], max_new_tokens=4)
    manager.run(until_idle=True)
    assert manager.get_result("poisoned", timeout=0).status == RequestStatus.FAILED
    assert manager.get_result(good, timeout=0).generated_tokens == alone(model, [3, 4], max_new_tokens=4)[0]


def test_prompt_and_new_tokens_up_to_the_context_are_taken_and_one_more_is_refused(model):
    context = model.config.max_position_embeddings
    manager = model.init_continuous_batching()
    manager.add_request([5] * (context - 4), max_new_tokens=4)  # fills the context exactly
    with pytest.raises(ValueError, match=f"context of {context} positions.*at most 4"):
        manager.add_request([5] * (context - 4), max_new_tokens=5)
    with pytest.raises(ValueError, match="shorten the prompt"):
        manager.add_request([5] * (context + 1), max_new_tokens=1)
    manager.run(until_idle=True)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_beams": 2}, "beam_search"),
        ({"penalty_alpha": 0.5, "top_k": 4}, "contrastive"),
        ({"temperature": -1.0, "do_sample": True}, "temperature"),
        ({"max_new_token": 3}, "did you mean 'max_new_tokens'"),
        ({"output_hidden_states": True}, "output_hidden_states"),
        ({"max_new_tokens": 10**6}, "past the model's context of 512 positions"),
        ({"max_new_tokens": 500, "num_return_sequences": 8, "do_sample": True}, "cache blocks"),
        ({"custom_generate": lambda model, input_ids, **kw: input_ids}, "callable owns the whole loop"),
    ],
)
def test_invalid_requests_are_refused_when_added(model, fields, message):
    manager = model.init_continuous_batching(max_cache_bytes=2**20)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        manager.add_request([1, 2, 3], **fields)


def test_a_full_queue_refuses_more(model):
    # Not started: nothing leaves the queue. The one free running slot takes a request at the next step, so that one
    # does not wait; two more do.
    manager = model.init_continuous_batching(max_queue_size=2, max_running=1)
    for prompt in ([1], [2], [3]):
        manager.add_request(prompt)
    with pytest.raises(QueueFull, match="max_queue_size=2"):
        manager.add_request([4])


def test_a_burst_no_larger_than_the_free_slots_is_never_refused(model):
    # Before: requests arriving between two steps counted as waiting though free slots would take them all (429s from
    # an idle server).
    manager = model.init_continuous_batching(max_queue_size=1, max_running=8)
    ids = [manager.add_request([i + 1], max_new_tokens=2) for i in range(8)]
    with pytest.raises(QueueFull, match="max_queue_size=1"):
        for i in range(8, 10):
            manager.add_request([i + 1], max_new_tokens=2)
    manager.run(until_idle=True)
    assert all(manager.get_result(rid, timeout=0).status == RequestStatus.FINISHED for rid in ids)
    other = model.init_continuous_batching()
    other.add_request([1], request_id="same")
    with pytest.raises(ValueError, match="'same' is already in use"):
        other.add_request([2], request_id="same")


def test_bad_manager_options_name_the_option(model):
    with pytest.raises(ValueError, match="block_size=0"):
        model.init_continuous_batching(block_size=0)
    with pytest.raises(ValueError, match="unknown options \\['max_batch'\\] \\(did you mean 'max_batch_tokens'\\?\\)"):
        model.init_continuous_batching(max_batch=3)
    with pytest.raises(ValueError, match="temperature"):
        model.init_continuous_batching(temperature=-2.0, do_sample=True)


def test_manager_defaults_apply_to_every_request(model):
    with model.init_continuous_batching(max_new_tokens=3, eos_token_id=None) as manager:
        out = manager.get_result(manager.add_request([1, 2]), timeout=PATIENCE)
    assert len(out.generated_tokens) == 3


def test_a_wrapped_transformers_model_batches_with_a_cache_per_request(tmp_path):
    pytest.importorskip("transformers")
    import decodekit
    from transformers import AutoModelForCausalLM

    from decodekit.testing import write_tiny_model

    hf = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path, "llama"))
    model = decodekit.wrap(hf)
    prompts = [[1, 2, 3], [4] * 9, [7, 8]]
    results = list(model.generate_batch(prompts, max_new_tokens=5, do_sample=True, seed=3, progress_bar=False).values())
    for prompt, result in zip(prompts, results):
        assert result.status == RequestStatus.FINISHED
        assert result.generated_tokens == alone(model, prompt, max_new_tokens=5, do_sample=True, seed=3)[0]


def test_a_structured_output_row_shares_the_step_and_equals_generate_alone(default_model):
    pytest.importorskip("llguidance", reason="structured output needs decodekit[structured] (make test installs it)")
    import json

    model, tok = default_model
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    ids = tok.apply_chat_template([{"role": "user", "content": "JSON for a person"}], add_generation_prompt=True)
    alone = model.generate(torch.tensor([ids]), json_schema=schema, tokenizer=tok, max_new_tokens=40)[0, len(ids) :]
    with model.init_continuous_batching() as manager:
        constrained = manager.add_request(ids, json_schema=schema, tokenizer=tok, max_new_tokens=40)
        plain = manager.add_request(ids, max_new_tokens=40)
        out, free = manager.get_result(constrained, timeout=PATIENCE), manager.get_result(plain, timeout=PATIENCE)
    eos = model.generation_config.eos_token_ids
    assert (
        out.generated_tokens
        == [t for t in alone.tolist() if t not in eos] + [t for t in alone.tolist() if t in eos][:1]
    )
    assert set(json.loads(tok.decode(out.generated_tokens, skip_special_tokens=True))) == {"name", "age"}
    assert free.status == RequestStatus.FINISHED and free.generated_tokens != out.generated_tokens


@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_attention_in_torch_equals_attention_over_each_rows_positions(window, dtype):
    # What the compiled step runs off the CPU kernel (CUDA): each row's query against its own positions, read
    # through its block table, after its new key and value are written at its slot.
    from decodekit.batching.paged import decode_attention, slots_of

    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    pool = 10 * block
    keys = torch.randn(pool, kv_heads, dim).to(dtype)
    values = torch.randn(pool, kv_heads, dim).to(dtype)
    tables = torch.tensor([[3, 7, 1], [0, 5, 9], [2, 8, 8]])  # row 2's table is padded with a block it never reads
    positions = torch.tensor([9, 2, 6])
    slots = slots_of(tables, torch.arange(3), positions, block)
    q, k, v = torch.randn(3, heads, dim).to(dtype), torch.randn(3, kv_heads, dim), torch.randn(3, kv_heads, dim)
    k, v = k.to(dtype), v.to(dtype)
    before_keys, before_values = keys.clone(), values.clone()
    got = decode_attention(q, k, v, keys, values, slots, tables, torch.arange(3), positions, block, window)
    for row in range(3):
        assert torch.equal(keys[slots[row]], k[row]) and torch.equal(values[slots[row]], v[row])
        first = 0 if window is None else max(0, int(positions[row]) - window + 1)
        seen = slots_of(tables, row, torch.arange(first, int(positions[row]) + 1), block)
        row_keys = before_keys.clone()
        row_keys[slots[row]], row_values = k[row], before_values.clone()
        row_values[slots[row]] = v[row]
        kk = row_keys[seen].float().repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
        vv = row_values[seen].float().repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[row].float(), kk) / dim**0.5, dim=-1)
        want = torch.einsum("hl,lhd->hd", weights, vv)
        torch.testing.assert_close(got[row].float(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    if native.load() and cpu.has("native_kernels"):  # and what decodekit's C++ kernel gives on the same input
        keys2, values2 = before_keys.clone(), before_values.clone()
        kernel = torch.ops.decodekit.paged_attention(
            q, k, v, keys2, values2, slots, tables, torch.arange(3), positions, block, window or 0
        )
        torch.testing.assert_close(got, kernel, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


def test_decode_attention_ignores_whatever_the_slots_a_row_does_not_see_hold():
    # The pools are uninitialised memory: a NaN in a slot no row has written (or past a row's position, or before
    # its window) must not reach the output through its masked weight. It did: the compiled step's logits came out
    # NaN now and then (test_compiled_decode_steps_equal_generate_alone[torch-attention] failed one run in two).
    from decodekit.batching.paged import decode_attention, slots_of

    torch.manual_seed(1)
    block, tables, positions = 4, torch.tensor([[3, 7, 1], [0, 5, 9]]), torch.tensor([9, 2])
    slots = slots_of(tables, torch.arange(2), positions, block)
    written = torch.zeros(40, dtype=torch.bool)
    for row in range(2):
        written[slots_of(tables, row, torch.arange(int(positions[row])), block)] = True
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    clean_keys, clean_values = torch.randn(40, 2, 8), torch.randn(40, 2, 8)
    for window in (None, 3):
        outs = []
        for junk in (0.0, float("nan"), float("inf")):
            keys, values = clean_keys.clone(), clean_values.clone()
            keys[~written], values[~written] = junk, junk
            outs.append(
                decode_attention(q, k, v, keys, values, slots, tables, torch.arange(2), positions, block, window)
            )
        assert torch.isfinite(outs[0]).all()
        torch.testing.assert_close(outs[1], outs[0]), torch.testing.assert_close(outs[2], outs[0])


def test_each_request_is_read_one_way_and_a_wrong_reader_is_told_not_left_waiting(model):
    # A request's outputs go to one place (batching/outputs.RequestOutputs): its listener, its stream, or get_result.
    manager = model.init_continuous_batching(block_size=4)
    heard = []
    told = manager.add_request([5, 6, 7], max_new_tokens=3, eos_token_id=None, streaming=True, listener=heard.append)
    streamed = manager.add_request([8, 9], max_new_tokens=3, eos_token_id=None, streaming=True)
    whole = manager.add_request([4, 4], max_new_tokens=3, eos_token_id=None)
    for reader in (lambda: manager.get_result(told), lambda: next(manager.request_id_iter(told))):
        with pytest.raises(ValueError, match=f"Request '{told}' hands its outputs to its listener"):
            reader()
    with pytest.raises(ValueError, match=f"Request '{streamed}' streams: read its outputs with request_id_iter"):
        manager.get_result(streamed)
    manager.run(until_idle=True)
    assert [len(out.generated_tokens) for out in heard] == [1, 2, 3] and heard[-1].is_finished()
    assert [len(out.generated_tokens) for out in manager.request_id_iter(streamed)] == [1, 2, 3]
    want = model.generate(torch.tensor([[4, 4]]), max_new_tokens=3, eos_token_id=None)[0, 2:].tolist()
    assert manager.get_result(whole, timeout=0).generated_tokens == want
    assert not manager._outputs and not manager._finished  # every reader has what was its own; nothing is kept


@pytest.mark.parametrize("window", [0, 1, 4, 5, 21])
@pytest.mark.parametrize("heads, kv_heads", [(6, 3), (8, 2), (4, 4)])
def test_flex_attention_over_the_block_tables_equals_decode_attention(window, heads, kv_heads):
    # batching/flex.py's block mask: rows at different positions (the first at 0, one at the end of its last block),
    # blocks out of order and one shared, windows that start inside a block, at a block's edge and past the row's
    # start; the partial blocks (first and last seen) masked, the ones between taken whole. Eagerly, flex attention
    # scores every slot of the pool through the mask, so a wrong mask anywhere shows.
    from decodekit.batching.paged import decode_attention, route_attention

    q, k, v, keys, values, slots, tables, owner, positions, bs = paged_case(torch.float32, 9, 16, H=heads, KV=kv_heads)
    tables = torch.cat((tables, torch.zeros(9, 3, dtype=torch.long)), 1)  # padding entries: block 0, read by none
    want_keys, want_values = keys.clone(), values.clone()
    want = decode_attention(q, k, v, want_keys, want_values, slots, tables, owner, positions, bs, window)
    flex_keys, flex_values = keys.clone(), values.clone()
    got = route_attention("flex")(q, k, v, flex_keys, flex_values, slots, tables, owner, positions, bs, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(flex_keys, want_keys) and torch.equal(flex_values, want_values)
    # What the fused kernel trusts and eager flex does not show: every slot of a "full" block is seen (no mask is
    # evaluated there), and the partial and full blocks together are those holding a seen slot.
    from decodekit.batching.flex import paged_block_mask

    mask = paged_block_mask(tables, owner, positions, bs, keys.shape[0] // bs, window)
    for i in range(len(positions)):
        seen = mask.mask_mod(torch.tensor(i), torch.tensor(0), torch.tensor(0), torch.arange(keys.shape[0]))
        holding = set(torch.unique(torch.nonzero(seen)[:, 0] // bs).tolist())
        partial = mask.kv_indices[i, 0, 0, : mask.kv_num_blocks[i, 0, 0]].tolist()
        full = mask.full_kv_indices[i, 0, 0, : mask.full_kv_num_blocks[i, 0, 0]].tolist()
        assert all(seen[b * bs : (b + 1) * bs].all() for b in full), i
        assert set(partial) | set(full) == holding and not set(partial) & set(full), i


def test_compiled_steps_through_flex_attention_equal_generate_alone(model):
    # paged_attention="flex": the compiled step's attention through flex attention over the block tables. Traced by
    # dynamo with the step's dynamic rows and table width, run by aot_eager: inductor's CPU flex template is refused
    # (next test), and its CUDA lowering is test_cuda's.
    requests = [
        ([5, 6, 7], {"max_new_tokens": 3}),
        ([9] * 13, {"max_new_tokens": 17}),
        ([4, 2], {"max_new_tokens": 9, "do_sample": True, "seed": 3}),
        ([8, 1, 8, 1, 3], {"max_new_tokens": 6, "num_return_sequences": 2, "do_sample": True, "seed": 4}),
    ]
    manager = model.init_continuous_batching(
        compile=True, compile_config={"backend": "aot_eager"}, block_size=4, paged_attention="flex"
    )
    each_as_alone(manager, model, requests)
    compiled = manager.runner.compiled
    assert compiled.route == "flex" and compiled.broken is None and compiled.steps > 10


def test_a_flex_step_that_fails_stays_compiled_over_gathered_blocks_and_says_so(tmp_path, caplog, monkeypatch):
    # The fused route failing (a lowering the device's compiler refuses, say) keeps the compiled step, through
    # gathered blocks, rather than dropping every later step to eager; the requests are those of generate() alone.
    # A model of its own: compiled steps are kept on the model, and one compiled before would not trace the fault.
    import decodekit.batching.flex as flex

    model = tiny_model(tmp_path, "llama").eval()

    def refused(*args, **kwargs):
        raise NotImplementedError("no flex kernel for this mask")

    monkeypatch.setattr(flex, "flex_decode_attention", refused)
    manager = model.init_continuous_batching(
        compile=True, compile_config={"backend": "aot_eager"}, block_size=4, paged_attention="flex"
    )
    with caplog.at_level(logging.WARNING, logger="decodekit"):
        each_as_alone(manager, model, [([5, 6, 7], {"max_new_tokens": 6}), ([9] * 6, {"max_new_tokens": 9})])
    compiled = manager.runner.compiled
    assert compiled.route == "gathered" and compiled.broken is None and compiled.steps > 5
    # (dynamo names an exception raised while it traces as its own: the reason is whatever torch gives)
    assert re.search(
        r"the compiled decode step through flex attention failed \(.+\); it attends through gathered blocks from now on",
        caplog.text,
    )


def test_paged_attention_names_what_it_accepts_and_when(model):
    # The accepted values are "auto" and the routes themselves (paged.ROUTES): one vocabulary, "kernel" among them.
    with pytest.raises(
        ValueError, match="paged_attention='paged' is invalid; expected one of auto, kernel, gathered, flex"
    ):
        model.init_continuous_batching(compile=True, paged_attention="paged")
    with pytest.raises(ValueError, match="paged_attention='flex' chooses the compiled decode step's attention; pass"):
        model.init_continuous_batching(paged_attention="flex")
    with pytest.raises(ValueError, match="paged_attention='flex' is for compiled steps on a GPU"):
        model.init_continuous_batching(compile=True, paged_attention="flex")
    # "gathered" on the CPU: the torch-operations route even where decodekit's kernel could serve
    manager = model.init_continuous_batching(compile=True, block_size=4, paged_attention="gathered")
    assert manager.runner.compiled.route == "gathered"
    each_as_alone(manager, model, [([5, 6, 7], {"max_new_tokens": 5}), ([9] * 6, {"max_new_tokens": 7})])
    if cpu.has("native_kernels"):
        kernel = model.init_continuous_batching(compile=True, block_size=4, paged_attention="kernel")
        assert kernel.runner.compiled.route == "kernel"
    with cpu.forced(native_kernels=False), pytest.raises(ValueError, match="paged_attention='kernel' cannot run here"):
        model.init_continuous_batching(compile=True, block_size=4, paged_attention="kernel")


def test_the_compiled_step_marks_its_sizes_dynamic_without_a_constraint():
    # Strict marks (mark_dynamic) made any guard on a marked size a violated constraint, and every step then ran
    # eagerly: seen on CUDA with four row symbols the trace found equal, then with the rows found equal to 16. The
    # sizes are now maybe dynamic, the rows of every input and the table's width: no constraint to violate.
    from decodekit.batching.compiled import mark_step_dynamic

    ids, position, slots, table = torch.zeros(1, 5), torch.zeros(5), torch.zeros(5), torch.zeros(5, 3)
    mark_step_dynamic(ids, position, slots, table)
    tensors = dict(zip("ipst", (ids, position, slots, table)))
    assert {name: getattr(t, "_dynamo_dynamic_indices", set()) for name, t in tensors.items()} == dict.fromkeys(
        "ipst", set()
    )
    weak = {name: getattr(t, "_dynamo_weak_dynamic_indices", set()) for name, t in tensors.items()}
    assert weak == {"i": {1}, "p": {0}, "s": {0}, "t": {0, 1}}


def test_steps_run_eagerly_until_the_compile_is_ready_then_compiled(model):
    # A server listens at once: warm_up(compile=False), then compile_when(ready) compiles between two steps once
    # ready() says so (torch's caches warmed by another process); every request equals generate() alone either way.
    manager = model.init_continuous_batching(max_running=3, compile=True)
    assert manager.warm_up(compile=False) == []
    ready, told = [], []
    manager.compile_when(lambda: bool(ready), told.append)
    requests = [
        ([3, 5, 7], dict(max_new_tokens=5, eos_token_id=None)),
        ([9, 2], dict(max_new_tokens=4, do_sample=True, seed=3)),
    ]
    each_as_alone(manager, model, requests)
    compiled = manager.runner.compiled
    assert compiled.steps == 0 and not told  # eager so far
    ready.append(True)
    each_as_alone(manager, model, requests)
    assert told == [[1, 3]] and compiled.steps > 2 + 3 and compiled.broken is None


def test_a_request_is_recorded_before_its_reader_has_it(model):
    # serve's metrics are the manager's on_end: a client that has its answer and reads /metrics right after must find
    # its request counted. Before, on_end ran after the output reached its reader (a CI run missed 3 tokens).
    recorded = []

    def slow_watcher(output):
        time.sleep(0.3)  # a watcher slower than the reader
        recorded.append(output.request_id)

    manager = model.init_continuous_batching(block_size=4)
    manager.on_end = slow_watcher
    manager.start()
    try:
        rid = manager.add_request([5, 6, 7], max_new_tokens=3)
        out = manager.get_result(rid, timeout=PATIENCE)
        assert out.status == RequestStatus.FINISHED and recorded == [rid]
    finally:
        manager.stop()


def test_one_way_to_choose_groups_of_one_beside_the_shared_pass(model):
    # sampler.choose: the requests that can share a pass are chosen in it, every other one is a group of one (its own
    # step), and a request whose own step raises gets its exception, the others their tokens; each Chosen equals the
    # request's tokens alone, and a request records it one way (Request.take).
    from decodekit.batching.manager import MethodCache
    from decodekit.batching.request import prepare_request
    from decodekit.batching.sampler import Chosen, ReadBack, choose
    from decodekit.core.selectors import race_rows

    def boom(ids, scores):
        raise RuntimeError("this processor fails")

    fields = [dict(do_sample=True, top_k=0, seed=3), dict(num_return_sequences=2, do_sample=True, seed=4), {}]
    requests = [
        prepare_request(model, [5 + i, 6], None, f"q{i}", False, dict(f, max_new_tokens=2), MethodCache())
        for i, f in enumerate(fields)
    ]
    failing = prepare_request(
        model, [9, 9], None, "bad", False, dict(max_new_tokens=2, logits_processor=[boom]), MethodCache()
    )
    assert [r.together is not None for r in requests] == [True, False, True] and failing.together is None
    generator = torch.Generator().manual_seed(1)
    logits = {r.id: 2 * torch.randn(r.rows, model.config.vocab_size, generator=generator) for r in [*requests, failing]}
    chosen = choose([*requests, failing], logits, race_rows)
    assert isinstance(chosen["bad"], RuntimeError) and "this processor fails" in str(chosen["bad"])
    assert chosen["q0"].going is None and chosen["q2"].going is None  # decided on the host from what they declare
    own = chosen["q1"]
    assert len(own.tokens) == 2 and own.going == [True, True] and own.sequences.shape == (2, 3)
    for r in requests:
        want = r.pipeline.selector(r.sequences, r.pipeline.processors(r.sequences, logits[r.id].float().clone()))
        assert chosen[r.id].tokens == want.tolist()
        r.take(chosen[r.id])
        assert [row[-1] for row in r.tokens] == want.tolist()
    assert isinstance(Chosen([7]).token, int) and Chosen([7]).token == 7
    back = ReadBack()
    back.add("ids", torch.tensor([[3, 2**40]]))
    back.add("flags", torch.tensor([True, False]))
    assert back.read() == {"ids": [3.0, float(2**40)], "flags": [1.0, 0.0]}


def test_work_between_steps_runs_in_the_thread_that_steps(model):
    # between_steps: what `decodekit serve` scores for echo runs where the steps run, between two of them; at once
    # where no thread steps; its error reaches the caller; once the manager stops, nothing runs.
    manager = model.init_continuous_batching(block_size=4)
    here = threading.get_ident()
    assert manager.between_steps(threading.get_ident).result(timeout=0) == here
    manager.start()
    try:
        rid = manager.add_request([5, 6, 7], max_new_tokens=6)
        assert manager.between_steps(threading.get_ident).result(timeout=PATIENCE) == manager._thread.ident != here
        with pytest.raises(ZeroDivisionError):
            manager.between_steps(lambda: 1 / 0).result(timeout=PATIENCE)
        assert manager.get_result(rid, timeout=PATIENCE).sequences == alone(model, [5, 6, 7], max_new_tokens=6)
    finally:
        manager.stop(timeout=PATIENCE)
    with pytest.raises(RuntimeError, match="the batching manager is stopping"):
        manager.between_steps(threading.get_ident).result(timeout=0)
