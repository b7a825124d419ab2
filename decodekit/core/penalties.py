"""The penalties, bans, biases and forced tokens: processors that read the sequence so far (repetition and n-gram
penalties, bad words, sequence bias, minimum length, forced BOS/EOS, ...), each on core.processors' Processor base,
taking transformers' constructor arguments under transformers' names."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .processors import NEG_INF, Processor, check_setting, token_ids


class ExponentialDecayLengthPenalty(Processor):
    """After `start` generated tokens (of a prompt of `input_ids_seq_length`), raises the EOS scores by
    |score| * (factor ** steps_past_start - 1), so EOS grows likelier without a hard cutoff.
    `exponential_decay_length_penalty` = (start: int >= 0, factor: number > 0)."""

    def __init__(self, exponential_decay_length_penalty, eos_token_id, input_ids_seq_length: int):
        start, self.factor = exponential_decay_length_penalty
        self.start = start + input_ids_seq_length
        self.eos = token_ids(eos_token_id)

    def __call__(self, input_ids, scores):
        past = input_ids.shape[1] - self.start
        if past <= 0:
            return scores
        eos = scores[:, self.eos]
        boost = (eos.abs() * (self.factor**past - 1)).masked_fill(~torch.isfinite(eos), 0.0)
        scores = scores.clone()  # the caller's scores stay as they were, as in transformers
        scores[:, self.eos] = eos + boost
        return scores


class SuppressTokensAtBeginLogitsProcessor(Processor):
    """Sets the scores of `begin_suppress_tokens` to -inf at the first generated position only (the
    sequence is `begin_index` tokens long)."""

    def __init__(self, begin_suppress_tokens: Sequence[int], begin_index: int, device="cpu"):
        self.tokens = torch.tensor(token_ids(begin_suppress_tokens), dtype=torch.long, device=device)
        self.begin_index = begin_index

    def set_begin_index(self, begin_index: int) -> None:
        self.begin_index = begin_index

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] != self.begin_index:
            return scores
        return scores.index_fill(-1, self.tokens.to(scores.device), NEG_INF)


class PrefixConstrainedLogitsProcessor(Processor):
    """Allows only the tokens `prefix_allowed_tokens_fn(batch_id, sequence)` returns for each row: row r
    belongs to prompt r // num_beams (its beams), as in transformers. An empty list is an error."""

    def __init__(self, prefix_allowed_tokens_fn, num_beams: int = 1):
        self.fn, self.rows_per_prompt = prefix_allowed_tokens_fn, num_beams

    def __call__(self, input_ids, scores):
        allowed = torch.full_like(scores, NEG_INF)
        for row, sequence in enumerate(input_ids):
            returned = self.fn(row // self.rows_per_prompt, sequence)
            try:
                tokens = [int(t) for t in returned]
            except (TypeError, ValueError):
                raise TypeError(
                    f"prefix_allowed_tokens_fn returned {returned!r} for prompt {row // self.rows_per_prompt};"
                    " it must return a list of the token ids allowed next."
                ) from None
            if not tokens:
                raise ValueError(
                    f"prefix_allowed_tokens_fn returned no allowed token for prompt {row // self.rows_per_prompt} "
                    f"after {sequence.tolist()}; it must return at least one token id."
                )
            allowed[row, tokens] = 0
        return scores + allowed


class RepetitionPenaltyLogitsProcessor(Processor):
    """Penalises every token already in the sequence (prompt included): positive scores are divided by
    `penalty` (> 0), negative ones multiplied, so a penalty above 1 always makes a repeat less likely.

    `prompt_ignore_length`: the leading positions not counted: an int for every row, or a tensor [batch] of one
    per row (generate() passes each row's left padding, so a pad id is never penalised); None counts everything.
    Token ids past the scores' vocabulary (an embedding larger than the head) are skipped."""

    def __init__(self, penalty: float, prompt_ignore_length: int | torch.Tensor | None = None):
        check_setting(
            "repetition_penalty", penalty, isinstance(penalty, (int, float)) and penalty > 0, "expected a number > 0"
        )
        ignore = prompt_ignore_length
        check_setting(
            "prompt_ignore_length",
            ignore,
            ignore is None
            or (isinstance(ignore, int) and ignore >= 0)
            or (isinstance(ignore, torch.Tensor) and ignore.dim() == 1),
            "expected None, an integer >= 0 or a 1-D tensor of one per row",
        )
        self.penalty, self.prompt_ignore_length = float(penalty), ignore

    def __call__(self, input_ids, scores):
        vocab = scores.shape[-1]
        ignore = self.prompt_ignore_length
        if isinstance(ignore, int):
            input_ids = input_ids[:, ignore:]
        elif isinstance(ignore, torch.Tensor):
            if ignore.shape[0] != input_ids.shape[0]:
                raise ValueError(
                    f"prompt_ignore_length has {ignore.shape[0]} rows and input_ids {input_ids.shape[0]}; "
                    "expected one per row."
                )
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            input_ids = input_ids.masked_fill(positions < ignore.to(input_ids.device)[:, None], vocab)
        # One spare column takes the ids to skip (ignored positions, ids past the vocabulary), dropped afterwards.
        padded = torch.nn.functional.pad(scores, (0, 1))
        return _penalised(padded, input_ids.clamp(max=vocab), self.penalty)[:, :vocab]


def _penalised(scores: torch.Tensor, ids: torch.LongTensor, penalty: float) -> torch.Tensor:
    """`scores` with those of `ids` divided by `penalty` where positive and multiplied where negative."""
    seen = scores.gather(-1, ids)
    return scores.scatter(-1, ids, torch.where(seen < 0, seen * penalty, seen / penalty))


class EncoderRepetitionPenaltyLogitsProcessor(Processor):
    """Makes the tokens of `encoder_input_ids` [batch, length] (the source an encoder-decoder model reads) likelier
    to be copied: the hallucination penalty. Positive scores are multiplied by `penalty` (> 0), negative ones
    divided, the inverse of RepetitionPenaltyLogitsProcessor."""

    def __init__(self, penalty: float, encoder_input_ids: torch.LongTensor):
        check_setting(
            "encoder_repetition_penalty",
            penalty,
            isinstance(penalty, (int, float)) and penalty > 0,
            "expected a number > 0",
        )
        self.penalty, self.encoder_input_ids = 1 / float(penalty), encoder_input_ids

    def __call__(self, input_ids, scores):
        return _penalised(scores, self.encoder_input_ids.to(scores.device), self.penalty)


class FrequencyPresencePenaltyLogitsProcessor(Processor):
    """OpenAI's penalties, on the tokens generated so far (the prompt's are not counted): subtracts
    count * frequency_penalty + (count > 0) * presence_penalty from each token's score. Both in [-2, 2]; negative
    values encourage repeats. `prompt_length`: where the generated tokens start in input_ids."""

    def __init__(self, frequency_penalty: float, presence_penalty: float, prompt_length: int):
        for name, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
            check_setting(
                name,
                value,
                isinstance(value, (int, float)) and not isinstance(value, bool) and -2 <= value <= 2,
                "expected a number in [-2, 2]",
            )
        self.frequency, self.presence, self.prompt_length = (
            float(frequency_penalty),
            float(presence_penalty),
            prompt_length,
        )

    def __call__(self, input_ids, scores):
        generated = input_ids[:, self.prompt_length :]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add(-1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def _ngram_continuations(tokens: list[int], n: int) -> dict[tuple[int, ...], set[int]]:
    table: dict[tuple[int, ...], set[int]] = {}
    for i in range(len(tokens) - n + 1):
        table.setdefault(tuple(tokens[i : i + n - 1]), set()).add(tokens[i + n - 1])
    return table


class NoRepeatNGramLogitsProcessor(Processor):
    """Bans any token that would complete an n-gram of size `ngram_size` (>= 1) already in the sequence."""

    def __init__(self, ngram_size: int):
        check_setting(
            "no_repeat_ngram_size",
            ngram_size,
            isinstance(ngram_size, int) and ngram_size >= 1,
            "expected an integer >= 1",
        )
        self.n = ngram_size

    def __call__(self, input_ids, scores):
        return _ban_repeats(input_ids, scores, self.n, lambda row, tokens: _ngram_continuations(tokens, self.n))


def _ban_repeats(input_ids, scores, n: int, table_of) -> torch.Tensor:
    """`scores` with -inf for each row's tokens that follow its last n - 1 tokens in `table_of(row, tokens)` (an
    n-gram continuation table); the caller's scores stay as they were."""
    if input_ids.shape[1] + 1 < n:
        return scores
    processed = scores
    for row, tokens in enumerate(input_ids.tolist()):
        prefix = tuple(tokens[len(tokens) - n + 1 :]) if n > 1 else ()
        banned = table_of(row, tokens).get(prefix, ())
        if banned:
            processed = scores.clone() if processed is scores else processed
            processed[row, list(banned)] = NEG_INF
    return processed


def _ends_with(input_ids: torch.LongTensor, prefix: Sequence[int]) -> torch.BoolTensor:
    """Per row: does the sequence end with `prefix`? (An empty prefix always matches.)"""
    if not prefix:
        return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    if len(prefix) > input_ids.shape[1]:
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    tail = input_ids[:, -len(prefix) :]
    return (tail == torch.tensor(prefix, device=input_ids.device)).all(dim=-1)


class EncoderNoRepeatNGramLogitsProcessor(Processor):
    """Bans any token that would repeat an n-gram of size `encoder_ngram_size` (>= 1) of `encoder_input_ids`
    [batch or 1, length] (an encoder-decoder model's source) in the generated sequence."""

    def __init__(self, encoder_ngram_size: int, encoder_input_ids: torch.LongTensor):
        check_setting(
            "encoder_no_repeat_ngram_size",
            encoder_ngram_size,
            isinstance(encoder_ngram_size, int) and encoder_ngram_size >= 1,
            "expected an integer >= 1",
        )
        if encoder_input_ids.dim() == 1:
            encoder_input_ids = encoder_input_ids[None]
        self.n = encoder_ngram_size
        self.tables = [_ngram_continuations(row, self.n) for row in encoder_input_ids.tolist()]

    def __call__(self, input_ids, scores):
        per_table = max(input_ids.shape[0] // len(self.tables), 1)  # beams of one source share its table
        return _ban_repeats(
            input_ids, scores, self.n, lambda row, tokens: self.tables[min(row // per_table, len(self.tables) - 1)]
        )


class SequenceBiasLogitsProcessor(Processor):
    """Adds a bias to the last token of each given sequence when the text so far ends with the rest of it.

    `sequence_bias`: {(token, ...): bias} or [[[token, ...], bias], ...]. A one-token sequence is always biased.
    """

    def __init__(self, sequence_bias):
        items = sequence_bias.items() if isinstance(sequence_bias, dict) else sequence_bias
        self.biases = [(tuple(int(t) for t in seq), float(b)) for seq, b in items]
        check_setting(
            "sequence_bias", sequence_bias, all(len(s) > 0 for s, _ in self.biases), "sequences must be non-empty"
        )

    def __call__(self, input_ids, scores):
        bias = torch.zeros_like(scores)
        for seq, b in self.biases:
            match = _ends_with(input_ids, seq[:-1])
            bias[:, seq[-1]] += match.to(scores.dtype) * b
        return scores + bias


class NoBadWordsLogitsProcessor(Processor):
    """Never generates any of `bad_words_ids` (a list of token-id lists): a sequence's last token is banned
    when the text ends with the rest of it. EOS ids are never banned, as the reference does."""

    def __init__(self, bad_words_ids: Iterable[Sequence[int]], eos_token_id: int | Sequence[int] | None = None):
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        self.words = [tuple(w) for w in bad_words_ids if not (len(w) == 1 and w[0] in eos)]
        check_setting(
            "bad_words_ids", bad_words_ids, all(len(w) > 0 for w in self.words), "token lists must be non-empty"
        )

    def __call__(self, input_ids, scores):
        if self.words:
            scores = scores.clone()  # the caller's scores stay as they were, as in transformers
        for word in self.words:
            match = _ends_with(input_ids, word[:-1])
            scores[:, word[-1]] = torch.where(match, NEG_INF, scores[:, word[-1]])
        return scores


class SuppressTokensLogitsProcessor(Processor):
    """Sets the scores of `suppress_tokens` to -inf at every step."""

    score_only = True

    def __init__(self, suppress_tokens: Sequence[int], device="cpu"):
        self.token_ids = tuple(token_ids(suppress_tokens))
        self.tokens = torch.tensor(self.token_ids, dtype=torch.long, device=device)

    def key(self) -> tuple:
        return (type(self).__qualname__, self.token_ids)

    def __call__(self, input_ids, scores):
        return scores.index_fill(-1, self.tokens.to(scores.device), NEG_INF)


class MinLengthLogitsProcessor(Processor):
    """Forbids EOS until the sequence (prompt included) is `min_length` tokens long."""

    def __init__(self, min_length: int, eos_token_id, device="cpu"):
        check_setting(
            "min_length", min_length, isinstance(min_length, int) and min_length >= 0, "expected an integer >= 0"
        )
        self.min_length = min_length
        self.eos = token_ids(eos_token_id)

    @property
    def blocks_eos_until(self) -> int:
        return self.min_length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] < self.min_length:
            scores = scores.clone()  # the caller's scores stay as they were, as in transformers
            scores[:, self.eos] = NEG_INF
        return scores


class MinNewTokensLengthLogitsProcessor(MinLengthLogitsProcessor):
    """Forbids EOS until `min_new_tokens` tokens have been generated after a prompt of `prompt_length_to_skip`."""

    def __init__(self, prompt_length_to_skip: int, min_new_tokens: int, eos_token_id, device="cpu"):
        check_setting(
            "min_new_tokens",
            min_new_tokens,
            isinstance(min_new_tokens, int) and min_new_tokens >= 0,
            "expected an integer >= 0",
        )
        super().__init__(prompt_length_to_skip + min_new_tokens, eos_token_id)
        self.prompt_length_to_skip, self.min_new_tokens = prompt_length_to_skip, min_new_tokens


def _force(scores: torch.FloatTensor, token_ids: Sequence[int]) -> torch.FloatTensor:
    forced = torch.full_like(scores, NEG_INF)
    forced[:, list(token_ids)] = 0
    return forced


class ForcedBOSTokenLogitsProcessor(Processor):
    """Makes `bos_token_id` the token after a sequence of one token (a decoder start token), as transformers does;
    after a longer prompt it does nothing."""

    def __init__(self, bos_token_id: int):
        self.bos = bos_token_id

    def __call__(self, input_ids, scores):
        return _force(scores, [self.bos]) if input_ids.shape[1] == 1 else scores


class ForcedEOSTokenLogitsProcessor(Processor):
    """Forces an EOS token as the last token when the sequence reaches `max_length`."""

    def __init__(self, max_length: int, eos_token_id, device="cpu"):
        self.max_length = max_length
        self.eos = token_ids(eos_token_id)

    def __call__(self, input_ids, scores):
        return _force(scores, self.eos) if input_ids.shape[1] == self.max_length - 1 else scores
