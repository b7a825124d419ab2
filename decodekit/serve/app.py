"""The OpenAI-compatible HTTP API over a ContinuousBatchingManager: /v1/completions, /v1/chat/completions,
/v1/models, /health. Request bodies are validated here (types, limits), then by decodekit itself when the request
is added (config fields, the method's own validation): either failure is a 400 with the message.

A request chooses its decoding method with `"decodekit": {"method": NAME, ...fields}` in the body (the openai
client's `extra_body`). NAME is a registered decodekit plugin (its fields then apply, as in generate()) or a method
the operator allowed when the server started; a request never names code to load or grants trust.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from ..batching import QueueFull, RequestStatus
from ..batching.request import GenerationOutput
from ..core.config import is_int
from ..models.tokenizer import chat_ids


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_tokens_limit: int = 4096  # the largest max_tokens a request may ask for
    default_max_tokens: int = 256  # chat requests without max_tokens (completions default to 16, as OpenAI's)
    max_request_bytes: int = 1_000_000
    max_n: int = 8
    methods: dict[str, Any] = field(default_factory=dict)  # allowed methods: {name: LoadedMethod}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_response(error: BadRequest) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}}
    return JSONResponse(body, status_code=error.status)


def _number(body: dict, name: str, low: float, high: float, default, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
        what = "an integer" if integer else "a number"
        raise BadRequest(f"{name}={value!r} is invalid; expected {what} in [{low}, {high}].", name)
    return value


def _stop_list(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"stop={stop!r} is invalid; expected a non-empty string or a list of up to 4 of them.", "stop")
    return stops


def generation_fields(body: dict, settings: ServerSettings, default_max_tokens: int) -> dict[str, Any]:
    """The generation config fields and request arguments of an OpenAI body."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", 1, settings.max_tokens_limit, default_max_tokens, True)
    temperature = _number(body, "temperature", 0, 2, 1.0)
    top_p = _number(body, "top_p", 0, 1, 1.0)
    if top_p == 0:
        raise BadRequest("top_p=0 is invalid; expected a number in (0, 1].", "top_p")
    n = _number(body, "n", 1, settings.max_n, 1, True)
    seed = _number(body, "seed", 0, 2**63 - 1, None, True)
    fields: dict[str, Any] = {"max_new_tokens": max_tokens, "num_return_sequences": n}
    if temperature > 0:
        fields.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    else:
        fields["do_sample"] = False
    if seed is not None:
        fields["seed"] = seed
    return fields


def method_fields(body: dict, settings: ServerSettings) -> dict[str, Any]:
    """The `decodekit` object of a body: {"method": NAME, ...fields} -> add_request arguments."""
    spec = body.get("decodekit")
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise BadRequest(f'"decodekit" must be an object {{"method": NAME, ...fields}}, got {spec!r}.', "decodekit")
    fields = dict(spec)
    for forbidden in ("custom_generate", "trust_remote_code"):
        if forbidden in fields:
            raise BadRequest(f'"decodekit.{forbidden}" cannot be set by a request: the operator allows methods when the '
                             "server starts (decodekit serve --method SPEC@REVISION).", f"decodekit.{forbidden}")
    name = fields.pop("method", None)
    if name is None:
        return fields
    from ..registry.manager import get_plugin_manager

    plugins = {n for n, _ in get_plugin_manager().list_name_plugin()}
    if name in settings.methods:
        fields["custom_generate"] = settings.methods[name]
    elif name not in plugins:
        raise BadRequest(f"decodekit method {name!r} is neither a registered decodekit plugin nor a method allowed when "
                         f"the server started; available: {sorted(plugins | set(settings.methods))}.", "decodekit.method")
    return fields


