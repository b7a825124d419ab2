"""The fused decode loop's machinery (compile=True): FusedLoop finds or compiles a strategy's step and runs it, or
falls back to the eager loop with the reason; the helpers the steps share (EOS blocks, host masks, processor keys).
Greedy decoding and sampling (plugins/fused.py: FusedTokens) and beam search (plugins/beam_search.py: FusedBeams)
are the strategies on it; core/compile.py compiles their steps.
"""

from __future__ import annotations

import logging

import torch

from .. import kernels
from ..families.cache import StaticCache
from .compile import FusedStep, step_options
from .selectors import selector_declares

logger = logging.getLogger("decodekit")

BUCKET = 256  # cache slots are rounded up to a multiple: a new prompt length within a bucket does not recompile
SYNC_EVERY = 8  # steps between the host's reads of the "all finished" flag


def fixed_step_logits(model, tokens, mask, positions, cache, slots) -> torch.Tensor:
    """The logits [rows, 1, V] (the model's dtype) of one fixed-shape step: the model's forward at cache `slots` (its
    cache_position path), `mask` over the whole static cache."""
    out = model(
        tokens,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        cache_position=slots,
        logits_to_keep=1,
    )
    return out.logits


def step_logits(model, tokens, mask, positions, cache, slots) -> torch.Tensor:
    """The float32 next-token logits [rows, V] of one fixed-shape step (fixed_step_logits)."""
    return fixed_step_logits(model, tokens, mask, positions, cache, slots)[:, -1, :].float()


def bucket(length: int) -> int:
    return -(-length // BUCKET) * BUCKET


def host_block(processors, sequences: torch.LongTensor, width: int) -> torch.Tensor:
    """The scores' additive mask [B, V] of the host-mask `processors` for the next token of `sequences`."""
    block = torch.zeros(sequences.shape[0], width, device=sequences.device)
    for p in processors:
        block.masked_fill_(~p.step_mask(sequences)[:, :width].to(block.device), -float("inf"))
    return block


def supports_step(model, step: str) -> bool:
    """Whether `model` (or the module it wraps) declares the compiled `step` ("fused": generate(compile=True)'s
    static-cache step; "paged": continuous batching's) among its `steps_supported`."""
    return step in getattr(getattr(model, "module", model), "steps_supported", ())


def eager_steps_fused(model) -> bool:
    """Whether a call of `model` without compile=True runs the fused step uncompiled: on CPU, for a native model. The
    step runs the layers in decodekit's C++ stack (decodekit::decode_layers) instead of the eager loop's Python
    layers, one call a step instead of a dozen operators a layer. Such a call holds the model's layout (its
    StepHost) for its length where no other thread holds it, and runs the eager loop where one does."""
    return model.device.type == "cpu" and supports_step(model, "fused")


def unfusable_reason(model, pipeline, gc, takes_host_masks: bool = False, max_length: int | None = None) -> str | None:
    """Why this call cannot run as a fused step, or None: read from what the model, the processors, the selector and
    the criteria declare, never from their classes."""
    if not supports_step(model, "fused"):
        return f"{type(model).__name__} does not declare a fused step (steps_supported)"
    if pipeline.next_token_logits.needs_hidden_states:
        return "the next-token logits need hidden states"
    eos = set(gc.eos_token_ids or ())
    for p, declared in zip(pipeline.processors, pipeline.capabilities):
        name = getattr(p, "__qualname__", type(p).__name__)
        if declared.host_mask and not takes_host_masks:
            return f"the logits processor {name} computes a mask on the host every step, which this strategy's step does not take"
        blocks = declared.blocks_eos_until
        if blocks is not None and declared.eos != eos:
            return f"the logits processor {name} bans other tokens than the call's EOS ids {sorted(eos)}"
        if not (declared.score_only or declared.host_mask or blocks is not None):
            return (
                f"the logits processor {name} may read the whole sequence "
                "(one that reads only the scores can declare score_only = True: decodekit.core.processors.Processor)"
            )
    if not selector_declares(pipeline.selector, "traceable"):
        return f"the token selector {type(pipeline.selector).__name__} does not declare itself traceable"
    for c in pipeline.stopping:
        length, tokens = getattr(c, "ends_at_length", None), getattr(c, "ends_at_tokens", None)
        covered = (length is not None and (max_length is None or length >= max_length)) or (
            tokens is not None and set(tokens) <= eos
        )
        if not covered:
            return f"the stopping criterion {type(c).__name__} needs the host every step"
    if gc.output_logits:
        return "output_logits needs the raw logits every step"
    if pipeline.cache is not None and not isinstance(pipeline.cache, StaticCache):
        return "the cache is not a StaticCache"
    return None


def step_processors(pipeline) -> list:
    """The processors a fused step runs: those that read only the scores (min length is its EOS mask)."""
    return [p for p, declared in zip(pipeline.processors, pipeline.capabilities) if declared.score_only]


def processors_key(pipeline) -> tuple:
    """What identifies the processors a fused step runs (step_processors) for reuse of a compiled step: each one's
    own key (processors.Processor)."""
    return tuple(declared.key for declared in pipeline.capabilities if declared.score_only)


def host_masks(pipeline) -> list:
    """The processors whose effect is a mask computed on the host every step (host_mask): a step's input."""
    return [p for p, declared in zip(pipeline.processors, pipeline.capabilities) if declared.host_mask]


def _hashable(value):
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _hashable(v)) for k, v in value.items())))
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


# The arguments of the steps (FusedTokens' and FusedBeams'): the guards argument_guards_only keeps.
class FusedLoop:
    """The decoding loop of a fused strategy: falls back to `eager` when the call cannot be fused, else
    finds or compiles the step for (batch, cache bucket, `kind`) and runs it with `run`.

    A strategy defines `eager`, `kind` (hashable, what decides the compiled code besides batch, bucket and
    weights; its first item names it in the log), `make_step` (the function to compile, given the model
    and the step's cache) and `run` (prefill and the loop around the step). FusedTokens (greedy and
    sampling) is below, beam search's is in beam_search.py.
    """

    takes_host_masks = False  # whether `run` applies host-mask processors (host_mask) as a step input
    compiles = True

    def __init__(self, compiles: bool = True):
        # False: a call without compile=True, which runs the same step over its static cache, not compiled, where
        # eager_steps_fused says so; a call it cannot take runs the eager loop, silently.
        self.compiles = compiles

    def __call__(self, model, input_ids, attention_mask, pipeline, gc, streamer, context):
        if not self.compiles and not eager_steps_fused(model):
            return self.eager(model, input_ids, attention_mask, pipeline, gc, streamer, context)
        reason = unfusable_reason(model, pipeline, gc, self.takes_host_masks, context.max_length)
        if reason is not None:
            if self.compiles:
                logger.info("compile=True falls back to the eager loop: %s", reason)
            return self.eager(model, input_ids, attention_mask, pipeline, gc, streamer, context)
        host = kernels.StepHost.of(model)
        if self.compiles:
            with host.layout(model, input_ids.shape[0]) as layout:
                return self._fused(host, model, input_ids, attention_mask, pipeline, gc, streamer, context, layout)
        with host.layout_if_free(model, input_ids.shape[0]) as layout:
            if (
                layout is None
            ):  # another thread's call holds the layout: not waited for, the eager loop on the one in force
                return self.eager(model, input_ids, attention_mask, pipeline, gc, streamer, context)
            return self._fused(host, model, input_ids, attention_mask, pipeline, gc, streamer, context, layout)

    def _fused(self, host, model, input_ids, attention_mask, pipeline, gc, streamer, context, layout):
        options = step_options(gc.compile_config, model.device) if self.compiles else None
        key = (input_ids.shape[0], bucket(context.max_length), self.kind(pipeline, gc), _hashable(options), layout)
        fused = host.step("fused", key, lambda: self._make_step(model, key, options, pipeline, gc, host))
        if fused is None:
            return self.eager(model, input_ids, attention_mask, pipeline, gc, streamer, context)
        if model.device.type == "cpu":
            model.bind_native_layers()  # after the layout is held, which may pack the weights; before any tracing
        try:
            return self.run(model, fused, input_ids, attention_mask, pipeline, gc, streamer, context)
        except torch._dynamo.exc.TorchDynamoException as error:
            # Something in the step could not be compiled (a plugin processor dynamo cannot trace, say).
            what = "compile=True falls back to the eager loop: the step did not compile"
            host.failed("fused", key, error, what, redo=not fused.compiled_once)
            if streamer is not None:
                raise  # it has been handed the prompt: the eager loop would hand it again
            return self.eager(model, input_ids, attention_mask, pipeline, gc, streamer, context)

    @staticmethod
    def prefill(model, cache, input_ids, attention_mask):
        """Fills the step's cache with the prompt, eagerly (its length changes with every call); returns the
        last position's float32 logits, the step's key mask [rows, cache slots] and the prompt's last
        positions [rows, 1]."""
        B, T0 = input_ids.shape
        dev = input_ids.device
        cache.crop(0)
        mask = torch.zeros(B, cache.max_cache_len, dtype=torch.long, device=dev)
        mask[:, :T0] = attention_mask if attention_mask is not None else 1
        out = model(input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
        if attention_mask is not None:
            positions = attention_mask.sum(-1, keepdim=True) - 1
        else:
            positions = torch.full((B, 1), T0 - 1, device=dev)
        return out.logits[:, -1, :].float(), mask, positions

    def _make_step(self, model, key, options, pipeline, gc, host) -> FusedStep:
        batch, length, kind = key[:3]
        if self.compiles:
            why = "first compiled call" if not host.steps("fused") else "new batch size, cache bucket or processors"
            logger.info("compiling the decode step (batch %d, cache %d slots, %s; %s)", batch, length, kind[0], why)
        return FusedStep(model, batch, length, options, lambda m, cache: self.make_step(m, cache, pipeline, gc))


def eos_blocks(scores_width: int, eos: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectors added to the scores: none blocked, and EOS blocked (min_length: a tensor, not a processor,
    so the step does not change when the length passes min_length)."""
    none = torch.zeros(scores_width, device=device)
    block = none.clone()
    if eos:
        block[eos] = -float("inf")
    return none, block


def eos_tensor(gc, device) -> torch.Tensor:
    """The EOS ids as a tensor for torch.isin inside a step ([-1], which no token is, where there are none)."""
    return torch.tensor(gc.eos_token_ids or [-1], device=device)


def min_length_of(pipeline) -> int:
    """The length before which the call's EOS ids are banned (what the processors declare as blocks_eos_until)."""
    lengths = [declared.blocks_eos_until for declared in pipeline.capabilities]
    return max([n for n in lengths if n is not None] or [0])
