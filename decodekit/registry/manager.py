"""The plugin manager: one per process, holding the built-in strategies, the installed plugin packages
(entry-point group `decodekit`) and anything registered at run time. Discovery happens here only.

Hooks are called through pluggy (`call_hooks` / `call_first` are `pm.hook.<name>(...)`), in pluggy's order
(tryfirst, then the newest registration first). When a plugin registers, each of its hook functions is wrapped
(`_guarded`) so that one plugin's failure is that plugin's alone: an installed or run-time plugin whose hook raises
anything but ValueError (which says the user's config is invalid) or KeyboardInterrupt is disabled for the process,
recorded with its traceback summary (`decodekit list` shows it), and the call goes on without it. Built-in plugins
and the method a call asked for (custom_generate) are not skipped: their failures propagate, naming the plugin. The
wrapper also tags each result with its plugin's name, which callers need (a processor's owner, a loop's). A plugin
whose hook names match no hookspec (a misspelling) or that uses pluggy wrappers is refused at registration.

A method's hooks (custom_generate) are not registered here at all: `plugins_for_call` makes a per-call plugin
manager (the process's plugins, then the method's, registered last) that hook calls made in that context (this
thread, this asyncio task) alone use, so one thread's method never reaches another thread's generate(). Such
managers are kept per method set until the process's plugins change.

Environment:
  DECODEKIT_LOAD_PLUGINS   unset: load every installed plugin; empty: none; "a,b": only those entry points
  DECODEKIT_STRICT_PLUGINS "1": a plugin that fails raises instead of being disabled and recorded (for plugin authors)
  DECODEKIT_TRACE          "1": every hook call is written to stderr, through pluggy's hook-call monitoring: the
                           implementations in call order, then the plugins that returned something (`--trace`)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import logging
import os
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .hookspecs import hook_names, unknown_hook

logger = logging.getLogger("decodekit")

ENTRY_POINT_GROUP = "decodekit"

# Built-in strategies, registered exactly as an outside plugin is: (name, module).
BUILTIN_PLUGINS = (
    ("processors", "decodekit.plugins.processors"),
    ("structured", "decodekit.plugins.structured"),  # after processors: its tryfirst mask runs before them
    ("watermark", "decodekit.plugins.watermark"),  # its processor is placed by processors, after the warpers
    ("guidance", "decodekit.plugins.guidance"),  # after structured: its tryfirst hook then runs first of all
    ("stopping", "decodekit.plugins.stopping"),
    ("caches", "decodekit.plugins.caches"),
    ("greedy", "decodekit.plugins.greedy"),
    ("sampling", "decodekit.plugins.sampling"),
    ("llamacpp_samplers", "decodekit.plugins.llamacpp_samplers"),  # after sampling: mirostat's selector is asked first
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
        return {
            "name": self.name,
            "kind": self.kind,
            "source": self.source,
            "description": self.description,
            "hooks": self.hooks,
            "kwargs": self.kwargs,
            "error": self.error,
        }


class PluginLoadError(RuntimeError):
    pass


class PluginError(RuntimeError):
    """A plugin misbehaved: a hook named like no hookspec, an output of the wrong shape, a failing hook."""


_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_records: dict[str, PluginRecord] = {}


def describe(plugin: Any) -> str:
    """The first paragraph of the plugin's docstring, on one line."""
    doc = (inspect.getdoc(plugin) or "").strip()
    return " ".join(doc.split("\n\n")[0].split())


def _record(name: str, plugin: Any, kind: str, source: str) -> None:
    _records[name] = PluginRecord(name, kind, source, describe(plugin))


# Plugins whose failures propagate instead of disabling them: the built-ins and call-scoped methods.
_propagating: set[str] = set()


def _strict() -> bool:
    return os.environ.get("DECODEKIT_STRICT_PLUGINS", "") not in ("", "0")


def get_plugin_manager() -> pluggy.PluginManager:
    """The process's plugin manager, built once (and again only after reset())."""
    global _manager
    if _manager is None:
        with _lock:
            if _manager is None:
                pm = _new_manager()
                for name, module in BUILTIN_PLUGINS:
                    plugin = importlib.import_module(module)
                    checked_register(pm, plugin, name)
                    _record(name, plugin, "built-in", module)
                    _propagating.add(name)
                load_entry_points(pm)
                _manager = pm
    return _manager


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if os.environ.get("DECODEKIT_TRACE", "") not in ("", "0"):
        pm.add_hookcall_monitoring(_trace_before, _trace_after)
    return pm