def create_app(manager, tokenizer, settings: ServerSettings) -> FastAPI:
    """The FastAPI app over a started (or externally run) manager and the model's tokenizer."""
    app = FastAPI(title="decodekit", version="1")
    created = int(time.time())

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if settings.api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
                return error_response(BadRequest("A valid API key is required: Authorization: Bearer <key>.", None, 401,
                                                 "authentication_error"))
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_request_bytes:
            return error_response(BadRequest(f"The request body has {length} bytes; this server takes at most "
                                             f"{settings.max_request_bytes}.", None, 400))
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok" if manager.is_running() else "stopped"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": created,
                                            "owned_by": "decodekit"}]}

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        if len(raw) > settings.max_request_bytes:
            raise BadRequest(f"The request body has {len(raw)} bytes; this server takes at most "
                             f"{settings.max_request_bytes}.")
        try:
            body = json.loads(raw)
        except ValueError as error:
            raise BadRequest(f"The request body is not valid JSON: {error}.") from None
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        model = body.get("model")
        if model is not None and model != settings.model_name:
            raise BadRequest(f"model={model!r} is not served here; this server serves {settings.model_name!r}.", "model", 404,
                             "not_found_error")
        return body

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await body_of(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = tokenizer.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
                ids = prompt
            else:
                raise BadRequest("prompt must be a string or a list of token ids (one prompt per request).", "prompt")
            job = Job(manager, tokenizer, body, settings, ids, generation_fields(body, settings, 16), chat=False)
            return await job.respond(request)
        except BadRequest as error:
            return error_response(error)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await body_of(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise BadRequest("messages must be a non-empty list of {\"role\": ..., \"content\": \"...\"} objects.",
                                 "messages")
            try:
                ids = chat_ids(tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])
            except ValueError as error:
                raise BadRequest(str(error), "messages") from None
            fields = generation_fields(body, settings, settings.default_max_tokens)
            job = Job(manager, tokenizer, body, settings, ids, fields, chat=True)
            return await job.respond(request)
        except BadRequest as error:
            return error_response(error)

    return app


class Job:
    """One HTTP request's generation: added to the manager, then answered whole or streamed."""

    def __init__(self, manager, tokenizer, body, settings, ids, fields, chat: bool):
        self.manager, self.tokenizer, self.body, self.chat = manager, tokenizer, body, chat
        self.stops = _stop_list(body)
        self.stream = bool(body.get("stream", False))
        logprobs = body.get("logprobs")
        self.logprobs = bool(logprobs) if logprobs is not None else False
        if not isinstance(logprobs, (bool, int, type(None))):
            raise BadRequest(f"logprobs={logprobs!r} is invalid; expected a boolean (chat) or an integer (completions).",
                             "logprobs")
        if self.logprobs and fields["num_return_sequences"] > 1:
            raise BadRequest("logprobs are returned for n=1 only.", "logprobs")
        options = body.get("stream_options") or {}
        self.include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
        self.prompt_ids = ids
        self.model = settings.model_name
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        # The tokenizer serves stop strings (generation stops at one; texts() cuts it off) and structured output.
        arguments = {**fields, **method_fields(body, settings), "logprobs": self.logprobs, "tokenizer": tokenizer}
        if self.stops:
            arguments["stop_strings"] = self.stops
        try:
            self.request_id = manager.add_request(ids, request_id=self.id, streaming=self.stream, **arguments)
        except QueueFull as error:
            raise BadRequest(str(error), None, 429, "rate_limit_error") from None
        except (ValueError, TypeError) as error:
            raise BadRequest(str(error)) from None

    # ---- text ----
    def texts(self, output: GenerationOutput) -> list[tuple[str, str | None, bool]]:
        """(text, finish_reason, ended) of each row: the text is cut before the first stop string, and a row ends
        there or when the request does."""
        eos = set(self.manager.model.generation_config.eos_token_ids)
        rows = []
        for row in output.sequences or [output.generated_tokens]:
            ended_on_eos = bool(row) and row[-1] in eos
            text = self.tokenizer.decode(row[:-1] if ended_on_eos else row, skip_special_tokens=True)
            reason, ended = output.finish_reason, output.is_finished()
            cuts = [at for at in (text.find(stop) for stop in self.stops) if at >= 0]
            if cuts:
                text, reason, ended = text[:min(cuts)], "stop", True
            rows.append((text, reason, ended))
        return rows

    def usage(self, output: GenerationOutput) -> dict:
        generated = sum(len(r) for r in output.sequences) if output.sequences else len(output.generated_tokens)
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": generated,
                "total_tokens": len(self.prompt_ids) + generated}

    def choice(self, index: int, text: str, reason: str | None, output: GenerationOutput, delta: bool) -> dict:
        logprobs = None
        if self.logprobs and output.logprobs is not None:
            tokens = [self.tokenizer.decode([t]) for t in output.generated_tokens]
            if self.chat:
                logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                        for t, lp in zip(tokens, output.logprobs)]}
            else:
                logprobs = {"tokens": tokens, "token_logprobs": output.logprobs, "top_logprobs": None, "text_offset": None}
        if self.chat:
            key = "delta" if delta else "message"
            message = {"role": "assistant", "content": text}
            return {"index": index, key: message, "finish_reason": reason, "logprobs": logprobs}
        return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}

    def envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    # ---- answers ----
    async def respond(self, request: Request):
        if self.stream:
            return StreamingResponse(self.events(), media_type="text/event-stream")
        output = None
        try:
            while output is None:
                output = await run_in_threadpool(self.manager.get_result, self.request_id, 0.25)
                if output is None and await request.is_disconnected():
                    self.manager.cancel_request(self.request_id, keep_result=False)
                    return JSONResponse({}, status_code=499)
        except asyncio.CancelledError:
            self.manager.cancel_request(self.request_id, keep_result=False)
            raise
        return self.whole(output)

    def whole(self, output: GenerationOutput):
        if output.status == RequestStatus.FAILED:
            return error_response(BadRequest(output.error or "generation failed", None, 500, "server_error"))
        if output.status == RequestStatus.CANCELLED:
            return error_response(BadRequest("The request was cancelled (the server is stopping).", None, 503,
                                             "server_error"))
        choices = [self.choice(i, text, reason, output, delta=False)
                   for i, (text, reason, _) in enumerate(self.texts(output))]
        return JSONResponse({**self.envelope(choices, chunk=False), "usage": self.usage(output)})

    async def events(self):
        sent: dict[int, str] = {}
        closed: set[int] = set()
        try:
            async for output in iterate_in_threadpool(self.manager.request_id_iter(self.request_id)):
                if output.status == RequestStatus.FAILED:
                    yield _sse({"error": {"message": output.error, "type": "server_error", "code": 500}})
                    break
                texts = self.texts(output)
                choices = []
                for i, (text, reason, ended) in enumerate(texts):
                    if i in closed:
                        continue
                    before = sent.get(i, "")
                    piece = text[len(before):] if text.startswith(before) else ""
                    if piece.endswith("\ufffd") and not ended:  # a character whose bytes are not all out yet
                        continue
                    if piece or ended:
                        sent[i] = text
                        choices.append(self.choice(i, piece, reason if ended else None, output, delta=True))
                    if ended:
                        closed.add(i)
                if choices:
                    yield _sse(self.envelope(choices, chunk=True))
                if len(closed) == len(texts):
                    if not output.is_finished():  # stop strings ended every row: free the blocks
                        self.manager.cancel_request(self.request_id, keep_result=False)
                    if self.include_usage:
                        yield _sse({**self.envelope([], chunk=True), "usage": self.usage(output)})
                    break
            yield "data: [DONE]\n\n"
        finally:
            if len(closed) < max(len(sent), 1):  # the client went away (or the stream broke): free the request's blocks
                self.manager.cancel_request(self.request_id, keep_result=False)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
