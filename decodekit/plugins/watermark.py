"""Text watermarks, as `watermarking_config=`: the green list (Kirchenbauer et al., 2023) and SynthID Text
(Dathathri et al., 2024).

Green list: `WatermarkingConfig(...)` biases a pseudo-random "green" part of the vocabulary at every step, and
`WatermarkDetector` finds the excess of green tokens in a text.

The green list of a step is a permutation of the vocabulary drawn from a seed that hashes the previous
tokens ("lefthash": the last token; "selfhash": the context and the candidate token itself, checked for the
40 most likely candidates), with the same seeding and the same draws as transformers' WatermarkLogitsProcessor,
so that text watermarked by either is detected by either's detector.

SynthID: `SynthIDTextWatermarkingConfig(keys=[...], ngram_len=...)` reweights the distribution by tournament
over pseudo-random g-values of each candidate n-gram, one round per key, skipping contexts already seen; the
same hashing and g-value table as transformers' SynthIDTextWatermarkLogitsProcessor, so the scores equal
theirs. `SynthIDTextWatermarkDetector` scores a text by its mean g-value against the 0.5 of text without
the watermark (a z-score; transformers' detector is a Bayesian model trained per key set instead). It keeps
one state per step, so it runs with greedy decoding and sampling, not beam search or speculative decoding.

Either processor runs after the sampling warpers and before renormalize_logits, as in transformers
(plugins/processors.py places it).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np
import torch

from ..core.config import is_int, is_number
from ..registry import hookimpl

SEEDING_SCHEMES = ("lefthash", "selfhash")
TABLE_SIZE = 1_000_003
SELFHASH_CANDIDATES = 40


@dataclass
class WatermarkingConfig:
    """The watermark's settings; give the same ones to the detector.

    greenlist_ratio: the part of the vocabulary that is green at each step, in (0, 1) (default 0.25).
    bias: added to the green tokens' scores, a finite number (default 2.0; 0.5-2.0 keeps the text's quality).
    hashing_key: the secret the green lists derive from, an integer (default 15485863: choose your own).
    seeding_scheme: "lefthash" (the previous token seeds the list) or "selfhash" (the candidate too; slower, more robust).
    context_width: how many previous tokens seed the list, an integer >= 1 (default 1).
    """

    greenlist_ratio: float = 0.25
    bias: float = 2.0
    hashing_key: int = 15485863
    seeding_scheme: str = "lefthash"
    context_width: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, value) -> "WatermarkingConfig":
        """A WatermarkingConfig from one, a dict of its fields, or transformers' WatermarkingConfig; checked."""
        if isinstance(value, cls):
            config = value
        else:
            fields = value.to_dict() if hasattr(value, "to_dict") else value
            if not isinstance(fields, dict):
                raise ValueError(
                    f"watermarking_config={value!r} is invalid; expected a WatermarkingConfig or a dict of its "
                    f"fields ({', '.join(cls.__dataclass_fields__)})."
                )
            unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(
                    f"watermarking_config: unknown field {unknown[0]!r}; the fields are "
                    f"{list(cls.__dataclass_fields__)}."
                )
            config = cls(**fields)
        config.check()
        return config

    def check(self) -> None:
        def bad(name, accepted):
            return _invalid(self, name, accepted)

        if not is_number(self.greenlist_ratio) or not 0 < self.greenlist_ratio < 1:
            raise bad("greenlist_ratio", "expected a number in (0, 1)")
        if not is_number(self.bias):
            raise bad("bias", "expected a finite number")
        if not is_int(self.hashing_key):
            raise bad("hashing_key", "expected an integer")
        if self.seeding_scheme not in SEEDING_SCHEMES:
            raise bad("seeding_scheme", f"expected one of {list(SEEDING_SCHEMES)}")
        if not is_int(self.context_width) or self.context_width < 1:
            raise bad("context_width", "expected an integer >= 1")


def _invalid(config, name: str, accepted: str) -> ValueError:
    return ValueError(f"watermarking_config: {name}={getattr(config, name)!r} is invalid; {accepted}.")


