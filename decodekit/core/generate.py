"""generate(): input preparation, pipeline assembly through the hook points, and the decode loop."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
from typing import Any, NamedTuple

import torch

from ..families.cache import cached_length, recurrent
from .compile import check_compile_config, step_options
from .config import GenerationConfig, accepted_fields, add_plugin_fields, apply_fields, is_int, reject_unknown
from .limits import check_call_size
from .outputs import loop_result
from .pipeline import GenerationContext, Pipeline, build_pipeline
from .processors import check_scores
from .rows import Rows
from .stack import stack_room

logger = logging.getLogger("decodekit")

MODEL_INPUTS = ("input_ids", "attention_mask", "past_key_values")


def merge_config(model, generation_config: GenerationConfig | None, kwargs: dict[str, Any]):
    """A copy of the config with generate()'s keyword arguments applied; returns (config, model_kwargs).

    A keyword that is neither a config field (built-in or declared by a plugin) nor a model input is
    an error, so a typo never passes silently.
    """
    base = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    if base is not None and not isinstance(base, GenerationConfig) and callable(getattr(base, "to_diff_dict", None)):
        # transformers' GenerationConfig (a Hub method passing its own back): the fields it sets, those decodekit knows.
        known = set(accepted_fields())
        base = GenerationConfig(**{k: v for k, v in base.to_diff_dict().items() if k in known})
    if base is not None and not isinstance(base, GenerationConfig):
        raise TypeError(
            f"generation_config must be a decodekit or transformers GenerationConfig, got {type(base).__name__}."
        )
    gc = base.copy() if base is not None else GenerationConfig()
    known = add_plugin_fields(gc)
    model_kwargs = {k: kwargs.pop(k) for k in MODEL_INPUTS if k in kwargs}
    reject_unknown(
        kwargs,
        known | set(MODEL_INPUTS),
        caller="generate()",
        noun="arguments",
        accepts=f"the model inputs {list(MODEL_INPUTS)}, the generation config fields {sorted(known)}, and "
        "generation_config, logits_processor, stopping_criteria, streamer, tokenizer, seed, generator, "
        "custom_generate, trust_remote_code",
    )
    gc.update(**kwargs)
    if gc.max_new_tokens is not None and gc.max_length is not None and "max_length" in kwargs:
        logger.warning(
            "Both max_new_tokens (=%s) and max_length (=%s) are set; max_new_tokens takes precedence, as in "
            "transformers.",
            gc.max_new_tokens,
            gc.max_length,
        )
    return gc, model_kwargs


def preflight(fields: dict[str, Any], also_known: set[str] = frozenset()) -> GenerationConfig:
    """The generation config `fields` ask for, checked before any model is loaded (the command line checks its flags
    so; a bad value must not wait for a long load): every name a field (with a did-you-mean) or in `also_known` (a
    method's own parameters), the built-in checks, then each plugin's decodekit_validate_config with a context that
    has no model. A check that needs the model (a layer count, the tokenizer) is left to the call."""
    from ..registry.manager import before_loading

    gc = GenerationConfig()
    apply_fields(gc, fields, caller="the command line", also_known=set(also_known) | set(MODEL_INPUTS))
    gc.validate(None)
    with before_loading():
        prepare_call(None, gc, prompt_length=1, batch_size=1, device=torch.device("cpu"), choose_loop=False)
    return gc


# Fields that change only sampling, at the value that leaves sampling as it is (top_k also picks contrastive
# search's candidates). Set by a call that does not sample, they change nothing: said once per field and process, as
# transformers says it (the command line refuses them).
SAMPLING_ONLY = {
    "temperature": 1.0,
    "top_p": 1.0,
    "min_p": None,
    "typical_p": 1.0,
    "top_k": 50,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
}
_warned_unused: set[str] = set()


def warn_unused_sampling_fields(gc: GenerationConfig, given: dict[str, Any]) -> None:
    """Says which of SAMPLING_ONLY the call `given` set without sampling; for a validated config (validate_for_model)."""
    if gc.do_sample is not False:
        return
    unused = [
        name
        for name, neutral in SAMPLING_ONLY.items()
        if type(given.get(name)) in (int, float)
        and given[name] != neutral
        and name not in _warned_unused
        and not (name == "top_k" and getattr(gc, "penalty_alpha", None))
    ]
    if unused:
        _warned_unused.update(unused)
        shown = ", ".join(f"{name}={given[name]!r}" for name in unused)
        logger.warning(
            "do_sample is False: %s only change(s) sampling and will be ignored; pass do_sample=True to "
            "sample (said once).",
            shown,
        )


def check_call_objects(streamer, logits_processor, stopping_criteria, past_key_values) -> None:
    """TypeError naming the argument where generate() is handed something other than the object it takes."""
    if streamer is not None and not (
        callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))
    ):
        raise TypeError(
            f"streamer={streamer!r} is invalid; expected an object with put(token_ids) and end() "
            "(e.g. decodekit.TextStreamer) or None."
        )
    for name, value, what in (
        ("logits_processor", logits_processor, "(input_ids, scores) -> scores"),
        ("stopping_criteria", stopping_criteria, "(input_ids, scores) -> done[batch]"),
    ):
        if value is not None and (not isinstance(value, (list, tuple)) or not all(callable(f) for f in value)):
            raise TypeError(
                f"{name}={value!r} is invalid; expected a list of callables {what} "
                f"(a {'LogitsProcessorList' if name == 'logits_processor' else 'StoppingCriteriaList'} "
                "works) or None."
            )
    if past_key_values is not None and not callable(getattr(past_key_values, "get_seq_length", None)):
        raise TypeError(
            f"past_key_values={past_key_values!r} is invalid; expected a cache object (get_seq_length, "
            "update, ...: a decodekit or transformers Cache) or None."
        )


def validate_for_model(model, gc: GenerationConfig) -> None:
    """Validates the call's config for the model's vocabulary and, as transformers does, pads with the first EOS
    where no pad_token_id is set."""
    gc.validate(getattr(getattr(model, "config", None), "vocab_size", None))
    if gc.pad_token_id is None and gc.eos_token_ids:
        gc.pad_token_id = gc.eos_token_ids[0]


def call_limits(model, gc: GenerationConfig, prompt_length: int, seed, generator):
    """(max_length, generator) of a call on a prompt of `prompt_length` tokens: ValueError if nothing would be
    generated or the seed is invalid; a generator seeded with `seed` where none is given."""
    max_length = gc.max_length_for(
        prompt_length, getattr(getattr(model, "config", None), "max_position_embeddings", None)
    )
    if max_length <= prompt_length:
        raise ValueError(
            f"The prompt has {prompt_length} tokens and max_length is {max_length}: nothing to generate. "
            "Set max_new_tokens (tokens to generate after the prompt)."
        )
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2**64):
        raise ValueError(f"seed={seed!r} is invalid; expected an integer in [0, 2**64).")
    if generator is None and seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)
    return max_length, generator


@dataclasses.dataclass
class PreparedCall:
    """A call, prepared once the same way wherever it comes from (generate(), a continuous-batching request, an
    engine's adapter): its config (merged, validated for the model, every plugin's validation passed), the context
    the hooks see, the call's length and random generator, and the decoding loop a plugin claimed (None: the core
    loop, or a loop of the caller's own)."""

    config: GenerationConfig
    context: GenerationContext
    max_length: int
    generator: torch.Generator | None
    loop_owner: str | None = None
    loop: Any = None
    plugins: set[str] | None = None


def call_config(model, generation_config: GenerationConfig | None, fields: dict[str, Any]):
    """(config, model inputs) of a call: the model's config (or the one given) with `fields` applied (merge_config:
    an unknown name is an error), validated for the model (validate_for_model), and a word for sampling fields that a
    greedy call would ignore."""
    given = dict(fields)
    gc, model_kwargs = merge_config(model, generation_config, fields)
    validate_for_model(model, gc)
    warn_unused_sampling_fields(gc, given)
    return gc, model_kwargs


def prepare_call(
    model,
    gc: GenerationConfig,
    *,
    prompt_length: int,
    batch_size: int,
    device,
    seed=None,
    generator=None,
    tokenizer=None,
    before_hooks=None,
    choose_loop: bool = True,
    plugins: set[str] | None = None,
    engine_max_length: int | None = None,
) -> PreparedCall:
    """The one preparation every entry point shares, after call_config(): the call's limits (nothing to generate, an
    invalid seed: ValueError), `before_hooks(max_length)` (the caller's own checks that must come before any plugin
    runs: a request's admission), the hooks' context, every plugin's decodekit_validate_config, and the decoding
    loop a plugin claims (where `choose_loop`). `plugins`: the names whose hooks run (None: every registered one);
    `engine_max_length`: the length at which another engine, which keeps its own limits, ends the call."""
    from ..registry.manager import call_first, call_hooks

    if engine_max_length is None:
        max_length, generator = call_limits(model, gc, prompt_length, seed, generator)
    else:
        max_length = engine_max_length
    if before_hooks is not None:
        before_hooks(max_length)
    context = GenerationContext(
        model=model,
        batch_size=batch_size,
        prompt_length=prompt_length,
        max_length=max_length,
        device=device,
        tokenizer=tokenizer,
        generator=generator,
    )
    # Plugins validate their fields before any of them is used to pick a loop.
    call_hooks("decodekit_validate_config", only=plugins, generation_config=gc, context=context)
    owner, loop = (
        call_first("decodekit_decoding_loop", only=plugins, generation_config=gc, context=context)
        if choose_loop
        else (None, None)
    )
    return PreparedCall(gc, context, max_length, generator, owner, loop, plugins)


def loop_inputs(model, gc: GenerationConfig, call: PreparedCall, loop, input_ids, attention_mask, tokenizer):
    """(input_ids, attention_mask, context) as the loop runs them: each prompt repeated for its rows
    (num_return_sequences, or what the claimed loop asks), the call's size checked, the prompt healed (token_healing,
    the length counted again from the healed prompt), and the context saying the batch and its left padding."""
    context, max_length = call.context, call.max_length
    rows = loop.rows_per_prompt(gc) if loop is not None else gc.num_return_sequences
    check_call_size(model, gc, input_ids.shape[0], rows, input_ids.shape[1], max_length)
    input_ids, attention_mask = expand_rows(input_ids, attention_mask, rows)
    if gc.token_healing:
        from .healing import heal_tokens

        input_ids, attention_mask = heal_tokens(model, input_ids, tokenizer)
        max_length = call_limits(model, gc, input_ids.shape[1], None, None)[0]
        context = dataclasses.replace(context, prompt_length=input_ids.shape[1], max_length=max_length)
    padding = None if attention_mask is None else (attention_mask != 0).int().argmax(dim=1)
    return input_ids, attention_mask, dataclasses.replace(context, batch_size=input_ids.shape[0], padding=padding)


def check_prompt_ids(model, input_ids) -> None:
    """The check every prompt meets, in generate() (a tensor) and in a continuous-batching request (a list of ints): at
    least one token, each inside the model's vocabulary (ValueError naming the first that is not)."""
    tensor = isinstance(input_ids, torch.Tensor)
    if (input_ids.numel() if tensor else len(input_ids)) == 0:
        shape = f" (shape {tuple(input_ids.shape)})" if tensor else ""
        raise ValueError(f"input_ids is empty{shape}; a prompt needs at least one token, e.g. the BOS token.")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        return
    if tensor:
        outside = (input_ids < 0) | (input_ids >= vocab)
        bad = int(input_ids[outside].flatten()[0]) if bool(outside.any()) else None
    else:
        bad = next((t for t in input_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"input_ids contains the token id {bad}, outside the vocabulary [0, {vocab}).")


def checked_ids(model, gc: GenerationConfig, input_ids) -> torch.Tensor:
    """input_ids checked (an integer tensor [batch, seq], ids inside the vocabulary) and copied to the model's
    device; None: one row starting at BOS, as transformers does."""
    if input_ids is None:
        if gc.bos_token_id is None:
            raise ValueError(
                "generate() needs input_ids (a LongTensor [batch, seq]), e.g. tokenizer(text, "
                "return_tensors='pt'); without them it starts from bos_token_id, which is not set."
            )
        input_ids = torch.tensor([[gc.bos_token_id]])
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.long, torch.int, torch.int32):
        raise ValueError(
            f"input_ids must be an integer torch.Tensor [batch, seq], got {type(input_ids).__name__}"
            + (f" of dtype {input_ids.dtype}" if isinstance(input_ids, torch.Tensor) else "")
            + "."
        )
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be 2-D [batch, seq], got shape {tuple(input_ids.shape)}; "
            "for a single prompt use input_ids[None]."
        )
    check_prompt_ids(model, input_ids)
    return input_ids.to(model.device, torch.long, copy=True)  # a processor that writes into it writes into ours


