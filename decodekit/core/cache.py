"""The cache hook point, as the loop and plugins see it. The caches themselves live with the model families
(families/cache.py), which read and write them; they know nothing of generation."""

from ..families.cache import (Cache, DynamicCache, StaticCache, cached_length, crop_to, grows, new_cache, record_past,
                              recurrent, reorder_rows, rolls_back)

__all__ = ["Cache", "DynamicCache", "StaticCache", "cached_length", "crop_to", "grows", "new_cache", "record_past",
           "recurrent", "reorder_rows", "rolls_back"]