def _trace_before(hook_name: str, impls, kwargs) -> None:
    order = [impl.plugin_name for impl in reversed(impls)]
    sys.stderr.write(f"decodekit trace: {hook_name} -> {', '.join(order) or 'no implementation'}\n")


def _trace_after(outcome, hook_name: str, impls, kwargs) -> None:
    try:
        result = outcome.get_result()
    except BaseException as error:  # noqa: BLE001 (reported, then raised by pluggy to the caller)
        sys.stderr.write(f"decodekit trace: {hook_name} raised {type(error).__name__}: {error}\n")
        return
    tagged = [result] if isinstance(result, tuple) else result or []
    sys.stderr.write(f"decodekit trace: {hook_name} answered by {[name for name, _ in tagged] or 'none'}\n")


def _problems(hooks: dict[str, Any]) -> list[str]:
    """What is wrong with a plugin's hook implementations {hook name: HookImpl or a caller's impls}: names no
    hookspec has (with the closest one), wrappers."""
    problems = []
    for hook, impls in hooks.items():
        if unknown_hook(hook) is not None:
            problems.append(unknown_hook(hook))
        elif any(i.hookwrapper or i.wrapper for i in impls):
            problems.append(f"{hook} is a hook wrapper, which decodekit does not call")
    return problems


def checked_register(pm: pluggy.PluginManager, plugin: Any, name: str | None, for_call: bool = False) -> str:
    """pm.register, then the checks pluggy leaves to the host: every hook implementation names a hookspec
    (else PluginError with the closest name), and none is a wrapper (a plugin's failure must stay its own, which a
    wrapper around the others' calls would break). Each hook function is then wrapped by _guarded; `for_call`: the
    plugin is a call's method, whose failures always propagate."""
    registered = pm.register(plugin, name=name)
    if registered is None:  # pluggy returns None for a plugin blocked by name
        raise PluginError(f"plugin {name!r} is blocked from registering.")
    impls = {
        caller.name: [i for i in caller.get_hookimpls() if i.plugin is plugin]
        for caller in pm.get_hookcallers(plugin) or ()
    }
    problems = _problems(impls)
    if problems:
        pm.unregister(plugin)
        raise PluginError(
            f"plugin {registered!r} was not registered: "
            + "; ".join(problems)
            + f". decodekit's hooks are {hook_names()}."
        )
    for hook_name, own in impls.items():
        for impl in own:
            # pluggy calls impl.function with the arguments its original signature named (impl.argnames).
            impl.function = _guarded(registered, hook_name, impl.function, for_call)
    return registered


def _guarded(name: str, hook_name: str, function, for_call: bool):
    """`function` (plugin `name`'s implementation of `hook_name`) returning (name, result), or None where it
    returned None; a failure disables an isolated plugin (the call goes on without it) or propagates with a note
    naming the plugin."""

    @functools.wraps(function)
    def guarded(*args):
        if not for_call and get_plugin_manager().get_plugin(name) is None:
            return None  # disabled during this call, in a call's manager that still holds it
        try:
            result = function(*args)
        except (KeyboardInterrupt, ValueError):
            raise
        except BaseException as error:  # SystemExit from a plugin is a plugin failure too
            if _before_loading.get():
                return None  # a check that needs the model (preflight): the call itself makes it
            if for_call or name in _propagating or _strict():
                if hasattr(error, "add_note"):
                    error.add_note(f"(raised by plugin {name!r} in {hook_name})")
                raise
            if _requests_fail_alone.get():  # one served request's values: that request fails, nothing is disabled
                failure = PluginError(f"plugin {name!r} failed in {hook_name}: {type(error).__name__}: {error}")
                raise failure from error
            with _lock:
                pm = get_plugin_manager()
                if pm.get_plugin(name) is not None:
                    _disable(pm, name, hook_name, error)
            return None
        return None if result is None else (name, result)

    return guarded


