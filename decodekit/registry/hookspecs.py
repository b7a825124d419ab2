"""The hook specifications: everything a decoding plugin can contribute.

Built-in strategies, installed packages, Hub repos and local directories all implement these. pluggy
calls them once per generate() call to assemble the pipeline, never per token. Every hook gets the
GenerationConfig and a GenerationContext (model, batch size, prompt length, max length, device,
tokenizer, random generator); an implementation may take only the arguments it needs.

Order. Logits processors run by stage, declared by each processor (`stage`, one of core.processors.STAGES:
guidance, constraints, penalties, samplers, post, final); one that declares none runs in "penalties", after
decodekit's own penalties and before the sampling warpers. Within a stage: the built-ins, then the other plugins in the
order they registered, then processors passed to generate() (docs/plugins.md). Stopping criteria: the built-ins
(`tryfirst`), then the others. For the firstresult hooks (selector, cache, loop), the most recently registered plugin
that returns something other than None wins, so an outside plugin overrides a built-in by returning a value.
"""

from __future__ import annotations

import pluggy

PROJECT = "decodekit"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def decodekit_config_fields():
    """Generation config fields this plugin reads, as {name: default}.

    generate() accepts them as keyword arguments and rejects names no plugin declares.
    """


@hookspec
def decodekit_validate_config(generation_config, context):
    """Raise ValueError (naming the field, the value, what is accepted) if the config is invalid for this plugin."""


@hookspec
def decodekit_logits_processors(generation_config, context):
    """The logits hook point: a list of processors `(input_ids, scores) -> scores`, applied in order within the
    stage each declares (see Order above)."""


@hookspec(firstresult=True)
def decodekit_token_selector(generation_config, context):
    """The selection hook point: a selector `(input_ids, scores) -> next_tokens [B]`, or None to pass."""


@hookspec
def decodekit_stopping_criteria(generation_config, context):
    """The stopping hook point: a list of criteria `(input_ids, scores) -> done [B]`."""


@hookspec
def decodekit_cache_implementations():
    """Names this plugin accepts for `cache_implementation`."""


@hookspec(firstresult=True)
def decodekit_cache(generation_config, context):
    """The cache hook point: a KV cache for this call (update, get_seq_length, crop, reorder), or None to pass."""


@hookspec(firstresult=True)
def decodekit_decoding_loop(generation_config, context):
    """A decoding loop for strategies whose step is not "one token per row from a selector" (beam search,
    speculative decoding, contrastive search), or None to use the core loop.

    Returns an object with `rows_per_prompt(generation_config) -> int` (how many rows each prompt is
    expanded to) and `__call__(model, input_ids, attention_mask, pipeline, generation_config, streamer,
    context)`, which runs the loop with the pipeline's processors, stopping criteria and cache (the
    other hook points) and returns generate()'s result. A loop may declare `one_token_per_row = True`: it makes one
    token per row and step from the selector, as the core loop does, only faster (compile=True's fused step), so
    continuous batching, whose own step does that, serves a request that chose it.
    """


@hookspec(firstresult=True)
def decodekit_next_token_logits(generation_config, context):
    """How the core loop reads next-token logits from a model output, or None for `output.logits[:, -1]`.

    Returns a callable `(model_output) -> logits [B, V]` with an attribute `needs_hidden_states` (bool):
    when True, the loop asks the model for hidden states (DoLa contrasts early-exit layers this way).
    """


# The hook points only decodekit's own loop can take, and what each replaces: another engine's loop
# (transformers' generate(), vLLM) takes processors and stopping criteria, and refuses a plugin with these.
LOOP_ONLY_HOOKS = {
    "decodekit_token_selector": "token selection",
    "decodekit_cache": "the KV cache",
    "decodekit_decoding_loop": "the decoding loop",
    "decodekit_next_token_logits": "how next-token logits are read",
}


def hook_names() -> list[str]:
    """Every hook point's name, sorted."""
    return sorted(name for name, value in globals().items() if name.startswith("decodekit_") and callable(value))


def unknown_hook(name: str) -> str | None:
    """What is wrong with a function `name` offered as a hook implementation (no hook point has that name, with the
    closest one), or None: the one check, for a registered plugin and for `decodekit check` of a method."""
    import difflib

    names = hook_names()
    if name in names:
        return None
    close = difflib.get_close_matches(name, names, n=1)
    return f"{name} is not a decodekit hook" + (f" (did you mean {close[0]}?)" if close else f"; the hooks are {names}")
