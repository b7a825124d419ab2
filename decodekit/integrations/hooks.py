"""decodekit's hook points inside another engine's loop (transformers' generate(), vLLM): the hooks' arguments
for a call, and the refusal of the hook points that engine cannot take. Imports no engine."""

from __future__ import annotations

from typing import Any

from ..core.pipeline import GenerationContext
from ..core.processors import LogitsProcessorList
from ..core.stopping import StoppingCriteriaList
from ..registry.manager import call_hooks


def hook_arguments(
    model, gc, batch_size: int, prompt_length: int, device, max_length: int | None = None
) -> dict[str, Any]:
    """The keyword arguments every hook gets (generation_config, context) for a call of this shape."""
    context = GenerationContext(
        model=model,
        batch_size=batch_size,
        prompt_length=prompt_length,
        max_length=max_length or gc.max_length_for(prompt_length),
        device=device,
    )
    return dict(generation_config=gc, context=context)


def choose(method, plugins, trust_remote_code, revision, full_loop_advice: str) -> tuple[set[str], tuple | None]:
    """(the plugin names whose hooks run, (module, plugin name) of a method or None) for an engine's adapter: one
    hook-only `method` loaded through the trust gate, else `plugins` (registered names), else every registered outside
    plugin. `full_loop_advice` ends the refusal of a method that replaces the whole loop."""
    from ..hub_loader.method import load_method
    from ..registry.manager import outside_plugins

    if method is not None:
        if plugins is not None:
            raise ValueError("Pass either method= (one hook-only method) or plugins= (registered plugins), not both.")
        loaded = load_method(method, trust_remote_code, revision=revision)
        if not loaded.hooks:
            raise ValueError(
                f"method {method!r} replaces the whole decoding loop (its generate.py defines generate()), "
                f"so it has no hooks to give; {full_loop_advice}"
            )
        return {loaded.plugin_name}, (loaded.module, loaded.plugin_name)
    registered = outside_plugins()
    if plugins is not None:
        missing = sorted(set(plugins) - registered)
        if missing:
            raise ValueError(
                f"plugins={list(plugins)!r}: {missing} are not registered; the registered outside plugins "
                f"are {sorted(registered)}."
            )
        return set(plugins), None
    return registered, None


def check_chosen(chosen: set[str], args: dict[str, Any], engine: str, refused: dict[str, str], advice: str) -> None:
    """The chosen plugins' own validation, then the refusal of the hook points in `refused` ({hook: what it
    replaces}), which `engine` cannot take; `advice` ends the message (what to do instead)."""
    call_hooks("decodekit_validate_config", only=chosen, **args)
    for hook, replaces in refused.items():
        for owner, _ in call_hooks(hook, only=chosen, **args):
            raise ValueError(
                f"plugin {owner!r} implements {hook} ({replaces}) for this configuration, which {engine} "
                f"cannot take: {advice}"
            )


def chosen_hooks(chosen: set[str], args: dict[str, Any]) -> tuple[LogitsProcessorList, StoppingCriteriaList]:
    """The logits processors (each tagged with its plugin) and stopping criteria the `chosen` plugins contribute."""
    processors = LogitsProcessorList()
    for owner, contributed in call_hooks("decodekit_logits_processors", only=chosen, **args):
        processors.extend_from(owner, contributed)
    criteria = StoppingCriteriaList()
    for _, contributed in call_hooks("decodekit_stopping_criteria", only=chosen, **args):
        criteria.extend(contributed)
    return processors, criteria
