"""The model facade: one class, `Model`, over decodekit's model families and transformers models, giving both
generate(), generate_batch() and init_continuous_batching()."""

from .model import BACKENDS, Model, wrap

__all__ = ["BACKENDS", "Model", "wrap"]
