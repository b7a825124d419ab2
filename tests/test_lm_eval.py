"""decodekit as an lm-evaluation-harness model, with lm-eval's own `hf` model (transformers) as the oracle on the same
weights and a local multiple-choice task: each request's loglikelihood within 1e-4, the same is_greedy, the same
accuracy; and greedy generate_until outputs identical. Run by `make test-eval` (its own environment, lm-eval
installed); `make test` skips it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: `make test-eval` runs these tests")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from decodekit import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from decodekit.integrations.lm_eval import DecodekitLM  # noqa: E402
from decodekit.loading.default import default_model_path  # noqa: E402

CAPITALS = [
    ("France", ["Paris", "Rome", "Berlin"], 0),
    ("Italy", ["Madrid", "Rome", "Paris"], 1),
    ("Germany", ["Berlin", "Vienna", "Lisbon"], 0),
    ("Spain", ["Lisbon", "Athens", "Madrid"], 2),
    ("Japan", ["Seoul", "Tokyo", "Beijing"], 1),
]


@pytest.fixture(scope="module")
def both():
    path = default_model_path()
    ours = DecodekitLM(
        model=AutoModelForCausalLM.from_pretrained(path, dtype="float32"), tokenizer=AutoTokenizer.from_pretrained(path)
    )
    theirs = HFLM(pretrained=str(path.parent), gguf_file=path.name, tokenizer=None, batch_size=4, device="cpu")
    return ours, theirs


def requests_of(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_loglikelihoods_equal_lm_evals_hf_model(both):
    ours, theirs = both
    args = [(f"The capital of {country} is", f" {choice}") for country, choices, _ in CAPITALS for choice in choices]
    args += [("", "Paris"), ("Q: 2 + 2 = ", "4"), ("The capital of France is ", "Paris")]  # empty context, spaces
    mine = ours.loglikelihood(requests_of("loglikelihood", args))
    reference = theirs.loglikelihood(requests_of("loglikelihood", args))
    for (value, greedy), (want, want_greedy), pair in zip(mine, reference, args):
        assert value == pytest.approx(want, abs=1e-4), pair
        assert greedy == want_greedy, pair


def test_rolling_loglikelihoods_and_greedy_generations_equal_lm_evals(both):
    ours, theirs = both
    texts = [("The quick brown fox jumps over the lazy dog. " * 3,), ("Paris is the capital of France.",)]
    rolling = ours.loglikelihood_rolling(requests_of("loglikelihood_rolling", texts))
    assert rolling == pytest.approx(theirs.loglikelihood_rolling(requests_of("loglikelihood_rolling", texts)), abs=1e-3)
    asks = [("The capital of France is", {"until": ["."], "max_gen_toks": 12, "do_sample": False})]
    asks += [("Q: What is 2 + 2?\nA:", {"until": ["\n"], "max_gen_toks": 8, "do_sample": False})]
    assert ours.generate_until(requests_of("generate_until", asks)) == theirs.generate_until(
        requests_of("generate_until", asks)
    )


def test_a_local_task_gives_the_same_accuracy_as_lm_evals_hf_model(both, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps({"country": c, "choices": ch, "answer": a}) + "\n" for c, ch, a in CAPITALS))
    (tmp_path / "capitals.yaml").write_text(
        "task: capitals\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "The capital of {{country}} is"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        'target_delimiter: " "\nmetric_list:\n  - metric: acc\n'
    )
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(tmp_path))
    results = [
        lm_eval.simple_evaluate(model=lm, tasks=["capitals"], task_manager=tasks, log_samples=True) for lm in both
    ]
    accuracy = [r["results"]["capitals"]["acc,none"] for r in results]
    assert accuracy[0] == accuracy[1] and accuracy[0] >= 0.6
    mine, reference = (r["samples"]["capitals"] for r in results)
    for a, b in zip(mine, reference):
        for (value, greedy), (want, want_greedy) in zip((x[0] for x in a["resps"]), (x[0] for x in b["resps"])):
            assert float(value) == pytest.approx(float(want), abs=1e-4) and bool(greedy) == bool(want_greedy)


def test_lm_evals_own_api_client_against_decodekit_serve_gives_the_same_loglikelihoods(both, tmp_path):
    # lm-eval's local-completions model (its client for OpenAI-style servers) asks decodekit serve for echo logprobs
    # (token ids, echo, logprobs 1, max_tokens 1) and must get what DecodekitLM computes in process.
    pytest.importorskip("fastapi", reason="decodekit serve needs decodekit[serve]")
    from transformers import AutoTokenizer as HFTokenizer

    from decodekit.serve import Server, ServerSettings
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    ours, _ = both
    path = default_model_path()
    HFTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path / "tokenizer")
    manager = ours.model.init_continuous_batching(max_cache_bytes=64 * 2**20)
    server = Server(manager, ours.tokenizer, ServerSettings(model_name="tiny"), port=0).start()
    manager.start()
    try:
        client = LocalCompletionsAPI(
            model="tiny",
            base_url=f"{server.url}/v1/completions",
            tokenizer=str(tmp_path / "tokenizer"),
            tokenizer_backend="huggingface",
            num_concurrent=1,
            max_retries=1,
        )
        args = [
            (f"The capital of {country} is", f" {choice}") for country, choices, _ in CAPITALS[:3] for choice in choices
        ]
        remote = client.loglikelihood(requests_of("loglikelihood", args))
        local = ours.loglikelihood(requests_of("loglikelihood", args))
    finally:
        server.stop()
        manager.stop()
    for (value, greedy), (want, want_greedy), pair in zip(remote, local, args):
        assert value == pytest.approx(want, abs=1e-4), pair
        assert greedy == want_greedy, pair
