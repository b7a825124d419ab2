"""Stopping criteria: the stopping hook point.

One protocol: a criterion is a callable `(input_ids [B, T], scores [B, V]) -> done [B] (bool)`.
A row is finished once any criterion says so; finished rows are padded until every row is.
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class StoppingCriteria(Protocol):
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.BoolTensor: ...


class StoppingCriteriaList(list):
    """Done where any of its criteria is done.

    Each criterion may be tagged with the plugin that contributed it (`extend_from`). Eager calls check what each
    returns (a bool tensor [batch] on the ids' device, or one Python bool for every row, as transformers' older
    criteria return): a tensor of another shape would be broadcast and stop rows it never judged. A wrong output or
    an exception raises PluginError naming the criterion, its plugin and the position, and an installed or
    run-time plugin is disabled for the process (the registry's on_failure), as a processor's is.
    """

    def extend_from(self, owner: str, criteria) -> None:
        criteria = list(criteria)
        self.extend(criteria)
        self.__dict__.setdefault("owners", {}).update((id(c), owner) for c in criteria)

    def owner_of(self, criterion) -> str | None:
        return self.__dict__.get("owners", {}).get(id(criterion))

    def describe(self, criterion) -> str:
        from ..registry.manager import described

        return described("stopping criterion", criterion, self.owner_of(criterion))

    def __call__(self, input_ids, scores):
        from ..registry.manager import guarded

        B, position = input_ids.shape[0], input_ids.shape[-1]
        compiling = torch.compiler.is_compiling()
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        for criterion in self:
            if compiling:
                said = criterion(input_ids, scores)
            else:
                said = guarded(
                    "stopping criterion",
                    self.owner_of(criterion),
                    criterion,
                    lambda: criterion(input_ids, scores),
                    lambda said: self._check_output(criterion, said, input_ids),
                    position,
                )
            done = done | said
        return done

    def _check_output(self, criterion, said, input_ids) -> None:
        """A bool tensor [batch] on the ids' device, or one Python bool for every row."""
        from ..registry.manager import PluginError, returned

        B = input_ids.shape[0]
        if isinstance(said, bool) or (
            isinstance(said, torch.Tensor)
            and tuple(said.shape) == (B,)
            and said.dtype == torch.bool
            and said.device == input_ids.device
        ):
            return
        raise PluginError(
            f"{self.describe(criterion)} returned {returned(said)} at position {input_ids.shape[-1]}"
            f"; a criterion returns done [batch] = [{B}], a bool tensor on {input_ids.device}."
        )

    @property
    def max_length(self) -> int | None:
        """The length a criterion declares it ends every row at (ends_at_length), or None."""
        for criterion in self:
            length = getattr(criterion, "ends_at_length", None)
            if length is not None:
                return length
        return None


class MaxLengthCriteria:
    """Done when the sequence, prompt included, has `max_length` tokens. `max_position_embeddings`, where given,
    is the model's context: going past it logs a warning once, as transformers does.

    Declares `ends_at_length` (its max_length): a compiled step, which ends at the call's length on the device, stands
    for it where that is no later. EosTokenCriteria declares `ends_at_tokens`, the same for the call's EOS tokens, and
    StopStringCriteria `ends_at_strings` with `ends_row(tokens)`, its decision from a row's tokens on the host."""

    def __init__(self, max_length: int, max_position_embeddings: int | None = None):
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length={max_length!r} is invalid; expected an integer >= 1.")
        self.max_length, self.max_position_embeddings = max_length, max_position_embeddings
        self._warned = False

    @property
    def ends_at_length(self) -> int:
        return self.max_length

    def __call__(self, input_ids, scores):
        length, context = input_ids.shape[1], self.max_position_embeddings
        if context is not None and length > context and length < self.max_length and not self._warned:
            self._warned = True
            warnings.warn(
                f"the sequence ({length} tokens) is past the model's context of {context} positions; "
                "what follows may be garbage or fail.",
                UserWarning,
                stacklevel=2,
            )
        return torch.full((input_ids.shape[0],), length >= self.max_length, device=input_ids.device)


class EosTokenCriteria:
    """Done when the last token is one of `eos_token_id` (an int or a list)."""

    def __init__(self, eos_token_id: int | Sequence[int]):
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if not ids:
            raise ValueError("eos_token_id is empty; expected a token id or a non-empty list of them.")
        self.eos = torch.tensor(ids, dtype=torch.long)
        self.ends_at_tokens = tuple(ids)

    def __call__(self, input_ids, scores):
        self.eos = self.eos.to(input_ids.device)
        return torch.isin(input_ids[:, -1], self.eos)


class MaxTimeCriteria:
    """Done for every row once `max_time` seconds have passed since `initial_timestamp` (a time.time() value;
    default: construction)."""

    def __init__(self, max_time: float, initial_timestamp: float | None = None):
        if not isinstance(max_time, (int, float)) or max_time <= 0:
            raise ValueError(f"max_time={max_time!r} is invalid; expected a number of seconds > 0.")
        self.max_time = float(max_time)
        self.initial_timestamp = time.time() if initial_timestamp is None else initial_timestamp

    def __call__(self, input_ids, scores):
        expired = time.time() - self.initial_timestamp > self.max_time
        return torch.full((input_ids.shape[0],), expired, device=input_ids.device)


class ConfidenceCriteria:
    """Done when the newest token's probability under the scores that chose it is below
    `assistant_confidence_threshold`: an assistant model stops drafting where it is unsure. `scores` is a
    tensor [batch, vocab] or a tuple of them (the last is read), as transformers passes; the first row decides."""

    def __init__(self, assistant_confidence_threshold: float):
        value = assistant_confidence_threshold
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
            raise ValueError(f"assistant_confidence_threshold={value!r} is invalid; expected a number in [0, 1].")
        self.assistant_confidence_threshold = float(value)

    def __call__(self, input_ids, scores):
        last = scores[-1] if isinstance(scores, (tuple, list)) else scores
        p = float(last[0].softmax(-1)[input_ids[0, -1]])
        return torch.full((input_ids.shape[0],), p < self.assistant_confidence_threshold, device=input_ids.device)


def byte_level_decoder() -> dict[str, int]:
    """{character: byte} of the byte-level alphabet of GPT-2's BPE (and SmolLM2's, Llama 3's): bytes that print as
    themselves keep their character, the others take the characters from U+0100 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def validate_stopping_criteria(stopping_criteria: StoppingCriteriaList, max_length: int) -> StoppingCriteriaList:
    """A copy of `stopping_criteria` that stops at `max_length`: a MaxLengthCriteria is added where there is none;
    one with another length stays and a UserWarning says so (transformers' behaviour)."""
    found = stopping_criteria.max_length
    checked = copy.deepcopy(stopping_criteria)
    if found is None:
        checked.append(MaxLengthCriteria(max_length))
    elif found != max_length:
        warnings.warn(
            f"the stopping criteria stop at max_length={found}, the call's max_length is {max_length}.",
            UserWarning,
            stacklevel=2,
        )
    return checked


class StopStringCriteria:
    """Done when the newest token completes one of `stop_strings`, even if the string spans several tokens.

    Only an occurrence that ends inside the newest token counts, so a stop string already in the
    prompt never stops generation. The token may run past the end of the string (" Paris." stops "Paris").
    """

    def __init__(self, tokenizer, stop_strings: str | Sequence[str]):
        strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(
                f"stop_strings={stop_strings!r} is invalid; expected a non-empty string or a list of them."
            )
        self.tokenizer = tokenizer
        self.stop_strings = strings
        # A token decodes to at least one byte, a character is at most four: this many tokens always
        # cover the longest stop string plus the newest token.
        self.window = 4 * max(len(s) for s in strings) + 1

    @property
    def ends_at_strings(self) -> tuple[str, ...]:
        """Declares that it decides from a row's tokens on the host (ends_row): continuous batching's one-pass
        sampler decides it there without the request's own step."""
        return tuple(self.stop_strings)

    def __call__(self, input_ids, scores):
        done = [self.ends_row(row) for row in input_ids[:, -self.window :].tolist()]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    def ends_row(self, tokens: list[int]) -> bool:
        """Whether the newest of a row's tokens (a list, the newest last; only the last `window` are read)
        completes a stop string."""
        row = tokens[-self.window :]
        before = self.tokenizer.decode(row[:-1])
        text = self.tokenizer.decode(row)
        # The prefix decodes to the same characters unless a multi-byte character was split;
        # count from the common prefix so a completed character is treated as new text.
        common = 0
        while common < min(len(before), len(text)) and before[common] == text[common]:
            common += 1
        return any(self._ends_in_new_text(text, s, common) for s in self.stop_strings)

    @staticmethod
    def clean_tokenizer_vocab(tokenizer, static_prefix: str = "abcdef", stop_string_matching_mode=None):
        """(token strings, token ids) of the whole vocabulary, as tuples: each token as the text it adds after
        `static_prefix`, so a word-start marker reads as a space and no prefix-space rule of the tokenizer's leaks
        in. With a `stop_string_matching_mode` ("byte_level", "byte_fallback": _get_stop_string_matching_mode) each
        token is its bytes instead, so a fragment of a character is kept whole (as transformers' method of that name)."""
        base = tokenizer.convert_ids_to_tokens(tokenizer(static_prefix, add_special_tokens=False)["input_ids"])
        decoder = byte_level_decoder() if stop_string_matching_mode == "byte_level" else None
        tokens, indices = [], []
        for token, index in tokenizer.get_vocab().items():
            clean = StopStringCriteria._token_to_bytes(token, stop_string_matching_mode, decoder)
            if clean is None:
                text = tokenizer.convert_tokens_to_string(list(base) + [token])
                clean = text[text.index(static_prefix) + len(static_prefix) :]
                clean = clean.encode("utf-8") if stop_string_matching_mode is not None else clean
            tokens.append(clean)
            indices.append(index)
        return tuple(tokens), tuple(indices)

    @staticmethod
    def _get_stop_string_matching_mode(tokenizer) -> str | None:
        """How a tokenizer's tokens map to text, for matching stop strings: "byte_level" (GPT-2's byte alphabet),
        "byte_fallback" (`<0xNN>` tokens for bytes) or None (tokens are text), read from its decoder."""
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        if decoder is None:
            return None
        if type(decoder).__name__ == "ByteLevel":
            return "byte_level"
        try:
            state = json.loads(decoder.__getstate__())
        except (AttributeError, TypeError, ValueError):
            return None
        types = set()
        stack = [state]
        while stack:  # every "type" anywhere in the decoder's state (a Sequence nests its decoders)
            item = stack.pop()
            if isinstance(item, dict):
                types.add(item.get("type"))
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
        return "byte_fallback" if "ByteFallback" in types else "byte_level" if "ByteLevel" in types else None

    @staticmethod
    def _token_to_bytes(token: str, stop_string_matching_mode, byte_decoder) -> bytes | None:
        """The bytes `token` stands for in a byte-level vocabulary (each character one byte of `byte_decoder`) or as
        a byte-fallback token (`<0xNN>`), else None (the token is to be read as text)."""
        if stop_string_matching_mode == "byte_level":
            if byte_decoder is not None and all(char in byte_decoder for char in token):
                return bytes(byte_decoder[char] for char in token)
        elif stop_string_matching_mode == "byte_fallback":
            digits = token[3:5]
            if (
                len(token) == 6
                and token.startswith("<0x")
                and token.endswith(">")
                and all(char in "0123456789abcdefABCDEF" for char in digits)
            ):
                return bytes([int(digits, 16)])
        return None

    @staticmethod
    def _stop_string_create_embedding_vec(token_list, token_indices, stop_strings):
        """(table, most positions, most end lengths): the matching tables (_stop_string_get_matching_positions) as
        one int32 tensor a step can gather from, a row per token id and one more for ids past the vocabulary (-1
        everywhere): per stop string its positions, then per stop string its end lengths, each padded with -1 to
        the most any token has, and last the token's length. Laid out as transformers' vectorized matcher reads it."""
        positions, ends = StopStringCriteria._stop_string_get_matching_positions(
            token_list, token_indices, stop_strings
        )
        most_positions = max((len(p) for table in positions.values() for p in table.values()), default=1)
        most_ends = max((len(e) for table in ends.values() for e in table.values()), default=0)
        if not most_ends:
            raise ValueError(
                f"stop_strings={list(stop_strings)!r}: no token of the vocabulary can end any of them "
                "(characters the vocabulary does not have?)."
            )
        n = len(stop_strings)
        table = torch.full((max(token_indices) + 2, n * (most_positions + most_ends) + 1), -1, dtype=torch.int32)
        for i, stop in enumerate(stop_strings):
            for index, found in positions[stop].items():
                table[index, most_positions * i : most_positions * i + len(found)] = torch.tensor(found)
            start = most_positions * n + most_ends * i
            for index, found in ends[stop].items():
                table[index, start : start + len(found)] = torch.tensor(found)
        for token, index in zip(token_list, token_indices):
            table[index, -1] = len(token)
        return table, most_positions, most_ends

    @staticmethod
    def _stop_string_get_matching_positions(token_list, token_indices, stop_strings):
        """Per stop string, per token id: the positions i > 0 such that the token, ending i characters before the
        string's end, agrees with the string wherever they overlap (it may start before the string), and the
        lengths by which a token ending at or past the string's end covers it (one per number of characters past
        the end, the most first). Tokens with neither are left out. The tables transformers' vectorized matcher is
        built from, the same values, for code written against it."""
        positions: dict = {}
        overlaps: dict = {}
        for stop in stop_strings:
            positions[stop], overlaps[stop] = {}, {}
            for token, index in zip(token_list, token_indices):
                ends = []
                for past in range(len(token) - 1, -1, -1):  # characters of the token past the string's end
                    kept = token[: len(token) - past]
                    m = min(len(kept), len(stop))
                    if kept[len(kept) - m :] == stop[len(stop) - m :]:
                        ends.append(m)
                inside = []
                for i in range(1, len(stop)):
                    end = len(stop) - i
                    m = min(len(token), end)
                    if token[len(token) - m :] == stop[end - m : end]:
                        inside.append(i)
                if inside:
                    positions[stop][index] = inside
                if ends:
                    overlaps[stop][index] = ends
        return positions, overlaps

    @staticmethod
    def _ends_in_new_text(text: str, stop: str, new_from: int) -> bool:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        return start != -1 and start + len(stop) > new_from
