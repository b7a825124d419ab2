"""A decoding loop's rows: which are still generating, the token finished rows take, and the streamer that hears the
prompt, each step's tokens and the end. The one bookkeeping of every loop (the core loop, contrastive search, the
fused loop, speculative decoding)."""

from __future__ import annotations

import torch


class Rows:
    def __init__(self, input_ids: torch.Tensor, gc, streamer=None):
        self.unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        self.pad = torch.tensor(gc.pad_token_id if gc.pad_token_id is not None else 0, device=input_ids.device)
        self.streamer = streamer
        self.stream(input_ids)  # a streamer hears the prompt first, as transformers' does

    def chosen(self, tokens: torch.Tensor) -> torch.Tensor:
        """The step's tokens [B], a finished row's replaced by the pad token."""
        return torch.where(self.unfinished, tokens, self.pad)

    def advance(self, tokens: torch.Tensor, done: torch.Tensor) -> bool:
        """`tokens` [B] appended: streamed, and the rows `done` [B] says are finished end. Whether any row goes on."""
        self.stream(tokens)
        self.unfinished = self.unfinished & ~done
        return bool(self.unfinished.any())

    def stream(self, tokens: torch.Tensor) -> None:
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()