def _owner(pm: pluggy.PluginManager, impl) -> str:
    return pm.get_name(impl.plugin) or impl.plugin_name


def _disable(pm: pluggy.PluginManager, name: str, hook: str, error: BaseException) -> None:
    summary = "".join(traceback.format_exception_only(type(error), error)).strip()
    where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    location = f" at {where[0].filename}:{where[0].lineno}" if where else ""
    plugin = pm.get_plugin(name)
    if plugin is not None:
        pm.unregister(name=name)
        _changed()
    record = _records.get(name) or PluginRecord(name, "runtime")
    record.error = f"disabled after {hook} raised {summary}{location}"
    _records[name] = record
    logger.warning("plugin %r is disabled for this process: %s", name, record.error)


# Set while values are checked before any model is loaded (preflight): a hook that fails for anything but a ValueError
# there (it needed the model) is passed over, neither disabled nor raised.
_before_loading: contextvars.ContextVar[bool] = contextvars.ContextVar("decodekit_before_loading", default=False)


@contextlib.contextmanager
def before_loading():
    """Hook calls inside the block check values with no model loaded (the context's model is None): a ValueError
    says a value is invalid; any other failure is a check that needs the model, passed over until the call."""
    token = _before_loading.set(True)
    try:
        yield
    finally:
        _before_loading.reset(token)


# The methods active in this context: ((name, module), ...), and the plugin manager their hook calls use.
_call_plugins: contextvars.ContextVar[tuple[tuple[str, Any], ...]] = contextvars.ContextVar(
    "decodekit_call_plugins", default=()
)
_call_manager: contextvars.ContextVar[pluggy.PluginManager | None] = contextvars.ContextVar(
    "decodekit_call_manager", default=None
)
# Per-call managers by method set, valid while the process's plugins stay as they were (_changed clears them).
_call_managers: dict[tuple, pluggy.PluginManager] = {}
CALL_MANAGERS_KEPT = 32


def _changed() -> None:
    _call_managers.clear()


def _manager_with(methods: tuple[tuple[str, Any], ...]) -> pluggy.PluginManager:
    """A plugin manager holding the process's plugins, in their order, then `methods` (registered last, so called
    as the newest): pluggy's own ordering then places a method's tryfirst and trylast hooks."""
    key = tuple((name, id(module)) for name, module in methods)
    with _lock:
        pm = _call_managers.get(key)
        if pm is not None:
            return pm
        pm = _new_manager()
        for name, plugin in get_plugin_manager().list_name_plugin():
            checked_register(pm, plugin, name)
        for name, module in methods:
            if pm.get_plugin(name) is not None:
                pm.unregister(name=name)  # the method shadows a registered plugin of its name
            checked_register(pm, module, name, for_call=True)
        if len(_call_managers) >= CALL_MANAGERS_KEPT:
            _call_managers.pop(next(iter(_call_managers)))
        _call_managers[key] = pm
        return pm


@contextlib.contextmanager
def plugins_for_call(plugin: Any, name: str):
    """`plugin`'s hooks (a method's module), under `name`, for the hook calls made in this context inside the block
    alone: other threads and tasks never see them, and their failures propagate, naming the plugin. PluginError
    (before the block runs) for a hook that names no hookspec."""
    methods = _call_plugins.get() + ((name, plugin),)
    pm = _manager_with(methods)
    tokens = _call_plugins.set(methods), _call_manager.set(pm)
    try:
        yield
    finally:
        _call_plugins.reset(tokens[0])
        _call_manager.reset(tokens[1])


# Set while a served request is prepared or its own step runs (continuous batching): a plugin's hook, processor,
# selector or criterion that fails there fails that request alone and stays registered. One client's bad field used
# to disable the plugin for every later client, whose requests then named its fields unknown.
_requests_fail_alone: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "decodekit_requests_fail_alone", default=False
)


@contextlib.contextmanager
def failures_fail_the_request_alone():
    """Inside the block, a failure of a plugin's hook, processor, selector or stopping criterion does not disable the
    plugin (_guarded, failed_at_run_time): the caller fails the request it belongs to, the hook's failure raised as a
    PluginError naming the plugin."""
    token = _requests_fail_alone.set(True)
    try:
        yield
    finally:
        _requests_fail_alone.reset(token)


