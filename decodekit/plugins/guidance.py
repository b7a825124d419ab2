"""Classifier-free guidance (guidance_scale > 1): push the next-token distribution away from an
unconditional (or negative-prompt) run of the same model.

scores = scale * (logp_cond - logp_uncond) + logp_uncond, both log-softmaxed. The unconditional run
starts from `negative_prompt_ids` (or the prompt's last token) and follows the generated tokens with
its own cache. It runs first among the processors, as in transformers.
"""

from __future__ import annotations


import torch

from ..core.config import is_number
from ..core.generate import forward_accepts, mask_positions
from ..registry import hookimpl


@hookimpl
def decodekit_config_fields():
    return {"guidance_scale": None, "negative_prompt_ids": None, "negative_prompt_attention_mask": None}


@hookimpl
def decodekit_validate_config(generation_config, context):
    gc = generation_config
    if gc.guidance_scale is None:
        for name in ("negative_prompt_ids", "negative_prompt_attention_mask"):
            if getattr(gc, name) is not None:
                raise ValueError(f"{name} only applies with guidance_scale > 1; set guidance_scale.")
        return
    if not is_number(gc.guidance_scale) or gc.guidance_scale < 0:
        raise gc.invalid("guidance_scale", "expected a number >= 0 (1 means no guidance, larger pushes harder)")
    if gc.guidance_scale != 1 and getattr(context.model, "holds_recurrent_state", False):
        raise ValueError(
            f"guidance_scale runs a second, unconditional sequence through the model beside the prompt's, "
            f"and {type(context.model.module).__name__} keeps its recurrent state in its own layers, so "
            "the two would overwrite each other: generate without guidance_scale."
        )
    neg = gc.negative_prompt_ids
    if neg is None and gc.negative_prompt_attention_mask is not None:
        raise ValueError(
            "negative_prompt_attention_mask is the mask of negative_prompt_ids, which is not set; set both or neither."
        )
    if neg is not None:
        if (
            not isinstance(neg, torch.Tensor)
            or neg.dim() != 2
            or neg.shape[0] not in (1, context.batch_size)
            or neg.is_floating_point()
            or neg.is_complex()
            or neg.dtype == torch.bool
            or neg.numel() == 0
        ):
            raise ValueError(
                "negative_prompt_ids must be an integer tensor [batch or 1, seq] of token ids, got "
                + (
                    f"a {neg.dtype} tensor of shape {tuple(neg.shape)}"
                    if isinstance(neg, torch.Tensor)
                    else type(neg).__name__
                )
                + "."
            )
        vocab = getattr(getattr(context.model, "config", None), "vocab_size", None)
        if vocab is not None and (int(neg.min()) < 0 or int(neg.max()) >= vocab):
            raise ValueError(f"negative_prompt_ids holds token ids outside the vocabulary [0, {vocab}).")
        mask = gc.negative_prompt_attention_mask
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != neg.shape):
            got = f"shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(
                f"negative_prompt_attention_mask must be a tensor of the shape of negative_prompt_ids "
                f"{tuple(neg.shape)}, got {got}."
            )
    if gc.number("num_beams", 1) > 1:
        raise ValueError("guidance_scale is not supported with beam search (num_beams > 1).")


@hookimpl
def decodekit_logits_processors(generation_config, context):
    gc = generation_config
    if gc.guidance_scale is None or gc.guidance_scale == 1:
        return []
    return [
        UnbatchedClassifierFreeGuidanceLogitsProcessor(
            gc.guidance_scale, context.model, gc.negative_prompt_ids, gc.negative_prompt_attention_mask, gc.use_cache
        )
    ]


