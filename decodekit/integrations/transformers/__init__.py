"""transformers as a backend, both ways.

- `wrap(model)`: decodekit's generate() (every hook point, strategy and custom_generate method) on a
  transformers causal LM the user already holds; the model itself is not changed (decodekit.facade).
- `to_transformers(model, ...)`: registered decodekit plugins, or one hook-only method, as the
  logits_processor and stopping_criteria of transformers' own generate().

Needs the `transformers` extra: pip install 'decodekit[transformers]'.
"""

from ...facade import wrap
from ...facade.transformers import is_transformers_model, require_transformers

require_transformers()  # an ImportError here names the extra to install

from .bridge import TransformersHooks, to_transformers  # noqa: E402

__all__ = ["TransformersHooks", "is_transformers_model", "to_transformers", "wrap"]
