"""A native model as transformers presents a model to a Hub method (imported only where transformers is installed).

Methods published for transformers call its generation internals on the model they are handed
(`model._prepare_generation_config`, `model.prepare_inputs_for_generation`, `model._update_model_kwargs_for_generation`,
`GenerationMixin.generate(model, ..., custom_generate=loop)`) and run `model(...)` over transformers' Cache objects.
TransformersView gives one of decodekit's own models that surface without a second copy of anything: transformers'
own GenerationMixin, bound to a view whose `config` is the transformers config of the same checkpoint, whose
`generation_config` is transformers', and whose forward runs the native module (its kernels, its weights) over the
transformers Cache the method holds. Why a view, rather than a transformers module over the native weights or the
native family speaking transformers' Cache API: docs/architecture.md.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch
from transformers import AutoConfig, Cache, DynamicCache
from transformers import GenerationMixin as TransformersGeneration
from transformers.modeling_outputs import CausalLMOutputWithPast

from .view_step import Incremental, ViewCompile

# The output's cache field: `past_key_values` in transformers 5.16-5.23 (the oldest the extra takes), `cache` after.
OUTPUT_CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


# Inputs only other kinds of model take: a method that passes one asks for a model decodekit does not have.
OTHER_MODELS_INPUTS = {
    "encoder_outputs": "an encoder-decoder model",
    "decoder_input_ids": "an encoder-decoder model",
    "decoder_attention_mask": "an encoder-decoder model",
    "decoder_inputs_embeds": "an encoder-decoder model",
    "pixel_values": "a vision-language model",
    "input_features": "a speech model",
    "token_type_ids": "a model with token types",
    "labels": "a training forward (a loss)",
}
# What transformers' forwards take that changes nothing here: outputs are always a ModelOutput, and positions follow
# the cache (transformers 5 models ignore cache_position too; methods written for 4.5x still pass it).
IGNORED = ("return_dict", "cache_position")


def transformers_config(config):
    """The transformers config of a native model's checkpoint (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config).

    Every layer is described as full attention: the caches transformers builds from this config then keep every
    position, and the native model applies sliding windows itself, by its masks."""
    # A field decodekit leaves None takes transformers' default (its configs refuse None for some, use_sliding_window).
    fields = {name: value for name, value in config.to_dict().items() if value is not None}
    theirs = AutoConfig.for_model(fields.pop("model_type"), **fields)
    theirs.layer_types = ["full_attention"] * theirs.num_hidden_layers
    return theirs


def asked_for_missing(name: str, module) -> AttributeError:
    return AttributeError(
        f"a method asked the model for {name!r}, which transformers' PreTrainedModel has and decodekit's "
        f"{type(module).__name__} (a decoder-only text model) does not. Run the method on a transformers model "
        "(AutoModelForCausalLM.from_pretrained(..., backend='transformers') or decodekit.wrap(a transformers model)); "
        "docs/custom-generate.md lists what a method may call on each backend."
    )


# Keywords other calls take too (a tokenizer's token_type_ids, a plot's labels): refused by the forward, not by reading.
AMBIGUOUS = {"labels", "token_type_ids"}
# What a method may ask the model (the parameter `model`, as methods name it) for that only other kinds of model have.
OTHER_MODELS_ATTRIBUTES = {"get_encoder": "an encoder-decoder model", "encoder": "an encoder-decoder model"}


def asks_for_another_model(source: str, filename: str) -> list[str]:
    """What the method's code asks of the model that a decoder-only text model cannot give, found by reading it
    before it runs: `model.get_encoder()`, `encoder_outputs=`, `pixel_values=`, `output_attentions=True`, ... (each
    with its line), so such a method fails before it starts."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in OTHER_MODELS_ATTRIBUTES
            and isinstance(node.value, ast.Name)
            and node.value.id == "model"
        ):
            found.append(f"{node.attr} (line {node.lineno}), which {OTHER_MODELS_ATTRIBUTES[node.attr]} has")
        elif isinstance(node, ast.keyword) and node.arg in OTHER_MODELS_INPUTS and node.arg not in AMBIGUOUS:
            found.append(f"{node.arg}= (line {node.value.lineno}), an input of {OTHER_MODELS_INPUTS[node.arg]}")
        elif (
            isinstance(node, ast.keyword)
            and node.arg == "output_attentions"
            and isinstance(node.value, ast.Constant)
            and node.value.value is True
        ):
            found.append(f"output_attentions=True (line {node.value.lineno}), attention weights")
    return found


def check_method_file(path: Path, module) -> None:
    """ValueError before a method runs on a native model where its code asks for what only another kind of model
    has (asks_for_another_model)."""
    asked = asks_for_another_model(path.read_text(encoding="utf-8"), str(path))
    if asked:
        raise ValueError(
            f"the method's custom_generate/generate.py asks the model for {'; '.join(asked)}. decodekit's "
            f"{type(module).__name__} is a decoder-only text model that runs attention fused: run the method on a "
            "transformers model (AutoModelForCausalLM.from_pretrained(..., backend='transformers', "
            "attn_implementation='eager') or decodekit.wrap(a transformers model))."
        )