@dataclass
class SynthIDTextWatermarkingConfig:
    """SynthID Text's settings; give the same ones to the detector.

    keys: the secret, a non-empty list of integers (one tournament round each; transformers' examples use 9 to 30).
    ngram_len: the n-gram whose first n-1 tokens seed each candidate's g-values, an integer >= 2.
    context_history_size: how many past contexts are remembered so a repeated one is not watermarked again (>= 1).
    sampling_table_seed / sampling_table_size: the table of g-values the hashes index (size in [1, 2**24]).
    skip_first_ngram_calls: leave the first ngram_len - 1 steps alone.
    """

    keys: list
    ngram_len: int = 5
    context_history_size: int = 1024
    sampling_table_seed: int = 0
    sampling_table_size: int = 2**16
    skip_first_ngram_calls: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, value) -> "SynthIDTextWatermarkingConfig":
        fields = (
            value
            if isinstance(value, dict)
            else {k: getattr(value, k) for k in cls.__dataclass_fields__ if hasattr(value, k)}
        )
        config = cls(**{k: v for k, v in fields.items() if k in cls.__dataclass_fields__})
        config.check()
        return config

    def check(self) -> None:
        def bad(name, accepted):
            return _invalid(self, name, accepted)

        if not isinstance(self.keys, (list, tuple)) or not self.keys or not all(is_int(k) for k in self.keys):
            raise bad("keys", "expected a non-empty list of integers")
        if not is_int(self.ngram_len) or self.ngram_len < 2:
            raise bad("ngram_len", "expected an integer >= 2")
        if not is_int(self.context_history_size) or self.context_history_size < 1:
            raise bad("context_history_size", "expected an integer >= 1")
        if not is_int(self.sampling_table_size) or not 1 <= self.sampling_table_size <= 2**24:
            raise bad("sampling_table_size", "expected an integer in [1, 2**24]")
        if not is_int(self.sampling_table_seed):
            raise bad("sampling_table_seed", "expected an integer")


def watermark_config(value):
    """`watermarking_config` checked: a green-list or a SynthID config (ours, a dict, or transformers')."""
    synthid = (
        isinstance(value, SynthIDTextWatermarkingConfig)
        or type(value).__name__ == "SynthIDTextWatermarkingConfig"
        or (isinstance(value, dict) and "keys" in value)
    )
    return SynthIDTextWatermarkingConfig.of(value) if synthid else WatermarkingConfig.of(value)


@hookimpl
def decodekit_config_fields():
    return {"watermarking_config": None}


@hookimpl
def decodekit_validate_config(generation_config):
    gc = generation_config
    if gc.watermarking_config is None:
        return
    gc.watermarking_config = watermark_config(gc.watermarking_config)
    if isinstance(gc.watermarking_config, SynthIDTextWatermarkingConfig):
        others = [
            name
            for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
            if getattr(gc, name, None) is not None
        ]
        if gc.number("num_beams", 1) > 1 or others:
            raise ValueError(
                "SynthID keeps one state per generated token: it runs with greedy decoding or sampling, "
                f"not {'beam search' if not others else others[0]}."
            )


@hookimpl
def decodekit_logits_processors(generation_config, context):
    """The watermark processor of this call: its stage ("post") places it after the sampling warpers and before
    renormalize_logits, as transformers places it."""
    processor = processor_for(generation_config, context)
    return [processor] if processor is not None else []


def processor_for(generation_config, context):
    """The watermark processor of this call, or None."""
    config = generation_config.watermarking_config
    if config is None:
        return None
    config = watermark_config(config)
    if isinstance(config, SynthIDTextWatermarkingConfig):
        return SynthIDTextWatermarkLogitsProcessor(device=context.device, **config.to_dict())
    vocab = getattr(getattr(context.model, "config", None), "vocab_size", None)
    if not vocab:
        raise ValueError("watermarking_config needs the model's vocabulary size (config.vocab_size).")
    return WatermarkLogitsProcessor(int(vocab), context.device, **config.to_dict())


