"""The plugin manager: one per process, holding the built-in strategies and any others registered."""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

import pluggy

from . import hookspecs

# Built-in strategies, registered exactly as an outside plugin is: (name, module).
BUILTIN_PLUGINS = (
    ("processors", "decodekit.plugins.processors"),
    ("stopping", "decodekit.plugins.stopping"),
    ("caches", "decodekit.plugins.caches"),
    ("greedy", "decodekit.plugins.greedy"),
    ("sampling", "decodekit.plugins.sampling"),
)


@lru_cache(maxsize=1)
def get_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name, module in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(module), name=name)
    return pm


def register(plugin: Any, name: str | None = None) -> str:
    """Register a plugin object or module for every later generate() call; returns its name."""
    return get_plugin_manager().register(plugin, name=name)


def unregister(name: str) -> None:
    pm = get_plugin_manager()
    if pm.get_plugin(name) is None:
        raise ValueError(f"No plugin named {name!r} is registered; registered: {sorted(n for n, _ in pm.list_name_plugin())}.")
    pm.unregister(name=name)


def config_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for declared in get_plugin_manager().hook.decodekit_config_fields():
        fields.update(declared or {})
    return fields


def cache_implementations() -> tuple[str, ...]:
    names: list[str] = []
    for declared in get_plugin_manager().hook.decodekit_cache_implementations():
        names.extend(n for n in declared or () if n not in names)
    return tuple(names)