class _ViewedCache:
    """decodekit's cache protocol (update, get_seq_length) over a transformers Cache, for one native forward.

    `past` is the length the cache held before this forward. A static cache returns its whole buffer from update();
    the attention reads the `past + new` slots written so far, as transformers' mask over that buffer lets it."""

    def __init__(self, cache, past: int):
        self.cache, self.past = cache, past

    def update(self, key, value, layer_idx):
        keys, values = self.cache.update(key, value, layer_idx)
        end = self.past + key.shape[-2]
        if keys.shape[-2] > end:
            keys, values = keys[:, :, :end], values[:, :, :end]
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past


class _BaseModel:
    """`model.model` of a transformers causal LM: the embeddings, the decoder layers and the final norm."""

    def __init__(self, module):
        self.embed_tokens, self.layers, self.norm = module.embed, module.layers, module.norm


class TransformersView(TransformersGeneration):
    """One of decodekit's native models (through its facade) as transformers' generation code sees a model.

    Made by `Model.as_transformers()`; what a Hub method's generate() receives on a native model. Any attribute the
    view lacks is the facade's (and so the module's): `model.lm_head`, `model.parameters()`, `model.module`."""

    main_input_name = "input_ids"
    base_model_prefix = "model"
    input_modalities = "text"
    _is_stateful = False
    # decodekit compiles its own steps (generate(compile=True)); transformers' compile of this forward is not offered.
    _can_compile_fullgraph = False
    hf_quantizer = None
    tp_plan = None

    def __init__(self, model, steps: ViewCompile | None = None):
        """`steps`: a method call's decode steps (facade/view_step.py: compiled where the call asked to compile, else
        run eagerly); None (as_transformers()): every forward is the module's own."""
        self.__dict__.update(
            facade=model,
            module=model.module,
            config=transformers_config(model.module.config),
            generation_config=model.method_generation_config(model.generation_config),
            steps=steps,
            incremental=None,  # a cacheless method's state (view_step.Incremental)
        )

    def __getattr__(self, name: str):
        facade = self.__dict__.get("facade")
        if facade is None or name.startswith("__"):
            raise AttributeError(name)
        try:
            return getattr(facade, name)
        except AttributeError:
            raise asked_for_missing(name, self.module) from None

    def __repr__(self) -> str:
        return f"TransformersView({type(self.module).__name__}, {self.facade.name_or_path!r})"

    # --- what PreTrainedModel gives every model --------------------------------------------------------------

    @classmethod
    def can_generate(cls) -> bool:
        return True

    @classmethod
    def is_remote_code(cls) -> bool:
        return False

    @property
    def device(self) -> torch.device:
        return self.module.device

    @property
    def dtype(self) -> torch.dtype:
        return self.module.dtype

    @property
    def model(self) -> _BaseModel:
        return _BaseModel(self.module)

    def get_experts_implementation(self) -> dict:
        return {}  # no mixture-of-experts layers

    def set_experts_implementation(self, implementation) -> None:
        pass

    def get_input_embeddings(self):
        return self.module.get_input_embeddings()

    def get_output_embeddings(self):
        return self.module.get_output_embeddings()

    # --- what transformers 4.5x's models had, which methods written then call -----------------------------------

    def _reorder_cache(self, past_key_values, beam_idx):
        past_key_values.reorder_cache(beam_idx)
        return past_key_values

    def _get_initial_cache_position(self, seq_length, device, model_kwargs):
        if model_kwargs.get("cache_position") is None:
            cache = model_kwargs.get("past_key_values", model_kwargs.get("cache"))
            past = int(cache.get_seq_length()) if cache is not None else 0
            model_kwargs["cache_position"] = torch.arange(past, seq_length, device=device)
        return model_kwargs

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, cache=None, **ignored):
        """The mask prepare_inputs_for_generation builds for a static cache: left 2-D, as the native forward builds
        its own masks (causal, padding, sliding windows) from it."""
        return attention_mask

    # --- generation --------------------------------------------------------------------------------------------

    def generate(self, *args, custom_generate=None, **kwargs):
        """decodekit's generate() (every strategy at native speed, transformers' tokens); with a decoding loop given
        as custom_generate=callable, transformers' own generate(), which calls that loop as transformers does."""
        if callable(custom_generate):
            return TransformersGeneration.generate(self, *args, custom_generate=custom_generate, **kwargs)
        return self.facade.generate(*args, custom_generate=custom_generate, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values=None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """transformers' causal-LM forward, run by the native module: `cache` (or `past_key_values`) any
        transformers Cache, or none (a DynamicCache is made when use_cache); positions, where not given, follow
        the cache as transformers' models place them; the output a CausalLMOutputWithPast holding the cache."""
        self._refuse_other_inputs(kwargs)
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("forward() got two caches, cache= and past_key_values= (its older name): pass one.")
        cache = cache if cache is not None else past_key_values
        if isinstance(cache, (tuple, list)):
            raise TypeError(
                "past_key_values as a tuple of (key, value) pairs is transformers' legacy format, which "
                "transformers 5 and decodekit no longer take: pass a Cache (transformers.DynamicCache())."
            )
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask of {attention_mask.dim()} dimensions: a decodekit model builds its "
                "attention masks itself and takes the 2-D padding mask [batch, past + new] "
                f"(got shape {tuple(attention_mask.shape)})."
            )
        use_cache = self.config.use_cache if use_cache is None else use_cache
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        inputs.update(inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states)
        if cache is None and use_cache:
            return self._cacheless(logits_to_keep, **inputs)
        state = self.incremental
        if state is not None and cache is state.cache:
            self.incremental = None  # the method runs that cache itself from now on
        return self._run(cache, use_cache, logits_to_keep, **inputs)

    def _run(self, cache, use_cache, logits_to_keep, input_ids, attention_mask, position_ids, inputs_embeds,
             output_hidden_states) -> CausalLMOutputWithPast:  # fmt: skip
        if cache is None and use_cache:
            cache = DynamicCache(config=self.config)
        rows, length = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        past = int(cache.get_seq_length()) if cache is not None else 0
        steps = self.steps
        if steps is not None:
            reason = steps.refusal(cache, input_ids, inputs_embeds, output_hidden_states, length, past)
            logits = None if reason else steps.decode(cache, input_ids, attention_mask, position_ids, past)
            if logits is not None:
                return CausalLMOutputWithPast(logits=logits, **{OUTPUT_CACHE: cache if use_cache else None})
            if reason:
                steps.eager_because(reason)
        mirror = steps.mirror_of(cache) if steps is not None else None
        if mirror is not None:
            mirror.stale_from(past)
        native_cache = _ViewedCache(cache, past) if isinstance(cache, Cache) else cache
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=self.device).expand(rows, length)
        if attention_mask is not None:
            # A cache that keeps fewer positions than it has seen (a sliding or sink cache) is attended as it keeps them.
            attention_mask = attention_mask[:, -(past + length) :]
        out = self.module(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=native_cache if cache is not None else None,
            use_cache=cache is not None,
            output_hidden_states=bool(output_hidden_states),
            inputs_embeds=inputs_embeds,
            logits_to_keep=logits_to_keep,
        )
        return CausalLMOutputWithPast(
            logits=out.logits, hidden_states=out.hidden_states, **{OUTPUT_CACHE: cache if use_cache else None}
        )

    def _cacheless(self, logits_to_keep, **inputs) -> CausalLMOutputWithPast:
        """A forward given no cache (a method that runs the whole sequence every step, `model(input_ids).logits`):
        where it extends the previous such call's sequence, only the new positions run, over the cache kept from
        that call (a compiled step where the call compiles and it is one token a row); any other call runs whole
        and starts the state again. Linear work where the method's is quadratic; the logits are the full forward's
        within float rounding (a cached loop's: in bfloat16 a near tie can fall the other way)."""
        state = self.incremental
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        whole = logits_to_keep not in (0, None) or inputs["inputs_embeds"] is not None
        whole = whole or inputs["output_hidden_states"] or inputs["position_ids"] is not None or input_ids is None
        if whole or state is None or not state.extended_by(input_ids, attention_mask):
            out = self._run(None, True, logits_to_keep, **inputs)
            keep = not whole and input_ids.shape[1] > 0
            self.incremental = Incremental(input_ids, attention_mask, out[OUTPUT_CACHE], out.logits) if keep else None
            return out
        new = self._run(state.cache, True, 0, **{**inputs, "input_ids": input_ids[:, state.length :]})
        logits = state.extend(input_ids, attention_mask, new.logits)
        return CausalLMOutputWithPast(logits=logits, **{OUTPUT_CACHE: state.cache})

    def _refuse_other_inputs(self, kwargs: dict) -> None:
        for name, value in kwargs.items():
            if name in IGNORED or value is None or value is False:
                continue
            if name == "output_attentions":
                raise ValueError(
                    "output_attentions=True: decodekit's native models run attention fused and return no "
                    "attention weights; a transformers model (backend='transformers', attn_implementation="
                    "'eager') does."
                )
            if value is None:
                continue
            what = OTHER_MODELS_INPUTS.get(name)
            raise TypeError(
                f"forward() got {name}=, an input of {what or 'another kind of model'}; "
                f"{type(self.module).__name__} is a decoder-only text model and takes "
                f"{sorted(p for p in inspect.signature(self.forward).parameters if p != 'kwargs')}."
            )