def checked_mask(model, gc: GenerationConfig, input_ids: torch.Tensor, attention_mask):
    """attention_mask checked (0s and 1s, input_ids' shape) on the model's device; without one, inferred from a
    run of pad tokens at the start of a row."""
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
            shape = (
                tuple(attention_mask.shape)
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask).__name__
            )
            raise ValueError(
                f"attention_mask must be a tensor of the same shape as input_ids {tuple(input_ids.shape)}, got {shape}."
            )
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must contain only 0 (padding) and 1 (token).")
        return attention_mask.long().to(model.device)
    if gc.pad_token_id is not None and bool((input_ids[:, 0] == gc.pad_token_id).any()):
        # Only a run of pad tokens at the start is padding. A pad id later on is a real token (it is often EOS too,
        # e.g. <|im_end|> inside a chat prompt).
        return 1 - (input_ids == gc.pad_token_id).long().cumprod(dim=1)
    if input_ids.shape[0] > 1 and gc.pad_token_id is not None and bool((input_ids[:, -1] == gc.pad_token_id).any()):
        logger.warning(
            "A prompt ends with the pad token %d and no attention_mask was given: if the batch is right-padded, "
            "pass attention_mask and pad on the left (tokenizer padding_side='left').",
            gc.pad_token_id,
        )
    return None


