"""Built-in KV caches: static (preallocated, the default in generate()) and dynamic.

The static cache is the default because its size is known up front (prompt + max_new_tokens), and
writing in place avoids a reallocation per token.
"""

from ..core.cache import DynamicCache, StaticCache
from ..registry import hookimpl


@hookimpl
def decodekit_config_fields():
    return {"cache_implementation": None, "use_cache": True}


@hookimpl
def decodekit_cache_implementations():
    return ["static", "dynamic"]


@hookimpl
def decodekit_cache(generation_config, context):
    kind = generation_config.cache_implementation or "static"
    if kind == "dynamic":
        return DynamicCache()
    if kind == "static":
        config = context.model.config
        if all(hasattr(config, f) for f in ("num_hidden_layers", "num_key_value_heads", "head_dim")):
            return StaticCache.for_model(context.model, context.batch_size, context.max_length)
        # A model without those config fields (a toy, or another architecture) cannot be preallocated for.
        return DynamicCache()
    return None
