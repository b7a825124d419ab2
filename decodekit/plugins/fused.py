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
  same FusedLoop (core/fused_loop.py) and FusedStep (core/compile.py, with the per-model step cache).
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

import torch

from ..core.compile import check_compile_config
from ..core.fused_loop import (
    SYNC_EVERY,
    FusedLoop,
    eos_blocks,
    eos_tensor,
    host_block,
    host_masks,
    min_length_of,
    processors_key,
    step_logits,
    step_processors,
)
from ..core.outputs import loop_result
from ..core.rows import Rows
from ..core.transfer import to_device
from ..core.selectors import drawn_as, race
from ..core.processors import processor_key
from ..registry import hookimpl

logger = logging.getLogger("decodekit")


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
    if gc.compile or gc.compile_config is not None:
        return FusedTokens()
    if gc.output_hidden_states or gc.output_attentions:
        return None  # the core loop gives them
    return FusedTokens(compiles=False)  # the step uncompiled, where core.fused_loop.eager_steps_fused says so


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
        drawn = drawn_as(pipeline.selector)
        name = {"race": "sampling", "argmax": "greedy"}.get(drawn, "a plugin's traceable selector")
        own = None if drawn else processor_key(pipeline.selector)  # traced as it is: its own object decides the code
        masked = bool(host_masks(pipeline))  # eos_block is then [B, V], not [V]
        return (name, own, processors_key(pipeline), masked)

    def make_step(self, model, cache, pipeline, gc):
        procs = step_processors(pipeline)
        selector, drawn = pipeline.selector, drawn_as(pipeline.selector)

        def step(tokens, positions, slots, mask, eos_block, noise_key, unfinished, pad, eos_ids):
            logits = step_logits(model, tokens, mask, positions, cache, slots)
            scores = logits + eos_block
            for p in procs:
                scores = p(tokens, scores)
            if drawn == "race":
                nxt = race(scores, noise_key, slots + 1)  # the sequence is slot + 1 tokens long
            elif drawn == "argmax":
                nxt = scores.argmax(dim=-1)
            else:
                nxt = selector(tokens, scores)
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
        progress = Rows(input_ids, gc, streamer)
        pad, unfinished = progress.pad, progress.unfinished
        scores_out = [] if gc.output_scores else None
        noise_key = pipeline.selector.key.to(dev) if drawn_as(pipeline.selector) == "race" else None
        nxt = pipeline.selector(input_ids, first)
        unfinished = unfinished & ~torch.isin(nxt, eos_ids)
        if scores_out is not None:
            scores_out.append(first)
        min_length = min_length_of(pipeline)
        no_block, block = eos_blocks(first.shape[-1], eos, dev)
        host = host_masks(pipeline)
        generated = [nxt]
        alive = [unfinished]
        progress.stream(nxt)
        cur = T0 + 1
        # The step's cache slot advances on the device, as its positions do: a tensor made from a Python number each
        # step is a copy from pageable memory, which on a GPU waits for the step before (the host then prepares the
        # next step while the device idles)
        slots = to_device([T0 - 1], torch.long, dev)
        while cur < max_length:
            if (cur - T0) % SYNC_EVERY == 0 and not bool(unfinished.any()):
                break
            slot = cur - 1
            mask[:, slot] = 1
            positions = positions + 1
            slots = slots + 1
            eos_block = block if cur < min_length else no_block
            if host:
                eos_block = eos_block + host_block(
                    host, torch.cat((input_ids, torch.stack(generated, dim=1)), dim=1), eos_block.shape[-1]
                )
            nxt, unfinished, scores = fused(
                nxt[:, None], positions, slots, mask, eos_block, noise_key, unfinished, pad, eos_ids
            )
            generated.append(nxt)
            alive.append(unfinished)
            if scores_out is not None:
                scores_out.append(scores.clone())
            progress.stream(nxt)  # the compiled step keeps `unfinished` itself, so the rows are not advanced here
            cur += 1
        # Keep the steps up to the one after which every row was finished, as the eager loop stops there.
        done_after = ~torch.stack(alive).any(dim=1)
        keep = int(done_after.nonzero()[0]) + 1 if bool(done_after.any()) else len(generated)
        cache.lengths = [T0 + keep - 1] * len(cache.lengths)
        progress.end()
        sequences = torch.cat((input_ids, torch.stack(generated[:keep], dim=1)), dim=1)
        return loop_result(gc, sequences, cache, scores_out[:keep] if scores_out is not None else None)