def prepare_inputs(model, gc: GenerationConfig, input_ids, attention_mask):
    """Validates input_ids and attention_mask; infers a mask from left padding; drops an all-ones mask."""
    input_ids = checked_ids(model, gc, input_ids)
    attention_mask = checked_mask(model, gc, input_ids, attention_mask)
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and input_ids.shape[1] > context:
        logger.warning(
            "The prompt has %d tokens, more than the model's context of %d (max_position_embeddings); "
            "output past it is unreliable.",
            input_ids.shape[1],
            context,
        )
    if attention_mask is not None:
        if bool((attention_mask.sum(-1) == 0).any()):
            raise ValueError("attention_mask has a row with no tokens; every prompt needs at least one.")
        if input_ids.shape[0] > 1 and bool((attention_mask[:, -1] == 0).any()):
            logger.warning(
                "A prompt is right-padded; decoder-only models need left padding (tokenizer padding_side='left')."
            )
        if bool(attention_mask.all()):
            attention_mask = None  # no padding: the model's fastest path
    return input_ids, attention_mask


def expand_rows(input_ids, attention_mask, n: int):
    """Each prompt repeated n times in a row (for num_return_sequences, beams)."""
    if n == 1:
        return input_ids, attention_mask
    return input_ids.repeat_interleave(n, dim=0), attention_mask.repeat_interleave(
        n, dim=0
    ) if attention_mask is not None else None