def isolated(name: str | None) -> bool:
    """Whether a failure of plugin `name`'s processor, selector or criterion would disable it (failed_at_run_time):
    an installed or run-time plugin, outside DECODEKIT_STRICT_PLUGINS."""
    return not (name is None or name in _propagating or name in {n for n, _ in _call_plugins.get()} or _strict())


def failed_at_run_time(name: str | None, what: str, error: BaseException) -> bool:
    """A plugin's processor or selector failed during generation (raised, or gave a wrong output): an installed or
    run-time plugin is disabled, as when one of its hooks raises, so later calls run without it; a built-in, a
    call's method, or any plugin under DECODEKIT_STRICT_PLUGINS is not; nor is a ValueError a failure, which says
    the call's own values are invalid (as a hook's does): one client's bad field must not take a plugin from every
    later one. Returns whether it was disabled."""
    if not isolated(name) or isinstance(error, ValueError) or _requests_fail_alone.get():
        return False
    pm = get_plugin_manager()
    with _lock:
        if pm.get_plugin(name) is None:
            return False
        _disable(pm, name, what, error)
    return True


def described(kind: str, code, owner: str | None) -> str:
    """How an error names plugin code: "the logits processor NAME of plugin 'x'" (or "of stopping_criteria (passed
    to generate)" for an owner that says where it came from)."""
    name = getattr(code, "__name__", None) or type(code).__name__
    return f"the {kind} {name}" + (
        f" of {owner}" if owner and "(" in owner else f" of plugin {owner!r}" if owner else ""
    )


def plugin_failure(error: BaseException, owner: str | None, what: str, where: str) -> BaseException:
    """What to raise for `error`, raised by plugin code at run time (`what`: "a logits processor", ...; `where`
    names the code and position for a note): an isolated plugin is disabled (failed_at_run_time); the error gets a
    note naming `where`, and one that is no Exception (SystemExit) becomes a PluginError, so it fails the call and
    not the process. KeyboardInterrupt and GeneratorExit are the caller's to let through."""
    failed_at_run_time(owner, what, error)
    if not isinstance(error, Exception):
        failure = PluginError(f"{where} raised {type(error).__name__}({error})")
        failure.__cause__ = error
        return failure
    if not isinstance(error, (PluginError, ValueError)) and hasattr(error, "add_note"):
        error.add_note(f"(raised by {where})")
    return error


def _caller(hook_name: str, only: set[str] | None):
    pm = _call_manager.get() or get_plugin_manager()
    if only is None:
        return getattr(pm.hook, hook_name)
    return pm.subset_hook_caller(hook_name, [p for n, p in pm.list_name_plugin() if n not in only])


def call_hooks(hook_name: str, only: set[str] | None = None, **kwargs: Any) -> list[tuple[str, Any]]:
    """(plugin name, result) of every implementation of `hook_name` that returned something, in pluggy's order;
    with `only`, of the plugins named there alone. For a firstresult hook, the first one's alone."""
    caller = _caller(hook_name, only)
    results = caller(**kwargs)
    if caller.spec is not None and caller.spec.opts.get("firstresult"):
        return [results] if results is not None else []
    return results


def call_first(hook_name: str, only: set[str] | None = None, **kwargs: Any) -> tuple[str | None, Any]:
    """(plugin name, result) of the first implementation that returns something other than None (the hook is a
    firstresult one), else (None, None); with `only`, among the plugins named there alone."""
    return _caller(hook_name, only)(**kwargs) or (None, None)


def _selected(name: str) -> bool:
    wanted = os.environ.get("DECODEKIT_LOAD_PLUGINS")
    if wanted is None:
        return True
    return name in {w.strip() for w in wanted.split(",") if w.strip()}


