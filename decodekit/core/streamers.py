"""Streamers: generate() calls `put(tokens)` with the prompt first, then each new token, and `end()` once.

Any object with those two methods works. The two here print text, or hand it to another thread,
as soon as it is final: a word is held back until it ends, so tokens that merge are never shown twice.
"""

from __future__ import annotations

import sys
from queue import Queue
from typing import TextIO


class TextStreamer:
    """Decodes tokens as they arrive and writes finished text to `file` (stdout). Batch size 1 only.

    `skip_prompt=True` leaves the prompt out; `decode_kwargs` go to `tokenizer.decode`
    (e.g. skip_special_tokens=True).
    """

    def __init__(self, tokenizer, skip_prompt: bool = False, file: TextIO | None = None, **decode_kwargs):
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.file = file
        self.decode_kwargs = decode_kwargs
        self.tokens: list[int] = []
        self.printed = 0
        self.next_is_prompt = True

    def put(self, value) -> None:
        if value.dim() > 1:
            if value.shape[0] > 1:
                raise ValueError("TextStreamer only supports batch size 1.")
            value = value[0]
        if self.next_is_prompt:
            self.next_is_prompt = False
            if self.skip_prompt:
                return
        self.tokens.extend(value.tolist())
        text = self.tokenizer.decode(self.tokens, **self.decode_kwargs)
        if text.endswith("\n"):
            ready, self.tokens, self.printed = text[self.printed :], [], 0
        elif text.endswith("\ufffd"):
            return  # half of a multi-byte character: wait for the rest
        else:
            ready = text[self.printed : text.rfind(" ") + 1]
            self.printed += len(ready)
        if ready:
            self.on_text(ready)

    def end(self) -> None:
        if self.tokens:
            text = self.tokenizer.decode(self.tokens, **self.decode_kwargs)
            ready = text[self.printed :]
        else:
            ready = ""
        self.tokens, self.printed, self.next_is_prompt = [], 0, True
        self.on_text(ready, stream_end=True)

    def on_text(self, text: str, stream_end: bool = False) -> None:
        out = self.file or sys.stdout
        print(text, end="" if not stream_end else "\n", file=out, flush=True)


class TextIteratorStreamer(TextStreamer):
    """Makes the text an iterator for another thread: run generate() in a thread, iterate here.

    `timeout` (seconds) bounds each wait; queue.Empty is raised when it passes.
    """

    def __init__(self, tokenizer, skip_prompt: bool = False, timeout: float | None = None, **decode_kwargs):
        super().__init__(tokenizer, skip_prompt, **decode_kwargs)
        self.queue: Queue = Queue()
        self.timeout = timeout
        self._stop = object()

    def on_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.queue.put(text)
        if stream_end:
            self.queue.put(self._stop)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        item = self.queue.get(timeout=self.timeout)
        if item is self._stop:
            raise StopIteration
        return item
