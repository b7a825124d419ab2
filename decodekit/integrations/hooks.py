"""decodekit's hook points inside another engine's loop (transformers' generate(), vLLM, llama.cpp): which plugins
run, their config, and each call's hooks, prepared by core.generate.prepare_call as every other call is. An engine
takes some hook points and refuses the rest, naming them. Imports no engine."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, NamedTuple

import torch

from ..core.config import GenerationConfig, apply_fields
from ..core.generate import PreparedCall, prepare_call
from ..core.pipeline import build_pipeline, refuse_kept_hooks
from ..core.processors import LogitsProcessorList
from ..core.stopping import StoppingCriteriaList


class Engine(NamedTuple):
    """An engine whose loop runs decodekit's hooks: its name in messages, the hook points it cannot take ({hook: what
    it replaces}), and what to do instead (the end of a refusal)."""

    name: str
    refused: dict[str, str]
    advice: str

    def refusal(self, owner: str, hook: str) -> ValueError:
        return ValueError(
            f"plugin {owner!r} implements {hook} ({self.refused[hook]}) for this configuration, which {self.name} "
            f"cannot take: {self.advice}"
        )


# What vLLM and llama.cpp keep for themselves; each takes logits processors, a selector and stopping criteria.
OWN_LOOP_HOOKS = {
    "decodekit_cache": "the KV cache",
    "decodekit_decoding_loop": "the decoding loop",
    "decodekit_next_token_logits": "how next-token logits are read",
}


class CallHooks(NamedTuple):
    """One call's hooks inside an engine: the processors (each tagged with its plugin), the stopping criteria and the
    token selector (None where no chosen plugin gives one)."""

    processors: LogitsProcessorList
    criteria: StoppingCriteriaList
    selector: Any


@dataclasses.dataclass
class Chosen:
    """The plugins an adapter runs: their names, a method (module, plugin name) registered while their hooks are
    called (None: installed plugins), and the generation config their fields live in."""

    plugins: set[str]
    method: tuple | None = None
    config: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)

    def registered(self):
        """The method registered for the block (only for the hook calls made in it); nothing to do without one."""
        from ..hub_loader.method import registered_module

        return registered_module(*self.method) if self.method is not None else contextlib.nullcontext()

    def configure(self, fields: dict[str, Any], caller: str, model, engine: Engine, device=None) -> Chosen:
        """`fields` applied (an unknown name is refused, naming `caller`), then checked as a one-token call on
        `model` (validation, and the refusal of a hook point `engine` cannot take), so a bad value fails now rather
        than at the engine's first step."""
        with self.registered():
            apply_fields(self.config, fields, caller=caller)
            prepared = self._checked(model, prompt_length=1, max_length=2, batch_size=1, device=device, tokenizer=None)
            refuse_kept_hooks(engine, prepared.config, prepared.context, self.plugins)
        return self

    def prepare(
        self,
        model,
        engine: Engine,
        *,
        prompt_length: int,
        max_length: int,
        batch_size: int = 1,
        device=None,
        tokenizer=None,
    ) -> CallHooks:
        """The hooks of one call of `batch_size` rows on a `prompt_length`-token prompt that the engine ends at
        `max_length`: the call checked (_checked), then the chosen plugins' pipeline, assembled as every call's is
        (core.pipeline.build_pipeline), with the hook points `engine` keeps for itself refused."""
        with self.registered():
            prepared = self._checked(model, prompt_length, max_length, batch_size, device, tokenizer)
            pipeline = build_pipeline(prepared.config, prepared.context, only=self.plugins, engine=engine)
        return CallHooks(pipeline.processors, pipeline.stopping, pipeline.selector)

    def _checked(self, model, prompt_length, max_length, batch_size, device, tokenizer) -> PreparedCall:
        """prepare_call for the chosen plugins: each one's validation, the config merged as every call's is."""
        return prepare_call(
            model,
            self.config,
            prompt_length=prompt_length,
            batch_size=batch_size,
            device=device if device is not None else torch.device("cpu"),
            tokenizer=tokenizer,
            plugins=self.plugins,
            engine_max_length=max_length,
            choose_loop=False,
        )


def choose(method, plugins, trust_remote_code, revision, full_loop_advice: str) -> Chosen:
    """The plugins an engine's adapter runs: one hook-only `method` loaded through the trust gate, else `plugins`
    (registered names), else every registered outside plugin. `full_loop_advice` ends the refusal of a method that
    replaces the whole loop."""
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
        return Chosen({loaded.plugin_name}, (loaded.module, loaded.plugin_name))
    registered = outside_plugins()
    if plugins is not None:
        missing = sorted(set(plugins) - registered)
        if missing:
            raise ValueError(
                f"plugins={list(plugins)!r}: {missing} are not registered; the registered outside plugins "
                f"are {sorted(registered)}."
            )
        return Chosen(set(plugins))
    return Chosen(registered)
