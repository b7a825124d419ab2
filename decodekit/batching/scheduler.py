"""Which requests run in the next step, and how much of each.

Requests wait in arrival order until the runner can reserve their cache blocks (and fewer than `max_running`
run). A step then takes one token for every row of every decoding request, and fills the rest of its token
budget (`max_batch_tokens`, at least `min_prefill`) with chunks of prompts being prefilled, oldest first, so a
long prompt is spread over several steps instead of stalling the running requests for its whole length.
"""

from __future__ import annotations

from collections import deque

from .request import Request, RequestStatus
from .runner import Work


class Scheduler:
    def __init__(self, runner, max_batch_tokens: int, max_running: int, min_prefill: int):
        self.runner = runner
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.min_prefill = min_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running and self.runner.admit(self.waiting[0]):
            request = self.waiting.popleft()
            request.status = RequestStatus.PREFILLING
            self.running.append(request)

    def plan(self) -> list[Work]:
        works = [Work(r) for r in self.running if r.status == RequestStatus.DECODING]
        budget = max(self.max_batch_tokens - sum(w.tokens for w in works), self.min_prefill)
        for r in self.running:
            if budget <= 0:
                break
            if r.status == RequestStatus.PREFILLING:
                end = min(r.prompt_length, r.prefilled + budget)
                works.append(Work(r, r.prefilled, end))
                budget -= end - r.prefilled
        return works

    def remove(self, request: Request) -> None:
        """Takes a request out (finished, cancelled or failed) and frees its blocks."""
        if request in self.running:
            self.running.remove(request)
            self.runner.release(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
