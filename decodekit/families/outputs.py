"""What a model family's forward returns: attribute, key and index access, as transformers' ModelOutput offers
(Hub code uses all three)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch


class ModelOutput:
    """Fields set to None are left out of key and index access, like transformers."""

    def _present(self) -> list[tuple[str, Any]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]

    def keys(self) -> list[str]:
        return [k for k, _ in self._present()]

    def values(self) -> list[Any]:
        return [v for _, v in self._present()]

    def items(self) -> list[tuple[str, Any]]:
        return self._present()

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, str):
            return dict(self._present())[key]
        return self.values()[key]

    def __contains__(self, key: str) -> bool:
        return key in self.keys()

    def to_tuple(self) -> tuple:
        return tuple(self.values())


@dataclass
class CausalLMOutput(ModelOutput):
    """What a model forward returns. `hidden_states` holds the embeddings and every layer's output."""

    logits: torch.Tensor | None = None
    past_key_values: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
