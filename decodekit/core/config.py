"""GenerationConfig: transformers' field names and defaults, read from generation_config.json, validated.

Plugins may declare more fields (the `decodekit_config_fields` hook); they live on the same object
so that `model.generate(**inputs, my_field=3)` works the same for built-in and outside strategies.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
from pathlib import Path
from typing import Any

DEFAULT_NEW_TOKENS = 20  # transformers' default when neither max_new_tokens nor max_length is set
DEFAULTS: dict[str, Any] = {
    # length
    "max_length": None,  # None: DEFAULT_NEW_TOKENS after the prompt (max_length_for)
    "max_new_tokens": None,
    "min_length": 0,
    "min_new_tokens": None,
    "max_time": None,
    "stop_strings": None,
    # strategy
    "do_sample": False,
    "num_return_sequences": 1,
    "use_cache": True,
    "cache_implementation": None,
    "prefill_chunk_size": None,  # the core loop prefills the prompt in pieces of this many tokens
    "token_healing": False,  # core/healing.py
    # logits processing
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "min_p": None,
    "typical_p": 1.0,
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "epsilon_cutoff": None,
    "eta_cutoff": None,
    "exponential_decay_length_penalty": None,
    "begin_suppress_tokens": None,
    "remove_invalid_values": False,
    "renormalize_logits": False,
    "encoder_repetition_penalty": None,  # refused unless None or 1.0: it needs an encoder
    # special tokens
    "eos_token_id": None,
    "pad_token_id": None,
    "bos_token_id": None,
    # outputs
    "return_dict_in_generate": False,
    "output_scores": False,
    "output_logits": False,
    "output_hidden_states": False,
    "output_attentions": False,
}

CACHE_IMPLEMENTATIONS = ("dynamic", "static")


def accepted_fields() -> dict[str, Any]:
    """Every field generate() accepts, with its default: the built-in ones and those the registered plugins declare."""
    from ..registry.manager import config_fields

    return {**config_fields(), **DEFAULTS}


def add_plugin_fields(gc: "GenerationConfig") -> set[str]:
    """Gives `gc` each accepted field it lacks (a plugin's, at its default); returns the names of all accepted fields."""
    accepted = accepted_fields()
    for name, default in accepted.items():
        if not hasattr(gc, name):
            setattr(gc, name, default)
    return set(accepted)


def closest(name: str, names) -> str | None:
    """The one of `names` most like `name` (what a misspelling meant), or None."""
    found = difflib.get_close_matches(name, sorted(names), n=1)
    return found[0] if found else None


def reject_unknown(given, known, *, caller: str, noun: str = "fields", accepts: str) -> None:
    """The one check of names a caller passes: ValueError naming `caller`, the names it does not know (with the
    closest known one to the first) and what it `accepts`."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        close = closest(unknown[0], known)
        hint = f" (did you mean {close!r}?)" if close else ""
        raise ValueError(f"{caller} got unknown {noun} {unknown}{hint}; it accepts {accepts}.")


def apply_fields(gc: "GenerationConfig", fields: dict[str, Any], *, caller: str, also_known=()) -> None:
    """`fields` set on `gc`, each a generation config field (built-in or a registered plugin's); a name in
    `also_known` is passed over (the caller uses it), any other is refused (reject_unknown)."""
    known = add_plugin_fields(gc)
    reject_unknown(
        fields,
        known | set(also_known),
        caller=caller,
        accepts="decodekit's generation config fields and those the registered plugins declare (`decodekit list` "
        f"shows them): {sorted(known)}",
    )
    gc.update(**{k: v for k, v in fields.items() if k in known})


def _is_object(v: Any) -> bool:
    import torch

    return isinstance(v, (torch.Tensor, torch.nn.Module))


def is_int(v: Any) -> bool:
    """An integer that is not a bool (True is an int to Python, never a count to a user)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite real number: nan and inf are refused wherever a field does not say what they mean."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _token_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(is_int(t) and t >= 0 for t in v)


class GenerationConfig:
    """The knobs of one generate() call. Unknown keys from a JSON file are kept as attributes."""

    def __init__(self, **fields: Any):
        self.__dict__.update(copy.deepcopy(DEFAULTS))
        self.__dict__.update(fields)

    # --- construction --------------------------------------------------------------------------------

    @classmethod
    def from_model_config(cls, model_config) -> "GenerationConfig":
        return cls(
            **{
                k: getattr(model_config, k)
                for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                if getattr(model_config, k, None) is not None
            }
        )

    @classmethod
    def from_file(cls, path: str | Path, model_config=None) -> "GenerationConfig":
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
        base = cls.from_model_config(model_config).to_dict() if model_config is not None else {}
        base.update({k: v for k, v in fields.items() if v is not None or k not in base})
        return cls(**base)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        config_file_name: str = "generation_config.json",
        revision: str | None = None,
        token=None,
        local_files_only: bool = False,
    ) -> "GenerationConfig":
        """Reads `config_file_name` from a directory or a Hub repo (transformers' generation_config.json);
        fields decodekit does not know are kept as attributes."""
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            file = path / config_file_name
            if not file.is_file():
                raise FileNotFoundError(f"{path} has no {config_file_name}.")
        else:
            from huggingface_hub import hf_hub_download

            file = Path(
                hf_hub_download(
                    str(name_or_path),
                    config_file_name,
                    revision=revision,
                    token=token,
                    local_files_only=local_files_only,
                )
            )
        return cls.from_file(file)

    def save_pretrained(self, directory: str | Path, config_file_name: str = "generation_config.json") -> Path:
        """Writes the fields that differ from the defaults (plugin fields and unknown ones included) as JSON that
        transformers' GenerationConfig.from_pretrained reads. A value JSON cannot hold (a tensor, a model, a
        function) is a ValueError naming the field; nothing is written then."""
        defaults = accepted_fields()
        fields = {k: v for k, v in self.__dict__.items() if defaults.get(k, object()) != v and v is not None}
        for name, value in fields.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"generation config: {name} holds a {type(value).__name__}, which "
                    "generation_config.json cannot store; set it per call instead."
                ) from None
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / config_file_name
        target.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return target

    def to_dict(self) -> dict[str, Any]:
        # Tensors and models (negative_prompt_ids, assistant_model) are shared, not copied.
        return {k: v if _is_object(v) else copy.deepcopy(v) for k, v in self.__dict__.items()}

    def copy(self) -> "GenerationConfig":
        return GenerationConfig(**self.to_dict())

    def update(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.__dict__.items() if DEFAULTS.get(k, object()) != v}
        return f"GenerationConfig({changed})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GenerationConfig) and self.__dict__ == other.__dict__

    # --- derived values ------------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        if eos is None:
            return []
        return [eos] if is_int(eos) else list(eos)

    def max_length_for(self, prompt_length: int, max_positions: int | None = None) -> int:
        """The total length (prompt + new) at which generation stops, as transformers decides it:
        max_new_tokens wherever it is set (call, config or the model's config), else max_length where it is
        set, else DEFAULT_NEW_TOKENS after the prompt (at most `max_positions`, the model's context)."""
        if self.max_new_tokens is not None:
            return prompt_length + self.max_new_tokens
        if self.max_length is not None:
            return self.max_length
        total = prompt_length + DEFAULT_NEW_TOKENS
        return min(total, max_positions) if max_positions else total

    def min_length_for(self, prompt_length: int) -> int:
        if self.min_new_tokens is not None:
            return prompt_length + self.min_new_tokens
        return self.min_length

    # --- validation ----------------------------------------------------------------------------------

    def number(self, name: str, default: Any) -> Any:
        """Field `name` where it is a finite number, else `default`: for a plugin reading a field another plugin
        owns, before that plugin has validated it (the owner's validation then reports a bad value)."""
        value = getattr(self, name, default)
        return value if is_number(value) else default

    def invalid(self, name: str, accepted: str) -> ValueError:
        """The error for field `name`: its value and what is accepted. Plugins' validate_config hooks use it too."""
        return ValueError(f"generation config: {name}={getattr(self, name)!r} is invalid; {accepted}.")

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first invalid field, its value and what is accepted."""
        self._check_lengths()
        self._check_sampling()
        if self.num_return_sequences > 1 and not self.do_sample and self.number("num_beams", 1) == 1:
            raise self.invalid(
                "num_return_sequences", "greedy decoding returns one sequence per prompt; set do_sample=True"
            )
        if self.cache_implementation is not None and self.cache_implementation not in self._cache_names():
            raise self.invalid("cache_implementation", f"expected one of {list(self._cache_names())} or None")
        self._check_token_fields()
        self._check_switches()
        if vocab_size is not None:
            self._check_token_ids(vocab_size)

    def _check_lengths(self) -> None:
        bad = self.invalid

        def int_at_least(name: str, low: int, optional: bool = False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            if not is_int(v) or v < low:
                raise bad(name, f"expected an integer >= {low}" + (" or None" if optional else ""))

        int_at_least("max_length", 1, optional=True)
        int_at_least("max_new_tokens", 1, optional=True)
        int_at_least("min_length", 0)
        int_at_least("min_new_tokens", 0, optional=True)
        int_at_least("num_return_sequences", 1)
        int_at_least("top_k", 0, optional=True)
        int_at_least("no_repeat_ngram_size", 0, optional=True)
        int_at_least("prefill_chunk_size", 1, optional=True)
        if self.max_time is not None and (not is_number(self.max_time) or self.max_time <= 0):
            raise bad("max_time", "expected a number of seconds > 0 or None")
        if not isinstance(self.do_sample, bool):
            raise bad("do_sample", "expected True or False")

    def _check_sampling(self) -> None:
        bad = self.invalid
        if self.temperature is not None:
            if not is_number(self.temperature) or self.temperature < 0:
                raise bad("temperature", "expected a number > 0")
            if self.do_sample and self.temperature == 0:
                raise bad("temperature", "sampling needs temperature > 0 (use do_sample=False for greedy decoding)")
        if self.top_p is not None and (not is_number(self.top_p) or not 0 < self.top_p <= 1):
            raise bad("top_p", "expected a number in (0, 1]")
        if self.min_p is not None and (not is_number(self.min_p) or not 0 <= self.min_p <= 1):
            raise bad("min_p", "expected a number in [0, 1] or None")
        if self.typical_p is not None and (not is_number(self.typical_p) or not 0 < self.typical_p <= 1):
            raise bad("typical_p", "expected a number in (0, 1]")
        if self.repetition_penalty is not None and (
            not is_number(self.repetition_penalty) or self.repetition_penalty <= 0
        ):
            raise bad("repetition_penalty", "expected a number > 0 (1.0 means no penalty)")
        for name in ("epsilon_cutoff", "eta_cutoff"):
            v = getattr(self, name)
            if v is not None and (not is_number(v) or not 0 <= v < 1):
                raise bad(name, "expected a number in (0, 1) (0 or None: off)")
        decay = self.exponential_decay_length_penalty
        if decay is not None and not (
            isinstance(decay, (list, tuple))
            and len(decay) == 2
            and is_int(decay[0])
            and decay[0] >= 0
            and is_number(decay[1])
            and decay[1] > 0
        ):
            raise bad(
                "exponential_decay_length_penalty",
                "expected (start: int >= 0, decay factor: number > 0), e.g. (10, 1.5)",
            )
        if self.begin_suppress_tokens is not None and not (
            isinstance(self.begin_suppress_tokens, (list, tuple))
            and all(is_int(t) and t >= 0 for t in self.begin_suppress_tokens)
        ):
            raise bad("begin_suppress_tokens", "expected a list of token ids")
        erp = self.encoder_repetition_penalty
        if not (erp is None or (is_number(erp) and erp == 1.0)):
            raise bad(
                "encoder_repetition_penalty",
                "it penalises tokens of an encoder's input, and decodekit runs "
                "decoder-only models; use repetition_penalty",
            )

    def _check_token_fields(self) -> None:
        bad = self.invalid
        for name in ("eos_token_id", "pad_token_id", "bos_token_id", "forced_bos_token_id", "forced_eos_token_id"):
            v = getattr(self, name)
            ok = (
                v is None
                or (is_int(v) and v >= 0)
                or (name in ("eos_token_id", "forced_eos_token_id") and _token_list(v))
            )
            if not ok:
                raise bad(
                    name,
                    "expected a token id (int >= 0)" + (" or a list of them" if "eos" in name else "") + " or None",
                )
        if self.bad_words_ids is not None and (
            not isinstance(self.bad_words_ids, (list, tuple)) or not all(_token_list(w) for w in self.bad_words_ids)
        ):
            raise bad("bad_words_ids", "expected a list of non-empty lists of token ids, e.g. [[12], [7, 8]]")
        if self.suppress_tokens is not None and not (
            isinstance(self.suppress_tokens, (list, tuple)) and all(is_int(t) and t >= 0 for t in self.suppress_tokens)
        ):
            raise bad("suppress_tokens", "expected a list of token ids")
        if self.sequence_bias is not None:
            items = self.sequence_bias.items() if isinstance(self.sequence_bias, dict) else self.sequence_bias
            try:
                ok = all(_token_list(list(seq)) and is_number(b) for seq, b in items)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise bad("sequence_bias", "expected {(token ids...): bias} or [[[token ids], bias], ...]")
        if self.stop_strings is not None:
            strings = [self.stop_strings] if isinstance(self.stop_strings, str) else self.stop_strings
            if (
                not isinstance(strings, (list, tuple))
                or not strings
                or not all(isinstance(s, str) and s for s in strings)
            ):
                raise bad("stop_strings", "expected a non-empty string or a list of them")

    def _check_switches(self) -> None:
        bad = self.invalid
        for name in (
            "return_dict_in_generate",
            "output_scores",
            "output_logits",
            "use_cache",
            "remove_invalid_values",
            "renormalize_logits",
            "output_hidden_states",
            "output_attentions",
            "token_healing",
        ):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "expected True or False")

    def _check_token_ids(self, vocab_size: int) -> None:
        ids: list[tuple[str, int]] = [("eos_token_id", t) for t in self.eos_token_ids]
        for name in ("pad_token_id", "bos_token_id", "forced_bos_token_id"):
            if getattr(self, name) is not None:
                ids.append((name, getattr(self, name)))
        for words in self.bad_words_ids or []:
            ids += [("bad_words_ids", t) for t in words]
        ids += [("suppress_tokens", t) for t in self.suppress_tokens or []]
        ids += [("begin_suppress_tokens", t) for t in self.begin_suppress_tokens or []]
        forced_eos = self.forced_eos_token_id
        ids += [("forced_eos_token_id", t) for t in ([forced_eos] if is_int(forced_eos) else forced_eos or [])]
        if self.sequence_bias is not None:
            items = self.sequence_bias.items() if isinstance(self.sequence_bias, dict) else self.sequence_bias
            ids += [("sequence_bias", t) for seq, _ in items for t in seq]
        for name, t in ids:
            if t >= vocab_size:
                raise ValueError(
                    f"generation config: {name} contains token id {t}, outside the vocabulary [0, {vocab_size})."
                )

    @staticmethod
    def _cache_names() -> tuple[str, ...]:
        from ..registry import manager

        return manager.cache_implementations()
