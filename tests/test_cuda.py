"""decodekit on a GPU: every strategy, the compiled step (and its CUDA-graph replay), bf16 and int8 weights,
continuous batching and methods give on the device what they give on the CPU.

Skipped without a CUDA device; `make test-cuda` runs them on a machine with one (a CUDA build of torch in the
Python that runs make). DECODEKIT_TEST_DEVICE names another torch device type to run them on (xpu, mps).
"""

from __future__ import annotations

import os

import pytest
import torch

from decodekit import AutoModelForCausalLM
from decodekit.testing import write_tiny_model

from methods import HOOK_METHOD, TRANSFORMERS_STYLE_GREEDY, write_method

DEVICE = os.environ.get("DECODEKIT_TEST_DEVICE", "cuda")


def _available(device: str) -> bool:
    backend = getattr(torch, device, None)
    return device == "cpu" or bool(backend is not None and backend.is_available())


pytestmark = pytest.mark.skipif(
    not _available(DEVICE), reason=f"needs a {DEVICE} device: run `make test-cuda` on a machine with one"
)

PROMPT = torch.tensor([[5, 9, 14, 3, 7, 21, 8]])
BATCH = torch.tensor([[5, 9, 14, 3, 7, 8], [0, 0, 0, 4, 5, 6], [0, 11, 12, 13, 14, 15]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]])


@pytest.fixture(autouse=True, scope="module")
def exact_float32():
    """TF32 products would round float32 logits to about 1e-3: the comparisons with the CPU need float32's."""
    if DEVICE != "cuda":
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def pair(request, tmp_path_factory):
    """(the model on the CPU, the same checkpoint loaded on the device)."""
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, device=DEVICE)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def on(device, *tensors):
    return [t.to(device) for t in tensors]


def test_the_model_loads_on_the_device_with_its_cache_and_rotary_tables(pair):
    cpu, dev = pair
    assert dev.device.type == DEVICE
    assert all(p.device.type == DEVICE for p in dev.parameters())
    logits = dev(PROMPT.to(DEVICE)).logits
    assert logits.device.type == DEVICE
    torch.testing.assert_close(logits.cpu(), cpu(PROMPT).logits, rtol=1e-4, atol=1e-4)


def test_greedy_on_the_device_equals_the_cpu(pair):
    cpu, dev = pair
    for ids, mask in ((PROMPT, None), (BATCH, MASK)):
        want = cpu.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None)
        got = dev.generate(
            *on(DEVICE, ids),
            attention_mask=None if mask is None else mask.to(DEVICE),
            max_new_tokens=24,
            eos_token_id=None,
        )
        assert got.device.type == DEVICE
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_beams=3),
        dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5),
        dict(penalty_alpha=0.6, top_k=4),
        dict(dola_layers="high", repetition_penalty=1.2),
        dict(prompt_lookup_num_tokens=2),
        dict(guidance_scale=1.5),
        dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=5),
    ],
    ids=lambda kw: ",".join(kw),
)
def test_deterministic_strategies_on_the_device_equal_the_cpu(pair, kwargs):
    cpu, dev = pair
    want = cpu.generate(PROMPT, max_new_tokens=12, eos_token_id=None, **kwargs)
    got = dev.generate(PROMPT.to(DEVICE), max_new_tokens=12, eos_token_id=None, **kwargs)
    assert torch.equal(got.cpu(), want)


