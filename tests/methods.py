"""Method repositories (custom_generate/ folders) written by the tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

# Written the way a transformers user writes a Hub method: it touches only the public model surface
# (model(...).logits, model.generation_config, model.config.pad_token_id, model.device).
TRANSFORMERS_STYLE_GREEDY = '''
"""Greedy decoding with optional left padding, written for transformers."""
import torch


def generate(model, input_ids, generation_config=None, left_padding=None, **kwargs):
    generation_config = generation_config or model.generation_config
    cur_length = input_ids.shape[1]
    max_length = cur_length + (kwargs.get("max_new_tokens") or generation_config.max_new_tokens or 20)
    if left_padding is not None:
        if not isinstance(left_padding, int) or left_padding < 0:
            raise ValueError(f"left_padding must be an integer larger than 0, but is {left_padding}")
        pad_token = kwargs.pop("pad_token", None) or generation_config.pad_token_id or model.config.pad_token_id
        if pad_token is None:
            raise ValueError("pad_token is not defined")
        batch_size = input_ids.shape[0]
        pad_tensor = torch.full(size=(batch_size, left_padding), fill_value=pad_token).to(input_ids.device)
        input_ids = torch.cat((pad_tensor, input_ids), dim=1)
        cur_length = input_ids.shape[1]
        max_length = max_length + left_padding
    while cur_length < max_length:
        logits = model(input_ids).logits
        next_token_logits = logits[:, -1, :]
        next_tokens = torch.argmax(next_token_logits, dim=-1)
        input_ids = torch.cat((input_ids, next_tokens[:, None]), dim=-1)
        cur_length += 1
    return input_ids
'''

# A sampler's loop as Hub methods written for transformers have it: it reads both lengths from the config it is
# handed (so both must be set: the call's prepared config).
LENGTHS_FROM_CONFIG = """
import torch


def generate(model, input_ids, generation_config=None, **kwargs):
    generation_config = generation_config or model.generation_config
    prompt = input_ids.shape[1]
    while input_ids.shape[1] < generation_config.max_length and input_ids.shape[1] - prompt < generation_config.max_new_tokens:
        next_tokens = model(input_ids).logits[:, -1, :].argmax(dim=-1)
        input_ids = torch.cat((input_ids, next_tokens[:, None]), dim=-1)
    return input_ids
"""

# Greedy decoding through transformers' own generation internals, as many Hub methods are written: the config
# prepared by _prepare_generation_config, processors and criteria from the model's private builders, inputs from
# prepare_inputs_for_generation over a DynamicCache with cache_position.
TRANSFORMERS_INTERNALS = """
import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList

OWN = ("logits_processor", "stopping_criteria", "streamer", "tokenizer", "input_ids")


def generate(model, inputs=None, generation_config=None, **kwargs):
    input_ids = inputs if inputs is not None else kwargs["input_ids"]
    generation_config, _ = model._prepare_generation_config(
        generation_config, **{k: v for k, v in kwargs.items() if k not in OWN and v is not None})
    if generation_config.max_new_tokens is not None:
        generation_config.max_length = input_ids.shape[1] + generation_config.max_new_tokens
    model._prepare_special_tokens(generation_config, device=input_ids.device)
    processors = model._get_logits_processor(
        generation_config=generation_config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=input_ids.device, model_kwargs={})
    criteria = model._get_stopping_criteria(generation_config=generation_config, stopping_criteria=StoppingCriteriaList())
    cache = DynamicCache(config=model.config)
    ids, cache_position, first = input_ids, torch.arange(input_ids.shape[1], device=input_ids.device), True
    while True:
        step = model.prepare_inputs_for_generation(ids, past_key_values=cache, is_first_iteration=first, use_cache=True,
                                                   next_sequence_length=None if first else 1)
        scores = processors(ids, model(**step, cache_position=cache_position).logits[:, -1, :].float())
        ids = torch.cat([ids, scores.argmax(-1)[:, None]], dim=-1)
        if criteria(ids, scores).all():
            return ids
        cache_position, first = cache_position[-1:] + 1, False
