"""The plugin host: one object holding the process's plugins (the built-in strategies, the installed plugin packages
of entry-point group `decodekit`, anything registered at run time), what `decodekit list` shows of each, the per-call
managers of the methods in use, and the one failure policy (`PluginHost.on_failure`). Discovery happens here only.

Hooks are called through pluggy (`call_hooks` / `call_first` are `pm.hook.<name>(...)`), in pluggy's order
(tryfirst, then the newest registration first). When a plugin registers, each of its hook functions is wrapped so
that its failure goes to the policy, and its result is tagged with its plugin's name, which callers need (a
processor's owner, a loop's). A plugin whose hook names match no hookspec (a misspelling) or that uses pluggy
wrappers is refused at registration.

The failure policy, in one place (`on_failure`): an installed or run-time plugin whose code raises anything but
ValueError (which says the user's values are invalid) or KeyboardInterrupt is disabled for the process, recorded with
its traceback summary (`decodekit list` shows it); a failing hook is then passed over and the call goes on without it,
while a processor, selector or criterion failing mid-generation fails that call. Built-in plugins, the method a call
asked for (custom_generate) and every plugin under DECODEKIT_STRICT_PLUGINS are never disabled: their failures
propagate, naming the plugin. Two scopes change that: `before_loading` (values checked with no model: a hook that fails
for anything but ValueError needed the model, and is passed over) and `failures_fail_the_request_alone` (a served
request: the failure fails that request alone, the plugin stays).

A method's hooks (custom_generate) are not registered in the process's manager: `plugins_for_call` gives the hook
calls made in its context (this thread, this asyncio task) a per-call manager (the process's plugins, then the
method's, registered last), so one thread's method never reaches another thread's generate(). Such managers are kept
per method set until the process's plugins change.

Tests make a fresh host with `use_host(PluginHost(...))` rather than patching this module.

Environment:
  DECODEKIT_LOAD_PLUGINS   unset: load every installed plugin; empty: none; "a,b": only those entry points
  DECODEKIT_STRICT_PLUGINS "1": a plugin that fails raises instead of being disabled and recorded (for plugin authors)
  DECODEKIT_TRACE          "1": every hook call is written to stderr, through pluggy's hook-call monitoring: the
                           implementations in call order, then the plugins that returned something (`--trace`)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import inspect
import logging
import os
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import pluggy

from . import hookspecs
from .hookspecs import hook_names, unknown_hook

logger = logging.getLogger("decodekit")

ENTRY_POINT_GROUP = "decodekit"

# Built-in strategies, registered exactly as an outside plugin is: (name, module). Their order decides nothing but the
# firstresult hooks' (the newest registration is asked first): processors are placed by their declared stage.
BUILTIN_PLUGINS = (
    ("processors", "decodekit.plugins.processors"),
    ("structured", "decodekit.plugins.structured"),
    ("watermark", "decodekit.plugins.watermark"),
    ("guidance", "decodekit.plugins.guidance"),
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

# How many per-call managers (one per set of methods in use) a host keeps.
CALL_MANAGERS_KEPT = 32


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
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class PluginLoadError(RuntimeError):
    pass


class PluginError(RuntimeError):
    """A plugin misbehaved: a hook named like no hookspec, an output of the wrong shape, a failing hook."""


@dataclass(frozen=True)
class Scope:
    """What the hook calls of this context (thread, asyncio task) see: the methods active here ((name, module), ...)
    and the manager holding them, and the failure mode ("" as the policy says, "before_loading", "request")."""

    methods: tuple[tuple[str, Any], ...] = ()
    manager: pluggy.PluginManager | None = None
    mode: str = ""
    dropped: set[str] | None = None  # plugins this call's own failures disabled: its later hook calls skip them


_scope: contextvars.ContextVar[Scope] = contextvars.ContextVar("decodekit_plugin_scope", default=Scope())


@contextlib.contextmanager
def _scoped(**changes):
    token = _scope.set(dataclasses.replace(_scope.get(), **changes))
    try:
        yield
    finally:
        _scope.reset(token)


def describe(plugin: Any) -> str:
    """The first paragraph of the plugin's docstring, on one line."""
    doc = (inspect.getdoc(plugin) or "").strip()
    return " ".join(doc.split("\n\n")[0].split())