def mask_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """The position of every token of left-padded rows: real tokens count from 0; padding sits at 0 (masked)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def checked_loop(owner: str | None, loop):
    """`loop` as decodekit_decoding_loop returned it, if it keeps the hook's contract (callable, with
    rows_per_prompt); else a PluginError naming the plugin, which is disabled as a failing processor's is."""
    from ..registry.manager import PluginError, plugin_failure

    if loop is None or (callable(loop) and callable(getattr(loop, "rows_per_prompt", None))):
        return loop
    error = PluginError(
        f"plugin {owner!r}: decodekit_decoding_loop returned {type(loop).__name__}, not a loop: an "
        "object with rows_per_prompt(generation_config) and __call__(model, input_ids, attention_mask, "
        "pipeline, generation_config, streamer, context)."
    )
    raise plugin_failure(error, owner, "decodekit_decoding_loop's result", f"the decoding loop of plugin {owner!r}")


def run_loop(owner: str | None, loop, *arguments):
    """A plugin's decoding loop on the call's prepared arguments: one that raises fails the call naming the plugin,
    and an installed or run-time plugin is disabled (registry.guarded), as its processors would be."""
    from ..registry.manager import guarded

    return guarded("decoding loop", owner, None, lambda: loop(*arguments))


def token_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The position of every token of `input_ids` [B, T] for a forward of the whole sequence: the mask's
    (mask_positions) where there is one, else 0..T-1 where the forward takes position_ids, else None. Decoding loops
    give positions wherever the forward takes them, as transformers' generate() does: a transformers model derives
    them from the cache length, not the mask, and some derive none (Bamba put every decoded token at position 0)."""
    if attention_mask is not None:
        return mask_positions(attention_mask)
    if not forward_accepts(model, "position_ids"):
        return None
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)


def forward_accepts(model, name: str) -> bool:
    """Whether `model`'s forward (or `model` itself, a plain function as transformers' tests hand processors) names
    the keyword `name`."""
    try:
        params = inspect.signature(getattr(model, "forward", model)).parameters
    except (TypeError, ValueError):
        return False
    return name in params


class GenerationMixin:
    """Adds generate() to any model with the forward contract
    `model(input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True)`."""

    @torch.inference_mode()
    @stack_room
    def generate(
        self,
        inputs: torch.LongTensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor=None,
        stopping_criteria=None,
        streamer=None,
        tokenizer=None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        custom_generate=None,
        trust_remote_code: bool | None = None,
        **kwargs,
    ):
        """Generate continuations of `inputs` (or input_ids=). Keyword arguments are generation config fields.

        Returns the sequences [B * num_return_sequences, T], prompt included, or a GenerateOutput when
        return_dict_in_generate=True.
        """
        from ..registry.manager import pinned_plugins

        given = dict(inputs=inputs, generation_config=generation_config, logits_processor=logits_processor)
        given.update(stopping_criteria=stopping_criteria, streamer=streamer, tokenizer=tokenizer, seed=seed)
        given.update(generator=generator)
        if (
            custom_generate is not None
            and not callable(custom_generate)
            and not isinstance(custom_generate, (str, os.PathLike))
        ):
            raise ValueError(
                f"custom_generate={custom_generate!r} is invalid; it accepts a Hub repo id 'org/name', a local "
                "directory holding custom_generate/generate.py, or a callable."
            )
        with pinned_plugins():  # one set of plugins for the whole call, whatever other threads' failures disable
            if isinstance(custom_generate, (str, os.PathLike)):
                return run_method(self, custom_generate, trust_remote_code, given, kwargs)
            return self.generate_call(given, kwargs, custom_generate)

    def generate_call(self, given: dict, kwargs: dict, custom_generate=None):
        """generate() once its method is known: `given` its named arguments (inputs, generation_config,
        logits_processor, stopping_criteria, streamer, tokenizer, seed, generator), `kwargs` the rest, and
        `custom_generate` a callable loop or None. A hook-only method's call comes here with its hooks registered,
        without entering generate() again."""
        inputs, generation_config = given["inputs"], given["generation_config"]
        logits_processor, stopping_criteria = given["logits_processor"], given["stopping_criteria"]
        streamer, tokenizer, seed, generator = given["streamer"], given["tokenizer"], given["seed"], given["generator"]
        check_call_objects(streamer, logits_processor, stopping_criteria, kwargs.get("past_key_values"))
        method_extras = pop_declared_parameters(custom_generate, kwargs) if custom_generate is not None else {}
        if inputs is not None:
            if "input_ids" in kwargs:
                raise ValueError("Pass the prompt once: as `inputs` or as `input_ids`, not both.")
            kwargs["input_ids"] = inputs
        gc, model_kwargs = call_config(self, generation_config, kwargs)
        input_ids, attention_mask = prepare_inputs(
            self, gc, model_kwargs.get("input_ids"), model_kwargs.get("attention_mask")
        )
        batch, prompt_length = input_ids.shape
        call = prepare_call(
            self, gc, prompt_length=prompt_length, batch_size=batch, device=input_ids.device, seed=seed,
            generator=generator, tokenizer=tokenizer, choose_loop=custom_generate is None,
        )  # fmt: skip
        loop = checked_loop(call.loop_owner, call.loop)
        check_inner_outputs(self, gc, loop)
        input_ids, attention_mask, context = loop_inputs(self, gc, call, loop, input_ids, attention_mask, tokenizer)
        pipeline = build_pipeline(gc, context, logits_processor, stopping_criteria, model_kwargs.get("past_key_values"))
        arguments = (input_ids, attention_mask, pipeline, gc)
        if loop is not None:
            result = run_loop(call.loop_owner, loop, self, *arguments, streamer, context)
        elif custom_generate is not None:
            result = run_callable(custom_generate, self, *arguments, context, streamer, method_extras)
        else:
            result = decode(self, *arguments, streamer)
        return finish_processors(pipeline, result)

    @contextlib.contextmanager
    def for_method(self, method_file=None, compile: dict | None = None, method: str = "method"):
        """What a custom_generate method's own generate() is handed, for the duration: this model (the facade hands
        a native model as transformers presents one, with a compiled step where `compile` gives torch.compile's
        options: facade/model.Model.for_method)."""
        if compile is not None:
            logger.info("custom_generate %s runs eagerly (compile=True): %s has no compiled step for methods",
                        method, type(self).__name__)  # fmt: skip
        yield self

    @staticmethod
    def compute_transition_scores(sequences, scores, beam_indices=None, normalize_logits: bool = False) -> torch.Tensor:
        """The score of each generated token: [rows, generated length], 0 past a sequence's end.

        `scores`: the per-step tuple from return_dict_in_generate=True, output_scores=True (or `logits`).
        `beam_indices`: from beam search; each step's row in `scores` (-1 past the end). Without it, row r
        of the output reads row r of every step. `normalize_logits=True` applies log_softmax per step first.
        For beam search, sum(scores) / generated_length ** length_penalty gives back `sequences_scores`.
        """
        steps = torch.stack(tuple(scores))  # [steps, rows, V]
        if normalize_logits:
            steps = torch.log_softmax(steps.float(), dim=-1)
        if beam_indices is None:
            beam_indices = torch.arange(steps.shape[1], device=steps.device)[:, None].expand(-1, steps.shape[0])
        valid = beam_indices >= 0
        length = int(valid.sum(dim=1).max())
        rows, valid = beam_indices[:, :length].clamp(min=0), valid[:, :length]
        tokens = sequences[:, sequences.shape[1] - length :]
        step = torch.arange(length, device=steps.device)[None, :].expand_as(rows)
        return torch.where(valid, steps[step, rows, tokens], torch.zeros((), dtype=steps.dtype, device=steps.device))


def check_inner_outputs(model, gc: GenerationConfig, loop) -> None:
    """ValueError where the call asks for hidden states or attention weights that its loop or model cannot give."""
    inner = [name for name in ("output_hidden_states", "output_attentions") if getattr(gc, name)]
    if inner and loop is not None:
        raise ValueError(
            f"{inner[0]}=True is supported by greedy decoding and sampling (the core loop); this call "
            "runs another strategy's loop" + (" (compile=True's fused step)" if gc.compile else "") + "."
        )
    if gc.output_attentions and getattr(model, "returns_attentions", True) is False:
        raise ValueError(
            "output_attentions=True needs a model that returns attention weights: decodekit's native "
            "models do not; a transformers model through decodekit.wrap (attn_implementation='eager') does."
        )


def run_callable(fn, model, input_ids, attention_mask, pipeline: Pipeline, gc, context, streamer, extras: dict):
    """custom_generate given as a callable: it gets what transformers' decoding methods get (prepared ids, processors,
    criteria, the call's config with both lengths set), the token selector where it declares `token_selector`, and
    the keywords it declares that the call passed (`extras`)."""
    if "token_selector" in inspect.signature(fn).parameters:
        extras = {**extras, "token_selector": pipeline.selector}
    return fn(
        model,
        input_ids,
        pipeline.processors,
        pipeline.stopping,
        prepared_config(gc, context.prompt_length, context.max_length),
        streamer=streamer,
        attention_mask=attention_mask if attention_mask is not None else torch.ones_like(input_ids),
        past_key_values=pipeline.cache,
        use_cache=gc.use_cache,
        **extras,
    )


def finish_processors(pipeline: Pipeline, result):
    """generate()'s result, after each processor that declares `finishes` has seen it (structured output reports
    rows cut off before their constraint allowed an end)."""
    for processor, declared in zip(pipeline.processors, pipeline.capabilities):
        if declared.finishes:
            processor.finish(result)
    return result


# What a custom_generate callable always receives; anything else it declares is taken from generate()'s kwargs.
CALLABLE_PARAMETERS = {
    "model",
    "input_ids",
    "logits_processor",
    "stopping_criteria",
    "generation_config",
    "streamer",
    "attention_mask",
    "past_key_values",
    "use_cache",
    "token_selector",
}


def pop_declared_parameters(fn, kwargs: dict) -> dict:
    params = inspect.signature(fn).parameters.values()
    declared = [p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    return {name: kwargs.pop(name) for name in declared if name not in CALLABLE_PARAMETERS and name in kwargs}


def prepared_config(gc: GenerationConfig, prompt_length: int, max_length: int) -> GenerationConfig:
    """The call's config as a method receives it: max_length and max_new_tokens both set, so a loop written for
    either (`while length < generation_config.max_length`) runs to the call's end."""
    gc = gc.copy()
    gc.max_length, gc.max_new_tokens = max_length, max_length - prompt_length
    return gc


