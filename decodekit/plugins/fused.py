"""The fused decode step (compile=True): model forward, logits processors and token selection as one
torch.compile'd function over a fixed-shape static cache.

- The step reads no Python number that changes between steps: cache slots, positions and the mask are
  tensors, so it compiles once per (batch size, cache bucket, processors) and is reused across calls.
  Cache sizes are rounded up to a bucket of 256 slots, so a new prompt length or max_new_tokens within a
  bucket does not recompile.
- No host sync per step: EOS is tracked on the device and the host reads the "all finished" flag every
  SYNC_EVERY steps; steps generated after that point are trimmed, so the result equals the eager loop's.
- Sampling computes its noise inside the step as a hash of (key, position, row, token) (selectors.race_noise),
  the same function the eager sampler calls, so a seed gives the same text compiled or not.
- Greedy decoding and sampling are FusedTokens below; beam search is FusedBeams (beam_search.py), on the
  same FusedLoop and FusedStep (core/compile.py holds the compile machinery and the per-model step cache).
- What cannot be fused (processors that read the whole sequence, stop strings, max_time, speculative
  decoding, contrastive search, models other than decodekit's Llama family) runs in the eager loop, and a
  log line on the `decodekit` logger names the reason.
`compile_config` = {"mode", "fullgraph", "dynamic", "backend", "options"} is passed to torch.compile (an
inductor mode as the options it stands for, see compile_arguments); on CUDA, mode="reduce-overhead", the default
there (step_options), makes the step a CUDA graph replay (FusedStep: its cache at fixed addresses, its outputs
copied out), checked on an H200 by tests/test_cuda.py.
"""

from __future__ import annotations

import logging
import types

import torch

from ..core.processors import MinLengthLogitsProcessor
from ..core.stopping import EosTokenCriteria, MaxLengthCriteria
from ..families.cache import StaticCache
from ..core.compile import FusedStep, check_compile_config, compiled_steps, step_options
from ..core.outputs import loop_result
from ..core.selectors import SamplingSelector, race, selector_declares
from ..core.processors import declares
from .. import kernels
from ..families.llama import LlamaForCausalLM
from ..registry import hookimpl

logger = logging.getLogger("decodekit")

BUCKET = 256
SYNC_EVERY = 8


@hookimpl
def decodekit_config_fields():
    return {"compile": False, "compile_config": None, "disable_compile": False}


# Strategies with loops of their own, which run eagerly: (field, is it active, name, why).
UNFUSED_STRATEGIES = (
    ("assistant_model", lambda v: v is not None, "assisted decoding", "it has data-dependent shapes"),
    ("assistant_early_exit", lambda v: v is not None, "self-speculative decoding", "it has data-dependent shapes"),
    ("prompt_lookup_num_tokens", lambda v: v is not None, "prompt lookup decoding", "it has data-dependent shapes"),
    ("penalty_alpha", lambda v: v is not None and v > 0, "contrastive search", "it has data-dependent shapes"),
)


@hookimpl
def decodekit_validate_config(generation_config):
    gc = generation_config
    check_compile_config(gc)
    cc = gc.compile_config
    if gc.compile or cc is not None:
        for name, active, strategy, why in UNFUSED_STRATEGIES:
            if active(getattr(gc, name, None)):
                logger.info("compile=True: %s runs eagerly (%s)", strategy, why)


@hookimpl(trylast=True)
def decodekit_decoding_loop(generation_config):
    # trylast: a strategy with its own loop (beam search, ...) claims the call first and runs eagerly.
    gc = generation_config
    return FusedTokens() if gc.compile or gc.compile_config is not None else None


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