class GreenLists:
    """The green list after a sequence of tokens, for one vocabulary size and watermarking config."""

    def __init__(self, vocab_size: int, config: WatermarkingConfig, device=None):
        self.vocab_size, self.config = vocab_size, config
        self.size = int(vocab_size * config.greenlist_ratio)
        self.generator = torch.Generator(device=device or "cpu")
        self.generator.manual_seed(config.hashing_key)
        self.table = torch.randperm(TABLE_SIZE, generator=self.generator, device=device)

    def seed(self, tokens: torch.LongTensor) -> int:
        """The seed of the green list that follows `tokens` (the last context_width of them count)."""
        context = tokens[-self.config.context_width :]
        key = self.config.hashing_key
        if self.config.seeding_scheme == "selfhash":
            a = self.table[context % TABLE_SIZE] + 1
            b = self.table[context[-1] % TABLE_SIZE] + 1
            return int((key * a * b).min()) % (2**64 - 1)
        return (key * int(context[-1])) % (2**64 - 1)

    def after(self, tokens: torch.LongTensor) -> torch.LongTensor:
        """The green token ids after `tokens`."""
        self.generator.manual_seed(self.seed(tokens))
        return torch.randperm(self.vocab_size, generator=self.generator, device=tokens.device)[: self.size]


class WatermarkLogitsProcessor:
    """Adds `bias` to the green tokens of each row (rows shorter than context_width are left alone).

    `vocab_size`: the model's vocabulary size; `device`: where the green lists are drawn (the detector must draw
    them on the same kind of device); the rest are WatermarkingConfig's fields, with its defaults.
    """

    stage = "post"

    def __init__(
        self,
        vocab_size: int,
        device=None,
        greenlist_ratio: float = 0.25,
        bias: float = 2.0,
        hashing_key: int = 15485863,
        seeding_scheme: str = "lefthash",
        context_width: int = 1,
    ):
        self.config = config = WatermarkingConfig.of(
            dict(
                greenlist_ratio=greenlist_ratio,
                bias=bias,
                hashing_key=hashing_key,
                seeding_scheme=seeding_scheme,
                context_width=context_width,
            )
        )
        self.green = GreenLists(vocab_size, config, device)

    # transformers' attribute names, which code written against its processor (and its tests) reads.
    bias = property(lambda self: self.config.bias)
    seeding_scheme = property(lambda self: self.config.seeding_scheme)
    context_width = property(lambda self: self.config.context_width)
    hash_key = property(lambda self: self.config.hashing_key)
    vocab_size = property(lambda self: self.green.vocab_size)
    greenlist_size = property(lambda self: self.green.size)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[-1] < self.config.context_width:
            return scores
        out = scores.clone()
        for row, tokens in enumerate(input_ids):
            green = (
                self._selfhash(tokens, scores[row])
                if self.config.seeding_scheme == "selfhash"
                else self.green.after(tokens)
            )
            out[row, green] += self.config.bias
        return out

    def _selfhash(self, tokens, row_scores) -> torch.LongTensor:
        # A candidate is green when it is in the list its own choice would seed; the top candidates are checked.
        candidates = row_scores.argsort(descending=True)[:SELFHASH_CANDIDATES]
        green = [c for c in candidates if bool((self.green.after(torch.cat((tokens, c[None]))) == c).any())]
        return torch.stack(green) if green else candidates[:0]


def p_value(z: float) -> float:
    """The one-sided p-value of a z-score: how likely a text without the watermark scores at least this."""
    return 0.5 * math.erfc(z / math.sqrt(2))


@dataclass
class WatermarkDetectorOutput:
    """Per sequence (numpy arrays, as transformers' WatermarkDetectorOutput): tokens scored, green tokens among
    them, their fraction, the z-score against the green ratio, its one-sided p-value, whether the z-score is above
    the threshold, and the confidence 1 - p."""

    num_tokens_scored: np.ndarray
    num_green_tokens: np.ndarray
    green_fraction: np.ndarray
    z_score: np.ndarray
    p_value: np.ndarray
    prediction: np.ndarray
    confidence: np.ndarray  # 1 - p_value


