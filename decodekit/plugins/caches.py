"""Built-in KV caches: static (preallocated) and dynamic, made by families.cache.new_cache.

Static is the default for decodekit's own models: its size is known up front (prompt + max_new_tokens), and
writing in place avoids a reallocation per token. A model that makes its own caches (a wrapped transformers
model: transformers Cache objects) gets dynamic by default, as transformers' generate() does.
"""

from ..families.cache import new_cache
from ..core.config import is_int
from ..registry import hookimpl

CACHE_CONFIG_KEYS = ("max_cache_len",)


@hookimpl
def decodekit_config_fields():
    # max_cache_len / cache_config: transformers' size of a static cache (longer than the call needs: a cache kept
    # for later calls); cache_config's other keys belong to cache kinds decodekit does not have (quantized,
    # offloaded) and are refused by name.
    return {"cache_implementation": None, "use_cache": True, "max_cache_len": None, "cache_config": None}


@hookimpl
def decodekit_validate_config(generation_config, context):
    gc = generation_config
    config = gc.cache_config
    if config is not None:
        fields = config.to_dict() if callable(getattr(config, "to_dict", None)) else config
        if not isinstance(fields, dict) or set(fields) - set(CACHE_CONFIG_KEYS):
            unknown = sorted(set(fields) - set(CACHE_CONFIG_KEYS)) if isinstance(fields, dict) else None
            raise gc.invalid(
                "cache_config",
                f"expected a dict with keys among {list(CACHE_CONFIG_KEYS)}"
                + (f"; {unknown} configure cache kinds decodekit does not have" if unknown else ""),
            )
        if fields.get("max_cache_len") is not None and gc.max_cache_len is None:
            gc.max_cache_len = fields["max_cache_len"]
    length = gc.max_cache_len
    positions = getattr(getattr(context.model, "config", None), "max_position_embeddings", None)
    most = max(context.max_length, positions if is_int(positions) else 2**31 - 1)
    if length is not None and (not is_int(length) or not context.max_length <= length <= most):
        raise gc.invalid(
            "max_cache_len",
            f"expected an integer from this call's max_length ({context.max_length}: the "
            f"prompt and every new token) to the model's context ({most} positions), or None",
        )


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
        length = max(context.max_length, generation_config.max_cache_len or 0)
        return new_cache(context.model, kind, context.batch_size, length)
    return None