class MethodCall(NamedTuple):
    """A full-loop method's call, prepared once (prepare_method_call): the keyword arguments its generate() gets, the
    torch.compile options of its one-token steps (None: run eagerly, the same step's function) and the method file and
    label its model view is made for."""

    arguments: dict
    compile: dict | None
    method_file: Any
    label: str

    def run(self, model, fn, *args):
        """fn(the view of `model` made for this call, *args, **arguments)."""
        with model.for_method(self.method_file, self.compile, self.label) as target:
            return fn(target, *args, **self.arguments)


# Fields that are decodekit's request about how the method's steps run, not the method's own arguments (transformers'
# generate() would take compile_config as its own): taken out of what the method gets.
COMPILE_FIELDS = ("compile", "compile_config", "disable_compile")


def prepare_method_call(model, method, arguments: dict, kwargs: dict) -> MethodCall:
    """The one preparation of a full-loop method's call, whichever route it comes by: generate(custom_generate=...)
    (`arguments`: generate()'s named arguments, `kwargs` the rest) or a model repo's own custom_generate/ bound at
    from_pretrained (every argument in `kwargs`). The call's config is merged and validated once, through call_config:
    the model's config (or the generation_config given) with the config fields among the arguments and the compile
    fields applied. The method gets every argument as given (fields too, for methods that read them there) and, where
    its generate() takes it, that config as `generation_config` with the call's lengths set (prepared_config); the
    compile fields go to the steps' options instead."""
    from ..hub_loader.method import forwarded_arguments

    fn = method.generate
    asked = {name: kwargs.pop(name) for name in COMPILE_FIELDS if name in kwargs}
    given = forwarded_arguments(fn, arguments, kwargs)
    base = given.get("generation_config")
    gc = method_config(model, base, given, asked)
    options = step_options(gc.compile_config, model.device) if gc.compile or gc.compile_config is not None else None
    if asked:  # the steps' request, not the method's: its config keeps the values the call started from
        start = base if isinstance(base, GenerationConfig) else getattr(model, "generation_config", None)
        defaults = GenerationConfig()
        add_plugin_fields(defaults)
        gc = gc.copy()
        gc.update(**{name: getattr(start, name, getattr(defaults, name)) for name in asked})
    parameters = inspect.signature(fn).parameters
    takes_config = "generation_config" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    if takes_config and (base is None or isinstance(base, GenerationConfig)):
        prompt = given.get("input_ids", given.get("inputs"))
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 2:
            length = prompt.shape[1]
            max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
            gc = prepared_config(gc, length, gc.max_length_for(length, max_positions))
        convert = getattr(model, "method_generation_config", None)  # the facade's: transformers' config for its models
        given["generation_config"] = convert(gc) if convert is not None else gc
    return MethodCall(given, options, method.source.method_dir / "generate.py", method.source.label)


