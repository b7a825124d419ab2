"""Stopping criteria: the stopping hook point.

One protocol: a criterion is a callable `(input_ids [B, T], scores [B, V]) -> done [B] (bool)`.
A row is finished once any criterion says so; finished rows are padded until every row is.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class StoppingCriteria(Protocol):
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.BoolTensor: ...


class StoppingCriteriaList(list):
    """Done where any of its criteria is done."""

    def __call__(self, input_ids, scores):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for criterion in self:
            done = done | criterion(input_ids, scores)
        return done

    @property
    def max_length(self) -> int | None:
        for criterion in self:
            if isinstance(criterion, MaxLengthCriteria):
                return criterion.max_length
        return None


class MaxLengthCriteria:
    """Done when the sequence, prompt included, has `max_length` tokens."""

    def __init__(self, max_length: int):
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length={max_length!r} is invalid; expected an integer >= 1.")
        self.max_length = max_length

    def __call__(self, input_ids, scores):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.max_length, device=input_ids.device)


class EosTokenCriteria:
    """Done when the last token is one of `eos_token_id` (an int or a list)."""

    def __init__(self, eos_token_id: int | Sequence[int]):
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if not ids:
            raise ValueError("eos_token_id is empty; expected a token id or a non-empty list of them.")
        self.eos = torch.tensor(ids, dtype=torch.long)

    def __call__(self, input_ids, scores):
        self.eos = self.eos.to(input_ids.device)
        return torch.isin(input_ids[:, -1], self.eos)


class MaxTimeCriteria:
    """Done for every row once `max_time` seconds have passed since `start` (default: construction)."""

    def __init__(self, max_time: float, start: float | None = None):
        if not isinstance(max_time, (int, float)) or max_time <= 0:
            raise ValueError(f"max_time={max_time!r} is invalid; expected a number of seconds > 0.")
        self.max_time = float(max_time)
        self.start = time.monotonic() if start is None else start

    def __call__(self, input_ids, scores):
        expired = time.monotonic() - self.start > self.max_time
        return torch.full((input_ids.shape[0],), expired, device=input_ids.device)


class StopStringCriteria:
    """Done when the newest token completes one of `stop_strings`, even if the string spans several tokens.

    Only an occurrence that ends inside the newest token counts, so a stop string already in the
    prompt never stops generation. The token may run past the end of the string (" Paris." stops "Paris").
    """

    def __init__(self, tokenizer, stop_strings: str | Sequence[str]):
        strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop_strings={stop_strings!r} is invalid; expected a non-empty string or a list of them.")
        self.tokenizer = tokenizer
        self.stop_strings = strings
        # A token decodes to at least one byte, a character is at most four: this many tokens always
        # cover the longest stop string plus the newest token.
        self.window = 4 * max(len(s) for s in strings) + 1

    def __call__(self, input_ids, scores):
        done = []
        for row in input_ids[:, -self.window :].tolist():
            before = self.tokenizer.decode(row[:-1])
            text = self.tokenizer.decode(row)
            # The prefix decodes to the same characters unless a multi-byte character was split;
            # count from the common prefix so a completed character is treated as new text.
            common = 0
            while common < min(len(before), len(text)) and before[common] == text[common]:
                common += 1
            done.append(any(self._ends_in_new_text(text, s, common) for s in self.stop_strings))
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    @staticmethod
    def _ends_in_new_text(text: str, stop: str, new_from: int) -> bool:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        return start != -1 and start + len(stop) > new_from
