"""OpenAI request bodies -> the arguments of ContinuousBatchingManager.add_request, checked as OpenAI checks them.

Every field of a body is either served, accepted at the value that changes nothing (`logit_bias: {}`), or a 400
naming it: nothing is silently ignored. Types are strict (`stream: "false"` is an error, not a truthy string).
Limits apply to the final request, the OpenAI fields and the `decodekit` object merged: `max_new_tokens` there is
held to --max-tokens-limit like `max_tokens`, and so on. What a request's size decides (context, cache) is checked
by add_request before anything is allocated.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..core.config import is_int


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_tokens_limit: int = 4096  # the largest max_tokens a request may ask for
    default_max_tokens: int = 256  # chat requests without max_tokens (completions default to 16, as OpenAI's)
    max_request_bytes: int = 1_000_000
    max_n: int = 8
    max_stop: int = 16  # stop strings of a request, `stop` and decodekit's stop_strings together
    max_stop_chars: int = 256  # characters of one stop string
    methods: dict[str, Any] = field(default_factory=dict)  # allowed methods: {name: LoadedMethod}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


# Fields served on both endpoints, and on each. `decodekit` is this server's own object (the openai client's
# extra_body): a method and its fields.
# vLLM's and llama.cpp's sampling fields that their OpenAI servers take at the top level of a body.
LLAMACPP = {
    "top_n_sigma",
    "xtc_probability",
    "xtc_threshold",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "dynatemp_range",
    "dynatemp_exponent",
    "smoothing_factor",
    "smoothing_curve",
    "samplers",
}  # checked by their plugin
EXTRAS = {
    "top_k",
    "min_p",
    "repetition_penalty",
    "typical_p",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
} | LLAMACPP
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "user",
    "logprobs",
    "decodekit",
    "best_of",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "response_format",
} | EXTRAS
CHAT = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
COMPLETIONS = COMMON | {"prompt"}

# OpenAI fields not served, with the value at which each changes nothing (accepted).
UNSERVED = {
    "functions": [],
    "function_call": "none",
    "echo": False,
    "suffix": "",
    "store": False,
    "metadata": {},
    "service_tier": "auto",
    "modalities": ["text"],
}
# Built-in plugins that are machinery, not decoding methods a request would name: left out of the choices shown.
INFRASTRUCTURE_PLUGINS = frozenset({"caches", "fused", "stopping"})
MAX_LOGIT_BIAS = 300  # entries of a logit_bias, as OpenAI's limit
MAX_STOP_TOKEN_IDS = 1024  # each is compared with every row's newest token at every step
# A response_format schema (or the tools' parameters together) as JSON text: OpenAI's limit on a structured-output
# schema's strings; its grammar is compiled per distinct schema and kept.
MAX_SCHEMA_CHARS = 120_000
TOKEN_KEY = re.compile(r"\s*[0-9]{1,10}\s*")  # a logit_bias key: ASCII digits (str.isdigit takes "²", int() refuses it)
# How deep a JSON schema (response_format, a tool's parameters) may nest: the schema checkers and compilers recurse,
# and a body of 200 levels ended in a RecursionError (a 500) deep inside them.
MAX_SCHEMA_DEPTH = 64
RESPONSE_FORMAT_FIELDS = {"type", "json_schema"}
JSON_SCHEMA_FIELDS = {"name", "description", "schema", "strict"}


def nesting_depth(value, limit: int) -> int:
    """How deep `value` (parsed JSON) nests, counted iteratively and only as far as `limit` + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_schema_depth(schema, where: str) -> None:
    """BadRequest naming `where` for a schema nested past MAX_SCHEMA_DEPTH or longer than MAX_SCHEMA_CHARS as JSON
    (the depth first: the JSON encoder recurses)."""
    if nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise BadRequest(
            f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels; this server takes schemas of at most "
            f"{MAX_SCHEMA_DEPTH}.",
            where,
        )
    size = len(json.dumps(schema)) if schema is not None else 0
    if size > MAX_SCHEMA_CHARS:
        raise BadRequest(
            f"{where} is {size} characters of JSON; this server takes schemas of at most {MAX_SCHEMA_CHARS}.", where
        )


# decodekit fields a request may not set: Python objects (no JSON value is one), what only the operator decides,
# and what the OpenAI fields already say (set those instead).
DECODEKIT_FORBIDDEN = {
    "custom_generate": "the operator allows methods when the server starts (decodekit serve --method SPEC@REVISION)",
    "trust_remote_code": "the operator allows methods when the server starts (decodekit serve --method SPEC@REVISION)",
    "logits_processor": "it takes Python objects; choose a method instead",
    "stopping_criteria": "it takes Python objects; choose a method instead",
    "tokenizer": "the server's tokenizer serves every request",
    "streamer": "set stream instead",
    "generator": "set seed instead",
    "listener": "the server listens to its requests itself",
    "streaming": "set stream instead",
    "request_id": "the server names its requests",
    "input_ids": "set prompt or messages instead",
    "logprobs": "set logprobs instead",
    "top_logprobs": "set top_logprobs (chat) or logprobs (completions) instead",
    "max_length": "set max_tokens instead",
}

