"""Continuous batching: many requests at once, each with its own generation config and decoding method, over a
paged KV cache (paged.py), scheduled step by step (scheduler.py) by a background thread (manager.py).

Every decodekit model (decodekit.facade.Model) has `generate_batch` and `init_continuous_batching`; see docs/continuous-batching.md.
"""

from .manager import ContinuousBatchingManager, MethodCache, QueueFull, generate_batch
from .request import GenerationOutput, RequestStatus

__all__ = [
    "ContinuousBatchingManager",
    "GenerationOutput",
    "MethodCache",
    "QueueFull",
    "RequestStatus",
    "generate_batch",
]
