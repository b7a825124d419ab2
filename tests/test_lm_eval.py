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
    same = {"until": ["."], "max_gen_toks": 12, "do_sample": False}
    asks = [(f"The capital of {country} is", dict(same)) for country, _, _ in CAPITALS[:3]]
    asks += [("Q: What is 2 + 2?\nA:", {"until": ["\n"], "max_gen_toks": 8, "do_sample": False})]
    batches = []
    model_class = type(ours.model)
    generate_batch = model_class.generate_batch

    def counted(model, prompts, **kw):
        batches.append(len(prompts))
        return generate_batch(model, prompts, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_class, "generate_batch", counted)
        mine = ours.generate_until(requests_of("generate_until", asks))
    assert mine == theirs.generate_until(requests_of("generate_until", asks))
    assert batches == [3]  # the three of one setting in one continuous batch, the other alone


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


def local_tasks(folder) -> str:
    """A multiple-choice task and a generation task over one local JSONL file, as lm-eval task YAML."""
    data = folder / "capitals.jsonl"
    data.write_text("".join(json.dumps({"country": c, "choices": ch, "answer": a}) + "\n" for c, ch, a in CAPITALS))
    source = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (folder / "capitals.yaml").write_text(
        f"task: capitals\n{source}output_type: multiple_choice\n"
        'doc_to_text: "The capital of {{country}} is"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        'target_delimiter: " "\nmetric_list:\n  - metric: acc\n'
    )
    (folder / "capitals_gen.yaml").write_text(
        f"task: capitals_gen\n{source}output_type: generate_until\n"
        'doc_to_text: "The capital of {{country}} is"\ndoc_to_target: "{{choices[answer]}}"\n'
        'generation_kwargs:\n  until: [".", "\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "    ignore_case: true\n    ignore_punctuation: true\n"
        'filter_list:\n  - name: first_word\n    filter:\n      - function: regex\n        regex_pattern: "(\\\\w+)"\n'
        "      - function: take_first\n"
    )
    return str(folder)


def test_decodekit_eval_compares_methods_in_one_table(tmp_path, capsys, monkeypatch):
    # docs/evaluate.md's worked example as written, from the repository's root: its tasks and method are
    # docs/eval-example's files.
    import shlex
    from pathlib import Path

    from decodekit.cli import main

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(root)
    docs = (root / "docs" / "evaluate.md").read_text(encoding="utf-8")
    command = docs[docs.index("decodekit eval --tasks") :].split("\n```")[0].replace("\\\n", " ")
    argv = shlex.split(command)
    out = tmp_path / "out"
    argv[argv.index("--output") + 1] = str(out)  # the docs write ./eval-out; here the test's own folder
    assert main(argv[1:]) == 0
    printed = capsys.readouterr().out
    rows = json.loads((out / "comparison.json").read_text())
    method = "docs/eval-example/ban-recent"
    tasks = ("decodekit_capitals", "decodekit_capitals_gen")
    assert {(r["task"], r["method"]) for r in rows} == {(t, m) for t in tasks for m in ("greedy", method)}
    generation = {r["method"]: r for r in rows if r["task"] == "decodekit_capitals_gen"}
    assert all(r["tokens_per_s"] > 0 and 0 < r["mean_new_tokens"] <= 6 for r in generation.values())
    assert all(r["tokens_per_s"] is None for r in rows if r["task"] == "decodekit_capitals")  # nothing generated
    choice = {r["method"]: r["value"] for r in rows if r["task"] == "decodekit_capitals"}
    assert choice["greedy"] == choice[method] >= 0.6  # a loglikelihood is the model's own, whatever the method
    assert "decodekit_capitals_gen" in printed and "exact_match" in printed and "±" in printed
    assert (out / "results-decodekit_capitals-greedy.json").is_file()
    import xml.dom.minidom

    picture = xml.dom.minidom.parseString((out / "comparison.svg").read_text())  # a well-formed picture
    assert len(picture.getElementsByTagName("circle")) == 2  # metric against tokens/s: one point per method