ROLES = ("system", "developer", "user", "assistant", "tool")


def check_text(value, where: str = "body") -> None:
    """BadRequest if a string anywhere in `value` cannot be UTF-8 (a lone surrogate, "\\ud800", is valid JSON)."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                raise BadRequest(
                    f"{path} holds a lone surrogate ({item[error.start : error.end]!r} at character "
                    f"{error.start}); strings must be valid Unicode.",
                    path,
                ) from None
        elif isinstance(item, dict):
            stack.extend((v, f"{path}.{k}") for k, v in item.items())
            stack.extend((k, f"{path} key") for k in item)
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))


def check_fields(body: dict, served: set[str]) -> None:
    """BadRequest for a field that is unknown, or known but not served here at a value that would matter."""
    for name, value in body.items():
        if name in served or value is None:
            continue
        if name in UNSERVED:
            if value == UNSERVED[name] or (
                isinstance(UNSERVED[name], (dict, list)) and value == type(UNSERVED[name])()
            ):
                continue
            raise BadRequest(
                f"{name}={value!r} is not supported by this server (decodekit serve); see docs/serve.md "
                "for the fields it serves.",
                name,
            )
        close = difflib.get_close_matches(name, sorted(served | set(UNSERVED)), n=1)
        raise BadRequest(
            f"Unrecognized request argument supplied: {name}" + (f" (did you mean {close[0]!r}?)" if close else ""),
            name,
        )


def number(body: dict, name: str, low: float, high: float, default, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
        what = "an integer" if integer else "a number"
        raise BadRequest(f"{name}={value!r} is invalid; expected {what} in [{low}, {high}].", name)
    return value


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name}={value!r} is invalid; expected true or false.", name)
    return value


def stop_list(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"stop={stop!r} is invalid; expected a non-empty string or a list of them.", "stop")
    return stops


def stream_options(body: dict, stream: bool) -> bool:
    """Whether a stream ends with a usage chunk (stream_options.include_usage)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise BadRequest("stream_options is only allowed when stream is true.", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        raise BadRequest(
            f'stream_options={options!r} is invalid; expected {{"include_usage": true|false}}.', "stream_options"
        )
    return boolean(options, "include_usage")


def generation_fields(body: dict, settings: ServerSettings, default_max_tokens: int) -> dict[str, Any]:
    """The generation config fields of an OpenAI body's sampling fields."""
    for name in ("max_tokens", "max_completion_tokens"):
        number(body, name, 1, settings.max_tokens_limit, None, True)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    temperature = number(body, "temperature", 0, 2, 1.0)
    top_p = number(body, "top_p", 0, 1, 1.0)
    if top_p == 0:
        raise BadRequest("top_p=0 is invalid; expected a number in (0, 1].", "top_p")
    n = number(body, "n", 1, settings.max_n, 1, True)
    best_of = number(body, "best_of", 1, settings.max_n, None, True)
    if best_of is not None and best_of != n:
        raise BadRequest(
            f"best_of={best_of} is not supported (this server returns every sequence it generates); "
            f"leave it out or set it to n={n}.",
            "best_of",
        )
    seed = number(body, "seed", 0, 2**63 - 1, None, True)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest(f"user={user!r} is invalid; expected a string.", "user")
    fields: dict[str, Any] = {"max_new_tokens": max_tokens or default_max_tokens, "num_return_sequences": n}
    if temperature > 0:
        fields.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    else:
        fields["do_sample"] = False
    if seed is not None:
        fields["seed"] = seed
    return fields


def sampling_extras(body: dict, vocab: int, eos: list[int]) -> dict[str, Any]:
    """Generation config fields of OpenAI's penalties and logit_bias, response_format, and vLLM's and llama.cpp's
    extra sampling fields; `vocab` and `eos` are the model's (for logit_bias and stop_token_ids)."""
    fields: dict[str, Any] = {}
    for name in ("frequency_penalty", "presence_penalty"):
        value = number(body, name, -2, 2, 0)
        if value:
            fields[name] = value
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise BadRequest(
                f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids (as strings) -> bias "
                "in [-100, 100].",
                "logit_bias",
            )
        sequence_bias = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and TOKEN_KEY.fullmatch(key) else None
            if token is None or not 0 <= token < vocab:
                raise BadRequest(f"logit_bias key {key!r} is not a token id in [0, {vocab}).", "logit_bias")
            sequence_bias[(token,)] = float(number({"bias": value}, "bias", -100, 100, 0))
        fields["sequence_bias"] = sequence_bias
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise BadRequest(
                f'response_format={response_format!r} is invalid; expected {{"type": "text"}}, '
                '{"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., '
                '"schema": {...}}}.',
                "response_format",
            )
        unknown = sorted(set(response_format) - RESPONSE_FORMAT_FIELDS)
        if unknown:
            raise BadRequest(
                f"response_format has fields this server does not know: {unknown}; it takes "
                f"{sorted(RESPONSE_FORMAT_FIELDS)}.",
                "response_format",
            )
        if kind == "json_schema":
            check_json_schema(response_format.get("json_schema"))
        if kind != "text":
            fields["response_format"] = response_format
    top_k = number(body, "top_k", -1, 2**31 - 1, None, True)
    if top_k is not None:
        fields["top_k"] = max(top_k, 0)  # -1 and 0: off, as vLLM and llama.cpp
    for name, low, high in (("min_p", 0, 1), ("typical_p", 0, 1), ("repetition_penalty", 0, 10)):
        value = number(body, name, low, high, None)
        if value is not None:
            if value == 0 and name != "min_p":
                raise BadRequest(f"{name}=0 is invalid; expected a number in (0, {high}].", name)
            fields[name] = value
    min_tokens = number(body, "min_tokens", 0, 2**31 - 1, None, True)
    if min_tokens:
        fields["min_new_tokens"] = min_tokens
    stop_ids = body.get("stop_token_ids")
    if isinstance(stop_ids, list) and len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(
            f"stop_token_ids has {len(stop_ids)} entries; this server takes at most {MAX_STOP_TOKEN_IDS}.",
            "stop_token_ids",
        )
    if stop_ids is not None and (
        not isinstance(stop_ids, list) or not all(is_int(t) and 0 <= t < vocab for t in stop_ids)
    ):
        raise BadRequest(
            f"stop_token_ids={stop_ids!r} is invalid; expected a list of token ids in [0, {vocab}).", "stop_token_ids"
        )
    if stop_ids:
        stop_ids = sorted(set(stop_ids))  # one tokenizer view per distinct set for structured output, not per order
    ignore_eos = boolean(body, "ignore_eos")
    if ignore_eos or stop_ids:  # the tokens that end a row: stop_token_ids, and EOS unless ignored; none: None
        fields["eos_token_id"] = list(stop_ids or []) + ([] if ignore_eos else list(eos)) or None
    boolean(body, "skip_special_tokens", True)  # checked here; applied when the text is decoded
    fields.update({name: body[name] for name in LLAMACPP if body.get(name) is not None})
    return fields


def check_json_schema(spec) -> None:
    """response_format.json_schema as OpenAI defines it: {"name", "description"?, "schema", "strict"?}."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise BadRequest(f'{where} must be an object {{"name": ..., "schema": {{...}}}}, got {spec!r}.', where)
    unknown = sorted(set(spec) - JSON_SCHEMA_FIELDS)
    if unknown:
        raise BadRequest(
            f"{where} has fields this server does not know: {unknown}; it takes {sorted(JSON_SCHEMA_FIELDS)}.", where
        )
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise BadRequest(f"{where}.strict={spec['strict']!r} is invalid; expected true or false.", f"{where}.strict")
    for name in ("name", "description"):
        if spec.get(name) is not None and not isinstance(spec[name], str):
            raise BadRequest(f"{where}.{name} must be a string, got {spec[name]!r}.", f"{where}.{name}")
    check_schema_depth(spec.get("schema"), f"{where}.schema")


def method_fields(body: dict, settings: ServerSettings, plugins: set[str]) -> dict[str, Any]:
    """The `decodekit` object of a body: {"method": NAME, ...fields} -> add_request arguments; `plugins`: the names
    of the registered decodekit plugins."""
    spec = body.get("decodekit")
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise BadRequest(f'"decodekit" must be an object {{"method": NAME, ...fields}}, got {spec!r}.', "decodekit")
    fields = dict(spec)
    for name, why in DECODEKIT_FORBIDDEN.items():
        if name in fields:
            raise BadRequest(f'"decodekit.{name}" cannot be set by a request: {why}.', f"decodekit.{name}")
    name = fields.pop("method", None)
    if name is None:
        return fields
    if name in settings.methods:
        fields["custom_generate"] = settings.methods[name]
    elif name not in plugins:
        offered = sorted((plugins - INFRASTRUCTURE_PLUGINS) | set(settings.methods))
        close = difflib.get_close_matches(name, offered, n=1)
        raise BadRequest(
            f"decodekit method {name!r} is neither a registered decodekit plugin nor a method allowed when "
            f"the server started" + (f" (did you mean {close[0]!r}?)" if close else "") + f"; available: {offered}.",
            "decodekit.method",
        )
    return fields


def merged_request(
    body: dict, settings: ServerSettings, default_max_tokens: int, plugins: set[str], vocab: int, eos: list[int]
) -> dict[str, Any]:
    """add_request's arguments of a body (OpenAI fields, then the decodekit object over them), with the server's
    limits held on the merged values."""
    arguments = {
        **generation_fields(body, settings, default_max_tokens),
        **sampling_extras(body, vocab, eos),
        **method_fields(body, settings, plugins),
    }
    max_new = arguments.get("max_new_tokens")
    if not is_int(max_new) or not 1 <= max_new <= settings.max_tokens_limit:
        raise BadRequest(
            f"decodekit.max_new_tokens={max_new!r} is invalid; expected an integer in "
            f"[1, {settings.max_tokens_limit}] (this server's --max-tokens-limit).",
            "decodekit.max_new_tokens",
        )
    least = arguments.get("min_new_tokens")
    if is_int(least) and least > max_new:
        raise BadRequest(
            f"min_tokens={least} is more than max_tokens={max_new}; expected min_tokens <= max_tokens.", "min_tokens"
        )
    rows = arguments.get("num_return_sequences")
    if not is_int(rows) or not 1 <= rows <= settings.max_n:
        raise BadRequest(
            f"decodekit.num_return_sequences={rows!r} is invalid; expected an integer in "
            f"[1, {settings.max_n}] (n's limit here).",
            "decodekit.num_return_sequences",
        )
    own = arguments.get("stop_strings")
    if own is not None and not (isinstance(own, list) or isinstance(own, str)):
        raise BadRequest(
            f"decodekit.stop_strings={own!r} is invalid; expected a string or a list of strings.",
            "decodekit.stop_strings",
        )
    stops = stop_list(body) + ([own] if isinstance(own, str) else list(own or []))
    if len(stops) > settings.max_stop:
        raise BadRequest(
            f"{len(stops)} stop strings are too many (stop and decodekit.stop_strings together); this "
            f"server takes at most {settings.max_stop}.",
            "stop",
        )
    for stop in stops:
        if not isinstance(stop, str) or not stop or len(stop) > settings.max_stop_chars:
            raise BadRequest(
                f"stop string {stop!r} is invalid; expected a non-empty string of at most "
                f"{settings.max_stop_chars} characters.",
                "stop",
            )
    if stops:
        arguments["stop_strings"] = stops
    else:
        arguments.pop("stop_strings", None)
    return arguments


def logprob_fields(body: dict, chat: bool) -> dict[str, Any]:
    """logprobs (chat: true/false, with top_logprobs 0..20; completions: the number of alternatives, 0..5) as
    add_request's logprobs and top_logprobs."""
    if chat:
        wanted, top = boolean(body, "logprobs"), number(body, "top_logprobs", 0, 20, 0, True)
        if top and not wanted:
            raise BadRequest("top_logprobs needs logprobs=true.", "top_logprobs")
        return {"logprobs": wanted, "top_logprobs": top}
    top = number(body, "logprobs", 0, 5, None, True)
    return {"logprobs": top is not None, "top_logprobs": top or 0}


def chat_messages(body: dict) -> list[dict]:
    """The messages of a chat body as {"role", "content"} with text content (parts of type text joined), an
    assistant's earlier `tool_calls` and a tool result's `tool_call_id` kept."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest('messages must be a non-empty list of {"role": ..., "content": ...} objects.', "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRequest(f"{where} must be an object with a role in {list(ROLES)}, got {message!r}.", where)
        extra = set(message) - {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}
        if extra:
            raise BadRequest(f"{where} has fields this server does not serve: {sorted(extra)}.", where)
        calls = message.get("tool_calls")
        if calls is not None and (
            message["role"] != "assistant"
            or not isinstance(calls, list)
            or not all(
                isinstance(c, dict)
                and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments"), str)
                for c in calls
            )
        ):
            raise BadRequest(
                f'{where}.tool_calls is invalid; an assistant\'s earlier calls are a list of {{"id": ..., '
                '"type": "function", "function": {"name": ..., "arguments": "..."}}.',
                f"{where}.tool_calls",
            )
        content = message.get("content")
        if content is None and calls:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(
                        f"{where}.content[{j}] is invalid; this server takes text parts only: "
                        '{"type": "text", "text": "..."}.',
                        f"{where}.content",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise BadRequest(
                f"{where}.content must be a string or a list of text parts, got {content!r}.", f"{where}.content"
            )
        out.append(
            {
                "role": message["role"],
                "content": content,
                **{k: message[k] for k in ("tool_calls", "tool_call_id", "name") if message.get(k) is not None},
            }
        )
    return out


def completion_prompt(body: dict):
    """A completions body's prompt: a string, or token ids (one prompt per request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    raise BadRequest("prompt must be a string or a list of token ids (one prompt per request).", "prompt")