def described(kind: str, code, owner: str | None) -> str:
    """How an error names plugin code: "the logits processor NAME of plugin 'x'" (or "of stopping_criteria (passed
    to generate)" for an owner that says where it came from); `code` None: "the decoding loop of plugin 'x'"."""
    name = "" if code is None else " " + (getattr(code, "__name__", None) or type(code).__name__)
    return f"the {kind}{name}" + (
        f" of {owner}" if owner and "(" in owner else f" of plugin {owner!r}" if owner else ""
    )


def returned(value) -> str:
    """What plugin code returned, for an error: "a torch.float16 tensor of shape (2, 5) on cpu", else its type."""
    if all(hasattr(value, name) for name in ("dtype", "shape", "device")):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return type(value).__name__


def _strict() -> bool:
    return os.environ.get("DECODEKIT_STRICT_PLUGINS", "") not in ("", "0")


def _selected(name: str) -> bool:
    wanted = os.environ.get("DECODEKIT_LOAD_PLUGINS")
    if wanted is None:
        return True
    return name in {w.strip() for w in wanted.split(",") if w.strip()}


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


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if os.environ.get("DECODEKIT_TRACE", "") not in ("", "0"):
        pm.add_hookcall_monitoring(_trace_before, _trace_after)
    return pm


def _problems(hooks: dict[str, Any]) -> list[str]:
    """What is wrong with a plugin's hook implementations {hook name: its HookImpls}: names no hookspec has (with the
    closest one), wrappers."""
    problems = []
    for hook, impls in hooks.items():
        if unknown_hook(hook) is not None:
            problems.append(unknown_hook(hook))
        elif any(i.hookwrapper or i.wrapper for i in impls):
            problems.append(f"{hook} is a hook wrapper, which decodekit does not call")
    return problems


def _noted(error: BaseException, where: str) -> BaseException:
    if hasattr(error, "add_note"):
        error.add_note(f"(raised by {where})")
    return error


