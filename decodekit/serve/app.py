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

import ipaddress
import logging
import secrets

from fastapi import FastAPI

from . import generation, info, playground, tokens
from .protocol import BadRequest, ServerSettings
from .served import Served, error_response, too_large

logger = logging.getLogger("decodekit")

# Answered without the API key: a load balancer's and a scraper's, and the playground page (static; the page sends
# the key it is given with each request it makes).
OPEN_PATHS = ("/health", "/metrics", "/")


# A page of another site may not frame the playground, and the page loads nothing from elsewhere (its script and
# style are inline).
PAGE_HEADERS = [
    (b"x-frame-options", b"DENY"),
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' "
        b"'unsafe-inline'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "[::1]"}


def loopback_hosts(bound: str | None) -> set[str] | None:
    """The Host header names a server listening on `bound` answers: on a loopback address only the loopback names
    (a web page that renamed its own host to 127.0.0.1 through DNS rebinding sends its own name), elsewhere any
    (None): a server on a public address is reached by names decodekit cannot know."""
    if bound is None:
        return None
    name = bound.strip("[]").lower()
    try:
        loopback = ipaddress.ip_address(name).is_loopback
    except ValueError:
        loopback = name == "localhost"
    if not loopback:
        return None
    return LOOPBACK_NAMES | {f"[{name}]" if ":" in name else name}


def host_name(header: bytes) -> str:
    """The host of a Host header without its port: `[::1]:8000` -> `[::1]`, `Localhost:80` -> `localhost`."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[: text.find("]") + 1]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class Guard:
    """ASGI middleware: what every request must pass before an endpoint reads it, and what every answer carries.
    - Host: a server on a loopback address answers the loopback names only (400);
    - the API key on every path but OPEN_PATHS (401);
    - a POST body is JSON (415): a form or text/plain POST is what a page of another site may send without asking;
    - a declared body over the byte limit is refused before it is read (413);
    - the page carries frame and content-security headers;
    - an endpoint's unexpected exception is a JSON 500 (OpenAI's error object), logged, and the connection stays
      usable for the client's next request.
    Plain ASGI rather than @app.middleware("http"), under which a handler can no longer see its client disconnect."""

    def __init__(self, app, settings: ServerSettings, metrics, hosts: set[str] | None = None):
        self.app, self.settings, self.metrics, self.hosts = app, settings, metrics, hosts
        self.expected = f"Bearer {settings.api_key}".encode() if settings.api_key is not None else None

    def refusal(self, scope) -> BadRequest | None:
        headers = dict(scope.get("headers") or [])
        if self.hosts is not None and host_name(headers.get(b"host", b"")) not in self.hosts:
            return BadRequest(
                f"Host {headers.get(b'host', b'').decode('latin-1')!r} is not served: this server listens on a "
                f"loopback address and answers {sorted(self.hosts)}.",
                None,
                400,
            )
        if (
            self.expected is not None
            and scope["path"] not in OPEN_PATHS
            and not secrets.compare_digest(headers.get(b"authorization", b""), self.expected)
        ):
            return BadRequest(
                "A valid API key is required: Authorization: Bearer <key>.", None, 401, "authentication_error"
            )
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if scope["method"] == "POST" and kind != b"application/json":
            return BadRequest(
                f"Content-Type {kind.decode('latin-1') or '(none)'!r} is not accepted; send the body as JSON with "
                "Content-Type: application/json.",
                None,
                415,
            )
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.settings.max_request_bytes:
            return too_large(int(length), self.settings)
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self.refusal(scope)
        if error is not None:
            self.metrics.reject(error.status)
            await error_response(error)(scope, receive, send)
            return
        started = False
        page = scope["path"] == "/"

        async def sending(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if page:
                    message = {**message, "headers": [*message.get("headers", []), *PAGE_HEADERS]}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:  # noqa: BLE001 - a fault of the server's own code: that request fails, the server answers on
            logger.exception("decodekit serve: %s %s failed", scope["method"], scope["path"])
            if started:  # a stream already under way: the client sees it end early
                return
            self.metrics.reject(500)
            error = BadRequest("The server failed on this request (its log says why).", None, 500, "server_error")
            await error_response(error)(scope, receive, send)


def create_app(manager, tokenizer, settings: ServerSettings, host: str | None = None) -> FastAPI:
    """The FastAPI app over a started (or externally run) manager and the model's tokenizer: one router per module
    (info, tokens, generation, playground) over what they share (served.Served); `host`, the address it listens on
    (a loopback one limits the Host names it answers)."""
    from .metrics import Metrics

    app = FastAPI(title="decodekit", version="1")
    metrics = app.state.metrics = Metrics(manager, settings.model_name)
    previous = manager.on_end
    manager.on_end = metrics.ended if previous is None else (lambda output: (previous(output), metrics.ended(output)))
    app.add_middleware(Guard, settings=settings, metrics=metrics, hosts=loopback_hosts(host))
    served = Served(manager, tokenizer, settings, metrics)
    for module in (info, tokens, generation, playground):
        app.include_router(module.router(served))
    return app
