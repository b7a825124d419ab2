"""The OpenAI-compatible HTTP API over a ContinuousBatchingManager: /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics, and the playground page at / (serve/playground.py). Bodies are checked by serve/protocol.py (fields, types, limits), then by decodekit
itself when the request is added (config fields, the method's own validation): either failure is a 400.

A request chooses its decoding method with `"decodekit": {"method": NAME, ...fields}` in the body (the openai
client's `extra_body`). NAME is a registered decodekit plugin (its fields then apply, as in generate()) or a method
the operator allowed when the server started; a request never names code to load or grants trust.

What no request can do to the server: the body is read in pieces and cut at --max-request-bytes (413), whatever
its transfer encoding; tokenizing, templating and the method's own validation run in worker threads, never on the
event loop, and whatever they raise (SystemExit included) is that request's error; a request's outputs come to
the event loop as the manager makes them (no thread waits on them), and a client that goes away, streaming or
not, cancels its request at once, which frees its blocks at the next step.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..batching import QueueFull, RequestStatus
from ..batching.request import GenerationOutput
from ..core.config import is_int
from ..models.tokenizer import chat_ids
from . import playground
from .protocol import (
    CHAT,
    COMPLETIONS,
    INFRASTRUCTURE_PLUGINS,
    BadRequest,
    ServerSettings,
    boolean,
    chat_messages,
    check_fields,
    check_text,
    completion_prompt,
    logprob_fields,
    merged_request,
    stream_options,
)
from .tools import ToolPlan, messages_with_tools, plan_tools

# Answered without the API key: a load balancer's and a scraper's, and the playground page (static; the page sends
# the key it is given with each request it makes).
OPEN_PATHS = ("/health", "/metrics", "/")


def error_response(error: BadRequest) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}}
    return JSONResponse(body, status_code=error.status)


class Guard:
    """ASGI middleware: the API key on every path but OPEN_PATHS, and a declared body over the byte limit refused
    before it is read (413). Plain ASGI rather than @app.middleware("http"), under which a handler can no longer
    see its client disconnect."""

    def __init__(self, app, settings: ServerSettings, metrics):
        self.app, self.settings, self.metrics = app, settings, metrics
        self.expected = f"Bearer {settings.api_key}".encode() if settings.api_key is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            error = None
            if (
                self.expected is not None
                and scope["path"] not in OPEN_PATHS
                and not secrets.compare_digest(headers.get(b"authorization", b""), self.expected)
            ):
                error = BadRequest(
                    "A valid API key is required: Authorization: Bearer <key>.", None, 401, "authentication_error"
                )
            length = headers.get(b"content-length", b"")
            if error is None and length.isdigit() and int(length) > self.settings.max_request_bytes:
                error = too_large(int(length), self.settings)
            if error is not None:
                self.metrics.reject(error.status)
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def too_large(size: int, settings: ServerSettings) -> BadRequest:
    return BadRequest(
        f"The request body has {size} bytes or more; this server takes at most "
        f"{settings.max_request_bytes} (--max-request-bytes).",
        None,
        413,
    )


PIECE_CHARS = 32_768  # a long text is counted in pieces this long: each piece's encoding is a few MB at most


def tokens_within(tokenizer, texts: list[str], limit: int) -> None:
    """BadRequest if `texts` hold clearly more than `limit` tokens, found without encoding any long text whole: the
    tokenizer's encoding of ~400k tokens takes ~200 MB, which a refused request must not cost. Counted in pieces
    split at spaces; a prompt near the limit is then encoded whole and checked exactly by add_request."""
    if sum(len(t) for t in texts) <= PIECE_CHARS:
        return
    count = 0
    for text in texts:
        at = 0
        while at < len(text):
            end = min(len(text), at + PIECE_CHARS)
            if end < len(text):
                space = text.rfind(" ", at + PIECE_CHARS // 2, end)
                end = space if space > at else end
            count += len(tokenizer.encode(text[at:end], add_special_tokens=False))
            at = end
            if count > 2 * limit:
                raise BadRequest(
                    f"The prompt has more than {2 * limit} tokens; the model's context is {limit} positions "
                    "(max_position_embeddings).",
                    "prompt",
                )


def create_app(manager, tokenizer, settings: ServerSettings) -> FastAPI:
    """The FastAPI app over a started (or externally run) manager and the model's tokenizer."""
    from .metrics import CONTENT_TYPE_LATEST, Metrics

    app = FastAPI(title="decodekit", version="1")
    created = int(time.time())
    metrics = app.state.metrics = Metrics(manager, settings.model_name)
    previous = manager.on_end
    manager.on_end = metrics.ended if previous is None else (lambda output: (previous(output), metrics.ended(output)))
    app.add_middleware(Guard, settings=settings, metrics=metrics)

    @app.get("/health")
    async def health():
        return {"status": "ok" if manager.is_running() else "stopped"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": settings.model_name, "object": "model", "created": created, "owned_by": "decodekit"}],
        }

    async def body_of(request: Request, served: set[str]) -> dict:
        raw = bytearray()
        async for piece in request.stream():  # cut as it comes: a chunked body declares no length
            raw += piece
            if len(raw) > settings.max_request_bytes:
                raise too_large(len(raw), settings)
        try:
            body = json.loads(raw)
        except RecursionError:
            raise BadRequest("The request body nests too deeply to be read.") from None
        except ValueError as error:
            raise BadRequest(f"The request body is not valid JSON: {error}.") from None
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        check_text(body)
        check_fields(body, served)
        model = body.get("model")
        if model is not None and model != settings.model_name:
            raise BadRequest(
                f"model={model!r} is not served here; this server serves {settings.model_name!r}.",
                "model",
                404,
                "not_found_error",
            )
        return body

    def plugins() -> set[str]:
        from ..registry.manager import get_plugin_manager

        return {name for name, _ in get_plugin_manager().list_name_plugin()}

    context = getattr(manager.model.config, "max_position_embeddings", None) or 2**31
    vocab = manager.model.config.vocab_size
    eos = list(manager.model.generation_config.eos_token_ids)

    async def answer(request: Request, body: dict, chat: bool, prompt_of, plan: ToolPlan | None = None):
        """Checks the body's sampling fields, then prompt_of() (the token ids) and add_request in a worker thread."""
        fields = merged_request(body, settings, settings.default_max_tokens if chat else 16, plugins(), vocab, eos)
        if plan is not None and plan.forced:
            if "response_format" in fields:
                raise BadRequest(
                    "response_format and a tool_choice that forces a call both constrain the output; pass one of them.",
                    "response_format",
                )
            fields["json_schema"] = plan.constraint()
        job = Job(manager, tokenizer, body, settings, fields, chat, plan)
        await job.add(prompt_of)
        return await job.respond(request)

    async def endpoint(request: Request, chat: bool):
        try:
            body = await body_of(request, CHAT if chat else COMPLETIONS)
            if chat:
                plan = plan_tools(body)
                messages, template = messages_with_tools(chat_messages(body), plan, tokenizer)

                def prompt_of():
                    tokens_within(tokenizer, [m["content"] for m in messages], context)
                    return chat_ids(tokenizer, messages, content_as_text=True, **template)

                return await answer(request, body, chat, prompt_of, plan)
            else:
                prompt = completion_prompt(body)

                def prompt_of():
                    if isinstance(prompt, list):
                        return prompt
                    tokens_within(tokenizer, [prompt], context)
                    return tokenizer.encode(prompt)

            return await answer(request, body, chat, prompt_of)
        except BadRequest as error:
            metrics.reject(error.status)
            return error_response(error)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: {"prompt": text} or {"messages": [...]} -> {"tokens", "count", "max_model_len"}."""
        try:
            body = await body_of(
                request, {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}
            )
            if "messages" in body:
                messages = chat_messages(body)

                def encode():  # in a worker thread, as every long text's encoding: the event loop answers meanwhile
                    tokens_within(tokenizer, [m["content"] for m in messages], context)
                    return chat_ids(tokenizer, messages, True)
            elif isinstance(body.get("prompt"), str):
                special, prompt = boolean(body, "add_special_tokens", True), body["prompt"]

                def encode():
                    tokens_within(tokenizer, [prompt], context)  # what no request could use is not encoded whole
                    return tokenizer.encode(prompt, special)
            else:
                raise BadRequest('tokenize takes {"prompt": "..."} or {"messages": [...]}.', "prompt")
            ids = await run_in_threadpool(encode)
            return {"tokens": ids, "count": len(ids), "max_model_len": context}
        except BadRequest as error:
            return error_response(error)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: {"tokens": [ids]} -> {"prompt": text}."""
        try:
            body = await body_of(request, {"model", "tokens"})
            tokens = body.get("tokens")
            if isinstance(tokens, list) and len(tokens) > 2 * context:
                raise BadRequest(
                    f"tokens has {len(tokens)} ids; this server decodes at most {2 * context} (twice the "
                    "model's context).",
                    "tokens",
                )

            def decode():  # checked and decoded in a worker thread: the event loop answers meanwhile
                if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < vocab for t in tokens):
                    raise BadRequest(f"tokens must be a list of token ids in [0, {vocab}).", "tokens")
                return tokenizer.decode(tokens)

            return {"prompt": await run_in_threadpool(decode)}
        except BadRequest as error:
            return error_response(error)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        """Not offered: a 404 that says so, where a client would otherwise get a bare "Not Found"."""
        return error_response(
            BadRequest(
                "/v1/embeddings is not offered by decodekit serve: it serves generation (/v1/completions, "
                "/v1/chat/completions) for causal language models, whose hidden states are no trained embedding; use an "
                "embedding model's own server.",
                None,
                404,
                "not_found_error",
            )
        )

    @app.get("/")
    async def playground_page():
        return HTMLResponse(playground.PAGE.read_text(encoding="utf-8"))

    @app.get("/playground/methods")
    async def playground_methods():
        offered = await run_in_threadpool(playground.offered_methods, settings, plugins(), INFRASTRUCTURE_PLUGINS)
        return {"model": settings.model_name, "methods": offered}

    @app.post("/playground/step")
    async def playground_step(request: Request):
        """A chat completions body -> the next token explained (serve/playground.py)."""
        try:
            body = await body_of(request, CHAT)
            messages = chat_messages(body)
            fields = merged_request(body, settings, 1, plugins(), vocab, eos)  # one step: one token

            def explain():
                tokens_within(tokenizer, [m["content"] for m in messages], context)
                ids = chat_ids(tokenizer, messages, content_as_text=True)
                try:
                    return playground.explain_step(manager.model, tokenizer, ids, fields)
                except (ValueError, TypeError) as error:  # the call's own values, as add_request would say
                    raise BadRequest(str(error)) from None

            return await run_in_threadpool(explain)
        except BadRequest as error:
            metrics.reject(error.status)
            return error_response(error)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await endpoint(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await endpoint(request, chat=True)

    return app


async def until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is read by then: receive() only waits for the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Job:
    """One HTTP request's generation: added to the manager, then answered whole or streamed. The manager hands
    its outputs to `self.outputs` on the event loop (add_request's listener)."""

    def __init__(self, manager, tokenizer, body, settings, fields, chat: bool, plan: ToolPlan | None = None):
        self.manager, self.tokenizer, self.body, self.chat, self.plan = manager, tokenizer, body, chat, plan
        self.skip_special = boolean(body, "skip_special_tokens", True)
        self.eos = (
            set(fields["eos_token_id"] or [])
            if "eos_token_id" in fields
            else set(manager.model.generation_config.eos_token_ids)
        )
        self.stream = boolean(body, "stream")
        self.include_usage = stream_options(body, self.stream)
        wanted = logprob_fields(body, chat)
        self.logprobs = wanted["logprobs"]
        if self.logprobs and fields["num_return_sequences"] > 1:
            raise BadRequest("logprobs are returned for n=1 only.", "logprobs")
        self.stops = fields.get("stop_strings", [])
        self.fields = {**fields, **wanted, "tokenizer": tokenizer}
        self.model = settings.model_name
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.outputs: asyncio.Queue[GenerationOutput] = asyncio.Queue()
        self.prompt_ids: list[int] = []

    async def add(self, prompt_of) -> None:
        """The prompt's ids and add_request, in a worker thread: tokenizing a long prompt and the method's own
        validation must not hold the event loop, and nothing they raise may reach it."""
        loop = asyncio.get_running_loop()

        def listener(output):
            loop.call_soon_threadsafe(self.outputs.put_nowait, output)

        def add():
            try:
                self.prompt_ids = prompt_of()
                self.manager.add_request(
                    self.prompt_ids, request_id=self.id, streaming=self.stream, listener=listener, **self.fields
                )
            except QueueFull as error:
                return BadRequest(str(error), None, 429, "rate_limit_error")
            except BadRequest as error:
                return error
            except (ValueError, TypeError) as error:
                return BadRequest(str(error))
            except BaseException as error:  # noqa: BLE001 - a method's own code: its request fails, not the server
                method = self.fields.get("custom_generate")
                label = getattr(getattr(method, "source", None), "label", None) or self.body.get("decodekit", {}).get(
                    "method"
                )
                return BadRequest(
                    f"The request failed while it was prepared{f' by method {label!r}' if label else ''}: "
                    f"{type(error).__name__}: {error}",
                    None,
                    500,
                    "server_error",
                )
            return None

        error = await run_in_threadpool(add)
        if error is not None:
            raise error

    # ---- text ----
    def texts(self, output: GenerationOutput) -> list[tuple[str, str | None, bool]]:
        """(text, finish_reason, ended) of each row: the text is cut before the first stop string, and a row ends
        there or when the request does."""
        rows = []
        for row in output.sequences or [output.generated_tokens]:
            ended_on_eos = bool(row) and row[-1] in self.eos  # the stop token is not part of the text, as vLLM's
            text = self.tokenizer.decode(row[:-1] if ended_on_eos else row, skip_special_tokens=self.skip_special)
            reason, ended = output.finish_reason, output.is_finished()
            cuts = [at for at in (text.find(stop) for stop in self.stops) if at >= 0]
            if cuts:
                text, reason, ended = text[: min(cuts)], "stop", True
            rows.append((text, reason, ended))
        return rows

    def usage(self, output: GenerationOutput) -> dict:
        generated = sum(len(r) for r in output.sequences) if output.sequences else len(output.generated_tokens)
        return {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": generated,
            "total_tokens": len(self.prompt_ids) + generated,
        }

    def logprobs_of(self, output: GenerationOutput, start: int):
        """The OpenAI logprobs object of the first row's tokens from `start` on (a stream sends each token once)."""
        word = self.tokenizer.decode
        chosen = [word([t]) for t in output.generated_tokens[start:]]
        tops = (output.top_logprobs or [])[start:]
        if self.chat:

            def entry(token, logprob):
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            return {
                "content": [
                    {**entry(t, lp), "top_logprobs": [entry(word([i]), v) for i, v in top]}
                    for t, lp, top in zip(chosen, output.logprobs[start:], tops or [[]] * len(chosen))
                ]
            }
        offsets, at = [], len(self.tokenizer.decode(output.generated_tokens[:start])) if start else 0
        for token in chosen:
            offsets.append(at)
            at += len(token)
        return {
            "tokens": chosen,
            "token_logprobs": output.logprobs[start:],
            "text_offset": offsets,
            "top_logprobs": [{word([i]): v for i, v in top} for top in tops] if output.top_logprobs else None,
        }

    def choice(
        self, index: int, text: str, reason: str | None, output: GenerationOutput, delta: bool, start: int = 0
    ) -> dict:
        logprobs = None
        if self.logprobs and output.logprobs is not None:
            logprobs = self.logprobs_of(output, start)
        if self.chat:
            key = "delta" if delta else "message"
            message = {"role": "assistant", "content": text}
            if self.plan is not None and reason is not None:  # the whole text: its tool calls, if any, are parsed
                content, calls = self.plan.tool_calls(text)
                if calls:
                    message = {
                        "role": "assistant",
                        "content": content,
                        "tool_calls": [{**c, "index": i} if delta else c for i, c in enumerate(calls)],
                    }
                    reason = "tool_calls" if reason == "stop" else reason  # cut off by max_tokens: "length"
            return {"index": index, key: message, "finish_reason": reason, "logprobs": logprobs}
        return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}

    def envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    # ---- answers ----
    async def respond(self, request: Request):
        if self.stream:
            return StreamingResponse(self.events(), media_type="text/event-stream")
        result = asyncio.ensure_future(self.outputs.get())
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not result.done():  # the client went away, or this handler was cancelled
                self.manager.cancel_request(self.id, keep_result=False)
            result.cancel()
            gone.cancel()
        if not result.done() or result.cancelled():
            return Response(status_code=499)
        return self.whole(result.result())

    def whole(self, output: GenerationOutput):
        if output.status == RequestStatus.FAILED:
            return error_response(BadRequest(output.error or "generation failed", None, 500, "server_error"))
        if output.status == RequestStatus.CANCELLED:
            return error_response(
                BadRequest("The request was cancelled (the server is stopping).", None, 503, "server_error")
            )
        choices = [
            self.choice(i, text, reason, output, delta=False) for i, (text, reason, _) in enumerate(self.texts(output))
        ]
        return JSONResponse({**self.envelope(choices, chunk=False), "usage": self.usage(output)})

    async def events(self):
        """Server-sent events; Starlette cancels this generator when the client goes away, and `finally` then
        cancels the request."""
        sent: dict[int, str] = {}
        closed: set[int] = set()
        tokens_sent = 0  # of the first row, whose logprobs a chunk carries
        finished = False
        try:
            while not finished:
                output = await self.outputs.get()
                finished = output.is_finished()
                if output.status == RequestStatus.FAILED:
                    yield _sse({"error": {"message": output.error, "type": "server_error", "code": 500}})
                    break
                texts = self.texts(output)
                choices = []
                for i, (text, reason, ended) in enumerate(texts):
                    if i in closed:
                        continue
                    before = sent.get(i, "")
                    piece = text[len(before) :] if text.startswith(before) else ""
                    if piece.endswith("\ufffd") and not ended:  # a character whose bytes are not all out yet
                        continue
                    if self.plan is not None and not ended:  # with tools a row's text goes out whole, parsed
                        continue
                    if piece or ended:
                        sent[i] = text
                        choices.append(
                            self.choice(
                                i,
                                piece,
                                reason if ended else None,
                                output,
                                delta=True,
                                start=tokens_sent if i == 0 else 0,
                            )
                        )
                        if i == 0:
                            tokens_sent = len(output.generated_tokens)
                    if ended:
                        closed.add(i)
                if choices:
                    yield _sse(self.envelope(choices, chunk=True))
                if len(closed) == len(texts):
                    if not finished:  # stop strings ended every row: free the blocks
                        self.manager.cancel_request(self.id, keep_result=False)
                        finished = True
                    if self.include_usage:
                        yield _sse({**self.envelope([], chunk=True), "usage": self.usage(output)})
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the stream broke): free the request's blocks
                self.manager.cancel_request(self.id, keep_result=False)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
