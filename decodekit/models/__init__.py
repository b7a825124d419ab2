"""Getting a model: AutoModelForCausalLM and AutoTokenizer, weights from a directory, the Hub, a GGUF file or through
transformers (loading.py, gguf_file.py, transformers.py), the tokenizer over `tokenizers` and the default model.

The model families themselves live in decodekit.families and the CPU speed paths in decodekit.kernels; their old
names under decodekit.models (decodekit.models.llama, .config, .rope, .cpu, .native, .packed, .linear, .quantize,
.choices) are the same module objects, so code and docs written against them keep working.
"""

import sys

from ..families import config, llama, rope
from ..families.config import SUPPORTED_MODEL_TYPES, ModelConfig
from ..families.llama import LlamaForCausalLM
from ..kernels import choices, cpu, linear, native, packed, quantize
from .loading import AutoModelForCausalLM
from .tokenizer import AutoTokenizer, Tokenizer

for _module in (config, llama, rope, choices, cpu, linear, native, packed, quantize):
    sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "LlamaForCausalLM", "AutoModelForCausalLM", "AutoTokenizer", "Tokenizer"]