WatermarkDetection = WatermarkDetectorOutput  # its name before transformers' was taken


class WatermarkDetector:
    """Finds the green-list watermark in token sequences.

    model_config: the generating model's config (its vocab_size and bos_token_id are read); device: where the
    text was generated ("cpu" or a CUDA device: the green lists are drawn there); watermarking_config: the
    settings used when generating (a WatermarkingConfig, a dict, or transformers' config); ignore_repeated_ngrams:
    count each distinct (context, token) once. Call it on the generated ids (without the prompt, which would
    dilute the score): `detector(ids)` -> a numpy array of predictions, `detector(ids, return_dict=True)`
    -> WatermarkDetectorOutput.
    """

    def __init__(
        self, model_config, device, watermarking_config, ignore_repeated_ngrams: bool = False, max_cache_size: int = 128
    ):
        self.config = WatermarkingConfig.of(watermarking_config)
        self.bos_token_id = getattr(model_config, "bos_token_id", None)
        self.green = GreenLists(int(model_config.vocab_size), self.config, device)
        self.ignore_repeated_ngrams = ignore_repeated_ngrams
        if not is_int(max_cache_size) or max_cache_size < 1:
            raise ValueError(
                f"max_cache_size={max_cache_size!r} is invalid; expected an integer >= 1 (n-grams whose "
                "colour is remembered)."
            )
        self._is_green = lru_cache(maxsize=max_cache_size)(self._green_ngram)

    def _green_ngram(self, ngram: tuple[int, ...]) -> bool:
        tokens = torch.tensor(ngram, device=self.green.table.device)
        prefix = tokens if self.config.seeding_scheme == "selfhash" else tokens[:-1]
        return bool((self.green.after(prefix) == ngram[-1]).any())

    def __call__(self, input_ids: torch.LongTensor, z_threshold: float = 3.0, return_dict: bool = False):
        """As transformers': a numpy bool array of predictions (z-score > `z_threshold`), or with `return_dict=True`
        the whole WatermarkDetectorOutput (its fields numpy arrays, as WatermarkDetectorOutput's)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("WatermarkDetector takes token ids as a LongTensor [batch, length].")
        if self.bos_token_id is not None:
            starts = input_ids[:, 0] == self.bos_token_id
            if bool(starts.any()) != bool(starts.all()):
                raise ValueError("Some sequences start with BOS and others do not: tokenize them all alike.")
            if bool(starts.all()):
                input_ids = input_ids[:, 1:]
        n = self.config.context_width + (0 if self.config.seeding_scheme == "selfhash" else 1)
        if input_ids.shape[1] < n:
            raise ValueError(
                f"WatermarkDetector needs at least {n} tokens per sequence to score one "
                f"(context_width={self.config.context_width}, seeding_scheme={self.config.seeding_scheme!r})."
            )
        scored, greens = [], []
        for row in input_ids.tolist():
            counts = Counter(tuple(row[i : i + n]) for i in range(len(row) - n + 1))
            if self.ignore_repeated_ngrams:
                scored.append(len(counts))
                greens.append(sum(self._is_green(g) for g in counts))
            else:
                scored.append(sum(counts.values()))
                greens.append(sum(c * self._is_green(g) for g, c in counts.items()))
        ratio = self.config.greenlist_ratio
        z = [(g - ratio * t) / math.sqrt(t * ratio * (1 - ratio)) for g, t in zip(greens, scored)]
        prediction = np.array([v > z_threshold for v in z])
        if not return_dict:
            return prediction
        return WatermarkDetectorOutput(
            num_tokens_scored=np.array(scored),
            num_green_tokens=np.array(greens),
            green_fraction=np.array([g / t for g, t in zip(greens, scored)]),
            z_score=np.array(z),
            p_value=np.array([p_value(v) for v in z]),
            prediction=prediction,
            confidence=np.array([1 - p_value(v) for v in z]),
        )


# ---- SynthID Text ----

HASH_MULTIPLIER = 6364136223846793005  # a linear congruential generator's; int64 products wrap, as transformers'


def _hash(state: torch.LongTensor, data: torch.LongTensor) -> torch.LongTensor:
    """`state` [...] folded with each of data's last-dimension values in turn."""
    for i in range(data.shape[-1]):
        state = (state + data[..., i]) * HASH_MULTIPLIER + 1
    return state


