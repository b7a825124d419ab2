"""The generate() entry point of a hook-only method: one repository that runs under decodekit and under
transformers' own `generate(custom_generate=...)`.

decodekit's loader sees the entry point (marked with ENTRY_MARKER) and uses the module's hooks, as for any
hook-only method. transformers' loader calls generate(model=..., inputs=..., **its arguments); the entry
point then runs the hooks where the model lives.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from ..core.generate import GenerationMixin
from ..hub_loader.method import ENTRY_MARKER, registered_module
from ..registry.hookspecs import LOOP_ONLY_HOOKS

# transformers' generate() arguments that decodekit's generate() has no use for when they are unset.
_TRANSFORMERS_ONLY = ("prefix_allowed_tokens_fn", "synced_gpus", "use_model_defaults")


def hooks_entry_point(module_name: str) -> Callable[..., Any]:
    """generate(model, inputs=None, **kwargs) for the hook-only method defined in module `module_name`.

    On a decodekit model (native or wrapped): decodekit's generate() with the hooks registered for the call.
    On a transformers model: transformers' generate() with the hooks as logits_processor and stopping_criteria,
    or, for a method that selects tokens, makes the cache or runs its own loop, decodekit's generate() on
    decodekit.wrap(model). The method's own keywords (its decodekit_config_fields) are taken from kwargs.
    """

    def generate(model, inputs=None, input_ids=None, **kwargs):
        module = sys.modules[module_name]
        name = f"method:{module_name}"
        prompt = inputs if inputs is not None else input_ids
        if isinstance(model, GenerationMixin):
            with registered_module(module, name):
                return model.generate(prompt, **kwargs)
        from ..facade import wrap
        from .hooks import Chosen
        from .transformers import config_for, hooks_for

        if any(hasattr(module, hook) for hook in LOOP_ONLY_HOOKS):
            # transformers' loop cannot take these: decodekit's loop runs on the transformers model.
            kwargs = {k: v for k, v in kwargs.items() if not (k in _TRANSFORMERS_ONLY and v in (None, False))}
            if kwargs.get("generation_config") is not None:  # transformers' own, read as decodekit's
                kwargs["generation_config"] = config_for(model, kwargs["generation_config"])
            with registered_module(module, name):
                return wrap(model).generate(prompt, **kwargs)
        declared = module.decodekit_config_fields() if hasattr(module, "decodekit_config_fields") else {}
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k in declared}
        hooks = hooks_for(model, Chosen({name}, (module, name)), kwargs.get("generation_config"), fields)
        # As in decodekit's loop, the caller's own processors and criteria run after the method's.
        hooks.logits_processor.extend(kwargs.pop("logits_processor", None) or [])
        hooks.stopping_criteria.extend(kwargs.pop("stopping_criteria", None) or [])
        return model.generate(prompt, **hooks._asdict(), **kwargs)

    setattr(generate, ENTRY_MARKER, True)
    generate.__doc__ = hooks_entry_point.__doc__
    return generate
