"""The OpenAI-compatible HTTP API over a ContinuousBatchingManager, one module per group of endpoints:
generation.py (/v1/completions, /v1/chat/completions), tokens.py (/tokenize, /detokenize), info.py (/health,
/metrics, /v1/models), playground.py (the page at / and what it reads); served.py holds what they share. Bodies are
checked by serve/protocol.py (fields, types, limits), then by decodekit itself when the request is added (config
fields, the method's own validation): either failure is a 400.

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

import secrets

from fastapi import FastAPI

from . import generation, info, playground, tokens
from .protocol import BadRequest, ServerSettings
from .served import Served, error_response, too_large

# Answered without the API key: a load balancer's and a scraper's, and the playground page (static; the page sends
# the key it is given with each request it makes).
OPEN_PATHS = ("/health", "/metrics", "/")


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


def create_app(manager, tokenizer, settings: ServerSettings) -> FastAPI:
    """The FastAPI app over a started (or externally run) manager and the model's tokenizer: one router per module
    (info, tokens, generation, playground) over what they share (served.Served)."""
    from .metrics import Metrics

    app = FastAPI(title="decodekit", version="1")
    metrics = app.state.metrics = Metrics(manager, settings.model_name)
    previous = manager.on_end
    manager.on_end = metrics.ended if previous is None else (lambda output: (previous(output), metrics.ended(output)))
    app.add_middleware(Guard, settings=settings, metrics=metrics)
    served = Served(manager, tokenizer, settings, metrics)
    for module in (info, tokens, generation, playground):
        app.include_router(module.router(served))
    return app
