"""Token healing (token_healing=True), as transformers' generate() does it.

A prompt that ends inside a word ("The url is http") tokenizes differently from the same text in the middle of
a generation ("https" may be one token): the model is then asked to continue from a token boundary it rarely
saw. Healing re-tokenizes each stripped prompt, drops its last token and lets the model regenerate that one
token, with every vocabulary token that extends the dropped token's text favoured (+10, the dropped token itself
+11, so it is not replaced lightly). The healed prompt then goes to the call's decoding as the prompt.
"""

from __future__ import annotations

import torch

EXTENSION_BIAS = 10.0
ORIGINAL_BONUS = 1.0


def heal_tokens(model, input_ids: torch.LongTensor, tokenizer) -> tuple[torch.LongTensor, torch.LongTensor | None]:
    """The healed prompts [B, T'] and their attention mask (None where no row is padded)."""
    if tokenizer is None:
        raise ValueError(
            "token_healing=True re-tokenizes the prompt: pass the model's tokenizer to generate() (tokenizer=...)."
        )
    bos, pad = tokenizer.bos_token_id, tokenizer.pad_token_id
    pad = pad if pad is not None else bos
    texts = [text.strip() for text in tokenizer.batch_decode(input_ids, skip_special_tokens=True)]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    ids = encoded["input_ids"].to(input_ids.device)
    mask = encoded["attention_mask"].to(input_ids.device)
    if bos is not None and pad is not None:
        ids = torch.where(ids == bos, pad, ids)  # healing must not condition on a BOS in the middle of a row
    vocab = tokenizer.get_vocab()
    space = _space_marker(tokenizer)
    for row in range(ids.shape[0]):
        if bool((ids[row] == pad).all()):
            continue
        tail = int(ids[row, -1])
        tail_text = tokenizer.decode(tail)
        if space is not None:  # spaces as the vocabulary writes them, so " wor" finds "Ġworld"
            tail_text = tail_text.replace(" ", space)
        bias = {(index,): EXTENSION_BIAS for token, index in vocab.items() if token.startswith(tail_text)}
        if len(bias) <= 1:
            continue  # nothing extends the last token: it stays
        bias[(tail,)] = bias.get((tail,), EXTENSION_BIAS) + ORIGINAL_BONUS
        trimmed = ids[row, :-1]
        if trimmed.numel() == 0:
            continue  # a one-token prompt has nothing to regenerate from (transformers skips it too)
        if int((trimmed != pad).sum()) == 0 and bos is not None:
            trimmed = trimmed.clone()
            trimmed[-1] = bos  # only padding before the tail: regenerate it after BOS
        healed = model.generate(
            trimmed[None],
            max_new_tokens=1,
            sequence_bias=bias,
            do_sample=False,
            pad_token_id=pad,
            num_beams=1,
            num_return_sequences=1,
        )
        ids[row, -1] = healed[0, -1]
    return ids, (None if bool(mask.all()) else mask)


def _space_marker(tokenizer) -> str | None:
    """The first character of the vocabulary's token for " " (GPT-2's "Ġ", SentencePiece's "▁"), as transformers
    finds it; None where the tokenizer has no token for a space."""
    index = tokenizer.convert_tokens_to_ids(" ") if hasattr(tokenizer, "convert_tokens_to_ids") else None
    if index is None:
        return None
    return tokenizer.convert_ids_to_tokens(index)[0]
