"""The plugin manager: one per process, holding the built-in strategies, the installed plugin packages
(entry-point group `decodekit`) and anything registered at run time. Discovery happens here only.

Environment:
  DECODEKIT_LOAD_PLUGINS   unset: load every installed plugin; empty: none; "a,b": only those entry points
  DECODEKIT_STRICT_PLUGINS "1": a plugin that fails to load raises instead of being recorded (for plugin authors)
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs

logger = logging.getLogger("decodekit")

ENTRY_POINT_GROUP = "decodekit"

# Built-in strategies, registered exactly as an outside plugin is: (name, module).
BUILTIN_PLUGINS = (
    ("processors", "decodekit.plugins.processors"),
    ("guidance", "decodekit.plugins.guidance"),  # after processors: its tryfirst hook then runs first
    ("stopping", "decodekit.plugins.stopping"),
    ("caches", "decodekit.plugins.caches"),
    ("greedy", "decodekit.plugins.greedy"),
    ("sampling", "decodekit.plugins.sampling"),
    ("beam_search", "decodekit.plugins.beam_search"),
    ("speculative", "decodekit.plugins.speculative"),
    ("dola", "decodekit.plugins.dola"),
    ("contrastive", "decodekit.plugins.contrastive"),
    ("fused", "decodekit.plugins.fused"),
)


@dataclass
class PluginRecord:
    """What `decodekit list` shows about one plugin."""

    name: str
    kind: str  # built-in, package, runtime, hub, local
    source: str = ""  # distribution==version, a module path, repo@revision
    description: str = ""
    hooks: list[str] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "source": self.source, "description": self.description,
                "hooks": self.hooks, "kwargs": self.kwargs, "error": self.error}


class PluginLoadError(RuntimeError):
    pass


_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None
_records: dict[str, PluginRecord] = {}


def describe(plugin: Any) -> str:
    doc = inspect.getdoc(plugin) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _record(name: str, plugin: Any, kind: str, source: str) -> None:
    _records[name] = PluginRecord(name, kind, source, describe(plugin))


def get_plugin_manager() -> pluggy.PluginManager:
    global _manager
    if _manager is None:
        with _lock:
            if _manager is None:
                pm = pluggy.PluginManager(hookspecs.PROJECT)
                pm.add_hookspecs(hookspecs)
                for name, module in BUILTIN_PLUGINS:
                    plugin = importlib.import_module(module)
                    pm.register(plugin, name=name)
                    _record(name, plugin, "built-in", module)
                load_entry_points(pm)
                _manager = pm
    return _manager


def _selected(name: str) -> bool:
    wanted = os.environ.get("DECODEKIT_LOAD_PLUGINS")
    if wanted is None:
        return True
    return name in {w.strip() for w in wanted.split(",") if w.strip()}


def load_entry_points(pm: pluggy.PluginManager) -> None:
    """Registers every installed plugin; a broken one is recorded with its error and the rest still load."""
    from importlib_metadata import entry_points

    strict = os.environ.get("DECODEKIT_STRICT_PLUGINS", "") not in ("", "0")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if not _selected(ep.name) or pm.get_plugin(ep.name) is not None:
            continue
        dist = f"{ep.dist.name}=={ep.dist.version}" if ep.dist is not None else ep.value
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as e:  # any failure in someone else's package must not stop decodekit
            if strict:
                raise PluginLoadError(f"plugin {ep.name!r} ({dist}, {ep.value}) failed to load: {e}") from e
            message = f"{type(e).__name__}: {e}"
            logger.warning("plugin %r (%s) failed to load and is skipped: %s", ep.name, dist, message)
            _records[ep.name] = PluginRecord(ep.name, "package", dist, error=message)
            continue
        _record(ep.name, plugin, "package", dist)


def register(plugin: Any, name: str | None = None) -> str:
    """Register a plugin object or module for every later generate() call; returns its name."""
    pm = get_plugin_manager()
    registered = pm.register(plugin, name=name)
    _record(registered, plugin, "runtime", getattr(plugin, "__module__", None) or getattr(plugin, "__name__", ""))
    return registered


def unregister(name: str) -> None:
    pm = get_plugin_manager()
    if pm.get_plugin(name) is None:
        raise ValueError(f"No plugin named {name!r} is registered; registered: {sorted(n for n, _ in pm.list_name_plugin())}.")
    pm.unregister(name=name)
    _records.pop(name, None)


def hooks_of(pm: pluggy.PluginManager, plugin: Any) -> list[str]:
    return sorted(caller.name for caller in pm.get_hookcallers(plugin) or ())


def config_fields_of(plugin: Any) -> dict[str, Any]:
    impl = getattr(plugin, "decodekit_config_fields", None)
    return dict(impl() or {}) if callable(impl) else {}


def plugin_records() -> list[PluginRecord]:
    """Every registered plugin (with its hooks and the kwargs it accepts) and every one that failed to load."""
    pm = get_plugin_manager()
    out = []
    for name, plugin in pm.list_name_plugin():
        record = _records.get(name) or PluginRecord(name, "runtime", description=describe(plugin))
        record.hooks = hooks_of(pm, plugin)
        record.kwargs = config_fields_of(plugin)
        out.append(record)
    out.extend(r for r in _records.values() if r.error is not None)
    return out


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


def reset() -> None:
    """Forget every plugin; the next get_plugin_manager() discovers them again (tests, after installing one)."""
    global _manager
    with _lock:
        _manager = None
        _records.clear()