class PluginHost:
    """The plugins of one process (or of one test): the pluggy manager, built on first use; the records `decodekit
    list` shows; the plugins whose failures propagate; the per-call managers; the failure policy."""

    def __init__(self, builtins=BUILTIN_PLUGINS, installed: bool = True):
        self.builtins = tuple(builtins)
        self.installed = installed
        self.records: dict[str, PluginRecord] = {}
        self.propagating: set[str] = set()  # built-ins and scope="call" registrations: never disabled
        self._lock = threading.RLock()
        self._pm: pluggy.PluginManager | None = None
        self._call_managers: dict[tuple, pluggy.PluginManager] = {}

    # ---- the process's plugins ------------------------------------------------------------------------------

    @property
    def pm(self) -> pluggy.PluginManager:
        """The process's plugin manager, built once."""
        if self._pm is None:
            with self._lock:
                if self._pm is None:
                    pm = _new_manager()
                    for name, module in self.builtins:
                        plugin = importlib.import_module(module)
                        self._register_in(pm, plugin, name)
                        self._record(name, plugin, "built-in", module)
                        self.propagating.add(name)
                    if self.installed:
                        self._load_entry_points(pm)
                    self._pm = pm
        return self._pm

    def _record(self, name: str, plugin: Any, kind: str, source: str) -> None:
        self.records[name] = PluginRecord(name, kind, source, describe(plugin))

    def _load_entry_points(self, pm: pluggy.PluginManager) -> None:
        """Registers every installed plugin; a broken one is recorded with its error and the rest still load."""
        from importlib_metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if not _selected(ep.name) or pm.get_plugin(ep.name) is not None:
                continue
            dist = f"{ep.dist.name}=={ep.dist.version}" if ep.dist is not None else ep.value
            try:
                plugin = ep.load()
                self._register_in(pm, plugin, ep.name)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # any failure in someone else's package, SystemExit too, must not stop us
                if _strict():
                    raise PluginLoadError(f"plugin {ep.name!r} ({dist}, {ep.value}) failed to load: {e}") from e
                message = f"{type(e).__name__}: {e}"
                logger.warning("plugin %r (%s) failed to load and is skipped: %s", ep.name, dist, message)
                self.records[ep.name] = PluginRecord(ep.name, "package", dist, error=message)
                continue
            self._record(ep.name, plugin, "package", dist)

    def _register_in(self, pm: pluggy.PluginManager, plugin: Any, name: str | None) -> str:
        """pm.register, then the checks pluggy leaves to the host: every hook implementation names a hookspec
        (else PluginError with the closest name), and none is a wrapper (a plugin's failure must stay its own, which
        a wrapper around the others' calls would break). Each hook function is then wrapped by _hook_guard."""
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
                impl.function = self._hook_guard(registered, hook_name, impl.function)
        return registered

    def _hook_guard(self, name: str, hook_name: str, function):
        """`function` (plugin `name`'s implementation of `hook_name`) returning (name, result), or None where it
        returned None or failed and the policy goes on without it."""

        @functools.wraps(function)
        def hook(*args):
            # A plugin disabled by another call's failure meanwhile is still called here: the call holding this
            # manager was prepared with it (pinned_plugins) and keeps it whole. One this call's failure disabled
            # is not.
            dropped = _scope.get().dropped
            if dropped and name in dropped:
                return None
            try:
                result = function(*args)
            except BaseException as error:  # SystemExit from a plugin is a plugin failure too
                failure = self.on_failure(name, hook_name, error)
                if failure is None:
                    return None
                if failure is error:
                    raise
                raise failure from error
            return None if result is None else (name, result)

        return hook

    def register(self, plugin: Any, name: str | None = None, *, scope: str = "process") -> str:
        if scope not in ("process", "call"):
            raise ValueError(f"scope={scope!r} is invalid; expected 'process' or 'call'.")
        pm = self.pm
        with self._lock:
            registered = self._register_in(pm, plugin, name)
            self._changed()
            if scope == "call":
                self.propagating.add(registered)
            else:
                source = getattr(plugin, "__module__", None) or getattr(plugin, "__name__", "")
                self._record(registered, plugin, "runtime", source)
        return registered

    def unregister(self, name: str) -> None:
        pm = self.pm
        with self._lock:
            if pm.get_plugin(name) is None:
                record = self.records.get(name)
                if record is not None and record.error is not None:
                    del self.records[name]
                    return
                disabled = sorted(n for n, r in self.records.items() if r.error is not None)
                raise ValueError(
                    f"No plugin named {name!r} is registered; registered: "
                    f"{sorted(n for n, _ in pm.list_name_plugin())}"
                    + (f", disabled after failing: {disabled}." if disabled else ".")
                )
            pm.unregister(name=name)
            self._changed()
            self.records.pop(name, None)
            self.propagating.discard(name)

    def _changed(self) -> None:
        self._call_managers.clear()

    def manager_for(self, methods: tuple[tuple[str, Any], ...]) -> pluggy.PluginManager:
        """A plugin manager holding the process's plugins, in their order, then `methods` (registered last, so called
        as the newest): pluggy's own ordering then places a method's tryfirst and trylast hooks."""
        key = tuple((name, id(module)) for name, module in methods)
        with self._lock:
            pm = self._call_managers.get(key)
            if pm is not None:
                return pm
            pm = _new_manager()
            for name, plugin in self.pm.list_name_plugin():
                self._register_in(pm, plugin, name)
            for name, module in methods:
                if pm.get_plugin(name) is not None:
                    pm.unregister(name=name)  # the method shadows a registered plugin of its name
                self._register_in(pm, module, name)
            if len(self._call_managers) >= CALL_MANAGERS_KEPT:
                self._call_managers.pop(next(iter(self._call_managers)))
            self._call_managers[key] = pm
            return pm

    # ---- the failure policy ---------------------------------------------------------------------------------

    def isolated(self, owner: str | None) -> bool:
        """Whether a failure of plugin `owner`'s code disables it: an installed or run-time plugin, outside
        DECODEKIT_STRICT_PLUGINS and outside a served request's scope."""
        return not (owner is None or owner in self.propagating or _is_method(owner) or _strict())

    def on_failure(self, owner: str | None, phase: str, error: BaseException, where: str = "") -> BaseException | None:
        """The one policy for plugin `owner`'s code failing with `error`. `phase` is a hook's name while a call is
        assembled, else what failed mid-generation ("a logits processor", "a token selector", "a stopping
        criterion", "a decoding loop", ...), `where` the code and position for a note. Returns what to raise, or
        None where the call goes on without the plugin (a failing hook of a disabled plugin, or a check before
        loading). KeyboardInterrupt and GeneratorExit are always the caller's to raise as they are."""
        if isinstance(error, (KeyboardInterrupt, GeneratorExit)):
            return error
        hook = phase in hook_names()
        mode = _scope.get().mode
        if hook:
            if isinstance(error, ValueError):
                return error  # the user's values are invalid: said as the plugin said it
            if mode == "before_loading":
                return None  # a check that needs the model (preflight): the call itself makes it
            if not self.isolated(owner):
                return _noted(error, f"plugin {owner!r} in {phase}")
            if mode == "request":  # one served request's values: that request fails, nothing is disabled
                return PluginError(f"plugin {owner!r} failed in {phase}: {type(error).__name__}: {error}")
            self.disable(owner, phase, error)
            return None
        if self.isolated(owner) and not isinstance(error, ValueError) and mode != "request":
            self.disable(owner, phase, error)
        if not isinstance(error, Exception):  # SystemExit from plugin code fails the call, never the process
            failure = PluginError(f"{where or described(phase, error, owner)} raised {type(error).__name__}({error})")
            failure.__cause__ = error
            return failure
        if where and not isinstance(error, (PluginError, ValueError)):
            _noted(error, where)
        return error

    def disable(self, name: str, phase: str, error: BaseException) -> None:
        """Plugin `name` unregistered for the rest of the process, recorded with what failed."""
        summary = "".join(traceback.format_exception_only(type(error), error)).strip()
        where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
        location = f" at {where[0].filename}:{where[0].lineno}" if where else ""
        with self._lock:
            if self.pm.get_plugin(name) is not None:
                self.pm.unregister(name=name)
                self._changed()
            record = self.records.get(name) or PluginRecord(name, "runtime")
            record.error = f"disabled after {phase} raised {summary}{location}"
            self.records[name] = record
        dropped = _scope.get().dropped
        if dropped is not None:
            dropped.add(name)
        logger.warning("plugin %r is disabled for this process: %s", name, record.error)

    # ---- calling hooks --------------------------------------------------------------------------------------

    def caller(self, hook_name: str, only: set[str] | None = None):
        pm = _scope.get().manager or self.pm
        if only is None:
            return getattr(pm.hook, hook_name)
        return pm.subset_hook_caller(hook_name, [p for n, p in pm.list_name_plugin() if n not in only])

    def order(self) -> list[str]:
        """The plugins of this context in registration order (the process's, then the call's methods)."""
        pm = _scope.get().manager or self.pm
        return [name for name, _ in pm.list_name_plugin()]

    # ---- what plugins declare -------------------------------------------------------------------------------

    def declared_fields(self) -> dict[str, dict[str, Any]]:
        """{plugin name: the fields it declares}; a plugin whose declaration is no dict is a failing plugin."""
        out = {}
        for name, declared in call_hooks("decodekit_config_fields"):
            try:
                out[name] = dict(declared)
            except (TypeError, ValueError) as error:
                if not self.isolated(name):
                    raise PluginError(
                        f"plugin {name!r}: decodekit_config_fields returned {declared!r}, not a dict"
                    ) from error
                self.disable(name, "decodekit_config_fields", error)
        return out

    def plugin_records(self) -> list[PluginRecord]:
        """Every registered plugin (with its hooks and the kwargs it accepts) and every one that failed."""
        fields = self.declared_fields()  # first: a plugin that fails here is listed with its error, not as working
        out = []
        for name, plugin in self.pm.list_name_plugin():
            record = self.records.get(name) or PluginRecord(name, "runtime", description=describe(plugin))
            record.hooks = sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or ())
            record.kwargs = fields.get(name, {})
            out.append(record)
        out.extend(r for r in self.records.values() if r.error is not None)
        return out

    def outside_plugins(self) -> set[str]:
        """The names of the registered plugins that are not built in."""
        return {name for name, _ in self.pm.list_name_plugin()} - {name for name, _ in self.builtins}


