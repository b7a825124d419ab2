"""Built-in KV caches: static (preallocated) and dynamic, made by core.cache.new_cache.

Static is the default for decodekit's own models: its size is known up front (prompt + max_new_tokens), and
writing in place avoids a reallocation per token. A model that makes its own caches (a wrapped transformers
model: transformers Cache objects) gets dynamic by default, as transformers' generate() does.
"""

from ..core.cache import new_cache
from ..registry import hookimpl


@hookimpl
def decodekit_config_fields():
    return {"cache_implementation": None, "use_cache": True}


@hookimpl
def decodekit_cache_implementations():
    return ["static", "dynamic"]


@hookimpl
def decodekit_cache(generation_config, context):
    kind = generation_config.cache_implementation
    if kind is None:
        # decodekit's own models preallocate; a model that makes its own caches (a wrapped transformers model)
        # gets the kind its library defaults to, dynamic.
        kind = "dynamic" if getattr(context.model, "makes_caches", False) else "static"
    if kind in ("static", "dynamic"):
        return new_cache(context.model, kind, context.batch_size, context.max_length)
    return None
