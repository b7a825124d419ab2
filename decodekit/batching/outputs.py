"""One request's outputs: the one place the stepping thread puts them, and whoever added the request reads them."""

from __future__ import annotations

import logging
import queue
from typing import Any

logger = logging.getLogger("decodekit")


class RequestOutputs:
    """A request's outputs in order, each with every token so far (a streaming request's at every step, any
    request's final one last). Read from `queue` (get_result, request_id_iter), or handed to `listener` as they come
    (the server's event loop), which must return quickly: it runs in the stepping thread, and what it raises is
    logged, never let out to stop the steps."""

    def __init__(self, streaming: bool, listener: Any = None):
        self.streaming, self.listener = streaming, listener
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def check_read(self, reader: str, request_id: str) -> None:
        """ValueError where `reader` ("get_result" or "request_id_iter") would wait for outputs that go elsewhere: to
        the listener, or, for get_result, to the stream a streaming request is read from."""
        if self.listener is not None:
            raise ValueError(f"Request {request_id!r} hands its outputs to its listener; {reader}() has none to read.")
        if self.streaming and reader == "get_result":
            raise ValueError(f"Request {request_id!r} streams: read its outputs with request_id_iter().")

    def put(self, output) -> None:
        if self.listener is None:
            self.queue.put(output)
            return
        try:
            self.listener(output)
        except Exception:
            logger.exception("continuous batching: the listener of request %s raised", output.request_id)
