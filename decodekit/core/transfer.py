"""Copies of a step's host-made index tensors to the device that do not wait for the device."""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """`values` (a list, or a CPU tensor) as a tensor on `device`. On CUDA the copy goes from pinned memory without
    blocking: a copy from pageable memory waits until every kernel queued before it has run, so a step that made
    its indices after launching the forward would wait for the forward each time (the caching host allocator keeps
    the pinned buffer until the copy is done)."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
