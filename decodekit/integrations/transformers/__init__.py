"""transformers as a backend, both ways.

- `wrap(model)`: decodekit's generate() (every hook point, strategy and custom_generate method) on a
  transformers causal LM the user already holds; the model itself is not changed.
- `to_transformers(model, ...)`: registered decodekit plugins, or one hook-only method, as the
  logits_processor and stopping_criteria of transformers' own generate().
- `loading`: what decodekit.AutoModelForCausalLM and AutoTokenizer use for the architectures and tokenizers
  decodekit does not build natively.

Needs the `transformers` extra: pip install 'decodekit[transformers]'.
"""

from .model import require_transformers

require_transformers()  # an ImportError here names the extra to install

from .bridge import TransformersHooks, to_transformers  # noqa: E402
from .model import TransformersModel, is_transformers_model, wrap  # noqa: E402

__all__ = ["TransformersHooks", "TransformersModel", "is_transformers_model", "to_transformers", "wrap"]
