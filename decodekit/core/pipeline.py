"""Assembling one generate() call's pipeline from the plugins: the only place the core calls pluggy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .processors import LogitsProcessorList
from .selectors import checked_selector
from .stopping import StoppingCriteriaList


@dataclass
class GenerationContext:
    """What hooks may need to know about the call beyond the config. `model` is None while values are checked before
    any model is loaded (core.generate.preflight): a validator then checks what it can without one."""

    model: Any
    batch_size: int
    prompt_length: int
    max_length: int
    device: torch.device
    tokenizer: Any = None
    generator: torch.Generator | None = None
    padding: torch.Tensor | None = None  # per row: the left padding before its prompt [batch]; None: no padding


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


def checked_cache(owner: str | None, cache):
    """`cache` as plugin `owner`'s decodekit_cache returned it, if it has the cache protocol's methods the loops call
    (update, get_seq_length); else a PluginError naming the plugin, which is disabled as a failing processor's is.
    (A method of a cache that raises inside the model's forward is not told apart from the model's own failure.)"""
    missing = [name for name in ("update", "get_seq_length") if not callable(getattr(cache, name, None))]
    if cache is None or not missing:
        return cache
    from ..registry.manager import PluginError, plugin_failure

    error = PluginError(
        f"plugin {owner!r}: decodekit_cache returned a {type(cache).__name__} without {missing}; a "
        "cache has update(key, value, layer_idx), get_seq_length(), crop(length) and reorder(indices)."
    )
    raise plugin_failure(error, owner, "decodekit_cache", f"the cache of plugin {owner!r}")


def build_pipeline(
    generation_config, context, logits_processor=None, stopping_criteria=None, cache=None, make_cache: bool = True
) -> Pipeline:
    """Calls each hook point once (the config is already validated). User-supplied processors and criteria
    run after the plugins' ones. Each processor is tagged with the plugin that contributed it, and outputs
    are checked at the first step (processors.LogitsProcessorList, selectors.checked_selector). With
    `make_cache=False` (continuous batching, whose paged cache serves every request) no cache is made."""
    from ..registry.manager import call_first, call_hooks

    hook_args = dict(generation_config=generation_config, context=context)
    processors = LogitsProcessorList()
    for owner, contributed in call_hooks("decodekit_logits_processors", **hook_args):
        processors.extend_from(owner, contributed)
    processors.extend_from("logits_processor (passed to generate)", logits_processor or ())
    criteria = StoppingCriteriaList()
    for owner, contributed in call_hooks("decodekit_stopping_criteria", **hook_args):
        criteria.extend_from(owner, contributed)
    criteria.extend_from("stopping_criteria (passed to generate)", stopping_criteria or ())
    owner, selector = call_first("decodekit_token_selector", **hook_args)
    if selector is None:
        raise ValueError(
            "No registered plugin selects tokens for this generation config "
            f"(do_sample={generation_config.do_sample!r}); the built-ins handle do_sample=True and False."
        )
    if cache is None and make_cache and generation_config.use_cache:
        cache = checked_cache(*call_first("decodekit_cache", **hook_args))
    reader = call_first("decodekit_next_token_logits", **hook_args)[1]
    return Pipeline(processors, checked_selector(selector, owner), criteria, cache, reader or last_position_logits)
