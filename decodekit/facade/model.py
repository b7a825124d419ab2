"""The model facade: what `from_pretrained` and `wrap` return, over decodekit's own model families and over
transformers models alike.

A Model holds an nn.Module (`model.module`) with the forward contract and gives it generate() (core's loop,
every hook point, strategy and custom_generate method), generate_batch() and init_continuous_batching()
(continuous batching). Calling the Model calls the module; any attribute it does not define itself is the
module's, read and written, so Hub code written for transformers models reads `model.config`,
`model.lm_head`, `model.device` as it expects. The module itself is not changed: a transformers model keeps its
forward, weights, device placement (device_map included) and quantization.

What differs between the two backends is small and decided here: the generation config a model carries
(decodekit's config.json fields, or transformers' GenerationConfig) and who lays out the KV cache (decodekit's
caches, or transformers' Cache objects, which know every architecture's layers).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from ..core.config import GenerationConfig, add_plugin_fields, reject_unknown
from ..core.generate import GenerationMixin
from . import transformers_model as hf

logger = logging.getLogger("decodekit")

BACKENDS = ("native", "transformers")

# transformers' generation internals that Hub methods call on the model they are handed (model._get_logits_processor,
# ...): GenerationMixin's own in transformers 5 and 4.5x, and what 4.5x's models added. On a native model they come
# from as_transformers() (transformers' code over the native module); a name the installed transformers lacks is
# named as such there.
TRANSFORMERS_INTERNALS = frozenset(
    {
        "_assisted_decoding",
        "_beam_search",
        "_beam_search_has_unfinished_sequences",
        "_cache_dependant_input_preparation",
        "_check_early_stop_heuristic",
        "_constrained_beam_search",
        "_expand_inputs_for_generation",
        "_extract_generation_mode_kwargs",
        "_flatten_beam_dim",
        "_gather_beams",
        "_get_cache",
        "_get_candidate_generator",
        "_get_initial_cache_position",
        "_get_logits_processor",
        "_get_running_beams_for_next_iteration",
        "_get_stopping_criteria",
        "_get_top_k_continuations",
        "_group_beam_search",
        "_has_unfinished_sequences",
        "_maybe_initialize_input_ids_for_generation",
        "_merge_criteria_processor_list",
        "_prefill",
        "_prefill_chunking",
        "_prepare_attention_mask_for_generation",
        "_prepare_cache_for_generation",
        "_prepare_generated_length",
        "_prepare_generation_config",
        "_prepare_model_inputs",
        "_prepare_position_ids_for_generation",
        "_prepare_special_tokens",
        "_prepare_static_cache",
        "_reorder_cache",
        "_sample",
        "_supports_default_dynamic_cache",
        "_supports_logits_to_keep",
        "_unflatten_beam_dim",
        "_update_finished_beams",
        "_update_model_kwargs_for_generation",
        "_valid_auto_compile_criteria",
        "_validate_generated_length",
        "_validate_generation_mode",
        "_validate_model_kwargs",
        "create_masks_for_generate",
        "heal_tokens",
        "load_custom_generate",
        "prepare_inputs_for_generation",
        "can_generate",
        "main_input_name",
        "is_remote_code",
    }
)

# Module methods that return the module: on the facade they return the facade, so
# `model = AutoModelForCausalLM.from_pretrained(...).to("cuda")` keeps generate().
_CHAINED = ("to", "cpu", "cuda", "half", "float", "bfloat16", "double", "eval", "train", "requires_grad_")


class Model(GenerationMixin):
    """A causal LM with decodekit's generation: made by decodekit.AutoModelForCausalLM.from_pretrained or
    decodekit.wrap(module). `.module` is the model itself, `.backend` "native" (decodekit's model families, or any
    nn.Module with the forward contract and a `.config`) or "transformers"."""

    # The facade's own attributes; every other attribute set on it is set on the module.
    _OWN = frozenset({"module", "backend", "generation_config", "name_or_path", "generate", "tokenizer_source"})

    def __init__(self, module, generation_config: GenerationConfig | None = None, name_or_path: str | None = None):
        if hf.is_transformers_model(module):
            hf.check_causal_lm(module)
            backend = "transformers"
            if generation_config is None:
                generation_config = hf.generation_config_from(getattr(module, "generation_config", None), module.config)
        elif isinstance(module, torch.nn.Module) and hasattr(module, "config"):
            backend = "native"
            if generation_config is None:
                generation_config = GenerationConfig.from_model_config(module.config)
        else:
            raise TypeError(
                f"wrap() takes a transformers causal LM (a PreTrainedModel, e.g. from transformers.AutoModelForCausalLM) "
                f"or a torch.nn.Module with decodekit's forward contract and a .config (one of decodekit's model "
                f"families, decodekit.loading.LlamaForCausalLM), got {type(module).__name__}."
            )
        if not isinstance(generation_config, GenerationConfig):
            raise TypeError(
                f"generation_config must be a decodekit GenerationConfig, got {type(generation_config).__name__}."
            )
        own = self.__dict__
        own["module"], own["backend"], own["generation_config"] = module, backend, generation_config
        own["_cache_keyword"] = hf.cache_keyword(module) if backend == "transformers" else "past_key_values"
        own["_prompt_only_mask"] = backend == "transformers" and hf.masks_prompt_only(module)
        own["name_or_path"] = name_or_path or getattr(module, "name_or_path", None) or type(module).__name__

    # --- the module, seen through the facade ---------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if self.__dict__.get("backend") == "transformers":
            hf.forward_arguments(self.module, self._cache_keyword, self._prompt_only_mask, args, kwargs)
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        # Only called for names the facade lacks: the module's own. Before __init__ has run (copy, pickle) there
        # is no module yet, and the name is simply missing.
        module = self.__dict__.get("module")
        if module is None:
            raise AttributeError(name)
        if name in TRANSFORMERS_INTERNALS and not hasattr(module, name):
            if self.backend == "native" and hf.installed():
                return getattr(self.as_transformers(), name)
            raise AttributeError(
                f"{name} is an internal of transformers' generate(), which a Hub method written for transformers may "
                f"call; on decodekit's own models it comes from transformers, which is not installed: install it with "
                f"{hf.TRANSFORMERS_EXTRA!r} (docs/custom-generate.md)."
            )
        return getattr(module, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._OWN or name.startswith("__"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.module, name, value)

    def __repr__(self) -> str:
        return f"Model({type(self.module).__name__}, {self.name_or_path!r}, backend={self.backend!r})"

    @property
    def forward(self):
        return self.module.forward  # its signature tells the loop which inputs the model takes (logits_to_keep)

    @property
    def device(self) -> torch.device:
        return self.module.device

    @property
    def dtype(self) -> torch.dtype:
        return self.module.dtype

    # --- what the backends differ in -------------------------------------------------------------------------

    @property
    def makes_caches(self) -> bool:
        """Whether the model's own library lays out its KV caches (transformers), rather than decodekit."""
        return self.backend == "transformers"

    def method_generation_config(self, gc: GenerationConfig):
        """The generation config a custom_generate method written for the model's library receives: a transformers
        GenerationConfig for a transformers model (its generation internals, `_get_logits_processor` and the rest,
        read transformers' fields); for a native model too where transformers is installed (the method sees
        as_transformers(), and decodekit's own fields ride along), else decodekit's own."""
        if self.backend == "transformers":
            return hf.to_transformers_config(gc)
        return hf.to_transformers_config(gc, keep_own=True) if hf.installed() else gc

    @property
    def holds_recurrent_state(self) -> bool:
        """Whether the module keeps recurrent state in its own layers rather than in the cache it is handed
        (RecurrentGemma): it then cannot run a second sequence beside the first (guidance's unconditional run) or
        grow its batch in the middle of a call (contrastive search)."""
        return self.backend == "transformers" and hf.holds_recurrent_state(self.module)

    def make_cache(self, kind: str, batch_size: int, max_length: int):
        """The cache the hook point gives a transformers model (see makes_caches): a transformers Cache laid
        out as its config asks, or None for a model that keeps a cache of its own kind."""
        if not self.makes_caches:
            raise TypeError("decodekit lays out the caches of a native model: use decodekit.families.cache.new_cache.")
        return hf.make_cache(self.module, kind, max_length)

    def as_transformers(self):
        """The model as transformers' generation code sees a model: for a transformers model, the module itself; for a
        native model, a TransformersView (facade/as_transformers.py): transformers' GenerationMixin and config over
        the native module and its kernels. What a Hub method's generate() receives where transformers is installed."""
        if self.backend == "transformers":
            return self.module
        hf.require_transformers()
        from .as_transformers import TransformersView

        return TransformersView(self)

    @contextlib.contextmanager
    def for_method(self, method_file=None, compile: dict | None = None, method: str = "method"):
        """What a custom_generate method's own generate() is handed, for the duration: the surface a method written
        for transformers calls (as_transformers()) on a native model where transformers is installed; this Model
        otherwise (a wrapped transformers model already has that surface, through the module). `method_file`: the
        method's generate.py, read first on a native model: a method asking for what only another kind of model has
        (an encoder, attention weights, images) is refused before it starts. `compile`: torch.compile's options
        (core/compile.step_options) where the call asked to compile: the view then runs the method's one-token
        forwards as a compiled step (facade/view_step.py), else as that step's function run eagerly, so that a
        method's tokens do not depend on compile=; `method` names the method in its log lines."""
        if self.backend != "native" or not hf.installed():
            if compile is not None:
                logger.info(
                    "custom_generate %s runs eagerly (compile=True): the compiled step runs under a native model's "
                    "transformers view, and this model is %s",
                    method,
                    "a transformers model" if self.backend != "native" else "native without transformers installed",
                )
            yield self
            return
        from .as_transformers import TransformersView, check_method_file
        from .view_step import ViewCompile

        if method_file is not None:
            check_method_file(method_file, self.module)
        steps = ViewCompile(self.module, compile, method)
        try:
            yield TransformersView(self, steps)
        finally:
            steps.close()

    def own_tokenizer(self):
        """The tokenizer stored with the model's files (tokenizer.json, a GGUF vocabulary), loaded at first use and
        kept, or None where the model came from none (`tokenizer_source`, set by from_pretrained, says where). What a
        plugin uses when a call passed no tokenizer= (DRY's sequence breakers, as llama.cpp reads the model's own)."""
        own = self.__dict__
        if "_own_tokenizer" not in own:
            source = own.get("tokenizer_source")
            own["_own_tokenizer"] = source() if source is not None else None
        return own["_own_tokenizer"]

    # --- generation ----------------------------------------------------------------------------------------

    def generate(self, *args, assistant_model=None, **kwargs):
        if self.backend == "transformers":
            hf.refuse_own_generation_inputs(self.module)
        # An assistant given as a bare module gets a facade too, so speculative decoding treats both models alike.
        if assistant_model is not None:
            try:
                kwargs["assistant_model"] = wrap(assistant_model)
            except TypeError as error:  # what the call got wrong is one of its arguments: a ValueError naming it
                raise ValueError(f"assistant_model={assistant_model!r:.80} is invalid: {error}") from None
        return super().generate(*args, **kwargs)

    generate.__doc__ = GenerationMixin.generate.__doc__

    def init_continuous_batching(self, generation_config: GenerationConfig | None = None, **options):
        """A ContinuousBatchingManager over this model (not started: use it as a context manager, start(), or run()
        it). Options: max_queue_size, block_size, max_cache_bytes, max_batch_tokens, max_running, min_prefill,
        paged_attention, methods (see decodekit.batching.ContinuousBatchingManager); any other keyword is a
        generation config field, a default of every request."""
        from ..batching.manager import MANAGER_OPTIONS, ContinuousBatchingManager

        if self.holds_recurrent_state:
            raise ValueError(
                f"continuous batching runs many requests through the model, each with its own cache, and "
                f"{type(self.module).__name__} keeps its recurrent state in its own layers, so the requests "
                "would overwrite each other's: call generate() with a batch of prompts instead."
            )
        fields = {k: options.pop(k) for k in list(options) if k not in MANAGER_OPTIONS and k != "methods"}
        if fields:
            base = generation_config if generation_config is not None else self.generation_config
            generation_config = base.copy()
            known = add_plugin_fields(generation_config)
            reject_unknown(
                fields,
                known | set(MANAGER_OPTIONS),
                caller="init_continuous_batching()",
                noun="options",
                accepts=f"generation_config, {', '.join(MANAGER_OPTIONS)}, methods, and generation config fields",
            )
            generation_config.update(**fields)
            generation_config.validate(getattr(self.config, "vocab_size", None))
        return ContinuousBatchingManager(self, generation_config, **options)

    def generate_batch(
        self, inputs: list, generation_config: GenerationConfig | None = None, progress_bar: bool = True, **kwargs
    ) -> dict:
        """Every prompt of `inputs` (lists of token ids) through continuous batching: {request id: GenerationOutput},
        in the order of `inputs`. kwargs: generation config fields and request arguments for every prompt
        (custom_generate, seed, logprobs, ...), and the manager's options. An invalid prompt fails alone (status
        FAILED, the message in `error`)."""
        from ..batching.manager import generate_batch

        return generate_batch(self, inputs, generation_config, progress_bar, **kwargs)


def _chained(name: str):
    def method(self, *args, **kwargs):
        getattr(self.module, name)(*args, **kwargs)
        return self

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The module's {name}(); returns this Model."
    return method


for _name in _CHAINED:
    setattr(Model, _name, _chained(_name))


def wrap(model: Any) -> Model:
    """decodekit's generation on a model that stays as it is (weights shared, not copied).

    `model`: a decoder-only transformers PreTrainedModel with a language-modelling head (on any device and dtype,
    quantized or spread with device_map), or one of decodekit's model families (decodekit.loading.LlamaForCausalLM).
    Returns a Model; wrapping one again returns it."""
    if isinstance(model, Model):
        return model
    return Model(model)
