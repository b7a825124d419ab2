"""Loading a custom generation method and running it: the order is resolve, requirements, trust, import."""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from . import source as sources
from .importer import check_imports, check_modules, import_generate_module
from .requirements import check_requirements
from .trust import check_trust

logger = logging.getLogger("decodekit")

HOOK_MARKER = "decodekit_impl"  # the attribute pluggy's HookimplMarker("decodekit") sets
# Set on the generate() that decodekit.integrations.entry.hooks_entry_point makes: a hook-only method's entry
# point for transformers' loader, which decodekit's loader passes over to use the module's hooks.
ENTRY_MARKER = "decodekit_hooks_entry_point"


@dataclass
class LoadedMethod:
    source: sources.MethodSource
    module: ModuleType
    generate: Callable | None  # replaces the whole loop
    hooks: bool  # the module implements decodekit hooks instead

    @property
    def plugin_name(self) -> str:
        return f"{self.source.kind}:{self.source.label}@{self.source.revision[:12]}"


def hook_names(module: Any) -> list[str]:
    return sorted(n for n in dir(module) if n.startswith("decodekit_") and hasattr(getattr(module, n), HOOK_MARKER))


def load(source: sources.MethodSource, trust_remote_code) -> LoadedMethod:
    # In transformers' order: trust first (an untrusted method is told so, whatever it needs), then the modules its
    # files import (named), then the files its relative imports read (a missing one: FileNotFoundError), then
    # requirements.txt.
    check_trust(source.label, source.kind, source.revision, list(source.files), trust_remote_code, source.links)
    check_modules(source)
    check_imports(source)
    check_requirements(source.method_dir, source.label)
    logger.info("running custom_generate from %s (%s) at revision %s", source.label, source.kind, source.revision)
    module = import_generate_module(source)
    generate = getattr(module, "generate", None)
    if callable(generate) and not getattr(generate, ENTRY_MARKER, False):
        params = list(inspect.signature(generate).parameters)
        if not params or params[0] != "model":
            raise TypeError(
                f"custom_generate/generate.py of `{source.label}`: generate() must take `model` as its first "
                f"parameter, got ({', '.join(params)})."
            )
        return LoadedMethod(source, module, generate, hooks=False)
    if hook_names(module):
        return LoadedMethod(source, module, None, hooks=True)
    raise AttributeError(
        f"custom_generate/generate.py of `{source.label}` defines neither a generate(model, ...) function nor "
        "decodekit hook implementations (functions decorated with decodekit.hookimpl)."
    )


def load_method(spec, trust_remote_code=None, revision=None, token=None, local_files_only=False) -> LoadedMethod:
    return load(
        sources.resolve(spec, revision=revision, token=token, local_files_only=local_files_only), trust_remote_code
    )


def load_pinned(entries: list[str], source: str, engine: str) -> dict[str, LoadedMethod]:
    """{spec: LoadedMethod} of the hook-only methods an operator allows, given as SPEC@REVISION entries (a local
    directory or Hub repo and the revision its code is trusted at), each loaded through the trust gate at that
    revision. `source` names where the entries came from and `engine` what runs them, in the errors."""
    methods = {}
    for entry in filter(None, (e.strip() for e in entries)):
        spec, sep, revision = entry.rpartition("@")
        if not sep or not spec or not revision:
            raise ValueError(
                f"{source}: {entry!r} is invalid; each entry is SPEC@REVISION (a local directory or Hub "
                "repo and the revision its code is trusted at; the trust error for SPEC alone prints it)."
            )
        method = load_method(spec, trust_remote_code=revision)
        if method.generate is not None:
            raise ValueError(
                f"{source}: {spec!r} replaces the whole decoding loop; {engine} runs hook-only methods "
                "(logits processors, a selector, stopping criteria)."
            )
        methods[spec] = method
    return methods


def registered_for_call(method: LoadedMethod):
    """The method's hook implementations, for the hook calls of one generate() call (registry.plugins_for_call)."""
    return registered_module(method.module, method.plugin_name)


def registered_module(module: ModuleType, name: str):
    """`module`'s hook implementations as plugin `name`, for the hook calls made in this context inside the block
    alone (failures propagate); never in the process's registry, so other threads do not see them."""
    from ..registry.manager import plugins_for_call

    return plugins_for_call(module, name)


def forwarded_arguments(fn: Callable, arguments: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """generate()'s arguments for a method's generate(): its named `arguments` the caller gave (not None), every
    keyword of `kwargs` as given (eos_token_id=None says "no end token"), and `inputs` passed as `input_ids` unless the
    method names `inputs` itself."""
    args = {**{k: v for k, v in arguments.items() if v is not None}, **kwargs}
    if "inputs" in args and "inputs" not in inspect.signature(fn).parameters:
        args["input_ids"] = args.pop("inputs")
    return args


def bind_to_model(model, method: LoadedMethod, prepare: Callable[[LoadedMethod, dict], Any]) -> None:
    """Makes the method the model's generate(), with its own signature (minus `model`) visible to inspect.
    A hook-only method instead has its hooks registered around each call of the built-in generate().

    The method is handed the model as it was before the binding (a shallow copy without it: the same weights,
    config and facade), so a method that prepares its own inputs and then calls model.generate(...) runs the
    built-in generate, as in transformers, where the binding is not on the model the method receives either. A
    call naming custom_generate= runs the built-in generate too (which runs that method). `prepare(method, keyword
    arguments)` prepares each call as generate(custom_generate=...) does (core.generate.prepare_method_call: the
    config merged and validated, compile= and compile_config turned into its steps' options) and returns what runs
    it: `run(model, fn)`.
    """
    builtin = model.generate
    if method.generate is None:
        # A hook-only method: every call of this model's generate() runs with its hooks registered.
        @functools.wraps(builtin)
        def generate_with_hooks(*args, **kwargs):
            with registered_for_call(method):
                return builtin(*args, **kwargs)

        model.generate = generate_with_hooks
        model.custom_generate_source = method.source
        return
    fn = method.generate

    @functools.wraps(fn)
    def generate(*args, **kwargs):
        if "custom_generate" in kwargs:
            return builtin(*args, **kwargs)
        if args:  # the prompt given positionally: by name, so the preparation sees it
            kwargs = {**dict(zip(list(inspect.signature(fn).parameters)[1:], args)), **kwargs}
        unbound = copy.copy(model)
        unbound.__dict__.pop("generate", None)
        return prepare(method, kwargs).run(unbound, fn)

    signature = inspect.signature(fn)
    generate.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
    model.generate = generate
    model.custom_generate_source = method.source
