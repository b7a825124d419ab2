"""The playground's endpoints (serve/playground.py) over HTTP; tests/test_playground_browser.py drives the page."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("fastapi", reason="decodekit serve needs decodekit[serve] (make test installs it)")
pytest.importorskip("uvicorn", reason="decodekit serve needs decodekit[serve] (make test installs it)")

from decodekit.batching import RequestStatus  # noqa: E402
from decodekit.hub_loader.source import resolve  # noqa: E402
from decodekit.serve import Server, ServerSettings, allowed_methods  # noqa: E402

from methods import HOOK_METHOD, write_method  # noqa: E402
from helpers import PATIENCE

KEY = "playground-key"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(default_model, tmp_path_factory):
    model, tok = default_model
    method = write_method(tmp_path_factory.mktemp("methods") / "ban", HOOK_METHOD)
    manager = model.init_continuous_batching(max_queue_size=16, max_cache_bytes=64 * 2**20)
    settings = ServerSettings(
        model_name="smol",
        api_key=KEY,
        max_tokens_limit=64,
        methods=allowed_methods([f"{method}@{resolve(str(method)).revision}"]),
    )
    server = Server(manager, tok, settings, port=0).start()
    manager.start()
    yield server, str(method)
    server.stop()
    manager.join(timeout=PATIENCE)


def call(server, path: str, body: dict | None = None, key: str | None = KEY):
    request = urllib.request.Request(
        server.url + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=PATIENCE) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_the_page_is_served_at_the_root_without_the_key(served):
    status, page = call(served[0], "/", key=None)
    assert status == 200 and 'id="transcript"' in page and "/playground/step" in page


def test_methods_lists_what_a_request_may_choose_with_its_fields(served):
    server, method = served
    assert call(server, "/playground/methods", key=None)[0] == 401
    status, text = call(server, "/playground/methods")
    offered = {m["name"]: m for m in json.loads(text)["methods"]}
    assert status == 200 and "caches" not in offered and "fused" not in offered  # machinery, not methods
    assert offered["llamacpp_samplers"]["fields"]["mirostat"] == 0
    allowed = next(m for name, m in offered.items() if m["kind"] == "method")
    assert allowed["fields"] == {"banned_token": None}


def test_step_shows_each_processor_in_order_and_the_token_generate_chooses(served, default_model):
    server, _ = served
    body = {"messages": MESSAGES, "temperature": 0, "decodekit": {"repetition_penalty": 1.5}}
    status, text = call(server, "/playground/step", body)
    assert status == 200, text
    step = json.loads(text)
    names = [p["processor"] for p in step["processors"]]
    assert len(names) == 1 and "RepetitionPenaltyLogitsProcessor" in names[0]
    # The penalty lowers the score of a token of the prompt that was among the top ones, and nothing else changes.
    before = {t["id"]: t["score"] for t in step["processors"][0]["before"]}
    after = {t["id"]: t["score"] for t in step["processors"][0]["after"]}
    assert step["processors"][0]["before"] == step["logits"] and step["processors"][-1]["after"] == step["scores"]
    assert all(after.get(i, float("-inf")) <= s for i, s in before.items())
    model, tok = default_model
    from decodekit.loading.tokenizer import chat_ids

    ids = torch.tensor([chat_ids(tok, MESSAGES)])
    first = model.generate(ids, max_new_tokens=1, repetition_penalty=1.5)[0, -1].item()
    assert step["chosen"]["id"] == first == step["scores"][0]["id"]


def test_step_with_a_method_names_its_processor_and_obeys_it(served):
    server, _ = served
    status, text = call(server, "/playground/step", {"messages": MESSAGES, "temperature": 0})
    best = json.loads(text)["chosen"]["id"]
    status, text = call(server, "/playground/methods")
    name = next(m["name"] for m in json.loads(text)["methods"] if m["kind"] == "method")
    status, text = call(
        server,
        "/playground/step",
        {"messages": MESSAGES, "temperature": 0, "decodekit": {"method": name, "banned_token": best}},
    )
    step = json.loads(text)
    assert status == 200 and step["chosen"]["id"] != best
    assert any("local:" in p["processor"] for p in step["processors"])
    status, text = call(server, "/playground/step", {"messages": MESSAGES, "decodekit": {"method": "nope"}})
    assert status == 400 and "decodekit method 'nope'" in text


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"decodekit": {"num_beams": 8}}, "beam_search"),  # /v1/chat/completions refuses it: so does the step
        ({"decodekit": {"penalty_alpha": 0.6, "top_k": 4}}, "contrastive"),
        ({"decodekit": {"observer": "x"}}, "cannot be set by a request"),
    ],
)
def test_step_refuses_what_the_completions_endpoint_refuses(served, extra, words):
    server, _ = served
    for path in ("/playground/step", "/v1/chat/completions"):
        status, text = call(server, path, {"messages": MESSAGES, "max_tokens": 2, **extra})
        assert status == 400 and words in text, (path, text)


def test_step_runs_as_a_request_of_the_manager_under_its_queue_and_cache_limits(default_model):
    # /playground/step ran generate() in the threadpool, outside --max-running, --max-queue and --cache-mb: a 2,031
    # token step cost 14.5 s and +245 MB, three at once 192 s and +3.3 GB, while served requests waited.
    model, tok = default_model
    manager = model.init_continuous_batching(max_queue_size=1, max_cache_bytes=8 * 2**20, max_running=1)
    server = Server(manager, tok, ServerSettings(model_name="smol", max_tokens_limit=64), port=0).start()
    try:  # the manager is not stepping: requests wait in its queue, as behind a busy server
        long = [{"role": "user", "content": "word " * 2000}]
        status, text = call(server, "/playground/step", {"messages": long}, key=None)
        assert status == 400 and "cache blocks" in text  # more than --cache-mb holds: refused before it runs
        first = manager.add_request([1, 2, 3], max_new_tokens=2)
        manager.add_request([1, 2, 3], max_new_tokens=2)  # the running slot and the one queue place are taken
        status, text = call(server, "/playground/step", {"messages": MESSAGES}, key=None)
        assert status == 429, text
        manager.start()
        assert manager.get_result(first, timeout=PATIENCE).status == RequestStatus.FINISHED
        status, text = call(server, "/playground/step", {"messages": MESSAGES, "temperature": 0}, key=None)
        step = json.loads(text)
        assert status == 200 and step["chosen"]["id"] == step["scores"][0]["id"]
    finally:
        server.stop()
        manager.stop()


def test_fields_json_cannot_fill_are_not_offered_and_token_fields_take_lists(served, default_model):
    # Before: the page offered prefix_allowed_tokens_fn (a Python function) and negative_prompt_ids, which a request
    # could only send as a JSON list and was refused "must be an integer tensor".
    server, _ = served
    offered = {m["name"]: m for m in json.loads(call(server, "/playground/methods")[1])["methods"]}
    assert "prefix_allowed_tokens_fn" not in offered["processors"]["fields"]
    assert "negative_prompt_ids" in offered["guidance"]["fields"]
    assert "token ids" in offered["guidance"]["forms"]["negative_prompt_ids"]
    model, tok = default_model
    negative = tok.encode("Paris")
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 4}
    body["decodekit"] = {"method": "guidance", "guidance_scale": 1.5, "negative_prompt_ids": negative}
    status, text = call(server, "/v1/chat/completions", body)
    assert status == 200, text
    from decodekit.loading.tokenizer import chat_ids

    ids = torch.tensor([chat_ids(tok, MESSAGES)])
    want = model.generate(ids, max_new_tokens=4, guidance_scale=1.5, negative_prompt_ids=torch.tensor([negative]))
    assert json.loads(text)["choices"][0]["message"]["content"] == tok.decode(
        want[0, ids.shape[1] :], skip_special_tokens=True
    )
    for fields, words in [
        (
            {"prefix_allowed_tokens_fn": "x"},
            'prefix_allowed_tokens_fn" cannot be set by a request: it takes a Python function',
        ),
        (
            {"guidance_scale": 1.5, "negative_prompt_ids": "Paris"},
            "decodekit.negative_prompt_ids='Paris' is invalid; expected a non-empty list of token ids",
        ),
        ({"guidance_scale": 1.5, "negative_prompt_ids": [[1, 2], [3]]}, "all of one length"),
    ]:
        status, text = call(server, "/v1/chat/completions", {**body, "decodekit": fields})
        assert status == 400 and words in json.loads(text)["error"]["message"], text


def test_an_unknown_method_s_refusal_lists_only_what_can_be_served(served):
    status, text = call(served[0], "/v1/chat/completions", {"messages": MESSAGES, "decodekit": {"method": "nope"}})
    available = json.loads(text)["error"]["message"].split("available: ")[1]
    assert status == 400 and "processors" in available
    for refused in ("beam_search", "contrastive", "speculative", "dola"):
        assert refused not in available, available


def test_explain_after_a_reply_cut_by_max_tokens_goes_on_with_that_reply(served, default_model):
    # Before: the page sent the cut reply as a finished turn, and the step explained the first token of a new one.
    server, _ = served
    short = json.loads(
        call(server, "/v1/chat/completions", {"messages": MESSAGES, "temperature": 0, "max_tokens": 3})[1]
    )
    longer = json.loads(
        call(server, "/v1/chat/completions", {"messages": MESSAGES, "temperature": 0, "max_tokens": 4})[1]
    )
    assert short["choices"][0]["finish_reason"] == "length"
    cut = short["choices"][0]["message"]["content"]
    body = {
        "messages": [*MESSAGES, {"role": "assistant", "content": cut}],
        "temperature": 0,
        "continue_final_message": True,
    }
    status, text = call(server, "/playground/step", body)
    assert status == 200, text
    assert cut + json.loads(text)["chosen"]["text"] == longer["choices"][0]["message"]["content"]
    status, text = call(server, "/playground/step", {**body, "messages": MESSAGES})
    assert status == 400 and "continue_final_message needs the last message to be an assistant's" in text


def test_methods_lists_the_cached_ones_with_their_facts_and_search_finds_the_hubs(served, hub, tmp_path):
    # The playground lists, beside what it serves, the methods of this machine's Hub cache with `decodekit info`'s
    # facts (not served: the operator chooses what runs), and finds the Hub's through `decodekit search`.
    server, method = served
    readme = "---\ntags:\n- custom_generate\n---\nBans one token, as a hook.\n"
    sha = hub.repos.push_dir("acme/banner", write_method(tmp_path / "banner", HOOK_METHOD, readme=readme))
    resolve("acme/banner")  # into the test's Hub cache, as a download would put it
    status, text = call(server, "/playground/methods")
    entries = {m["name"]: m for m in json.loads(text)["methods"]}
    cached = entries["acme/banner"]
    assert cached["kind"] == "cached" and "not among the methods the server was started with" in cached["refused"]
    assert cached["facts"]["pin"] == sha and cached["facts"]["summary"] == "Bans one token, as a hook."
    assert cached["facts"]["what"] == "hooks: decodekit_config_fields, decodekit_logits_processors"
    assert entries[method]["facts"]["pin"] == resolve(method).revision and entries[method]["refused"] is None
    status, text = call(server, "/playground/search?q=banner")
    assert status == 200 and [r["id"] for r in json.loads(text)["results"]] == ["acme/banner"]
    assert json.loads(text)["results"][0]["summary"] == "Bans one token, as a hook."


def test_info_of_a_searched_method_reads_it_without_running_it(served, hub, tmp_path):
    server, _ = served
    readme = "---\ntags:\n- custom_generate\n---\nBans one token, as a hook.\n"
    sha = hub.repos.push_dir("acme/shown", write_method(tmp_path / "shown", HOOK_METHOD, readme=readme))
    status, text = call(server, "/playground/info?repo=acme/shown")
    facts = json.loads(text)["facts"]
    assert status == 200 and facts["pin"] == sha and facts["what"].startswith("hooks: ") and facts["files"] == 1
    status, text = call(server, "/playground/info?repo=../etc")
    assert status == 400 and "expected a Hub repo id 'org/name'" in text
    status, text = call(server, "/playground/info?repo=acme/absent")
    assert status == 502 and "neither a local directory nor a Hub repository" in text
