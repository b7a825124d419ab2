"""decodekit: a plugin framework for custom decoding methods on causal language models.

The names below are imported when first used (PEP 562), so `import decodekit` and the command line's `--help` need
no torch: what each name is, and where it lives, is the table _EXPORTS.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DynamicCache": ".families.cache",
    "StaticCache": ".families.cache",
    "GenerationConfig": ".core.config",
    "GenerateOutput": ".core.outputs",
    "LogitsProcessorList": ".core.processors",
    "StoppingCriteriaList": ".core.stopping",
    "TextIteratorStreamer": ".core.streamers",
    "TextStreamer": ".core.streamers",
    "Model": ".facade",
    "wrap": ".facade",
    "AutoModelForCausalLM": ".loading",
    "AutoTokenizer": ".loading",
    "default_model_path": ".loading.default",
    "SynthIDTextWatermarkDetector": ".plugins.watermark",
    "SynthIDTextWatermarkingConfig": ".plugins.watermark",
    "WatermarkDetector": ".plugins.watermark",
    "WatermarkingConfig": ".plugins.watermark",
    "get_plugin_manager": ".registry",
    "hookimpl": ".registry",
    "register": ".registry",
    "set_threads": ".kernels.threads",
    "unregister": ".registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'decodekit' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