"""

# Contributes to the core loop through decodekit's hooks instead of replacing it.
HOOK_METHOD = '''
"""Bans one token through the logits hook point; the core loop does the rest."""
from decodekit import hookimpl


@hookimpl
def decodekit_config_fields():
    return {"banned_token": None}


@hookimpl
def decodekit_logits_processors(generation_config):
    banned = generation_config.banned_token
    if banned is None:
        return []

    def ban(input_ids, scores):
        scores[:, banned] = -float("inf")
        return scores

    return [ban]
'''


# Methods for the engines' adapters (tests/test_vllm.py, bench/bench_vllm.py).
CACHE_METHOD = '''
"""Brings its own cache when asked to: decodekit's loop can take that, vLLM cannot."""
from decodekit import DynamicCache, hookimpl


@hookimpl
def decodekit_config_fields():
    return {"own_cache": False}


@hookimpl
def decodekit_cache(generation_config):
    return DynamicCache() if generation_config.own_cache else None
'''

SELECTOR_METHOD = '''
"""Picks the second most likely token: a selector, which vLLM takes as a processor keeping only that token."""
from decodekit import hookimpl


@hookimpl
def decodekit_config_fields():
    return {"second_best": False}


@hookimpl
def decodekit_token_selector(generation_config):
    if not generation_config.second_best:
        return None
    return lambda input_ids, scores: scores.topk(2, dim=-1).indices[:, 1]
'''

SCORE_ONLY = '''
"""A processor that reads only the scores (it subtracts their maximum, which changes no choice)."""
from decodekit import hookimpl


@hookimpl
def decodekit_config_fields():
    return {"centered": False}


@hookimpl
def decodekit_logits_processors(generation_config):
    if not generation_config.centered:
        return []

    def center(input_ids, scores):
        return scores - scores.max(dim=-1, keepdim=True).values

    center.score_only = True
    return [center]
'''


# Reads the sequence: bans the two tokens it ends with (an engine adapter must pass the right ids in order).
# Bans repeating either of the sequence's last two tokens (ban_recent=true): docs/eval-example's method, one source.
RECENT_TOKENS_BAN = (
    Path(__file__).resolve().parents[1] / "docs" / "eval-example" / "ban-recent" / "custom_generate" / "generate.py"
).read_text(encoding="utf-8")


def write_method(
    root: Path,
    generate_py: str,
    requirements: str | None = None,
    extra: dict[str, str] | None = None,
    readme: str = "---\ntags:\n- custom_generate\n---\n# a method\n",
) -> Path:
    method = root / "custom_generate"
    method.mkdir(parents=True, exist_ok=True)
    (method / "generate.py").write_text(textwrap.dedent(generate_py))
    if requirements is not None:
        (method / "requirements.txt").write_text(requirements)
    for name, text in (extra or {}).items():
        path = method / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (root / "README.md").write_text(readme)
    return root


# Faults on demand, for the server's hardening tests: `fault` names what goes wrong and `fault_step` after how many
# generated tokens.
FAULT_METHOD = '''
"""Goes wrong on request: raises from its processor, picks a token outside the vocabulary, or exits while the
request is prepared."""
import torch
from decodekit import hookimpl

RAISES = {"exit": SystemExit, "interrupt": KeyboardInterrupt, "raise": RuntimeError}


@hookimpl
def decodekit_config_fields():
    return {"fault": None, "fault_step": 2}


@hookimpl
def decodekit_validate_config(generation_config, context):
    if generation_config.fault == "exit-when-added":
        raise SystemExit("fault injected while the request is added")


@hookimpl
def decodekit_logits_processors(generation_config, context):
    fault, start = generation_config.fault, context.prompt_length
    if fault not in RAISES:
        return []

    def boom(input_ids, scores):
        if input_ids.shape[1] - start >= generation_config.fault_step:
            raise RAISES[fault]("fault injected")
        return scores

    return [boom]


@hookimpl
def decodekit_token_selector(generation_config, context):
    if generation_config.fault != "outside-vocabulary":
        return None
    start = context.prompt_length

    def select(input_ids, scores):
        chosen = scores.argmax(dim=-1)
        return chosen + scores.shape[-1] + 5 if input_ids.shape[1] - start >= generation_config.fault_step else chosen

    return select
'''
