"""decodekit serve speaks the OpenAI API clients send: driven by the OpenAI ecosystem's own clients (openai's
`parse`, instructor, langchain-openai) on a loopback port, with response_format, tools, logit_bias, penalties,
top_logprobs, vLLM's extra fields, /metrics and /tokenize."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi", reason="decodekit serve needs decodekit[serve] (make test installs it)")
pytest.importorskip("llguidance", reason="response_format and tools need decodekit[structured] (make test installs it)")
openai = pytest.importorskip("openai", reason="the server's tests use the openai client (decodekit[dev])")
pydantic = pytest.importorskip("pydantic", reason="openai's parse takes pydantic models")

from decodekit.serve import Server, ServerSettings  # noqa: E402
from decodekit.serve.protocol import BadRequest, ChatCompletionRequest, CompletionRequest  # noqa: E402
from decodekit.serve.tools import ToolPlan, plan_tools  # noqa: E402
from helpers import PATIENCE  # noqa: E402

NAME = "smol"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=20)
    age: int


@pytest.fixture(scope="module")
def server(default_model):
    model, tok = default_model
    manager = model.init_continuous_batching(max_cache_bytes=256 * 2**20)
    srv = Server(manager, tok, ServerSettings(model_name=NAME, max_tokens_limit=256), port=0).start()
    manager.start()
    yield srv
    srv.stop()
    manager.join(timeout=PATIENCE)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=PATIENCE)


def test_openai_parse_with_a_pydantic_model(client):
    reply = client.chat.completions.parse(
        model=NAME,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person,
        max_tokens=80,
        temperature=0,
    )
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person) and reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streaming"])
def test_json_object_and_json_schema_on_completions_too(client, stream):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 15}},
        "required": ["city"],
        "additionalProperties": False,
    }
    for body in (
        {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
        {"type": "json_object"},
    ):
        kwargs = dict(
            model=NAME,
            prompt='The capital of France, as JSON {"city": ...}:',
            max_tokens=200,
            temperature=0,
            extra_body={"response_format": body},
            stream=stream,
        )
        reply = client.completions.create(**kwargs)
        text = "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text
        value = json.loads(text)
        assert isinstance(value, dict) and (body["type"] == "json_object" or set(value) == {"city"})


def test_a_schema_the_engine_cannot_compile_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=NAME,
            messages=ASK,
            max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
        )


def test_instructor_in_json_schema_and_tools_modes(client):
    instructor = pytest.importorskip("instructor", reason="instructor is a test dependency (decodekit[dev])")
    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
        patched = instructor.from_openai(client, mode=mode)
        person = patched.chat.completions.create(
            model=NAME,
            response_model=Person,
            max_retries=0,
            max_tokens=80,
            temperature=0,
            messages=[{"role": "user", "content": "A person."}],
        )
        assert isinstance(person, Person), mode


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_openai_with_structured_output(server, method):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is a test dependency")
    chat = langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="none", model=NAME, temperature=0, max_tokens=80, max_retries=0
    )
    person = chat.with_structured_output(Person, method=method).invoke("Describe a person.")
    assert isinstance(person, Person)


@pytest.mark.parametrize(
    "choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"], ids=["named", "required"]
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streaming"])
def test_a_forced_tool_choice_returns_a_valid_call(client, choice, stream):
    reply = client.chat.completions.create(
        model=NAME, messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=40, temperature=0, stream=stream
    )
    if stream:
        chunks = list(reply)
        calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        calls, reason = reply.choices[0].message.tool_calls, reply.choices[0].finish_reason
    assert reason == "tool_calls" and len(calls) == 1 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather" and set(json.loads(calls[0].function.arguments)) == {"city"}


def test_a_tool_result_goes_back_to_the_model(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 25 degrees."},
    ]
    reply = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=20, temperature=0)
    assert reply.choices[0].message.content and reply.usage.prompt_tokens > 60  # the tools and the result were read


def test_auto_parses_hermes_tool_calls_and_keeps_other_text():
    plan = plan_tools(ChatCompletionRequest.of({"messages": [], "tools": [WEATHER]}))
    assert isinstance(plan, ToolPlan) and plan.choice == "auto" and plan.constraint() is None
    content, calls = plan.tool_calls(
        'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    assert content == "Let me look." and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    assert plan.tool_calls("Just text.") == ("Just text.", [])
    content, calls = plan.tool_calls(
        '<tool_call> not json </tool_call> a <tool_call>{"name": "get_weather"}</tool_call> b <tool_call> never closed'
    )
    assert content == "a  b <tool_call> never closed" and [c["function"]["arguments"] for c in calls] == ["{}"]


def test_parsing_tool_calls_of_a_long_adversarial_output_is_one_scan():
    # A regular expression with whitespace around a lazy group backtracked cubically on this (most of a minute on the
    # event loop for a 40-token output); a scan is linear. 200,000 characters finish at once; the cubic did not.
    plan = plan_tools(ChatCompletionRequest.of({"messages": [], "tools": [WEATHER]}))
    text = ("<tool_call>" + " " * 1000) * 200
    assert plan.tool_calls(text) == (text, [])
    many = '<tool_call> {"name": "get_weather", "arguments": {"city": "Oslo"}} </tool_call>\n' * 2000
    content, calls = plan.tool_calls(many)
    assert content is None and len(calls) == 2000


def test_logit_bias_of_minus_100_bans_greedys_first_token(client, default_model):
    _, tok = default_model
    plain = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=3, temperature=0)
    first = tok.encode(plain.choices[0].text)[0]
    banned = client.completions.create(
        model=NAME, prompt="The capital of France is", max_tokens=3, temperature=0, logit_bias={str(first): -100}
    )
    assert tok.encode(banned.choices[0].text)[0] != first


def test_penalties_change_a_repetitive_continuation_as_openai_defines_them(client, default_model):
    model, tok = default_model
    prompt = "one one one one one one"
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    penalised = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=8, temperature=0, frequency_penalty=2, presence_penalty=1
    )
    assert penalised.choices[0].text != plain.choices[0].text
    ids = torch.tensor([tok.encode(prompt)])
    expected = model.generate(ids, max_new_tokens=8, frequency_penalty=2, presence_penalty=1)[0, ids.shape[1] :]
    assert penalised.choices[0].text == tok.decode(expected, skip_special_tokens=True)


def test_the_penalty_processor_subtracts_count_times_frequency_plus_presence():
    from decodekit.core.penalties import FrequencyPresencePenaltyLogitsProcessor

    scores = torch.zeros(1, 6)
    ids = torch.tensor([[5, 1, 1, 1, 2]])  # prompt [5]; generated 1 three times, 2 once
    out = FrequencyPresencePenaltyLogitsProcessor(0.5, 0.25, prompt_length=1)(ids, scores)
    assert out.tolist() == [[0.0, -1.75, -0.75, 0.0, 0.0, 0.0]] and scores.abs().sum() == 0


def test_top_logprobs_are_sorted_and_greedys_token_is_the_top_one(client):
    reply = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    for entry in reply.choices[0].logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(
            entry.logprob
        )


def test_vllms_extra_fields_at_the_top_level(client, default_model):
    model, tok = default_model
    prompt = "The capital of France is"
    eos_free = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 2, "repetition_penalty": 1.3},
    )
    ids = torch.tensor([tok.encode(prompt)])
    expected = model.generate(ids, max_new_tokens=12, eos_token_id=None, repetition_penalty=1.3)[0, ids.shape[1] :]
    assert eos_free.choices[0].text == tok.decode(expected, skip_special_tokens=True)
    assert eos_free.usage.completion_tokens == 12
    plain = model.generate(ids, max_new_tokens=6)[0, ids.shape[1] :].tolist()
    stopped = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"stop_token_ids": [plain[2]]}
    )  # greedy's third token
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 3
    assert stopped.choices[0].text == tok.decode(plain[:2])  # the stop token is not part of the text, as vLLM's


def test_metrics_rise_after_a_request_and_tokenize_round_trips(server, client, default_model):
    import urllib.request

    def metrics():
        with urllib.request.urlopen(f"{server.url}/metrics") as response:
            text = response.read().decode()
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("decodekit:")
        }

    before = metrics()
    client.completions.create(model=NAME, prompt="Hello", max_tokens=3, temperature=0)
    after = metrics()
    key = next(k for k in after if k.startswith("decodekit:generation_tokens_total"))
    assert after[key] == before.get(key, 0) + 3
    assert any(
        k.startswith("decodekit:time_to_first_token_seconds_count") and v > before.get(k, 0) for k, v in after.items()
    )
    tokens = client.post("/../tokenize", body={"prompt": "Hello there"}, cast_to=object)
    _, tok = default_model
    assert tokens["tokens"] == tok.encode("Hello there") and tokens["count"] == len(tokens["tokens"])
    assert client.post("/../detokenize", body={"tokens": tokens["tokens"]}, cast_to=object) == {"prompt": "Hello there"}


def test_llama_cpps_sampler_fields_at_the_top_level(client, default_model):
    model, tok = default_model
    fields = {
        "top_n_sigma": 1.0,
        "xtc_probability": 0.5,
        "xtc_threshold": 0.1,
        "dry_multiplier": 0.8,
        "samplers": ["dry", "top_n_sigma", "xtc", "temperature"],
    }
    reply = client.completions.create(
        model=NAME, prompt="Once upon a time", max_tokens=10, temperature=0.8, seed=5, extra_body=fields
    )
    ids = torch.tensor([tok.encode("Once upon a time")])
    expected = model.generate(
        ids, max_new_tokens=10, do_sample=True, temperature=0.8, top_p=1.0, top_k=0, seed=5, tokenizer=tok, **fields
    )[0, ids.shape[1] :]
    assert reply.choices[0].text == tok.decode(expected, skip_special_tokens=True)
    with pytest.raises(openai.BadRequestError, match="mirostat"):
        client.completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0.8, extra_body={"mirostat": 4})


def test_an_unknown_method_lists_methods_not_machinery_and_suggests_the_closest():
    from decodekit.serve.protocol import BadRequest, ServerSettings, method_fields

    settings = ServerSettings(model_name="m", methods={"ban-method": object()})
    with pytest.raises(BadRequest) as caught:
        method_fields(
            {"method": "ban-metod"},
            settings,
            {"processors", "caches", "fused", "stopping", "beam_search"},
        )
    message = str(caught.value)
    assert "(did you mean 'ban-method'?)" in message
    # Not caches, fused or stopping (machinery), nor beam_search, which the server refuses (its own decoding loop).
    assert "available: ['ban-method', 'processors']" in message


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": "Hi", "temperature": "hot"}, "temperature='hot' is invalid; expected a number in [0, 2]."),
        ({"prompt": "Hi", "top_p": 0}, "top_p=0 is invalid; expected a number in (0, 1]."),
        ({"prompt": "Hi", "n": True}, "n=True is invalid; expected an integer >= 1."),
        ({"prompt": "Hi", "stop": ["a", 3]}, "stop=['a', 3] is invalid; expected a string or a list of strings."),
        ({"prompt": "Hi", "logprobs": 6}, "logprobs=6 is invalid; expected an integer in [0, 5]."),
        ({"messages": [], "logprobs": 1}, "logprobs=1 is invalid; expected true or false."),
        ({"messages": [], "top_logprobs": 21}, "top_logprobs=21 is invalid; expected an integer in [0, 20]."),
        ({"prompt": "Hi", "decodekit": [1]}, "decodekit=[1] is invalid; expected an object."),
    ],
    ids=[
        "number",
        "open-range",
        "bool-is-no-count",
        "list-item",
        "completions-logprobs",
        "chat-logprobs",
        "top",
        "obj",
    ],
)
def test_each_field_is_held_to_its_declared_type_and_range(body, message):

    schema = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(BadRequest) as caught:
        schema.of(body)
    assert str(caught.value) == message
    assert caught.value.param == message.split("=", 1)[0]  # the field, for the client's error.param


def test_a_body_is_read_into_its_endpoints_model_and_to_fields_gives_add_requests_arguments():

    settings = ServerSettings(model_name="m", max_tokens_limit=64, max_n=4)
    body = ChatCompletionRequest.of(
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 9,
            "max_completion_tokens": 5,
            "temperature": 0.5,
            "top_k": -1,
            "stop": "x",
            "stop_token_ids": [7, 3, 7],
            "logit_bias": {"4": -100},
            "echo": False,  # OpenAI's, not served: accepted at the value that changes nothing
        }
    )
    fields = body.to_fields(settings, {"processors"}, vocab=10, eos=[2], default_max_tokens=256)
    assert fields == {
        "max_new_tokens": 5,  # max_completion_tokens wins, as OpenAI's
        "num_return_sequences": 1,
        "do_sample": True,
        "temperature": 0.5,
        "top_p": 1.0,
        "top_k": 0,
        "sequence_bias": {(4,): -100.0},
        "eos_token_id": [3, 7, 2],
        "stop_strings": ["x"],
    }
    assert CompletionRequest.of({"prompt": "Hi"}).to_fields(settings, set(), 10, [2], 16)["max_new_tokens"] == 16
    with pytest.raises(BadRequest, match=r"max_completion_tokens=65 is invalid; expected an integer in \[1, 64\]"):
        ChatCompletionRequest.of({"messages": [], "max_completion_tokens": 65}).to_fields(settings, set(), 10, [2], 1)


def validated(model_type, data: dict):
    """`data` validated as `model_type` (one of the openai client's response types), with no field anywhere in it that
    the type does not declare: the client builds its objects without validating and keeps unknown fields, so only
    this catches a misspelt or misplaced one."""
    parsed = model_type.model_validate(data)

    def undeclared(obj, path: str) -> list[str]:
        if isinstance(obj, pydantic.BaseModel):
            found = [f"{path}.{name}" for name in obj.model_extra or {}]
            return found + [
                x for name in type(obj).model_fields for x in undeclared(getattr(obj, name), f"{path}.{name}")
            ]
        if isinstance(obj, list):
            return [x for i, item in enumerate(obj) for x in undeclared(item, f"{path}[{i}]")]
        return []

    assert undeclared(parsed, model_type.__name__) == []
    return parsed


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streaming"])
def test_responses_validate_against_openais_own_types(server, stream):
    """Each response body (and each streamed chunk) of both endpoints, with logprobs, n=2 and tool calls, validates
    against the openai package's own pydantic types, nested fields it does not declare refused."""
    import httpx
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    bodies = [
        ("completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "logprobs": 2}, Completion, Completion),
        ("completions", {"prompt": "Hi", "max_tokens": 4, "n": 2, "seed": 1}, Completion, Completion),
        (
            "chat/completions",
            {"messages": ASK, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2},
            ChatCompletion,
            ChatCompletionChunk,
        ),
        (
            "chat/completions",
            {"messages": ASK, "max_tokens": 60, "temperature": 0, "tools": [WEATHER], "tool_choice": "required"},
            ChatCompletion,
            ChatCompletionChunk,
        ),
    ]
    for path, body, whole_type, chunk_type in bodies:
        body = {
            "model": NAME,
            **body,
            **({"stream": True, "stream_options": {"include_usage": True}} if stream else {}),
        }
        response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=PATIENCE)
        assert response.status_code == 200, response.text
        if not stream:
            validated(whole_type, response.json())
            continue
        events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 2
        for event in events[:-1]:
            chunk = json.loads(event)
            if chunk_type is Completion:
                # OpenAI's own streamed completions carry finish_reason null until the last chunk, which the client's
                # Completion type (one for whole and streamed answers) does not admit.
                for choice in chunk["choices"]:
                    choice["finish_reason"] = choice["finish_reason"] or "stop"
            validated(chunk_type, chunk)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_response_model_validates_against_openais_own_types(chat):
    """The server's answers are built by one class (serve/responses.Answers), each shape a pydantic model: a whole
    answer, a streamed piece and the last chunk with usage, with logprobs and tool calls, each as OpenAI's types
    declare it (no field they do not know, none missing)."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from decodekit.serve.responses import Answers, Usage

    answers = Answers(chat, "cmpl-1", 1700000000, NAME)
    logprobs = answers.logprobs(["Hel", "lo"], [-0.5, -9999.0], [[("Hel", -0.5), ("Hi", -1.5)], [("lo", -9999.0)]], 0)
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
    usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    whole = answers.whole([answers.choice(0, "Hello", "stop", logprobs, delta=False)], usage).out()
    piece = answers.chunk([answers.choice(0, "Hel", None, logprobs, delta=True)]).out()
    last = answers.chunk([], usage).out()
    assert "usage" not in piece and last["choices"] == [] and last["usage"]["total_tokens"] == 5
    if not chat:
        assert whole["choices"][0]["logprobs"]["text_offset"] == [0, 3]
        validated(Completion, whole)
        validated(Completion, {**piece, "choices": [{**piece["choices"][0], "finish_reason": "stop"}]})
        validated(Completion, last)
        return
    called = answers.whole([answers.choice(0, None, "tool_calls", None, delta=False, tool_calls=calls)], usage).out()
    streamed_call = answers.chunk([answers.choice(0, None, "tool_calls", None, delta=True, tool_calls=calls)]).out()
    assert "tool_calls" not in whole["choices"][0]["message"] and called["choices"][0]["message"]["content"] is None
    assert streamed_call["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    for data in (whole, called):
        validated(ChatCompletion, data)
    for data in (piece, last, streamed_call):
        validated(ChatCompletionChunk, data)


def prefix_logprobs(model, ids: list[int]) -> list[float]:
    """Each token's logprob after the first, each from a forward over its own prefix alone (not the echo's code)."""
    out = []
    with torch.inference_mode():
        for i in range(1, len(ids)):
            logits = model(torch.tensor([ids[:i]]), use_cache=False).logits[0, -1].float()
            out.append(float(torch.log_softmax(logits, -1)[ids[i]]))
    return out


def test_echo_returns_the_prompts_logprobs_with_nothing_generated(client, default_model):
    # What evaluation harnesses ask for a loglikelihood: echo, logprobs, max_tokens 0 (OpenAI's legacy completions).
    model, tok = default_model
    prompt = "The capital of France is Paris"
    ids = tok.encode(prompt)
    reply = client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    choice = reply.choices[0]
    assert choice.text == tok.decode(ids) and reply.usage.completion_tokens == 0
    assert reply.usage.prompt_tokens == len(ids)
    got = choice.logprobs
    assert got.tokens == [tok.decode([t]) for t in ids]
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert got.token_logprobs[1:] == pytest.approx(prefix_logprobs(model, ids), abs=2e-4)
    assert got.text_offset == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    for value, top in zip(got.token_logprobs[1:], got.top_logprobs[1:]):
        assert len(top) == 2 and max(top.values()) >= value - 1e-6
    assert " Paris" in got.tokens and got.top_logprobs[got.tokens.index(" Paris")].get(" Paris") is not None


def test_echo_puts_the_prompt_before_a_generated_completion(client, default_model):
    _, tok = default_model
    ids = tok.encode("The capital of France is")
    plain = client.completions.create(model=NAME, prompt=ids, max_tokens=3, temperature=0, logprobs=1)
    echo = client.completions.create(model=NAME, prompt=ids, max_tokens=3, temperature=0, logprobs=1, echo=True)
    prompt_text = tok.decode(ids)
    assert echo.choices[0].text == prompt_text + plain.choices[0].text
    logprobs = echo.choices[0].logprobs
    assert logprobs.tokens[len(ids) :] == plain.choices[0].logprobs.tokens
    assert logprobs.token_logprobs[len(ids) :] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert logprobs.text_offset[len(ids)] == len(prompt_text)
    text_only = client.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert text_only.choices[0].text.startswith(prompt_text) and text_only.choices[0].logprobs is None


@pytest.mark.parametrize("continuation", [" Paris", " banana"])
def test_echo_answers_a_loglikelihood_as_evaluation_harnesses_read_it(client, default_model, continuation):
    # lm-evaluation-harness's local-completions: the prompt is context + continuation as token ids, max_tokens 1,
    # echo, logprobs 1; the continuation's logprobs are token_logprobs[len(context):-1], and it is greedy where each
    # of its tokens is its position's most likely.
    model, tok = default_model
    context = tok.encode("The capital of France is")
    whole = context + tok.encode(continuation)
    reply = client.completions.create(model=NAME, prompt=whole, max_tokens=1, temperature=0, echo=True, logprobs=1)
    got = reply.choices[0].logprobs
    values, tops = got.token_logprobs[len(context) : -1], got.top_logprobs[len(context) : -1]
    expected = prefix_logprobs(model, whole)[len(context) - 1 :]
    assert values == pytest.approx(expected, abs=2e-4) and len(values) == len(whole) - len(context)
    with torch.inference_mode():
        logits = model(torch.tensor([whole]), use_cache=False).logits[0, len(context) - 1 : -1]
    greedy = bool((logits.argmax(-1) == torch.tensor(whole[len(context) :])).all())
    assert all(v == max(top.values()) for v, top in zip(values, tops)) == greedy
    assert greedy == (continuation == " Paris")  # the model's answer is greedy, the other is not
