"""/v1/completions' echo: the prompt put before the completion, with each prompt token's logprob given the tokens
before it (the first has none: null, as OpenAI's legacy completions gave it) and, with logprobs=N, the N most likely
tokens at each position. Evaluation harnesses (lm-evaluation-harness's `local-completions`) score a continuation so:
a prompt of context + continuation, echo=true, logprobs=1, max_tokens 0 or 1.

The logprobs are the model's own (a log-softmax of its logits, no processor applied), computed by one forward over
the prompt in the thread that runs the batch's steps (ContinuousBatchingManager.between_steps), between two steps.
"""

from __future__ import annotations

import math

import torch

from .responses import CompletionLogprobs, finite


class PromptScores:
    """The logprobs of a prompt's tokens after the first (`logprobs`, one per token from the second on) and, where
    asked, the `top` most likely [(token id, logprob)] at each of those positions (`tops`)."""

    def __init__(self, logprobs: list[float], tops: list[list[tuple[int, float]]] | None):
        self.logprobs, self.tops = logprobs, tops


def score_prompt(model, ids: list[int], top: int) -> PromptScores:
    """The model's logprob of each of `ids` after the first given those before it, and the `top` most likely tokens at
    each of those positions (top 0: none), from one forward over the prompt (positions read back in one transfer)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device), use_cache=False).logits[0, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(ids[1:], device=logp.device)
        chosen = logp.gather(1, targets[:, None])[:, 0]
        if not top:
            return PromptScores(chosen.tolist(), None)
        values, indices = logp.topk(top, dim=-1)
        host = torch.cat((chosen[:, None], values, indices.to(values.dtype)), dim=1).double().tolist()
    tops = [list(zip((int(i) for i in row[1 + top :]), row[1 : 1 + top])) for row in host]
    return PromptScores([row[0] for row in host], tops)


def echoed(
    tokenizer, prompt_ids: list[int], scores: PromptScores | None, text: str, generated: CompletionLogprobs | None
):
    """(the choice's text, its logprobs) with the prompt before them: its text decoded from its ids (the offsets of
    its tokens agree with it) and, with `scores`, its tokens' logprobs before the generated tokens'."""
    prompt_text = tokenizer.decode(prompt_ids)
    if scores is None:
        return prompt_text + text, generated
    words = [tokenizer.decode([t]) for t in prompt_ids]
    offsets, at = [], 0
    for word in words:
        offsets.append(at)
        at += len(word)
    logprobs: list[float | None] = [None, *(finite(v) for v in scores.logprobs)]
    tops = None
    if scores.tops is not None:
        word = tokenizer.decode
        tops = [None, *({word([i]): finite(v) for i, v in top if v > -math.inf} for top in scores.tops)]
    echo = CompletionLogprobs(tokens=words, token_logprobs=logprobs, text_offset=offsets, top_logprobs=tops)
    if generated is None:
        return prompt_text + text, echo
    shift = len(prompt_text)
    return prompt_text + text, CompletionLogprobs(
        tokens=[*echo.tokens, *generated.tokens],
        token_logprobs=[*echo.token_logprobs, *generated.token_logprobs],
        text_offset=[*echo.text_offset, *(o + shift for o in generated.text_offset)],
        top_logprobs=None if tops is None else [*tops, *(generated.top_logprobs or [{}] * len(generated.tokens))],
    )