def _is_method(name: str | None) -> bool:
    return name is not None and name in {n for n, _ in _scope.get().methods}


_host_lock = threading.Lock()
_host = PluginHost()


def host() -> PluginHost:
    """The process's plugin host."""
    return _host


@contextlib.contextmanager
def use_host(replacement: PluginHost):
    """`replacement` is the process's host inside the block (every thread's): a test's own plugins, no globals
    patched."""
    global _host
    with _host_lock:
        previous, _host = _host, replacement
    try:
        yield replacement
    finally:
        with _host_lock:
            _host = previous


# ---- the module's functions: the process's host ------------------------------------------------------------


def get_plugin_manager() -> pluggy.PluginManager:
    """The process's plugin manager, built once (and again only after reset())."""
    return _host.pm


def register(plugin: Any, name: str | None = None, *, scope: str = "process") -> str:
    """Register a plugin object or module for every later generate() call, in every thread; returns its name.
    PluginError if a hook of it names no hookspec. scope="call": its failures propagate instead of disabling it
    (a custom_generate method is not registered here at all: plugins_for_call keeps it to its own call)."""
    return _host.register(plugin, name, scope=scope)


def unregister(name: str) -> None:
    """Removes plugin `name`: a registered one, or one that failed and was disabled (`decodekit list` shows it with
    its error), whose record goes."""
    _host.unregister(name)