class SynthIDGValues:
    """The g-values of n-grams: a hash of the n-gram, then of each key, indexes a table of random bits."""

    def __init__(self, config: SynthIDTextWatermarkingConfig, device=None):
        self.config = config
        self.keys = torch.tensor(config.keys, device=device)
        generator = torch.Generator(device=device or "cpu").manual_seed(config.sampling_table_seed)
        self.table = torch.randint(0, 2, (config.sampling_table_size,), generator=generator, device=device)

    def of_keys(self, hashes: torch.LongTensor) -> torch.LongTensor:
        """hashes [...] -> g-values [..., depth] (one per key)."""
        return self.table[_hash(hashes[..., None], self.keys[:, None]) % self.table.numel()]

    def context_hash(self, context: torch.LongTensor) -> torch.LongTensor:
        return _hash(torch.ones(context.shape[:-1], dtype=torch.long, device=context.device), context)

    def of_sequences(self, ids: torch.LongTensor) -> torch.LongTensor:
        """ids [B, T] -> the g-values of each n-gram [B, T - ngram_len + 1, depth]."""
        ngrams = ids.unfold(1, self.config.ngram_len, 1)
        return self.of_keys(_hash(torch.ones(ngrams.shape[:-1], dtype=torch.long, device=ids.device), ngrams))


class SynthIDTextWatermarkState:
    """A SynthID processor's state for one batch: the last ngram_len - 1 tokens of each row (zeros at first, as
    transformers), the hashes of the contexts seen lately, and the number of calls."""

    def __init__(self, batch_size: int, ngram_len: int, context_history_size: int, device=None):
        self.context = torch.zeros(batch_size, ngram_len - 1, dtype=torch.long, device=device)
        self.context_history = torch.zeros(batch_size, context_history_size, dtype=torch.long, device=device)
        self.num_calls = 0


class SynthIDTextWatermarkLogitsProcessor:
    """SynthID Text: the distribution is reweighted by one tournament round per key over the candidates'
    g-values; a row whose context was seen within the last `context_history_size` steps is left as it is.
    Returns log-probabilities. One call per generated token (its `state` follows the tokens itself).

    Takes transformers' arguments (SynthIDTextWatermarkingConfig's fields and `device`); `debug_mode` replaces the
    scores by ones first, so only the watermark shows."""

    stage = "post"

    def __init__(
        self,
        ngram_len: int,
        keys,
        sampling_table_size: int,
        sampling_table_seed: int,
        context_history_size: int,
        device=None,
        skip_first_ngram_calls: bool = False,
        debug_mode: bool = False,
    ):
        self.config = SynthIDTextWatermarkingConfig.of(
            dict(
                keys=list(keys),
                ngram_len=ngram_len,
                sampling_table_size=sampling_table_size,
                sampling_table_seed=sampling_table_seed,
                context_history_size=context_history_size,
                skip_first_ngram_calls=skip_first_ngram_calls,
            )
        )
        self.g = SynthIDGValues(self.config, device)
        self.device, self.debug_mode, self.state = device, debug_mode, None

    def compute_g_values(self, input_ids: torch.LongTensor) -> torch.LongTensor:
        """The g-values of each n-gram of `input_ids` [B, T] -> [B, T - ngram_len + 1, depth]."""
        return self.g.of_sequences(input_ids)

    @staticmethod
    def update_scores(scores: torch.Tensor, g_values: torch.Tensor) -> torch.Tensor:
        """scores [B, V] reweighted by g_values [B, V, depth], one tournament round per depth: log-probabilities."""
        probs = torch.softmax(scores, dim=1)
        for depth in range(g_values.shape[-1]):
            layer = g_values[:, :, depth]
            probs = probs * (1 + layer - (layer * probs).sum(dim=1, keepdim=True))
        logs = torch.log(probs)
        return torch.where(torch.isfinite(logs), logs, torch.finfo(logs.dtype).min)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, vocab = scores.shape
        if self.debug_mode:
            scores = torch.ones_like(scores)
        state = self.state
        if state is None:
            state = self.state = SynthIDTextWatermarkState(
                rows, self.config.ngram_len, self.config.context_history_size, scores.device
            )
        else:
            state.context = torch.cat((state.context[:, 1:], input_ids[:, -1:]), dim=1)
        state.num_calls += 1
        if self.config.skip_first_ngram_calls and state.num_calls < self.config.ngram_len:
            return scores
        seen = self.g.context_hash(state.context)
        candidates = torch.arange(vocab, device=scores.device)
        g = self.g.of_keys((seen[:, None] + candidates[None, :]) * HASH_MULTIPLIER + 1)  # [rows, vocab, depth]
        logs = self.update_scores(scores, g)
        repeated = (state.context_history == seen[:, None]).any(dim=1, keepdim=True)
        state.context_history = torch.cat((seen[:, None], state.context_history[:, :-1]), dim=1)
        return torch.where(repeated, scores, logs)


