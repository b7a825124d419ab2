"""What every endpoint of `decodekit serve` shares: the served model and its limits (Served), reading a request body
(Served.body_of), and errors as OpenAI's API answers them (error_response)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from .protocol import BadRequest, Body, ServerSettings, check_text


def error_response(error: BadRequest) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}}
    return JSONResponse(body, status_code=error.status)


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


PARSED_INLINE_BYTES = 16 * 1024  # a body up to this size is parsed on the event loop: a thread's hop costs more


@dataclass
class Served:
    """The model a server serves, with what its endpoints read of it: the manager (its steps), the tokenizer, the
    operator's settings, the metrics, the context length, vocabulary size and end tokens."""

    manager: object
    tokenizer: object
    settings: ServerSettings
    metrics: object
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        model = self.manager.model
        self.context = getattr(model.config, "max_position_embeddings", None) or 2**31
        self.vocab = model.config.vocab_size
        self.eos = list(model.generation_config.eos_token_ids)

    async def body_of(self, request: Request, schema: type[Body]):
        """The JSON object of a request as `schema` (a protocol.Body model), read in pieces and cut at
        --max-request-bytes, its text and fields checked, and its `model` the one served (BadRequest otherwise)."""
        settings = self.settings
        raw = bytearray()
        async for piece in request.stream():  # cut as it comes: a chunked body declares no length
            raw += piece
            if len(raw) > settings.max_request_bytes:
                raise too_large(len(raw), settings)
        # Parsing and checking a body of up to --max-request-bytes takes tens of milliseconds: a large one is parsed in
        # a worker thread, so the event loop is not held for it (it still shares the interpreter lock meanwhile).
        if len(raw) <= PARSED_INLINE_BYTES:
            return self.parsed(raw, schema)
        return await run_in_threadpool(self.parsed, raw, schema)

    def parsed(self, raw: bytes | bytearray, schema: type[Body]):
        """body_of's JSON object as `schema`, checked (BadRequest otherwise)."""
        settings = self.settings
        try:
            body = json.loads(raw)
        except RecursionError:
            raise BadRequest("The request body nests too deeply to be read.") from None
        except ValueError as error:
            raise BadRequest(f"The request body is not valid JSON: {error}.") from None
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        check_text(body)
        parsed = schema.of(body)
        if parsed.model is not None and parsed.model != settings.model_name:
            raise BadRequest(
                f"model={parsed.model!r} is not served here; this server serves {settings.model_name!r}.",
                "model",
                404,
                "not_found_error",
            )
        return parsed

    def plugins(self) -> set[str]:
        """The names of the registered decodekit plugins."""
        from ..registry.manager import get_plugin_manager

        return {name for name, _ in get_plugin_manager().list_name_plugin()}

    def refused(self, error: BadRequest) -> JSONResponse:
        """The error response for a refused request, counted in the metrics."""
        self.metrics.reject(error.status)
        return error_response(error)