def test_assisted_decoding_on_the_device_equals_greedy(tmp_path, llama):
    target = AutoModelForCausalLM.from_pretrained(llama, device=DEVICE)
    draft = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "draft", "llama", seed=3), device=DEVICE)
    ids = PROMPT.to(DEVICE)
    greedy = target.generate(ids, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(target.generate(ids, max_new_tokens=16, eos_token_id=None, assistant_model=draft), greedy)


def test_sampling_on_the_device_is_reproducible_for_a_seed(pair):
    """A seed's generator lives on the model's device, as torch's do: the same seed gives the same text there
    (CUDA's generator draws other numbers than the CPU's, so not the CPU's text), another seed another."""
    _, dev = pair
    kwargs = dict(do_sample=True, temperature=0.9, top_k=30, top_p=0.95, max_new_tokens=20, eos_token_id=None)
    ids, mask = BATCH.to(DEVICE), MASK.to(DEVICE)
    first = dev.generate(ids, attention_mask=mask, seed=7, **kwargs)
    assert torch.equal(dev.generate(ids, attention_mask=mask, seed=7, **kwargs), first)
    assert not torch.equal(dev.generate(ids, attention_mask=mask, seed=8, **kwargs), first)


def test_speculative_sampling_on_the_device(tmp_path, llama):
    """Assisted sampling draws its acceptance coins and residual samples from the call's generator: a seed's, on
    the device, or one of the CPU's that the caller passes."""
    target = AutoModelForCausalLM.from_pretrained(llama, device=DEVICE)
    draft = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "draft", "llama", seed=3), device=DEVICE)
    ids = PROMPT.to(DEVICE)
    kwargs = dict(do_sample=True, max_new_tokens=16, eos_token_id=None, assistant_model=draft)
    seeded = target.generate(ids, seed=5, **kwargs)
    assert torch.equal(target.generate(ids, seed=5, **kwargs), seeded)
    on_cpu = [target.generate(ids, generator=torch.Generator().manual_seed(5), **kwargs) for _ in range(2)]
    assert torch.equal(on_cpu[0], on_cpu[1]) and on_cpu[0].device.type == DEVICE