class FusedTokens(FusedLoop):
    """Greedy decoding and sampling: one token per row and step."""

    one_token_per_row = True  # the core loop's step, compiled: continuous batching's own step serves it (hookspecs)

    def rows_per_prompt(self, gc) -> int:
        return gc.num_return_sequences

    def eager(self, model, input_ids, attention_mask, pipeline, gc, streamer, context):
        from ..core.generate import decode

        return decode(model, input_ids, attention_mask, pipeline, gc, streamer)

    takes_host_masks = True

    def kind(self, pipeline, gc) -> tuple:
        sampling = isinstance(pipeline.selector, SamplingSelector)
        masked = any(declares(p, "host_mask") for p in pipeline.processors)  # eos_block is then [B, V], not [V]
        return ("sampling" if sampling else "greedy", processors_key(step_processors(pipeline)), masked)

    def make_step(self, model, cache, pipeline, gc):
        procs = step_processors(pipeline)
        sampling = isinstance(pipeline.selector, SamplingSelector)

        def step(tokens, positions, slots, mask, eos_block, noise_key, unfinished, pad, eos_ids):
            logits = (
                model(
                    tokens,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    cache_position=slots,
                    logits_to_keep=1,
                )
                .logits[:, -1, :]
                .float()
            )
            scores = logits + eos_block
            for p in procs:
                scores = p(tokens, scores)
            if sampling:
                nxt = race(scores, noise_key, slots + 1)  # the sequence is slot + 1 tokens long
            else:
                nxt = scores.argmax(dim=-1)
            nxt = torch.where(unfinished, nxt, pad)
            return nxt, unfinished & ~torch.isin(nxt, eos_ids), scores

        return step

    def run(self, model, fused, input_ids, attention_mask, pipeline, gc, streamer, context):
        B, T0 = input_ids.shape
        dev = input_ids.device
        cache = fused.cache
        max_length = context.max_length
        logits, mask, positions = self.prefill(model, cache, input_ids, attention_mask)
        first = pipeline.processors(input_ids, logits)
        eos = gc.eos_token_ids
        eos_ids = eos_tensor(gc, dev)
        pad = torch.tensor(gc.pad_token_id if gc.pad_token_id is not None else 0, device=dev)
        unfinished = torch.ones(B, dtype=torch.bool, device=dev)
        scores_out = [] if gc.output_scores else None
        sampling = isinstance(pipeline.selector, SamplingSelector)
        noise_key = pipeline.selector.key.to(dev) if sampling else None
        nxt = pipeline.selector(input_ids, first)
        unfinished = unfinished & ~torch.isin(nxt, eos_ids)
        if scores_out is not None:
            scores_out.append(first)
        min_length = min_length_of(pipeline)
        no_block, block = eos_blocks(first.shape[-1], eos, dev)
        host = [p for p in pipeline.processors if declares(p, "host_mask")]
        generated = [nxt]
        alive = [unfinished]
        if streamer is not None:
            streamer.put(input_ids.cpu())
            streamer.put(nxt.cpu())
        cur = T0 + 1
        while cur < max_length:
            if (cur - T0) % SYNC_EVERY == 0 and not bool(unfinished.any()):
                break
            slot = cur - 1
            mask[:, slot] = 1
            positions = positions + 1
            slots = torch.tensor([slot], device=dev)
            eos_block = block if cur < min_length else no_block
            if host:
                eos_block = eos_block + host_block(
                    host, torch.cat((input_ids, torch.stack(generated, dim=1)), dim=1), eos_block.shape[-1]
                )
            nxt, unfinished, scores = fused(
                nxt[:, None], positions, slots, mask, eos_block, noise_key, unfinished, pad, eos_ids
            )
            fused.compiled_once = True
            generated.append(nxt)
            alive.append(unfinished)
            if scores_out is not None:
                scores_out.append(scores.clone())
            if streamer is not None:
                streamer.put(nxt.cpu())
            cur += 1
        # Keep the steps up to the one after which every row was finished, as the eager loop stops there.
        done_after = ~torch.stack(alive).any(dim=1)
        keep = int(done_after.nonzero()[0]) + 1 if bool(done_after.any()) else len(generated)
        cache.lengths = [T0 + keep - 1] * len(cache.lengths)
        if streamer is not None:
            streamer.end()
        sequences = torch.cat((input_ids, torch.stack(generated[:keep], dim=1)), dim=1)
        return loop_result(gc, sequences, cache, scores_out[:keep] if scores_out is not None else None)
