"""Plugin registration: the hook specifications and the plugin manager."""

from .hookspecs import hookimpl, hookspec
from .manager import get_plugin_manager, register, unregister

__all__ = ["hookimpl", "hookspec", "get_plugin_manager", "register", "unregister"]
