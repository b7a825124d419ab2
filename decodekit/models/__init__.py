"""Native model families, weight loading (safetensors, GGUF) and the tokenizer."""

from .config import SUPPORTED_MODEL_TYPES, ModelConfig
from .llama import LlamaForCausalLM
from .loading import AutoModelForCausalLM
from .tokenizer import AutoTokenizer, Tokenizer

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "LlamaForCausalLM", "AutoModelForCausalLM", "AutoTokenizer", "Tokenizer"]
