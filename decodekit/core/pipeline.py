"""Assembling one generate() call's pipeline from the plugins: the only place the core calls pluggy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .processors import STAGES, Capabilities, LogitsProcessorList, capabilities
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

    @property
    def capabilities(self) -> tuple[Capabilities, ...]:
        """What each of its processors declares, in their order (core.processors.capabilities): what the fused step,
        continuous batching and beam search read of them."""
        return tuple(capabilities(p) for p in self.processors)


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
    raise plugin_failure(error, owner, "decodekit_cache's result", f"the cache of plugin {owner!r}")


GIVEN_PROCESSORS = "logits_processor (passed to generate)"
GIVEN_CRITERIA = "stopping_criteria (passed to generate)"


def staged(contributions: list[tuple[str, Any]], plugin_order: list[str]) -> LogitsProcessorList:
    """The processors of `contributions` [(owner, processors)] in pipeline order: by the stage each declares
    (processors.STAGES), then by owner (`plugin_order`, registration order; an owner not in it, such as generate()'s
    argument, after them in the order given), then as each owner listed them. A stage no pipeline has is the
    plugin's failure (PluginError naming the processor)."""
    rank = {name: i for i, name in enumerate(plugin_order)}
    for owner, _ in contributions:
        rank.setdefault(owner, len(rank))
    keyed = []
    for owner, processors in contributions:
        stages = declared_stages(owner, processors)
        if stages is None:
            continue  # the plugin failed and is disabled: this call goes on without its processors
        for processor, stage in zip(processors, stages):
            keyed.append(((stage, rank[owner], len(keyed)), owner, processor))
    out = LogitsProcessorList()
    for _, owner, processor in sorted(keyed, key=lambda item: item[0]):
        out.extend_from(owner, [processor])
    return out


def declared_stages(owner: str, processors: list) -> list[int] | None:
    """The stage (its index in STAGES) of each of `owner`'s processors, their declarations (capabilities: stage,
    flags, key) read here, inside the plugin guard: a declaration that raises or names no stage is the plugin's failure, as its
    hook raising would be (disabled, or raised naming it, by the host's policy; None: go on without it). For the
    processors passed to generate(), ValueError naming the argument."""
    from ..registry.manager import PluginError, described, host

    stages = []
    for processor in processors:
        try:
            stages.append(STAGES.index(capabilities(processor).stage))
        except Exception as error:  # a property of the plugin's raising anything
            what = (
                f"{described('logits processor', processor, owner)}: its declarations cannot be read "
                f"({type(error).__name__}: {error})"
            )
            if owner == GIVEN_PROCESSORS:
                raise ValueError(f"logits_processor: {what}") from error
            failure = host().on_failure(owner, "decodekit_logits_processors", PluginError(what))
            if failure is None:
                return None
            raise failure from error
    return stages


def refuse_kept_hooks(engine, generation_config, context, only: set[str] | None) -> None:
    """ValueError (engine.refusal) where a plugin among `only` implements, for this configuration, a hook point that
    `engine` keeps for itself (engine.refused: {hook: what it replaces})."""
    from ..registry.manager import call_hooks

    for hook in engine.refused:
        for owner, _ in call_hooks(hook, only=only, generation_config=generation_config, context=context):
            raise engine.refusal(owner, hook)


def build_pipeline(
    generation_config,
    context,
    logits_processor=None,
    stopping_criteria=None,
    cache=None,
    make_cache: bool = True,
    *,
    only: set[str] | None = None,
    engine=None,
) -> Pipeline:
    """Calls each hook point once (the config is already validated): the one assembly of a call's pipeline, for
    decodekit's loops and for another engine's. Processors are placed by their stage (`staged`); processors and
    criteria passed here run after the plugins' ones of their stage; each is tagged with the plugin that contributed
    it, and outputs are checked at every eager step (processors.LogitsProcessorList, selectors.checked_selector).
    With `make_cache=False` (continuous batching, whose paged cache serves every request) no cache is made.

    `only`: the hooks of the plugins named there alone. `engine`: another engine's loop runs the pipeline (it has
    `refused`, the hook points it keeps for itself, and `refusal(owner, hook)`): a plugin implementing one of those
    is refused; no cache is made; the selector may be None (the engine then selects)."""
    from ..registry.manager import call_first, call_hooks, host

    hook_args = dict(generation_config=generation_config, context=context)
    if engine is not None:
        refuse_kept_hooks(engine, generation_config, context, only)
    contributions = call_hooks("decodekit_logits_processors", only=only, **hook_args)
    processors = staged([*contributions, (GIVEN_PROCESSORS, list(logits_processor or ()))], host().order())
    criteria = StoppingCriteriaList()
    for owner, contributed in call_hooks("decodekit_stopping_criteria", only=only, **hook_args):
        criteria.extend_from(owner, contributed)
    criteria.extend_from(GIVEN_CRITERIA, stopping_criteria or ())
    owner, selector = call_first("decodekit_token_selector", only=only, **hook_args)
    if engine is not None:
        return Pipeline(processors, selector and checked_selector(selector, owner), criteria, None)
    if selector is None:
        raise ValueError(
            "No registered plugin selects tokens for this generation config "
            f"(do_sample={generation_config.do_sample!r}); the built-ins handle do_sample=True and False."
        )
    if cache is None and make_cache and generation_config.use_cache:
        cache = checked_cache(*call_first("decodekit_cache", only=only, **hook_args))
    reader = call_first("decodekit_next_token_logits", only=only, **hook_args)[1]
    return Pipeline(processors, checked_selector(selector, owner), criteria, cache, reader or last_position_logits)