def load_entry_points(pm: pluggy.PluginManager) -> None:
    """Registers every installed plugin; a broken one is recorded with its error and the rest still load."""
    from importlib_metadata import entry_points

    strict = _strict()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if not _selected(ep.name) or pm.get_plugin(ep.name) is not None:
            continue
        dist = f"{ep.dist.name}=={ep.dist.version}" if ep.dist is not None else ep.value
        try:
            plugin = ep.load()
            checked_register(pm, plugin, ep.name)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # any failure in someone else's package, SystemExit too, must not stop decodekit
            if strict:
                raise PluginLoadError(f"plugin {ep.name!r} ({dist}, {ep.value}) failed to load: {e}") from e
            message = f"{type(e).__name__}: {e}"
            logger.warning("plugin %r (%s) failed to load and is skipped: %s", ep.name, dist, message)
            _records[ep.name] = PluginRecord(ep.name, "package", dist, error=message)
            continue
        _record(ep.name, plugin, "package", dist)


def register(plugin: Any, name: str | None = None, *, scope: str = "process") -> str:
    """Register a plugin object or module for every later generate() call, in every thread; returns its name.
    PluginError if a hook of it names no hookspec. scope="call": its failures propagate instead of disabling it
    (a custom_generate method is not registered here at all: plugins_for_call keeps it to its own call)."""
    pm = get_plugin_manager()
    with _lock:
        registered = checked_register(pm, plugin, name)
        _changed()
        if scope == "call":
            _propagating.add(registered)
        else:
            _record(
                registered, plugin, "runtime", getattr(plugin, "__module__", None) or getattr(plugin, "__name__", "")
            )
    return registered


def unregister(name: str) -> None:
    """Removes plugin `name`: a registered one, or one that failed and was disabled (`decodekit list` shows it with
    its error), whose record goes."""
    pm = get_plugin_manager()
    with _lock:
        if pm.get_plugin(name) is None:
            record = _records.get(name)
            if record is not None and record.error is not None:
                del _records[name]
                return
            disabled = sorted(n for n, r in _records.items() if r.error is not None)
            raise ValueError(
                f"No plugin named {name!r} is registered; registered: "
                f"{sorted(n for n, _ in pm.list_name_plugin())}"
                + (f", disabled after failing: {disabled}." if disabled else ".")
            )
        pm.unregister(name=name)
        _changed()
        _records.pop(name, None)
        _propagating.discard(name)


def hooks_of(pm: pluggy.PluginManager, plugin: Any) -> list[str]:
    return sorted(caller.name for caller in pm.get_hookcallers(plugin) or ())


def _declared_fields() -> dict[str, dict[str, Any]]:
    """{plugin name: the fields it declares}; a plugin whose declaration fails is disabled (see module doc)."""
    out = {}
    for name, declared in call_hooks("decodekit_config_fields"):
        try:
            out[name] = dict(declared)
        except (TypeError, ValueError) as error:
            if name in _propagating or _strict():
                raise PluginError(
                    f"plugin {name!r}: decodekit_config_fields returned {declared!r}, not a dict"
                ) from error
            _disable(get_plugin_manager(), name, "decodekit_config_fields", error)
    return out


def plugin_records() -> list[PluginRecord]:
    """Every registered plugin (with its hooks and the kwargs it accepts) and every one that failed."""
    fields = _declared_fields()  # first: a plugin that fails here is listed with its error, not as working
    pm = get_plugin_manager()
    out = []
    for name, plugin in pm.list_name_plugin():
        record = _records.get(name) or PluginRecord(name, "runtime", description=describe(plugin))
        record.hooks = hooks_of(pm, plugin)
        record.kwargs = fields.get(name, {})
        out.append(record)
    out.extend(r for r in _records.values() if r.error is not None)
    return out


def config_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for declared in _declared_fields().values():
        fields.update(declared)
    return fields


def cache_implementations() -> tuple[str, ...]:
    names: list[str] = []
    for _, declared in call_hooks("decodekit_cache_implementations"):
        names.extend(n for n in declared if n not in names)
    return tuple(names)


def outside_plugins() -> set[str]:
    """The names of the registered plugins that are not built in."""
    builtin = {name for name, _ in BUILTIN_PLUGINS}
    return {name for name, _ in get_plugin_manager().list_name_plugin()} - builtin


def reset() -> None:
    """Forget every plugin; the next get_plugin_manager() discovers them again (tests, after installing one)."""
    global _manager
    with _lock:
        _manager = None
        _changed()
        _records.clear()
        _propagating.clear()