class UnbatchedClassifierFreeGuidanceLogitsProcessor:
    """Classifier-free guidance with a second, unconditional run of `model` (guidance_scale >= 0; 1 only
    log-softmaxes), as generate(guidance_scale=...) does.

    Returns log-probabilities: scale * (log p(x | prompt) - log p(x | unconditional)) + log p(x | unconditional).
    The unconditional run starts from `unconditional_ids` [batch or 1, length] with `unconditional_attention_mask`
    (default: each row's last token) and follows the generated tokens with its own cache; `use_cache=False` is
    accepted for transformers' signature and still keeps one (the scores are the same).
    """

    stage = "guidance"

    def __init__(
        self,
        guidance_scale: float,
        model,
        unconditional_ids=None,
        unconditional_attention_mask=None,
        use_cache: bool = True,
    ):
        self.scale = self.guidance_scale = float(guidance_scale)
        self.model = model
        self.negative = unconditional_ids
        self.negative_mask = unconditional_attention_mask
        # The cache is the one the model's forward makes and returns, as transformers' processor keeps it: whatever
        # kind the model lays out (a hybrid's, MiniMax's lightning attention, decodekit's), for any model object
        # (transformers' own, wrapped or not). A model that returns none is run on the whole sequence each step.
        self.cache = None
        self.ids = self.mask = None

    def _unconditional(self, input_ids: torch.LongTensor) -> torch.Tensor:
        B = input_ids.shape[0]
        if self.mask is None:  # first step: the negative prompt, or each row's last token
            ids = self.negative.expand(B, -1) if self.negative is not None else input_ids[:, -1:]
            mask = self.negative_mask.expand(B, -1) if self.negative_mask is not None else torch.ones_like(ids)
            self.mask = mask.to(input_ids.device).long()
            self.ids = feed = ids.to(input_ids.device)
        else:
            self.ids = torch.cat((self.ids, input_ids[:, -1:]), dim=-1)
            self.mask = torch.cat((self.mask, self.mask.new_ones(B, 1)), dim=-1)
            feed = self.ids if self.cache is None else input_ids[:, -1:]
        # Positions only where the forward takes them, as decode() gives them: transformers' own test model of this
        # processor takes none, and derives them from its cache.
        positions = (
            {"position_ids": mask_positions(self.mask)[:, -feed.shape[1] :]}
            if forward_accepts(self.model, "position_ids")
            else {}
        )
        out = self.model(feed, attention_mask=self.mask, past_key_values=self.cache, use_cache=True, **positions)
        self.cache = returned_cache(out)
        return out.logits[:, -1, :].float()

    def __call__(self, input_ids, scores):
        scores = torch.log_softmax(scores, dim=-1)
        if self.scale == 1:
            return scores
        uncond = torch.log_softmax(self._unconditional(input_ids), dim=-1)
        return self.scale * (scores - uncond) + uncond


def returned_cache(out):
    """The cache a forward returned, under transformers' newer name (`cache`) or the older one, or None."""
    for name in ("cache", "past_key_values"):
        cache = out.get(name) if isinstance(out, dict) else getattr(out, name, None)
        if cache is not None:
            return cache
    return None


class ClassifierFreeGuidanceLogitsProcessor:
    """Classifier-free guidance over a doubled batch (transformers' class of this name): `scores` hold 2B rows, the
    conditional ones first and the unconditional ones after; returns the B rows
    uncond + (cond - uncond) * `guidance_scale` (> 1). generate(guidance_scale=...) uses the unbatched class."""

    stage = "guidance"

    def __init__(self, guidance_scale: float):
        if not is_number(guidance_scale) or not guidance_scale > 1:
            raise ValueError(
                f"guidance_scale={guidance_scale!r} is invalid; this processor needs a number > 1 (the "
                "unbatched class takes any scale >= 0)."
            )
        self.guidance_scale = float(guidance_scale)

    def __call__(self, input_ids, scores):
        if scores.shape[0] != 2 * input_ids.shape[0]:
            raise ValueError(
                f"the scores have {scores.shape[0]} rows and input_ids {input_ids.shape[0]}; expected twice "
                "as many scores: the conditional rows, then the unconditional ones."
            )
        cond, uncond = scores.split(input_ids.shape[0], dim=0)
        return uncond + (cond - uncond) * self.guidance_scale
