"""Green-list watermarking (Kirchenbauer et al., 2023): `watermarking_config=WatermarkingConfig(...)` biases a
pseudo-random "green" part of the vocabulary at every step, and `WatermarkDetector` finds the excess of green
tokens in a text.

The green list of a step is a permutation of the vocabulary drawn from a seed that hashes the previous
tokens ("lefthash": the last token; "selfhash": the context and the candidate token itself, checked for the
40 most likely candidates), with the same seeding and the same draws as transformers' WatermarkLogitsProcessor,
so that text watermarked by either is detected by either's detector. The processor runs after the sampling
warpers and before renormalize_logits, as in transformers (plugins/processors.py places it).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch

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
                raise ValueError(f"watermarking_config={value!r} is invalid; expected a WatermarkingConfig or a dict of its "
                                 f"fields ({', '.join(cls.__dataclass_fields__)}).")
            unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"watermarking_config: unknown field {unknown[0]!r}; the fields are "
                                 f"{list(cls.__dataclass_fields__)}.")
            config = cls(**fields)
        config.check()
        return config

    def check(self) -> None:
        def bad(name, accepted):
            return ValueError(f"watermarking_config: {name}={getattr(self, name)!r} is invalid; {accepted}.")

        if not _is_number(self.greenlist_ratio) or not 0 < self.greenlist_ratio < 1:
            raise bad("greenlist_ratio", "expected a number in (0, 1)")
        if not _is_number(self.bias) or not math.isfinite(self.bias):
            raise bad("bias", "expected a finite number")
        if not isinstance(self.hashing_key, int) or isinstance(self.hashing_key, bool):
            raise bad("hashing_key", "expected an integer")
        if self.seeding_scheme not in SEEDING_SCHEMES:
            raise bad("seeding_scheme", f"expected one of {list(SEEDING_SCHEMES)}")
        if not isinstance(self.context_width, int) or isinstance(self.context_width, bool) or self.context_width < 1:
            raise bad("context_width", "expected an integer >= 1")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


@hookimpl
def decodekit_config_fields():
    return {"watermarking_config": None}


@hookimpl
def decodekit_validate_config(generation_config):
    if generation_config.watermarking_config is not None:
        generation_config.watermarking_config = WatermarkingConfig.of(generation_config.watermarking_config)


def processor_for(generation_config, context):
    """The watermark processor of this call, or None (plugins/processors.py puts it in transformers' place)."""
    config = generation_config.watermarking_config
    if config is None:
        return None
    vocab = getattr(getattr(context.model, "config", None), "vocab_size", None)
    if not vocab:
        raise ValueError("watermarking_config needs the model's vocabulary size (config.vocab_size).")
    return WatermarkLogitsProcessor(int(vocab), WatermarkingConfig.of(config), context.device)


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
        context = tokens[-self.config.context_width:]
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
    """Adds `config.bias` to the green tokens of each row (rows shorter than context_width are left alone).

    `vocab_size`: the model's vocabulary size; `config`: a WatermarkingConfig; `device`: where the green
    lists are drawn (the detector must draw them on the same kind of device).
    """

    def __init__(self, vocab_size: int, config: WatermarkingConfig, device=None):
        self.config = config
        self.green = GreenLists(vocab_size, config, device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[-1] < self.config.context_width:
            return scores
        out = scores.clone()
        for row, tokens in enumerate(input_ids):
            green = self._selfhash(tokens, scores[row]) if self.config.seeding_scheme == "selfhash" else self.green.after(tokens)
            out[row, green] += self.config.bias
        return out

    def _selfhash(self, tokens, row_scores) -> torch.LongTensor:
        # A candidate is green when it is in the list its own choice would seed; the top candidates are checked.
        candidates = row_scores.argsort(descending=True)[:SELFHASH_CANDIDATES]
        green = [c for c in candidates if bool((self.green.after(torch.cat((tokens, c[None]))) == c).any())]
        return torch.stack(green) if green else candidates[:0]


@dataclass
class WatermarkDetection:
    """Per sequence: tokens scored, green tokens among them, their fraction, the z-score against the green
    ratio, its one-sided p-value, and whether the z-score is above the threshold."""

    num_tokens_scored: list[int]
    num_green_tokens: list[int]
    green_fraction: list[float]
    z_score: list[float]
    p_value: list[float]
    prediction: list[bool]


class WatermarkDetector:
    """Finds the green-list watermark in token sequences.

    model_config: the generating model's config (its vocab_size and bos_token_id are read); device: where the
    text was generated ("cpu" or a CUDA device: the green lists are drawn there); watermarking_config: the
    settings used when generating (a WatermarkingConfig, a dict, or transformers' config); ignore_repeated_ngrams:
    count each distinct (context, token) once. Call it on the generated ids (without the prompt, which would
    dilute the score): `detector(ids)` -> WatermarkDetection.
    """

    def __init__(self, model_config, device, watermarking_config, ignore_repeated_ngrams: bool = False):
        self.config = WatermarkingConfig.of(watermarking_config)
        self.bos_token_id = getattr(model_config, "bos_token_id", None)
        self.green = GreenLists(int(model_config.vocab_size), self.config, device)
        self.ignore_repeated_ngrams = ignore_repeated_ngrams
        self._is_green = lru_cache(maxsize=4096)(self._green_ngram)

    def _green_ngram(self, ngram: tuple[int, ...]) -> bool:
        tokens = torch.tensor(ngram, device=self.green.table.device)
        prefix = tokens if self.config.seeding_scheme == "selfhash" else tokens[:-1]
        return bool((self.green.after(prefix) == ngram[-1]).any())

    def __call__(self, input_ids: torch.LongTensor, z_threshold: float = 3.0) -> WatermarkDetection:
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
            raise ValueError(f"WatermarkDetector needs at least {n} tokens per sequence to score one "
                             f"(context_width={self.config.context_width}, seeding_scheme={self.config.seeding_scheme!r}).")
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
        return WatermarkDetection(
            num_tokens_scored=scored, num_green_tokens=greens, green_fraction=[g / t for g, t in zip(greens, scored)],
            z_score=z, p_value=[0.5 * math.erfc(v / math.sqrt(2)) for v in z], prediction=[v > z_threshold for v in z])
