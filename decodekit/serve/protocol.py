"""OpenAI request bodies, as pydantic models, -> the arguments of ContinuousBatchingManager.add_request.

Each body is a model (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest) declaring every
field it serves with its JSON type, strictly (`stream: "false"` is an error, not a truthy string), and its fixed
range; the names a body may use are the model's fields, and OpenAI's fields this server does not serve are accepted
only at the value that changes nothing (`logit_bias: {}`), else a 400 naming them: nothing is silently ignored.
`to_fields()` checks what depends on the server (--max-tokens-limit, n's limit, the vocabulary) or spans fields,
with the limits held on the final request, the OpenAI fields and the `decodekit` object merged (`max_new_tokens`
there is held to --max-tokens-limit like `max_tokens`). What a request's size decides (context, cache) is checked by
add_request before anything is allocated.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


LONGEST = 2**31 - 1


class Body(BaseModel):
    """A request body: its fields declared with their JSON types and fixed ranges (Body.of reads one)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None

    @classmethod
    def of(cls, body: dict):
        """The body as this model: BadRequest for a name it does not serve (with the closest one), an OpenAI field
        not served here at a value that would matter, or a value of the wrong type or range (naming the field and
        what it accepts)."""
        check_fields(body, set(cls.model_fields))
        try:
            return cls.model_validate({k: v for k, v in body.items() if k in cls.model_fields})
        except ValidationError as error:
            name = str(error.errors()[0]["loc"][0])
            raise BadRequest(
                f"{name}={body[name]!r} is invalid; expected {accepted(cls.model_fields[name])}.", name
            ) from None


class SamplerFields(Body):
    """vLLM's and llama.cpp's sampling fields that their OpenAI servers take at the top level of a body: any JSON
    value, checked by their plugin (llamacpp_samplers)."""

    top_n_sigma: Any = None
    xtc_probability: Any = None
    xtc_threshold: Any = None
    dry_multiplier: Any = None
    dry_base: Any = None
    dry_allowed_length: Any = None
    dry_penalty_last_n: Any = None
    dry_sequence_breakers: Any = None
    mirostat: Any = None
    mirostat_tau: Any = None
    mirostat_eta: Any = None
    dynatemp_range: Any = None
    dynatemp_exponent: Any = None
    smoothing_factor: Any = None
    smoothing_curve: Any = None
    samplers: Any = None


LLAMACPP = tuple(name for name in SamplerFields.model_fields if name not in Body.model_fields)