def method_config(model, base, given: dict, asked: dict) -> GenerationConfig:
    """The config of a method's call: call_config over `base` (None: the model's; a transformers config: the fields
    decodekit knows) with the config fields among `given` (a method's own arguments are not fields: left out) and the
    compile fields `asked`, checked (check_compile_config)."""
    probe = GenerationConfig()
    known = add_plugin_fields(probe)
    fields = {k: v for k, v in given.items() if k in known and k != "generation_config"}
    gc, _ = call_config(model, base, {**fields, **asked})
    check_compile_config(gc)
    return gc


def run_method(model, spec, trust_remote_code, arguments: dict, kwargs: dict):
    """custom_generate given as a Hub repo id or a local directory."""
    from ..hub_loader.method import load_method, registered_for_call

    load_options = {k: kwargs.pop(k) for k in ("revision", "token", "local_files_only") if k in kwargs}
    method = load_method(spec, trust_remote_code, **load_options)
    if method.generate is not None:
        return prepare_method_call(model, method, arguments, kwargs).run(model, method.generate)
    with registered_for_call(method):  # its hooks, for this call's hook calls alone
        return model.generate_call(arguments, kwargs)


def prefill_in_chunks(model, step_ids, step_positions, attention_mask, cache, cached: int, chunk: int, keep_one: bool):
    """The prompt's tokens past `cached` fed `chunk` at a time, less memory for their activations, until at most one
    chunk is left: (what is left, its positions) for the first step, whose logits decide as before. Not for a
    recurrent (state-space) cache: transformers' Mamba reads a multi-token input as a new prompt."""
    while step_ids.shape[1] > chunk:
        cached += chunk
        model(
            step_ids[:, :chunk],
            attention_mask=attention_mask[:, :cached] if attention_mask is not None else None,
            position_ids=step_positions[:, :chunk] if step_positions is not None else None,
            past_key_values=cache,
            use_cache=True,
            **({"logits_to_keep": 1} if keep_one else {}),
        )
        step_ids = step_ids[:, chunk:]
        step_positions = step_positions[:, chunk:] if step_positions is not None else None
    return step_ids, step_positions


