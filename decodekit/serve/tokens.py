"""vLLM's /tokenize and /detokenize: a prompt or messages as the model's token ids, and back."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from ..core.config import is_int
from ..loading.tokenizer import chat_ids
from .protocol import BadRequest, DetokenizeRequest, TokenizeRequest, chat_messages
from .served import Served, error_response, tokens_within


def router(served: Served) -> APIRouter:
    routes = APIRouter()
    tokenizer, context = served.tokenizer, served.context

    @routes.post("/tokenize")
    async def tokenize(request: Request):
        """{"prompt": text} or {"messages": [...]} -> {"tokens", "count", "max_model_len"}."""
        try:
            body = await served.body_of(request, TokenizeRequest)
            if body.messages is not None:
                messages = chat_messages(body.messages)

                def encode():  # in a worker thread, as every long text's encoding: the event loop answers meanwhile
                    tokens_within(tokenizer, [m["content"] for m in messages], context)
                    return chat_ids(tokenizer, messages, True)
            elif body.prompt is not None:
                special, prompt = body.add_special_tokens is not False, body.prompt

                def encode():
                    tokens_within(tokenizer, [prompt], context)  # what no request could use is not encoded whole
                    return tokenizer.encode(prompt, special)
            else:
                raise BadRequest('tokenize takes {"prompt": "..."} or {"messages": [...]}.', "prompt")
            ids = await run_in_threadpool(encode)
            return {"tokens": ids, "count": len(ids), "max_model_len": context}
        except BadRequest as error:
            return error_response(error)

    @routes.post("/detokenize")
    async def detokenize(request: Request):
        """{"tokens": [ids]} -> {"prompt": text}."""
        try:
            tokens = (await served.body_of(request, DetokenizeRequest)).tokens
            if isinstance(tokens, list) and len(tokens) > 2 * context:
                raise BadRequest(
                    f"tokens has {len(tokens)} ids; this server decodes at most {2 * context} (twice the "
                    "model's context).",
                    "tokens",
                )

            def decode():  # checked and decoded in a worker thread: the event loop answers meanwhile
                if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < served.vocab for t in tokens):
                    raise BadRequest(f"tokens must be a list of token ids in [0, {served.vocab}).", "tokens")
                return tokenizer.decode(tokens)

            return {"prompt": await run_in_threadpool(decode)}
        except BadRequest as error:
            return error_response(error)

    return routes
