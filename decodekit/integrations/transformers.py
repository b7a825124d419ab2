"""transformers as a backend, both ways.

- `wrap(model)`: decodekit's generate() (every hook point, strategy and custom_generate method) on a transformers
  causal LM the user already holds; the model itself is not changed (decodekit.facade).
- `to_transformers(model, ...)`: registered decodekit plugins, or one hook-only method, as the logits_processor and
  stopping_criteria of transformers' own generate().

The logits and stopping hook points map one to one onto transformers' `logits_processor` and `stopping_criteria`,
which take the same `(input_ids, scores)` protocol. The other hook points have no place in transformers' loop (it
selects tokens and makes caches itself), so a plugin that contributes to them for the given config is refused,
naming the hook; run such a method with decodekit's loop on the model instead (`decodekit.wrap(model).generate(...)`).

Hooks see the real call: the pipeline is built at the first step, when the batch size and prompt length are known,
and built again when the same lists serve a later generate() call.

Needs the `transformers` extra: pip install 'decodekit[transformers]'.
"""

from __future__ import annotations

from ..facade.transformers_model import require_transformers

require_transformers()  # an ImportError here names the extra to install

from typing import Any, NamedTuple  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

from ..facade import wrap  # noqa: E402
from ..facade.transformers_model import generation_config_from, is_transformers_model  # noqa: E402
from ..registry.hookspecs import LOOP_ONLY_HOOKS  # noqa: E402
from .hooks import Chosen, Engine, choose  # noqa: E402

__all__ = ["TransformersHooks", "is_transformers_model", "to_transformers", "wrap"]

TRANSFORMERS = Engine(
    "transformers' generate()",
    LOOP_ONLY_HOOKS,
    "only the logits and stopping hook points become its logits_processor and stopping_criteria. Run it with "
    "decodekit's loop on the model instead: decodekit.wrap(model).generate(...).",
)


class TransformersHooks(NamedTuple):
    """What to pass to transformers' generate(): `hf_model.generate(**inputs, **hooks._asdict())`."""

    logits_processor: Any  # transformers.LogitsProcessorList
    stopping_criteria: Any  # transformers.StoppingCriteriaList


class _Pipeline:
    """The chosen plugins' processors and criteria for the current generate() call, built at its first step."""

    def __init__(self, model, chosen: Chosen):
        self.model, self.chosen = model, chosen
        self.length = 0
        self.prompt = None
        self.processors = self.criteria = None

    def current(self, input_ids: torch.LongTensor, appended: bool):
        """The pipeline of the call `input_ids` belongs to. `appended`: the step's token is already in input_ids
        (stopping criteria see it; processors do not)."""
        L = input_ids.shape[1]
        # Within one call each step adds one token (criteria see it one call early), rows keep their prompt,
        # and beams reorder only among the beams of one prompt.
        same_call = (
            self.prompt is not None
            and L in (self.length, self.length + 1)
            and input_ids.shape[0] == self.prompt.shape[0]
            and torch.equal(input_ids[:, : self.prompt.shape[1]], self.prompt)
        )
        if not same_call:
            self.build(input_ids[:, : L - 1] if appended else input_ids)
        self.length = L
        return self

    def build(self, prompt: torch.LongTensor) -> None:
        batch_size, prompt_length = prompt.shape
        # transformers keeps the call's real limit; the config's is what hooks can know of it.
        max_length = max(self.chosen.config.max_length_for(prompt_length), prompt_length + 1)
        hooks = self.chosen.prepare(
            self.model,
            TRANSFORMERS,
            prompt_length=prompt_length,
            max_length=max_length,
            batch_size=batch_size,
            device=prompt.device,
        )
        self.processors, self.criteria = hooks.processors, hooks.criteria
        self.prompt = prompt.clone()


class HookLogitsProcessor(transformers.LogitsProcessor):
    """The chosen plugins' logits processors, in the order decodekit applies them, as one transformers processor."""

    def __init__(self, pipeline: _Pipeline):
        self.pipeline = pipeline

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.pipeline.current(input_ids, appended=False).processors(input_ids, scores)


class HookStoppingCriteria(transformers.StoppingCriteria):
    """The chosen plugins' stopping criteria as one transformers criterion: done [batch] where any says so."""

    def __init__(self, pipeline: _Pipeline):
        self.pipeline = pipeline

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return self.pipeline.current(input_ids, appended=True).criteria(input_ids, scores)


def to_transformers(
    model,
    *,
    method=None,
    plugins: list[str] | None = None,
    trust_remote_code=None,
    generation_config=None,
    revision: str | None = None,
    **fields,
) -> TransformersHooks:
    """decodekit plugins as transformers' logits_processor and stopping_criteria for `model`.

    model: the transformers model they will run in (hooks see it as context.model; its generation config
        gives eos/pad and defaults).
    method: one hook-only method (a Hub repo id or a local directory with custom_generate/generate.py),
        loaded with its requirement check and trust gate (`trust_remote_code`, `revision` as for
        custom_generate); else `plugins`, names of registered plugins; else every registered outside plugin.
        Built-in strategies are never included: transformers applies its own temperature, top-k, ...
    generation_config / **fields: the decodekit config fields the plugins read (e.g. a method's own keywords).
    Refuses a plugin that would select tokens, make the cache or run its own loop for this configuration.
    """
    chosen = choose(
        method,
        plugins,
        trust_remote_code,
        revision,
        "run it as transformers' own custom_generate "
        f"instead: model.generate(..., custom_generate={str(method)!r}, trust_remote_code=True).",
    )
    return hooks_for(model, chosen, generation_config, fields)


def hooks_for(model, chosen: Chosen, generation_config, fields: dict[str, Any]) -> TransformersHooks:
    """The processors and criteria of the `chosen` plugins with `fields` set on `generation_config` (or the
    model's); a bad field or value, or a hook point transformers' loop cannot take, fails here, before generate()."""
    chosen.config = config_for(model, generation_config)
    chosen.configure(fields, "to_transformers()", model, TRANSFORMERS, device=model.device)
    pipeline = _Pipeline(model, chosen)
    return TransformersHooks(
        transformers.LogitsProcessorList([HookLogitsProcessor(pipeline)]),
        transformers.StoppingCriteriaList([HookStoppingCriteria(pipeline)]),
    )


def config_for(model, generation_config):
    """A decodekit GenerationConfig: the one given, one made from a transformers GenerationConfig given, or the model's."""
    from ..core.config import GenerationConfig

    if isinstance(generation_config, GenerationConfig):
        return generation_config.copy()
    if generation_config is None or isinstance(generation_config, transformers.GenerationConfig):
        return generation_config_from(generation_config or getattr(model, "generation_config", None), model.config)
    raise TypeError(
        f"generation_config must be a decodekit or transformers GenerationConfig, got "
        f"{type(generation_config).__name__}."
    )
