"""/v1/completions and /v1/chat/completions: a body checked (serve/protocol.py), its prompt made, the request added to
the manager, and its outputs answered as they come (a Job), streamed or whole."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..batching import QueueFull, RequestStatus
from ..batching.request import GenerationOutput
from ..core.config import is_int
from ..loading.tokenizer import chat_ids
from .protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    chat_messages,
    completion_prompt,
)
from .echo import PromptScores, echoed, score_prompt
from .responses import Answers, Usage, finite
from .served import Served, error_response, tokens_within
from .tools import ToolPlan, messages_with_tools, plan_tools


def continued_chat_ids(tokenizer, messages: list[dict], body, template: dict | None = None) -> list[int]:
    """A chat body's prompt ids: ready for the assistant's reply, or going on with the last assistant message where
    the body asks (continue_final_message); BadRequest for a body that cannot."""
    try:
        return chat_ids(
            tokenizer,
            messages,
            content_as_text=True,
            continue_final=bool(body.continue_final_message),
            **(template or {}),
        )
    except ValueError as error:
        raise BadRequest(str(error), "continue_final_message") from None


def router(served: Served) -> APIRouter:
    routes = APIRouter()
    manager, tokenizer, settings = served.manager, served.tokenizer, served.settings

    async def answer(request: Request, body: GenerationRequest, prompt_of, plan: ToolPlan | None = None):
        """Checks the body's sampling fields, then prompt_of() (the token ids) and add_request in a worker thread."""
        default_max = settings.default_max_tokens if body.chat else 16
        fields = body.to_fields(settings, served.plugins(), served.vocab, served.eos, default_max)
        if plan is not None and plan.forced:
            if "response_format" in fields:
                raise BadRequest(
                    "response_format and a tool_choice that forces a call both constrain the output; pass one of them.",
                    "response_format",
                )
            fields["json_schema"] = plan.constraint()
        job = Job(manager, tokenizer, body, settings, fields, plan)
        await job.add(prompt_of)
        return await job.respond(request)

    async def endpoint(request: Request, chat: bool):
        try:
            body = await served.body_of(request, ChatCompletionRequest if chat else CompletionRequest)
            if chat:
                plan = plan_tools(body)
                messages, template = messages_with_tools(chat_messages(body.messages), plan, tokenizer)

                def prompt_of():
                    tokens_within(tokenizer, [m["content"] for m in messages], served.context)
                    return continued_chat_ids(tokenizer, messages, body, template)

                return await answer(request, body, prompt_of, plan)
            prompt = completion_prompt(body.prompt)

            def prompt_of():
                if isinstance(prompt, list):
                    return prompt
                tokens_within(tokenizer, [prompt], served.context)
                return tokenizer.encode(prompt)

            return await answer(request, body, prompt_of)
        except BadRequest as error:
            return served.refused(error)

    @routes.post("/v1/completions")
    async def completions(request: Request):
        return await endpoint(request, chat=False)

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await endpoint(request, chat=True)

    return routes


