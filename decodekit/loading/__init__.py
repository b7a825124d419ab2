"""Getting a model: AutoModelForCausalLM and AutoTokenizer, weights from a directory, the Hub, a GGUF file or through
transformers (pretrained.py, gguf_file.py, via_transformers.py), the tokenizer over `tokenizers` and the default model.

The model families themselves live in decodekit.families and the CPU speed paths in decodekit.kernels.
"""

from ..families.config import SUPPORTED_MODEL_TYPES, ModelConfig
from ..families.llama import LlamaForCausalLM
from .pretrained import AutoModelForCausalLM
from .tokenizer import AutoTokenizer, Tokenizer

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ModelConfig",
    "LlamaForCausalLM",
    "AutoModelForCausalLM",
    "AutoTokenizer",
    "Tokenizer",
]
