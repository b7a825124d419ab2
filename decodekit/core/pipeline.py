"""Assembling one generate() call's pipeline from the plugins: the only place the core calls pluggy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .processors import LogitsProcessorList
from .stopping import StoppingCriteriaList


@dataclass
class GenerationContext:
    """What hooks may need to know about the call beyond the config."""

    model: Any
    batch_size: int
    prompt_length: int
    max_length: int
    device: torch.device
    tokenizer: Any = None
    generator: torch.Generator | None = None


def last_position_logits(output) -> torch.Tensor:
    return output.logits[:, -1, :]


last_position_logits.needs_hidden_states = False


@dataclass
class Pipeline:
    processors: LogitsProcessorList
    selector: Any
    stopping: StoppingCriteriaList
    cache: Any
    next_token_logits: Any = last_position_logits


def build_pipeline(pm, generation_config, context, logits_processor=None, stopping_criteria=None, cache=None) -> Pipeline:
    """Calls each hook point once (the config is already validated). User-supplied processors and criteria
    run after the plugins' ones."""
    processors = LogitsProcessorList()
    for contributed in pm.hook.decodekit_logits_processors(generation_config=generation_config, context=context):
        processors.extend(contributed or ())
    processors.extend(logits_processor or ())
    criteria = StoppingCriteriaList()
    for contributed in pm.hook.decodekit_stopping_criteria(generation_config=generation_config, context=context):
        criteria.extend(contributed or ())
    criteria.extend(stopping_criteria or ())
    selector = pm.hook.decodekit_token_selector(generation_config=generation_config, context=context)
    if selector is None:
        raise ValueError(
            "No registered plugin selects tokens for this generation config "
            f"(do_sample={generation_config.do_sample!r}); the built-ins handle do_sample=True and False."
        )
    if cache is None and generation_config.use_cache:
        cache = pm.hook.decodekit_cache(generation_config=generation_config, context=context)
    reader = pm.hook.decodekit_next_token_logits(generation_config=generation_config, context=context)
    return Pipeline(processors, selector, criteria, cache, reader or last_position_logits)
