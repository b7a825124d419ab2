"""`decodekit serve`: an OpenAI-compatible HTTP server over continuous batching (app.py holds the API).

The HTTP side (uvicorn, FastAPI) runs in a background thread and the model's steps in the thread that calls
`Server.run_steps()` (the main thread for `decodekit serve`): on CPU, torch work belongs in one thread (see
ContinuousBatchingManager.run). Needs the `serve` extra: pip install 'decodekit[serve]'.
"""

from __future__ import annotations

import importlib.util
import logging
import socket
import threading
import time

logger = logging.getLogger("decodekit")

for _module in ("fastapi", "uvicorn"):
    if importlib.util.find_spec(_module) is None:
        raise ImportError(f"decodekit serve needs {_module}, which is not installed: pip install 'decodekit[serve]'")

import uvicorn  # noqa: E402

from .app import create_app  # noqa: E402
from .protocol import ServerSettings  # noqa: E402


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, not yet listening: `decodekit serve` binds before it loads and compiles the
    model, so a bad --host or --port fails at once. OSError with a sentence naming the address otherwise."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise OSError(f"--port {port!r} is invalid; expected an integer in [0, 65535] (0: a free port).")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise OSError(f"--host {host!r} is not an address of this machine or a name that resolves ({error}).") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port}: {error.strerror or error} (is the port in use, or the address "
            "not this machine's?)."
        ) from None
    return sock


class Server:
    """The HTTP server of `manager` on host:port (port 0: a free one, read back from `port` after start()), or
    on `sock`, a socket bind() made."""

    def __init__(
        self,
        manager,
        tokenizer,
        settings: ServerSettings,
        host: str = "127.0.0.1",
        port: int = 8000,
        sock: socket.socket | None = None,
    ):
        self.manager = manager
        self.app = create_app(manager, tokenizer, settings, host=host)
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.host, self.port, self.sock = host, port, sock
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "Server":
        """Starts answering HTTP (in a background thread) and returns once the socket listens."""
        sockets = [self.sock] if self.sock is not None else None
        self.thread = threading.Thread(target=self.server.run, args=(sockets,), name="decodekit-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP server did not start on {self.host}:{self.port} (is the port in use?)")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def run_steps(self) -> None:
        """The model's steps in this thread until stop() (or Ctrl-C)."""
        try:
            self.manager.run()
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def stop(self) -> None:
        self.manager.stop(block=False)
        self.server.should_exit = True
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)


def allowed_methods(specs: list[str]) -> dict:
    """{spec: LoadedMethod} for the operator's `--method SPEC@REVISION` entries, through the trust gate at the
    pinned revision; hook-only methods only (they run side by side in one batch)."""
    from ..hub_loader.method import load_pinned

    return load_pinned(specs, "--method", "the server")


__all__ = ["Server", "ServerSettings", "allowed_methods", "bind", "create_app"]
