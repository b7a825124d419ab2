"""What the command line shows on the terminal: status lines, the spinner, --stats, and Ctrl-C's handling."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time


def status(line: str) -> None:
    """A line on stderr saying what a long step is doing (or took), shown at once."""
    print(line, file=sys.stderr, flush=True)


class Stats:
    """A streamer in front of the real one (or none): when the first generated token and the last arrived.
    `on_first` runs once before generated tokens are passed on; with `hold`, the first `hold` tokens are kept back
    until one more arrives (with compile=True the first comes from the eager prefill, the next after the compile)."""

    def __init__(self, inner=None, on_first=None, hold: int = 0):
        self.inner, self.on_first, self.hold = inner, on_first, hold
        self.prompt_seen = False
        self.first = self.last = None
        self.tokens = 0
        self.held: list | None = []

    def put(self, value) -> None:

        if not self.prompt_seen:
            self.prompt_seen = True
            self._pass(value)
            return
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now
        self.tokens += value.numel()
        if self.held is None:
            self._pass(value)
            return
        self.held.append(value)
        if len(self.held) > self.hold:
            self._release()

    def _release(self) -> None:
        held, self.held = self.held or [], None
        if self.on_first is not None:
            self.on_first()
        for value in held:
            self._pass(value)

    def _pass(self, value) -> None:
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.held is not None:
            self._release()
        if self.inner is not None:
            self.inner.end()


class Spinner:
    """A turning mark after `message` on `stream` while something slow runs (a compile, a kernel build); stop()
    clears the line. For terminals only: a log or a pipe gets one plain line instead."""

    FRAMES = "|/-\\"

    def __init__(self, message: str, stream=None, interval: float = 0.1):
        import threading

        self.message, self.stream, self.interval = message, stream or sys.stderr, interval
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._turn, daemon=True)

    def start(self) -> "Spinner":
        self.thread.start()
        return self

    def _turn(self) -> None:
        frame = 0
        while not self.done.is_set():
            self.stream.write(f"\r{self.message} {self.FRAMES[frame % len(self.FRAMES)]}")
            self.stream.flush()
            frame += 1
            self.done.wait(self.interval)

    def stop(self) -> None:
        if self.done.is_set():
            return
        self.done.set()
        self.thread.join()
        self.stream.write("\r" + " " * (len(self.message) + 2) + "\r")
        self.stream.flush()


def weights_line(model) -> str:
    """--stats: the formats the model's weights are held in and their bytes (decodekit's own models)."""
    from ..kernels.blocks import weight_formats
    from ..sizes import human_size

    formats = weight_formats(model.module)
    parts = [f"{name} {human_size(size)}" for name, size in sorted(formats.items(), key=lambda kv: -kv[1])]
    return f"weights: {human_size(sum(formats.values()))} ({', '.join(parts)})"


def stats_line(new: int, began: float, loaded: float, done: float, stats) -> str:
    """--stats: the load time, the tokens and their rate, and where a stream was watched, the first token's wait
    and the rate after it."""
    line = f"stats: load {loaded - began:.2f} s; {new} tokens in {done - loaded:.2f} s"
    line += f" ({new / max(done - loaded, 1e-9):.1f} tokens/s)"
    if stats is not None and stats.first is not None:
        line += f"; first token after {stats.first - loaded:.2f} s"
        if stats.tokens > 1:
            line += f", then {(stats.tokens - 1) / max(stats.last - stats.first, 1e-9):.1f} tokens/s"
    return line


def stopped() -> int:
    """The exit code of a run stopped by Ctrl-C, 130; a second Ctrl-C while the process winds down is ignored."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return 130


@contextlib.contextmanager
def interrupt_deferred():
    """Ctrl-C inside the block is held until it ends, then raised: a KeyboardInterrupt that lands inside an extension
    module's initialisation (torch's import) was swallowed by a destructor, or killed the process at exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt
