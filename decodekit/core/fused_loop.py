"""The fused decode loop's machinery (compile=True): FusedLoop finds or compiles a strategy's step and runs it, or
falls back to the eager loop with the reason; the helpers the steps share (EOS blocks, host masks, processor keys).
Greedy decoding and sampling (plugins/fused.py: FusedTokens) and beam search (plugins/beam_search.py: FusedBeams)
are the strategies on it; core/compile.py compiles their steps.
"""

from __future__ import annotations

import logging
import types

import torch

from .. import kernels
from ..families.cache import StaticCache
from ..families.llama import LlamaForCausalLM
from .compile import FusedStep, compiled_steps, step_options
from .processors import MinLengthLogitsProcessor, declares
from .selectors import selector_declares
from .stopping import EosTokenCriteria, MaxLengthCriteria

logger = logging.getLogger("decodekit")

BUCKET = 256  # cache slots are rounded up to a multiple: a new prompt length within a bucket does not recompile
SYNC_EVERY = 8  # steps between the host's reads of the "all finished" flag


def step_logits(model, tokens, mask, positions, cache, slots) -> torch.Tensor:
    """The float32 next-token logits [rows, V] of one fixed-shape step: the model's forward at cache `slots` (its
    cache_position path), `mask` over the whole static cache."""
    out = model(
        tokens,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        cache_position=slots,
        logits_to_keep=1,
    )
    return out.logits[:, -1, :].float()


def bucket(length: int) -> int:
    return -(-length // BUCKET) * BUCKET


def host_block(processors, sequences: torch.LongTensor, width: int) -> torch.Tensor:
    """The scores' additive mask [B, V] of the host-mask `processors` for the next token of `sequences`."""
    block = torch.zeros(sequences.shape[0], width, device=sequences.device)
    for p in processors:
        block.masked_fill_(~p.step_mask(sequences)[:, :width].to(block.device), -float("inf"))
    return block


def unfusable_reason(model, pipeline, gc, takes_host_masks: bool = False) -> str | None:
    if not isinstance(getattr(model, "module", model), LlamaForCausalLM):
        return f"{type(model).__name__} is not one of decodekit's own models"
    if pipeline.next_token_logits.needs_hidden_states:
        return "the next-token logits need hidden states"
    for p in pipeline.processors:
        if declares(p, "host_mask") and not takes_host_masks:
            name = getattr(p, "__qualname__", type(p).__name__)
            return f"the logits processor {name} computes a mask on the host every step, which this strategy's step does not take"
        if not (declares(p, "score_only") or declares(p, "host_mask") or isinstance(p, MinLengthLogitsProcessor)):
            name = getattr(p, "__qualname__", type(p).__name__)
            return (
                f"the logits processor {name} may read the whole sequence "
                "(one that reads only the scores can declare score_only = True: decodekit.core.processors.Processor)"
            )
    if not selector_declares(pipeline.selector, "traceable"):
        return f"the token selector {type(pipeline.selector).__name__} does not declare itself traceable"
    for c in pipeline.stopping:
        if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria)):
            return f"the stopping criterion {type(c).__name__} needs the host every step"
    if gc.output_logits:
        return "output_logits needs the raw logits every step"
    if pipeline.cache is not None and not isinstance(pipeline.cache, StaticCache):
        return "the cache is not a StaticCache"
    return None


def step_processors(pipeline) -> list:
    """The processors a fused step runs: those that read only the scores (min length is its EOS mask)."""
    return [p for p in pipeline.processors if declares(p, "score_only")]


def processors_key(processors) -> tuple:
    """What identifies a set of processors for reuse of a compiled step: class and settings, or for a plain
    function the function itself (its closure may hold settings, so a new one compiles anew)."""
    out = []
    for p in processors:
        if isinstance(p, types.FunctionType) or not hasattr(p, "__dict__"):
            out.append(("function", p))
        else:
            settings = tuple(sorted((k, _hashable(v)) for k, v in vars(p).items()))
            out.append((type(p).__qualname__, settings))
    return tuple(out)


def _hashable(value):
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _hashable(v)) for k, v in value.items())))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.flatten().tolist()))
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

    def __call__(self, model, input_ids, attention_mask, pipeline, gc, streamer, context):
        reason = unfusable_reason(model, pipeline, gc, self.takes_host_masks)
        if reason is not None:
            logger.info("compile=True falls back to the eager loop: %s", reason)
            return self.eager(model, input_ids, attention_mask, pipeline, gc, streamer, context)
        with kernels.step_layout(model, input_ids.shape[0]) as layout:
            return self._fused(model, input_ids, attention_mask, pipeline, gc, streamer, context, layout)

    def _fused(self, model, input_ids, attention_mask, pipeline, gc, streamer, context, layout):
        fused = self._step_for(model, input_ids.shape[0], context.max_length, pipeline, gc, layout)
        if fused is None:
            return self.eager(model, input_ids, attention_mask, pipeline, gc, streamer, context)
        if model.device.type == "cpu":
            model.bind_native_layers()  # after _step_for, which may pack the weights; before any tracing
        try:
            return self.run(model, fused, input_ids, attention_mask, pipeline, gc, streamer, context)
        except torch._dynamo.exc.TorchDynamoException as e:
            if fused.compiled_once:
                raise
            # Something in the step could not be compiled (a plugin processor dynamo cannot trace, say).
            compiled_steps(model, "fused")[fused.key] = None
            logger.info(
                "compile=True falls back to the eager loop: the step did not compile (%s)", str(e).splitlines()[0]
            )
            if streamer is not None:
                raise
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

    def _step_for(self, model, batch, max_length, pipeline, gc, layout) -> FusedStep | None:
        options = step_options(gc.compile_config, model.device)
        length = bucket(max_length)
        kind = self.kind(pipeline, gc)
        key = (batch, length, kind, _hashable(options), layout)
        steps = compiled_steps(model, "fused")

        def make() -> FusedStep:
            why = "first compiled call" if not steps else "new batch size, cache bucket or processors"
            logger.info("compiling the decode step (batch %d, cache %d slots, %s; %s)", batch, length, kind[0], why)
            step = FusedStep(model, batch, length, options, lambda m, cache: self.make_step(m, cache, pipeline, gc))
            step.key = key
            return step

        return steps.get_or_make(key, make)


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
    return max([p.min_length for p in pipeline.processors if isinstance(p, MinLengthLogitsProcessor)] or [0])