async def until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is read by then: receive() only waits for the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Job:
    """One HTTP request's generation: added to the manager, then answered whole or streamed. The manager hands
    its outputs to `self.outputs` on the event loop (add_request's listener)."""

    def __init__(self, manager, tokenizer, body: GenerationRequest, settings, fields, plan: ToolPlan | None = None):
        self.manager, self.tokenizer, self.body, self.chat, self.plan = manager, tokenizer, body, body.chat, plan
        self.skip_special = body.skip_special_tokens is not False
        self.eos: set[int] = set()  # the tokens that end a row, once add_request has checked the request's fields
        self.stream = bool(body.stream)
        self.include_usage = body.include_usage()
        wanted = body.logprob_fields()
        self.logprobs = wanted["logprobs"]
        if self.logprobs and fields["num_return_sequences"] > 1:
            raise BadRequest("logprobs are returned for n=1 only.", "logprobs")
        self.stops = fields.get("stop_strings", [])
        self.fields = {**fields, **wanted, "tokenizer": tokenizer}
        self.model = settings.model_name
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.answers = Answers(self.chat, self.id, self.created, self.model)
        self.outputs: asyncio.Queue[GenerationOutput] = asyncio.Queue()
        self.prompt_ids: list[int] = []
        self.echo = bool(getattr(body, "echo", False))
        self.generates = getattr(body, "generates", True)
        self.prompt_scores: PromptScores | None = None  # with echo and logprobs: the prompt's (echo.score_prompt)

    async def add(self, prompt_of) -> None:
        """The prompt's ids and add_request, in a worker thread: tokenizing a long prompt and the method's own
        validation must not hold the event loop, and nothing they raise may reach it."""
        loop = asyncio.get_running_loop()

        def listener(output):
            loop.call_soon_threadsafe(self.outputs.put_nowait, output)

        def add():
            try:
                self.prompt_ids = prompt_of()
                self.eos = self.end_tokens()  # before add_request: its listener may be called at once
                if self.echo and self.logprobs:
                    self.prompt_scores = self.score_prompt()
                if not self.generates:
                    return None
                self.manager.add_request(
                    self.prompt_ids, request_id=self.id, streaming=self.stream, listener=listener, **self.fields
                )
            except QueueFull as error:
                return BadRequest(str(error), None, 429, "rate_limit_error")
            except BadRequest as error:
                return error
            except (ValueError, TypeError) as error:
                return BadRequest(str(error))
            except (
                ImportError
            ) as error:  # an optional engine the request needs (llguidance): its message names the extra
                return BadRequest(f"This server cannot serve the request as asked: {error}", None, 400)
            except BaseException as error:  # noqa: BLE001 - a method's own code: its request fails, not the server
                method = self.fields.get("custom_generate")
                label = getattr(getattr(method, "source", None), "label", None) or (self.body.decodekit or {}).get(
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

    def score_prompt(self) -> PromptScores:
        """The prompt's logprobs for echo, computed between two of the batch's steps (ValueError for a prompt the
        model's context cannot hold)."""
        context = getattr(self.manager.model.config, "max_position_embeddings", None)
        if context is not None and len(self.prompt_ids) > context:
            raise ValueError(
                f"The prompt has {len(self.prompt_ids)} tokens, past the model's context of {context} positions: "
                "shorten it."
            )
        top = self.fields["top_logprobs"]
        return self.manager.between_steps(lambda: score_prompt(self.manager.model, self.prompt_ids, top)).result()

    def end_tokens(self) -> set[int]:
        """The tokens that end a row: the request's eos_token_id (an id or a list of ids, as generate() takes it),
        else the model's."""
        if "eos_token_id" not in self.fields:
            return set(self.manager.model.generation_config.eos_token_ids)
        value = self.fields["eos_token_id"]
        ids = [] if value is None else [value] if is_int(value) else value if isinstance(value, list) else None
        if ids is None or not all(is_int(t) for t in ids):
            raise BadRequest(
                f"decodekit.eos_token_id={value!r} is invalid; expected a token id or a list of token ids.",
                "decodekit.eos_token_id",
            )
        return {int(t) for t in ids}

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

    def usage(self, output: GenerationOutput) -> Usage:
        generated = sum(len(r) for r in output.sequences) if output.sequences else len(output.generated_tokens)
        prompt = len(self.prompt_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)

    def logprobs_of(self, output: GenerationOutput, start: int):
        """The logprobs of the first row's tokens from `start` on (a stream sends each token once)."""
        word = self.tokenizer.decode
        tops = None
        if output.top_logprobs:
            # A token that cannot come (-inf: masked by a constraint, a warper, another token's +inf) is not listed.
            tops = [[(word([i]), v) for i, v in top if v > -math.inf] for top in output.top_logprobs[start:]]
        return self.answers.logprobs(
            [word([t]) for t in output.generated_tokens[start:]],
            [finite(v) for v in output.logprobs[start:]],
            tops,
            len(word(output.generated_tokens[:start])) if start else 0,
        )

    def scored_only(self):
        """The answer of an echo request of max_tokens 0: the prompt and its logprobs, nothing generated."""
        text, logprobs = echoed(self.tokenizer, self.prompt_ids, self.prompt_scores, "", None)
        choice = self.answers.choice(0, text, "length", logprobs, delta=False)
        usage = Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=0, total_tokens=len(self.prompt_ids))
        return self.answers.whole([choice], usage)

    def choice(self, index: int, text: str, reason: str | None, output: GenerationOutput, delta: bool, start: int = 0):
        logprobs = None
        if self.logprobs and output.logprobs is not None:
            logprobs = self.logprobs_of(output, start)
        if self.echo:  # never streamed (protocol refuses it): the whole text and logprobs
            text, logprobs = echoed(self.tokenizer, self.prompt_ids, self.prompt_scores, text, logprobs)
        calls = None
        if self.plan is not None and reason is not None:  # the whole text: its tool calls, if any, are parsed
            content, calls = self.plan.tool_calls(text)
            if calls:
                text = content
                reason = "tool_calls" if reason == "stop" else reason  # cut off by max_tokens: "length"
        return self.answers.choice(index, text, reason, logprobs, delta, calls)

    # ---- answers ----
    async def respond(self, request: Request):
        if not self.generates:
            return JSONResponse(self.scored_only().out())
        if self.stream:
            return StreamingResponse(self.events(), media_type="text/event-stream")
        output = await self.final(request)
        return Response(status_code=499) if output is None else self.whole(output)

    async def final(self, request: Request) -> GenerationOutput | None:
        """The request's final output, or None where the client went away first (the request is then cancelled)."""
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
            return None
        return result.result()

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
        return JSONResponse(self.answers.whole(choices, self.usage(output)).out())

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
                    yield _sse(self.answers.chunk(choices).out())
                if len(closed) == len(texts):
                    if not finished:  # stop strings ended every row: free the blocks
                        self.manager.cancel_request(self.id, keep_result=False)
                        finished = True
                    if self.include_usage:
                        yield _sse(self.answers.chunk([], self.usage(output)).out())
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the stream broke): free the request's blocks
                self.manager.cancel_request(self.id, keep_result=False)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
