"""decodekit: a plugin framework for custom decoding methods on causal language models."""

from .core.cache import DynamicCache, StaticCache
from .core.config import GenerationConfig
from .core.outputs import GenerateOutput
from .core.processors import LogitsProcessorList
from .core.stopping import StoppingCriteriaList
from .core.streamers import TextIteratorStreamer, TextStreamer
from .facade import Model, wrap
from .models import AutoModelForCausalLM, AutoTokenizer
from .plugins.watermark import (SynthIDTextWatermarkDetector, SynthIDTextWatermarkingConfig, WatermarkDetector,
                                WatermarkingConfig)
from .registry import get_plugin_manager, hookimpl, register, unregister

__version__ = "0.1.0"

__all__ = [
    "AutoModelForCausalLM", "AutoTokenizer", "GenerationConfig", "GenerateOutput", "DynamicCache", "StaticCache",
    "LogitsProcessorList", "StoppingCriteriaList", "TextStreamer", "TextIteratorStreamer",
    "get_plugin_manager", "hookimpl", "register", "unregister", "Model", "wrap", "WatermarkingConfig", "WatermarkDetector",
    "SynthIDTextWatermarkingConfig", "SynthIDTextWatermarkDetector",
]