@dataclass
class SynthIDDetection:
    """Per sequence: n-grams scored (repeated contexts and n-grams after an EOS left out), their mean
    g-value, its z-score against the 0.5 of text without the watermark, the one-sided p-value, and whether
    the z-score is above the threshold."""

    num_ngrams_scored: list[int]
    mean_g_value: list[float]
    z_score: list[float]
    p_value: list[float]
    prediction: list[bool]


class SynthIDTextWatermarkDetector:
    """Finds the SynthID Text watermark by the mean of its g-values.

    watermarking_config: the settings used when generating; eos_token_id: n-grams from the first EOS on are
    not scored (None: all are). Call it on the generated ids without the prompt: `detector(ids)`.
    """

    def __init__(self, watermarking_config, eos_token_id: int | None = None, device=None):
        self.config = SynthIDTextWatermarkingConfig.of(watermarking_config)
        self.g = SynthIDGValues(self.config, device)
        self.eos_token_id = eos_token_id

    def __call__(self, input_ids: torch.LongTensor, z_threshold: float = 3.0) -> SynthIDDetection:
        n = self.config.ngram_len
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < n:
            raise ValueError(f"SynthIDTextWatermarkDetector takes token ids [batch, length >= ngram_len={n}].")
        g = self.g.of_sequences(input_ids).float()  # [B, N, depth]
        keep = self._fresh_contexts(input_ids)
        if self.eos_token_id is not None:
            ended = (input_ids == self.eos_token_id).long().cumsum(dim=1) > 0
            keep &= ~ended[:, n - 1 :]
        depth = g.shape[-1]
        counts = keep.sum(dim=1)
        means = (g * keep[..., None]).sum(dim=(1, 2)) / (counts * depth).clamp(min=1)
        z = [(float(m) - 0.5) / (0.5 / math.sqrt(int(c) * depth)) if c else 0.0 for m, c in zip(means, counts)]
        return SynthIDDetection(
            num_ngrams_scored=counts.tolist(),
            mean_g_value=means.tolist(),
            z_score=z,
            p_value=[p_value(v) for v in z],
            prediction=[v > z_threshold for v in z],
        )

    def _fresh_contexts(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """bool [B, N]: the n-grams whose context was not seen among the previous context_history_size."""
        hashes = self.g.context_hash(input_ids[:, :-1].unfold(1, self.config.ngram_len - 1, 1))  # [B, N]
        fresh = torch.ones_like(hashes, dtype=torch.bool)
        for row in range(hashes.shape[0]):
            recent: list[int] = []
            for i, h in enumerate(hashes[row].tolist()):
                fresh[row, i] = h not in recent
                recent = [h, *recent][: self.config.context_history_size]
        return fresh