class GenerationRequest(SamplerFields):
    """The fields both generation endpoints serve: OpenAI's, vLLM's and llama.cpp's sampling fields, and decodekit's
    own object (the openai client's extra_body): a method and its fields."""

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    best_of: int | None = Field(None, ge=1)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    user: str | None = None
    decodekit: dict[str, Any] | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    top_k: int | None = Field(None, ge=-1, le=LONGEST)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    typical_p: float | None = Field(None, gt=0, le=1)
    min_tokens: int | None = Field(None, ge=0, le=LONGEST)
    ignore_eos: bool | None = None
    stop_token_ids: list[Any] | None = None
    skip_special_tokens: bool | None = None

    chat: ClassVar[bool] = False

    def to_fields(
        self, settings: ServerSettings, plugins: set[str], vocab: int, eos: list[int], default_max_tokens: int
    ) -> dict[str, Any]:
        """add_request's arguments: the OpenAI fields, then the decodekit object over them, with the server's limits
        held on the merged values; `plugins` are the registered plugins' names, `vocab` and `eos` the model's."""
        arguments = {
            **self.sampling(settings, default_max_tokens),
            **self.extras(vocab, eos),
            **method_fields(self.decodekit, settings, plugins),
        }
        held_to_limits(arguments, settings)
        own = arguments.get("stop_strings")
        if own is not None and not isinstance(own, (list, str)):
            raise BadRequest(
                f"decodekit.stop_strings={own!r} is invalid; expected a string or a list of strings.",
                "decodekit.stop_strings",
            )
        stops = ([self.stop] if isinstance(self.stop, str) else list(self.stop or [])) + (
            [own] if isinstance(own, str) else list(own or [])
        )
        check_stops(stops, settings)
        if stops:
            arguments["stop_strings"] = stops
        else:
            arguments.pop("stop_strings", None)
        return arguments

    def sampling(self, settings: ServerSettings, default_max_tokens: int) -> dict[str, Any]:
        """The generation config fields of OpenAI's length and sampling fields."""
        name, max_tokens = self.longest()
        if max_tokens is not None and max_tokens > settings.max_tokens_limit:
            raise BadRequest(
                f"{name}={max_tokens!r} is invalid; expected an integer in [1, {settings.max_tokens_limit}] (this "
                "server's --max-tokens-limit).",
                name,
            )
        n = 1 if self.n is None else self.n
        for name, value in (("n", n), ("best_of", self.best_of)):
            if value is not None and value > settings.max_n:
                raise BadRequest(f"{name}={value} is invalid; expected an integer in [1, {settings.max_n}].", name)
        if self.best_of is not None and self.best_of != n:
            raise BadRequest(
                f"best_of={self.best_of} is not supported (this server returns every sequence it generates); "
                f"leave it out or set it to n={n}.",
                "best_of",
            )
        fields: dict[str, Any] = {"max_new_tokens": max_tokens or default_max_tokens, "num_return_sequences": n}
        temperature = 1.0 if self.temperature is None else self.temperature
        if temperature > 0:
            top_p = 1.0 if self.top_p is None else self.top_p
            fields.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        else:
            fields["do_sample"] = False
        if self.seed is not None:
            fields["seed"] = self.seed
        return fields

    def longest(self) -> tuple[str, int | None]:
        """(the field that sets the most tokens to generate, its value)."""
        return "max_tokens", self.max_tokens

    def extras(self, vocab: int, eos: list[int]) -> dict[str, Any]:
        """Generation config fields of OpenAI's penalties and logit_bias, response_format, and vLLM's and llama.cpp's
        extra sampling fields."""
        fields: dict[str, Any] = {}
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                fields[name] = getattr(self, name)
        if self.logit_bias:
            fields["sequence_bias"] = sequence_bias(self.logit_bias, vocab)
        if self.response_format is not None:
            check_response_format(self.response_format)
            if self.response_format.get("type") != "text":
                fields["response_format"] = self.response_format
        if self.top_k is not None:
            fields["top_k"] = max(self.top_k, 0)  # -1 and 0: off, as vLLM and llama.cpp
        for name in ("min_p", "typical_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.min_tokens:
            fields["min_new_tokens"] = self.min_tokens
        stop_ids = checked_stop_ids(self.stop_token_ids, vocab)
        if self.ignore_eos or stop_ids:  # the tokens that end a row: stop_token_ids, and EOS unless ignored; none: None
            fields["eos_token_id"] = list(stop_ids or []) + ([] if self.ignore_eos else list(eos)) or None
        fields.update({name: getattr(self, name) for name in LLAMACPP if getattr(self, name) is not None})
        return fields

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (stream_options.include_usage)."""
        options = self.stream_options
        if options is None:
            return False
        if not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true.", "stream_options")
        usage = options.get("include_usage")
        if set(options) - {"include_usage", "include_obfuscation"} or not isinstance(usage, (bool, type(None))):
            raise BadRequest(
                f'stream_options={options!r} is invalid; expected {{"include_usage": true|false}}.', "stream_options"
            )
        return bool(usage)


class CompletionRequest(GenerationRequest):
    """/v1/completions: a prompt (text or token ids); logprobs is the number of alternatives shown (0..5); echo puts
    the prompt before the completion, with its tokens' logprobs where logprobs is given (the first token's null, as
    OpenAI's legacy completions gave them), and with echo max_tokens may be 0: the prompt scored, nothing generated
    (what evaluation harnesses ask for a loglikelihood)."""

    prompt: Any = None
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    max_tokens: int | None = Field(None, ge=0)

    def logprob_fields(self) -> dict[str, Any]:
        return {"logprobs": self.logprobs is not None, "top_logprobs": self.logprobs or 0}

    @property
    def generates(self) -> bool:
        """Whether anything is generated (max_tokens=0 with echo: the prompt's logprobs only)."""
        return not (self.echo and self.max_tokens == 0)

    def to_fields(
        self, settings: ServerSettings, plugins: set[str], vocab: int, eos: list[int], default_max_tokens: int
    ) -> dict[str, Any]:
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest(
                "max_tokens=0 is served with echo=true (the prompt's logprobs, nothing generated); expected an "
                "integer >= 1 or echo=true.",
                "max_tokens",
            )
        if self.echo and self.stream:
            raise BadRequest("echo=true is served without stream; leave one of them out.", "echo")
        if not self.generates:  # the fields are checked as a one-token request's: nothing runs them
            return self.model_copy(update={"max_tokens": 1}).to_fields(settings, plugins, vocab, eos, 1)
        return super().to_fields(settings, plugins, vocab, eos, default_max_tokens)


class ChatCompletionRequest(GenerationRequest):
    """/v1/chat/completions: messages, tools; logprobs true/false with top_logprobs 0..20."""

    messages: Any = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's: the last message is an assistant's reply cut short, which the answer goes on with (no new turn).
    continue_final_message: bool | None = None

    chat: ClassVar[bool] = True

    def longest(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:  # OpenAI's newer name for max_tokens, which it wins over
            return "max_completion_tokens", self.max_completion_tokens
        return super().longest()

    def logprob_fields(self) -> dict[str, Any]:
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true.", "top_logprobs")
        return {"logprobs": bool(self.logprobs), "top_logprobs": self.top_logprobs or 0}


class TokenizeRequest(Body):
    """vLLM's /tokenize: {"prompt": text} or {"messages": [...]}."""

    prompt: str | None = None
    messages: Any = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(Body):
    """vLLM's /detokenize: {"tokens": [ids]}."""

    tokens: Any = None


def accepted(info) -> str:
    """What a field accepts, in words, from its declared type and range: "an integer in [1, 8]", "true or false"."""
    text = " or ".join(_kinds(info.annotation))
    bounds = {type(m).__name__: m for m in info.metadata if isinstance(m, annotated_types.BaseMetadata)}
    low, high = bounds.get("Ge") or bounds.get("Gt"), bounds.get("Le") or bounds.get("Lt")
    if low is not None and high is not None:
        low_text = f"[{low.ge}" if "Ge" in bounds else f"({low.gt}"
        high_text = f"{high.le}]" if "Le" in bounds else f"{high.lt})"
        text += f" in {low_text}, {high_text}"
    elif low is not None:
        text += f" >= {low.ge}" if "Ge" in bounds else f" > {low.gt}"
    return text


ONE = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}
MANY = {int: "integers", float: "numbers", bool: "booleans", str: "strings"}


def _kinds(annotation) -> list[str]:
    if get_origin(annotation) is Union or type(annotation).__name__ == "UnionType":
        return [word for member in get_args(annotation) if member is not type(None) for word in _kinds(member)]
    origin = get_origin(annotation) or annotation
    if origin is list:
        items = get_args(annotation)
        return ["a list" + (f" of {MANY[items[0]]}" if items and items[0] in MANY else "")]
    return [ONE.get(origin, "a JSON value")]


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
    "observer": "it takes a Python callable; the playground's /playground/step explains a step",
    "streaming": "set stream instead",
    "request_id": "the server names its requests",
    "input_ids": "set prompt or messages instead",
    "logprobs": "set logprobs instead",
    "top_logprobs": "set top_logprobs (chat) or logprobs (completions) instead",
    "max_length": "set max_tokens instead",
    # Fields that take Python objects, which JSON cannot carry.
    "prefix_allowed_tokens_fn": "it takes a Python function; response_format or a method constrains a served reply",
    "assistant_model": "it takes a model object",
}
# Fields that take token tensors: a request gives them as JSON lists of token ids, as the playground says.
TOKEN_FIELDS = {
    "negative_prompt_ids": "token ids of the negative prompt, e.g. [1, 2, 3]",
    "negative_prompt_attention_mask": "1 or 0 per negative prompt token, e.g. [1, 1, 1]",
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


def sequence_bias(bias, vocab: int) -> dict[tuple[int], float]:
    """logit_bias ({token id as a string: bias in [-100, 100]}) as the sequence_bias field."""
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(
            f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids (as strings) -> bias in [-100, 100].",
            "logit_bias",
        )
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and TOKEN_KEY.fullmatch(key) else None
        if token is None or not 0 <= token < vocab:
            raise BadRequest(f"logit_bias key {key!r} is not a token id in [0, {vocab}).", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise BadRequest(f"bias={value!r} is invalid; expected a number in [-100, 100].", "logit_bias")
        out[(token,)] = float(value)
    return out


def check_response_format(response_format: dict) -> None:
    """response_format as OpenAI defines it: text, json_object, or json_schema with its schema."""
    kind = response_format.get("type")
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


def checked_stop_ids(stop_ids, vocab: int) -> list[int] | None:
    """stop_token_ids checked (token ids of the vocabulary, at most MAX_STOP_TOKEN_IDS), sorted and deduplicated:
    one tokenizer view per distinct set for structured output, not per order."""
    if stop_ids is None:
        return None
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(
            f"stop_token_ids has {len(stop_ids)} entries; this server takes at most {MAX_STOP_TOKEN_IDS}.",
            "stop_token_ids",
        )
    if not all(is_int(t) and 0 <= t < vocab for t in stop_ids):
        raise BadRequest(
            f"stop_token_ids={stop_ids!r} is invalid; expected a list of token ids in [0, {vocab}).", "stop_token_ids"
        )
    return sorted(set(stop_ids))


def held_to_limits(arguments: dict[str, Any], settings: ServerSettings) -> None:
    """The server's limits on the merged request (the decodekit object may set the same fields again)."""
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


def check_stops(stops: list, settings: ServerSettings) -> None:
    """A request's stop strings (stop and decodekit.stop_strings together): at most max_stop, each non-empty and at
    most max_stop_chars long."""
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


def method_fields(spec: dict | None, settings: ServerSettings, plugins: set[str]) -> dict[str, Any]:
    """The `decodekit` object of a body: {"method": NAME, ...fields} -> add_request arguments; `plugins`: the names
    of the registered decodekit plugins."""
    if spec is None:
        return {}
    fields = dict(spec)
    for name, why in DECODEKIT_FORBIDDEN.items():
        if name in fields:
            raise BadRequest(f'"decodekit.{name}" cannot be set by a request: {why}.', f"decodekit.{name}")
    for name in TOKEN_FIELDS:
        if fields.get(name) is not None:
            fields[name] = token_tensor(fields[name], f"decodekit.{name}")
    name = fields.pop("method", None)
    if name is None:
        return fields
    if not isinstance(name, str):
        raise BadRequest(
            f"decodekit.method={name!r} is invalid; expected a string, the name of a registered decodekit plugin or "
            "of a method allowed when the server started.",
            "decodekit.method",
        )
    if name in settings.methods:
        fields["custom_generate"] = settings.methods[name]
    elif name not in plugins:
        offered = sorted((plugins - INFRASTRUCTURE_PLUGINS - own_loop_plugins()) | set(settings.methods))
        close = difflib.get_close_matches(name, offered, n=1)
        raise BadRequest(
            f"decodekit method {name!r} is neither a registered decodekit plugin nor a method allowed when "
            f"the server started" + (f" (did you mean {close[0]!r}?)" if close else "") + f"; available: {offered}.",
            "decodekit.method",
        )
    return fields


def token_tensor(value, where: str):
    """A JSON list of token ids (or one list of them per row) as the [rows, tokens] tensor a field takes."""
    import torch

    rows = value if isinstance(value, list) and value and all(isinstance(v, list) for v in value) else [value]
    if (
        not all(isinstance(row, list) and row and all(is_int(t) and t >= 0 for t in row) for row in rows)
        or len({len(row) for row in rows}) != 1
    ):
        raise BadRequest(
            f"{where}={value!r} is invalid; expected a non-empty list of token ids (integers >= 0), or one such "
            "list per row, all of one length.",
            where,
        )
    return torch.tensor(rows, dtype=torch.long)


def own_loop_plugins() -> set[str]:
    """The registered plugins that own the decoding loop (or how logits are read): a server's shared steps cannot
    run them, so they are offered as refused, never as available."""
    from ..registry.manager import get_plugin_manager

    pm = get_plugin_manager()
    return {
        pm.get_name(impl.plugin)
        for hook in ("decodekit_decoding_loop", "decodekit_next_token_logits")
        for impl in getattr(pm.hook, hook).get_hookimpls()
    }


def chat_messages(messages) -> list[dict]:
    """A chat body's messages as {"role", "content"} with text content (parts of type text joined), an assistant's
    earlier `tool_calls` and a tool result's `tool_call_id` kept."""
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
        for name in ("name", "tool_call_id"):  # strings, as OpenAI declares them
            if message.get(name) is not None and not isinstance(message[name], str):
                raise BadRequest(f"{where}.{name}={message[name]!r} is invalid; expected a string.", f"{where}.{name}")
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


def completion_prompt(prompt):
    """A completions body's prompt: a string, or token ids (one prompt per request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    raise BadRequest("prompt must be a string or a list of token ids (one prompt per request).", "prompt")
