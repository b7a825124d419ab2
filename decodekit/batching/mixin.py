"""`generate_batch` and `init_continuous_batching` on every decodekit model (transformers' ContinuousMixin names).

Kept apart from manager.py so a model class can inherit it without importing the batching machinery."""

from __future__ import annotations

MANAGER_OPTIONS = ("max_queue_size", "block_size", "max_cache_bytes", "max_batch_tokens", "max_running", "min_prefill")


class ContinuousMixin:
    def init_continuous_batching(self, generation_config=None, **options):
        """A ContinuousBatchingManager over this model (not started: use it as a context manager, start(), or run()
        it). Options: max_queue_size, block_size, max_cache_bytes, max_batch_tokens, max_running, min_prefill,
        methods (see decodekit.batching.ContinuousBatchingManager); any other keyword is a generation config
        field, a default of every request."""
        from ..core.config import add_plugin_fields, closest
        from .manager import ContinuousBatchingManager

        fields = {k: options.pop(k) for k in list(options) if k not in MANAGER_OPTIONS and k != "methods"}
        if fields:
            base = generation_config if generation_config is not None else self.generation_config
            generation_config = base.copy()
            known = add_plugin_fields(generation_config)
            unknown = sorted(set(fields) - known)
            if unknown:
                close = closest(unknown[0], known | set(MANAGER_OPTIONS))
                raise ValueError(f"init_continuous_batching() got unknown options {unknown}"
                                 + (f" (did you mean {close!r}?)" if close else "") + f"; it accepts generation_config, "
                                 f"{', '.join(MANAGER_OPTIONS)}, methods, and generation config fields.")
            generation_config.update(**fields)
            generation_config.validate(getattr(self.config, "vocab_size", None))
        return ContinuousBatchingManager(self, generation_config, **options)

    def generate_batch(self, inputs: list, generation_config=None, progress_bar: bool = True, **kwargs) -> dict:
        """Every prompt of `inputs` (lists of token ids) through continuous batching: {request id: GenerationOutput},
        in the order of `inputs`. kwargs: generation config fields and request arguments for every prompt
        (custom_generate, seed, logprobs, ...), and the manager's options. An invalid prompt fails alone (status
        FAILED, the message in `error`)."""
        from .manager import generate_batch

        return generate_batch(self, inputs, generation_config, progress_bar, **kwargs)