@pytest.mark.parametrize("mode", [None, "reduce-overhead", "default"])
def test_the_compiled_step_on_the_device_equals_eager(llama, mode):
    """compile=True (on CUDA a CUDA-graph replay of the step, as mode="reduce-overhead"), and mode="default" (no
    graphs), over two calls (the second replays what the first compiled) and a batch with padding."""
    model = AutoModelForCausalLM.from_pretrained(llama, device=DEVICE)
    config = {"compile_config": {"mode": mode}} if mode else {"compile": True}
    for ids, mask in ((PROMPT, None), (BATCH, MASK), (PROMPT[:, 2:], None)):
        ids, mask = ids.to(DEVICE), None if mask is None else mask.to(DEVICE)
        eager = model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)
        assert torch.equal(
            model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None, **config), eager
        )
    sampled = dict(do_sample=True, top_p=0.9, seed=3, max_new_tokens=20, eos_token_id=None)
    ids = PROMPT.to(DEVICE)
    assert torch.equal(model.generate(ids, **sampled, **config), model.generate(ids, **sampled))
    beams = dict(num_beams=3, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(model.generate(ids, **beams, **config), model.generate(ids, **beams))


def test_bf16_weights_on_the_device_track_float32(llama):
    """bfloat16 weights on the device: logits within bfloat16's rounding of the float32 model's, and the compiled
    step equal to the eager loop."""
    fp32 = AutoModelForCausalLM.from_pretrained(llama, device=DEVICE)
    bf16 = AutoModelForCausalLM.from_pretrained(llama, device=DEVICE, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    ids = PROMPT.to(DEVICE)
    torch.testing.assert_close(bf16(ids).logits.float(), fp32(ids).logits, rtol=0.05, atol=0.1)
    eager = bf16.generate(ids, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(bf16.generate(ids, max_new_tokens=16, eos_token_id=None, compile=True), eager)


def test_int8_weights_on_the_device_equal_int8_on_the_cpu(llama):
    """quantize="int8" stores int8 weights with per-channel scales wherever the model is; on the device the
    products are the library's, and their logits agree with the CPU's int8 model."""
    cpu = AutoModelForCausalLM.from_pretrained(llama, quantize="int8")
    dev = AutoModelForCausalLM.from_pretrained(llama, quantize="int8", device=DEVICE)
    torch.testing.assert_close(dev(PROMPT.to(DEVICE)).logits.cpu(), cpu(PROMPT).logits, rtol=1e-3, atol=1e-3)
    ids = PROMPT.to(DEVICE)
    eager = dev.generate(ids, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(eager.cpu(), cpu.generate(PROMPT, max_new_tokens=16, eos_token_id=None))
    assert torch.equal(dev.generate(ids, max_new_tokens=16, eos_token_id=None, compile=True), eager)


@pytest.mark.parametrize("method", ["int4", "int4-g128"])
def test_int4_weights_on_the_device_run_pytorchs_int4_kernel(tmp_path, method):
    """quantize="int4..." on the device holds PyTorch's int4 layout (kernels/int4pack.py: tinygemm), whose logits
    agree with the CPU's int4 model to bfloat16 activations' rounding; eager and compiled give the same tokens."""
    from decodekit.kernels.int4pack import Int4PackLinear

    path = write_tiny_model(tmp_path / "tiny", "llama", hidden_size=128, intermediate_size=256)
    cpu = AutoModelForCausalLM.from_pretrained(path, quantize=method)
    dev = AutoModelForCausalLM.from_pretrained(path, quantize=method, device=DEVICE)
    assert type(dev.module.layers[0].mlp.down) is Int4PackLinear
    agree_in_bfloat16(cpu, dev)


def agree_in_bfloat16(cpu, dev):
    """The device's logits within 5% of the CPU's (bfloat16 activations there), and its eager and compiled calls the
    same tokens."""
    want, got = cpu(PROMPT).logits, dev(PROMPT.to(DEVICE)).logits.cpu().float()
    assert float((got - want).norm() / want.norm()) < 0.05
    ids = PROMPT.to(DEVICE)
    eager = dev.generate(ids, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(dev.generate(ids, max_new_tokens=16, eos_token_id=None, compile=True), eager)


def test_a_gguf_files_q4_blocks_load_on_the_device_in_pytorchs_int4_layout(tmp_path):
    """A GGUF file loaded on the device keeps its 4-bit matrices as PyTorch's int4 groups of 32 (tinygemm), in
    bfloat16; its logits agree with the CPU's blocks (float32) to bfloat16's rounding."""
    from decodekit.kernels.int4pack import Int4PackLinear
    from decodekit.testing import write_tiny_gguf

    path = write_tiny_gguf(
        tmp_path / "q4.gguf", "Q4_0", tie_word_embeddings=True, hidden_size=128, intermediate_size=256
    )
    cpu = AutoModelForCausalLM.from_pretrained(path)
    dev = AutoModelForCausalLM.from_pretrained(path, device=DEVICE)
    assert type(dev.module.layers[0].attn.qkv) is Int4PackLinear and dev.module.dtype == torch.bfloat16
    agree_in_bfloat16(cpu, dev)


def test_a_model_moved_to_the_device_after_loading_generates_there(llama):
    model = AutoModelForCausalLM.from_pretrained(llama)
    want = model.generate(PROMPT, max_new_tokens=12, eos_token_id=None)
    model.generate(PROMPT, max_new_tokens=12, eos_token_id=None, compile=True)  # a step built for the CPU first
    moved = model.to(DEVICE)
    assert torch.equal(moved.generate(PROMPT.to(DEVICE), max_new_tokens=12, eos_token_id=None).cpu(), want)
    assert torch.equal(
        moved.generate(PROMPT.to(DEVICE), max_new_tokens=12, eos_token_id=None, compile=True).cpu(), want
    )


@pytest.mark.parametrize("compile", [False, True])
def test_continuous_batching_on_the_device_equals_generate(llama, compile):
    model = AutoModelForCausalLM.from_pretrained(llama, device=DEVICE)
    prompts = [[5, 9, 14, 3, 7], [4, 5, 6], list(range(10, 40)), [11, 12, 13, 14, 15, 16, 17]]
    results = model.generate_batch(
        prompts, max_new_tokens=14, eos_token_id=None, compile=compile, block_size=4, progress_bar=False
    )
    for prompt, out in zip(prompts, results.values()):
        alone = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=14, eos_token_id=None)
        assert out.generated_tokens == alone[0, len(prompt) :].tolist()
    sampled = model.generate_batch(
        prompts[:2], max_new_tokens=10, do_sample=True, seed=4, eos_token_id=None, progress_bar=False
    )
    for prompt, out in zip(prompts, sampled.values()):
        alone = model.generate(
            torch.tensor([prompt], device=DEVICE), max_new_tokens=10, do_sample=True, seed=4, eos_token_id=None
        )
        assert out.generated_tokens == alone[0, len(prompt) :].tolist()


def test_continuous_batching_steps_run_compiled_as_cuda_graphs_on_the_device(llama):
    """The manager's compiled decode step on CUDA: torch attention over the block tables, replayed as CUDA graphs per
    row bucket (warm_up records them), each request's tokens those of generate() alone."""
    from decodekit.batching import RequestStatus

    model = AutoModelForCausalLM.from_pretrained(llama, device=DEVICE)
    manager = model.init_continuous_batching(compile=True, block_size=4, max_running=6)
    compiled = manager.runner.compiled
    assert compiled.graphs and manager.warm_up() == [2, 4, 8]
    prompts = [[5, 9, 14, 3, 7], [4, 5, 6], list(range(10, 40)), [11, 12, 13], [7] * 9]
    ids = [manager.add_request(p, max_new_tokens=3 + 4 * i, eos_token_id=None) for i, p in enumerate(prompts)]
    manager.run(until_idle=True)
    for i, (prompt, rid) in enumerate(zip(prompts, ids)):
        out = manager.get_result(rid, timeout=0)
        assert out.status == RequestStatus.FINISHED, out.error
        alone = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=3 + 4 * i, eos_token_id=None)
        assert out.generated_tokens == alone[0, len(prompt) :].tolist()
    assert compiled.broken is None and compiled.steps > 10


def synchronisations(call):
    """(call()'s result, how many times it synchronised with the GPU): torch's sync debug mode warns at each
    synchronising call (an item(), a tolist(), a copy to or from pageable memory)."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchroniz" in str(w.message) for w in seen)


@pytest.mark.skipif(DEVICE != "cuda", reason="torch's synchronisation check is CUDA's")
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_a_compiled_decode_step_of_continuous_batching_waits_for_the_device_once(llama, sample):
    """A decode step of requests chosen together (batching/sampler.py) synchronises with the GPU once: the read of
    the sampled tokens (synchronisations()); steps with prompt chunks are not counted."""
    model = AutoModelForCausalLM.from_pretrained(llama, device=DEVICE)
    manager = model.init_continuous_batching(compile=True, block_size=4, max_running=8)
    manager.warm_up()
    fields = dict(do_sample=True, temperature=0.7, top_p=0.9) if sample else {}
    for i in range(6):
        manager.add_request([5 + i, 9, 14, 3], max_new_tokens=12, eos_token_id=None, seed=i, **fields)
    forward, decode_steps = manager.runner.forward, []

    def counted(works):
        decode_steps.append(not any(work.prefill for work in works))
        return forward(works)

    manager.runner.forward = counted
    loop_once, syncs = manager._loop_once, []

    def step():
        before = len(decode_steps)
        going, count = synchronisations(loop_once)
        if len(decode_steps) > before and decode_steps[-1]:  # a step that ran a forward of decode rows alone
            syncs.append(count)
        return going

    manager._loop_once = step
    manager.run(until_idle=True)
    assert len(syncs) >= 8 and max(syncs) == 1, syncs


@pytest.mark.skipif(DEVICE != "cuda", reason="torch's synchronisation check is CUDA's")
@pytest.mark.parametrize("kwargs", [{}, {"num_beams": 3}], ids=["greedy", "beams"])
def test_a_compiled_generate_waits_for_the_device_only_every_few_steps(llama, kwargs):
    """generate(compile=True)'s loop reads the device once every SYNC_EVERY steps (whether every row has finished):
    the step's cache slot (and beam search's length) advance on the device. Made from a Python number each step,
    they were copies from pageable memory, each waiting for the step before: the host prepared every step while the
    GPU idled."""
    from decodekit.core.fused_loop import SYNC_EVERY

    model = AutoModelForCausalLM.from_pretrained(llama, device=DEVICE)
    ids, n = PROMPT.to(DEVICE), 64
    want = model.generate(ids, max_new_tokens=n, eos_token_id=None, compile=True, **kwargs)  # compiled, recorded
    got, syncs = synchronisations(
        lambda: model.generate(ids, max_new_tokens=n, eos_token_id=None, compile=True, **kwargs)
    )
    assert torch.equal(got, want) and syncs <= n // SYNC_EVERY + 12, syncs


def test_methods_run_on_the_device(tmp_path, llama):
    """A hook-only method and a transformers-style loop (which makes its tensors on model.device) run there."""
    model = AutoModelForCausalLM.from_pretrained(llama, device=DEVICE)
    ids = PROMPT.to(DEVICE)
    greedy = model.generate(ids, max_new_tokens=8, eos_token_id=None)
    banned = int(greedy[0, PROMPT.shape[1]])
    hooked = model.generate(
        ids,
        max_new_tokens=8,
        eos_token_id=None,
        banned_token=banned,
        custom_generate=str(write_method(tmp_path / "ban", HOOK_METHOD)),
        trust_remote_code=True,
    )
    assert hooked.device.type == DEVICE and banned not in hooked[0, PROMPT.shape[1] :].tolist()
    looped = model.generate(
        ids,
        max_new_tokens=8,
        custom_generate=str(write_method(tmp_path / "loop", TRANSFORMERS_STYLE_GREEDY)),
        trust_remote_code=True,
    )
    assert torch.equal(looped, greedy)


def test_a_wrapped_transformers_model_on_the_device_equals_its_own_generate(llama):
    transformers = pytest.importorskip("transformers")
    import decodekit

    hf = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).to(DEVICE)
    ids = BATCH.to(DEVICE)
    mask = MASK.to(DEVICE)
    for kwargs in (dict(), dict(num_beams=3), dict(do_sample=False, repetition_penalty=1.3)):
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=None, **kwargs)
        got = decodekit.wrap(hf).generate(
            ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=None, **kwargs
        )
        assert torch.equal(got, want)


@pytest.mark.parametrize("attention", ["auto", "flex"])
def test_continuous_batching_of_64_mixed_requests_on_the_1b_head_layout_never_falls_back(tmp_path, caplog, attention):
    """The 1B shape's head layout (32 query heads over 8 key/value heads, head_dim 64) at a tiny width and depth, 64
    requests of mixed lengths: the compiled step compiles on real shapes (no fallback logged), is replayed as graphs
    (no 'skipping cudagraphs' for mutated inputs: the pools are static addresses), and every request equals
    generate() alone; with its attention over the gathered blocks and through flex attention (batching/flex.py).
    Not run where the suite has no CUDA device."""
    import logging
    import random

    from decodekit.batching import RequestStatus

    if attention == "flex" and DEVICE == "cpu":
        pytest.skip("paged_attention='flex' is for GPUs (inductor's CPU flex template is refused)")

    path = write_tiny_model(
        tmp_path / "gqa", "llama", hidden_size=2048 // 8, num_attention_heads=32, num_key_value_heads=8, head_dim=64
    )
    model = AutoModelForCausalLM.from_pretrained(path, device=DEVICE)  # float32: rows equal generate() alone exactly
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 90) for _ in range(rng.randrange(4, 64))] for _ in range(64)]
    with caplog.at_level(logging.INFO):
        manager = model.init_continuous_batching(compile=True, block_size=16, max_running=64, paged_attention=attention)
        manager.warm_up()
        ids = [manager.add_request(p, max_new_tokens=16, eos_token_id=None) for p in prompts]
        manager.run(until_idle=True)
    assert manager.runner.compiled.broken is None
    assert (manager.runner.compiled.route == "flex") is (attention == "flex")
    assert "compiled decode step failed" not in caplog.text and "skipping cudagraphs" not in caplog.text
    for prompt, rid in zip(prompts[:8], ids[:8]):
        out = manager.get_result(rid, timeout=0)
        assert out.status == RequestStatus.FINISHED, out.error
        alone = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=16, eos_token_id=None)
        assert out.generated_tokens == alone[0, len(prompt) :].tolist()


@pytest.mark.skipif(DEVICE != "cuda", reason="the flex route's key tiles are the GPU kernel's")
def test_flex_attention_on_the_device_names_the_block_sizes_it_takes(llama):
    model = AutoModelForCausalLM.from_pretrained(llama, device=DEVICE)
    with pytest.raises(ValueError, match=r"key tiles \(64, 32, 16\) divides; got block_size=4"):
        model.init_continuous_batching(compile=True, block_size=4, paged_attention="flex")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_published_methods_compiled_on_the_device_equal_their_eager_tokens(
    tmp_path, kind, dtype, caplog, monkeypatch
):  # fmt: skip
    """compile=True for a Hub method's own loop on the device: its one-token forwards run as the compiled step (CUDA
    graphs replayed, none skipped), and every loop style gives its eager tokens: greedy, a left-padded batch, seeded
    sampling."""
    import logging

    from decodekit.core.compile import FusedStep
    from published_methods import BEAM_LOOP, CACHELESS, ROLLBACK, TOP_N_SIGMA

    steps = []
    call = FusedStep.__call__

    def counted(self, *args):
        if self.compiles:
            steps.append(self.graphs)
        return call(self, *args)

    monkeypatch.setattr(FusedStep, "__call__", counted)
    model = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / kind, kind), device=DEVICE, dtype=dtype)
    ids, batch, mask = PROMPT.to(DEVICE), BATCH.to(DEVICE), MASK.to(DEVICE)
    cases = [
        (CACHELESS, dict(input_ids=ids), None),
        (CACHELESS, dict(input_ids=batch, attention_mask=mask), None),
        (TOP_N_SIGMA, dict(input_ids=ids, eos_token_id=None), None),
        (TOP_N_SIGMA, dict(input_ids=batch, attention_mask=mask, pad_token_id=0, eos_token_id=None), None),
        (BEAM_LOOP, dict(input_ids=ids, num_beams=3), None),
        (ROLLBACK, dict(input_ids=ids, cache_kind="dynamic"), None),
        *[
            (TOP_N_SIGMA, dict(input_ids=ids, do_sample=True, n_sigma=2.0, eos_token_id=None), seed)
            for seed in (0, 1, 2)
        ],
    ]
    with caplog.at_level(logging.INFO):
        for index, (source, options, seed) in enumerate(cases):
            repo = str(write_method(tmp_path / str(index), source))
            call_options = dict(max_new_tokens=10, custom_generate=repo, trust_remote_code=True, **options)
            if seed is not None:
                torch.manual_seed(seed)
            eager = model.generate(**call_options)
            before = len(steps)
            if seed is not None:
                torch.manual_seed(seed)
            compiled = model.generate(**call_options, compile=True)
            assert torch.equal(compiled, eager), (index, eager.tolist(), compiled.tolist())
            assert len(steps) - before >= 8 and all(steps[before:]) == (DEVICE == "cuda"), index
    assert "skipping cudagraphs" not in caplog.text and "runs eagerly" not in caplog.text