def reset() -> None:
    """A fresh host: every plugin forgotten; the next use discovers them again (tests, after installing one)."""
    global _host
    with _host_lock:
        _host = PluginHost()


def call_hooks(hook_name: str, only: set[str] | None = None, **kwargs: Any) -> list[tuple[str, Any]]:
    """(plugin name, result) of every implementation of `hook_name` that returned something, in pluggy's order;
    with `only`, of the plugins named there alone. For a firstresult hook, the first one's alone."""
    caller = _host.caller(hook_name, only)
    results = caller(**kwargs)
    if caller.spec is not None and caller.spec.opts.get("firstresult"):
        return [results] if results is not None else []
    return results


def call_first(hook_name: str, only: set[str] | None = None, **kwargs: Any) -> tuple[str | None, Any]:
    """(plugin name, result) of the first implementation that returns something other than None (the hook is a
    firstresult one), else (None, None); with `only`, among the plugins named there alone."""
    return _host.caller(hook_name, only)(**kwargs) or (None, None)


def guarded(
    kind: str,
    owner: str | None,
    code,
    call: Callable[[], Any],
    check: Callable[[Any], None] | None = None,
    position: int | None = None,
):
    """call() (plugin `owner`'s `kind` of code, "logits processor", "token selector", ...) with its output given to
    check(output), which raises PluginError for a wrong one: the one guard around plugin code run mid-generation.
    A failure goes to the host's policy (on_failure), and what it says is raised, naming the code and position."""
    try:
        out = call()
        if check is not None:
            check(out)
        return out
    except BaseException as error:  # SystemExit from plugin code is its failure too, never the process's
        where = described(kind, code, owner) + (f" at position {position}" if position is not None else "")
        failure = _host.on_failure(owner, f"a {kind}", error, where)
        if failure is error:
            raise
        raise failure from error


def plugin_failure(error: BaseException, owner: str | None, what: str, where: str) -> BaseException:
    """What to raise for `error`, raised or returned by plugin `owner`'s code (`what`: "a logits processor", ...;
    `where` names the code and position): the host's policy for code outside a guarded() call."""
    return _host.on_failure(owner, what, error, where) or error


def isolated(owner: str | None) -> bool:
    return _host.isolated(owner)


@contextlib.contextmanager
def before_loading():
    """Hook calls inside the block check values with no model loaded (the context's model is None): a ValueError
    says a value is invalid; any other failure is a check that needs the model, passed over until the call."""
    with _scoped(mode="before_loading"):
        yield


@contextlib.contextmanager
def failures_fail_the_request_alone():
    """Inside the block, a failure of a plugin's hook, processor, selector or stopping criterion does not disable the
    plugin: the caller fails the request it belongs to, a hook's failure raised as a PluginError naming the plugin.
    One client's bad field used to disable the plugin for every later client."""
    with _scoped(mode="request"):
        yield


@contextlib.contextmanager
def plugins_for_call(plugin: Any, name: str):
    """`plugin`'s hooks (a method's module), under `name`, for the hook calls made in this context inside the block
    alone: other threads and tasks never see them, and their failures propagate, naming the plugin. PluginError
    (before the block runs) for a hook that names no hookspec."""
    methods = _scope.get().methods + ((name, plugin),)
    with _scoped(methods=methods, manager=_host.manager_for(methods)):
        yield


@contextlib.contextmanager
def pinned_plugins():
    """The plugins of this context as they are when the block starts, for every hook call inside it: one call of
    generate() sees one set of plugins from its first hook call to its last. A plugin that another thread's failure
    disables meanwhile stays in this call (validated with its argument, applied with its effect), and is gone from
    the next."""
    scope = _scope.get()
    if scope.manager is not None:
        yield
        return
    with _scoped(manager=_host.manager_for(scope.methods), dropped=set()):
        yield


def plugin_records() -> list[PluginRecord]:
    return _host.plugin_records()


def config_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for declared in _host.declared_fields().values():
        fields.update(declared)
    return fields


def cache_implementations() -> tuple[str, ...]:
    names: list[str] = []
    for _, declared in call_hooks("decodekit_cache_implementations"):
        names.extend(n for n in declared if n not in names)
    return tuple(names)


def outside_plugins() -> set[str]:
    return _host.outside_plugins()