def decode(model, input_ids, attention_mask, pipeline: Pipeline, gc: GenerationConfig, streamer=None):
    """The decode loop: forward, processors, selector, stopping, until every row is done."""
    B = input_ids.shape[0]
    cache = pipeline.cache
    use_cache = cache is not None
    extra = {"logits_to_keep": 1} if forward_accepts(model, "logits_to_keep") else {}
    if pipeline.next_token_logits.needs_hidden_states or gc.output_hidden_states:
        extra["output_hidden_states"] = True
    if gc.output_attentions:
        extra["output_attentions"] = True
    kept = StepOutputs(gc)
    rows = Rows(input_ids, gc, streamer)

    # Positions follow the real tokens of each row, wherever the forward takes them (token_positions).
    every = token_positions(model, input_ids, attention_mask)
    positions = every[:, -1:] if every is not None else None
    cached = cached_length(cache) if use_cache else 0
    step_ids = input_ids[:, cached:]
    step_positions = every[:, cached:] if every is not None else None
    chunk = gc.prefill_chunk_size
    if chunk and use_cache and not recurrent(cache) and not (gc.output_hidden_states or gc.output_attentions):
        step_ids, step_positions = prefill_in_chunks(
            model, step_ids, step_positions, attention_mask, cache, cached, chunk, "logits_to_keep" in extra
        )
    while True:
        out = model(
            step_ids,
            attention_mask=attention_mask,
            position_ids=step_positions,
            past_key_values=cache,
            use_cache=use_cache,
            **extra,
        )
        raw = pipeline.next_token_logits(out)
        scores = kept.forward(out, raw.float() if raw.dtype != torch.float32 else raw)
        scores = pipeline.processors(input_ids, scores)
        check_scores(pipeline.processors, scores, rows.unfinished, input_ids.shape[1])
        kept.processed(scores)
        next_tokens = rows.chosen(pipeline.selector(input_ids, scores))
        input_ids = torch.cat((input_ids, next_tokens[:, None]), dim=-1)
        if not rows.advance(next_tokens, pipeline.stopping(input_ids, scores)):
            break
        if attention_mask is not None:
            attention_mask = torch.cat((attention_mask, attention_mask.new_ones(B, 1)), dim=-1)
        if positions is not None:
            positions = positions + 1
        if use_cache:
            step_ids, step_positions = next_tokens[:, None], positions
        else:
            step_ids = input_ids
            step_positions = token_positions(model, input_ids, attention_mask) if positions is not None else None
    rows.end()
    return loop_result(gc, input_ids, cache, kept.scores, kept.logits, kept.hidden_states, kept.attentions)


class StepOutputs:
    """What the decode loop keeps of each step for a dict output: the processed scores, the raw logits, the hidden
    states and attentions, each a list where the config asks for it, else None."""

    def __init__(self, gc: GenerationConfig):
        self.scores: list | None = [] if gc.output_scores else None
        self.logits: list | None = [] if gc.output_logits else None
        self.hidden_states: list | None = [] if gc.output_hidden_states else None
        self.attentions: list | None = [] if gc.output_attentions else None

    def forward(self, out, logits: torch.Tensor) -> torch.Tensor:
        """Keeps what the step's forward gave; returns `logits`."""
        if self.hidden_states is not None:
            self.hidden_states.append(out.hidden_states)
        if self.attentions is not None:
            self.attentions.append(out.attentions)
        if self.logits is not None:
            self.logits.append(logits.clone())
        return logits

    def processed(self, scores: torch.Tensor) -> None:
        if self.scores is not None:
            self.scores.append(scores.clone())
