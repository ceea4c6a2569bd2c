"""The plugin manager: built-ins from one tuple, others from the ``fdx``
entry-point group, every implementation selected by name."""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pluggy

from fdx.core import hookspecs
from fdx.core.config import KIND_ALIASES, ConfigError, plugin_settings
from fdx.core.interfaces import BuildContext

log = logging.getLogger("fdx.plugins")

ENTRY_POINT_GROUP = "fdx"
DISABLE_ENV = "FDX_DISABLED_PLUGINS"

# Built-in plugins are ordinary plugins, registered from this tuple.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "fdx.plugins.schedulers.v0",
    "fdx.plugins.schedulers.v1",
    "fdx.plugins.schedulers.policies",
    "fdx.plugins.schedulers.global_redis",
    "fdx.plugins.cache.paged",
    "fdx.plugins.cache.prefix",
    "fdx.plugins.cache.swap",
    "fdx.plugins.cache.splitwise",
    "fdx.plugins.backends.cpu",
    "fdx.plugins.backends.cuda",
    "fdx.plugins.backends.iluvatar",
    "fdx.plugins.backends.attention",
    "fdx.plugins.backends.block_attention",
    "fdx.plugins.backends.runner",
    "fdx.plugins.backends.tp",
    "fdx.plugins.backends.cuda_graph",
    "fdx.plugins.decoding.sampler",
    "fdx.plugins.decoding.device_sampler",
    "fdx.plugins.decoding.token_processor",
    "fdx.plugins.decoding.logits_processors",
    "fdx.plugins.decoding.xgrammar_backend",
    "fdx.plugins.decoding.llguidance_backend",
    "fdx.plugins.models.llama",
    "fdx.plugins.models.qwen2",
    "fdx.plugins.models.qwen3",
    "fdx.plugins.models.ernie4_5",
    "fdx.plugins.models.qwen2_moe",
    "fdx.plugins.models.qwen3_moe",
    "fdx.plugins.models.ernie4_5_moe",
    "fdx.plugins.models.moe_taps",
    "fdx.plugins.models.weight_formats",
    "fdx.plugins.lora.peft_loader",
    "fdx.plugins.parsers.tool_parsers",
    "fdx.plugins.parsers.reasoning_parsers",
    "fdx.plugins.observers.otel",
    "fdx.plugins.spec.ngram",
    "fdx.plugins.spec.suffix",
    "fdx.plugins.spec.draft_model",
)

# The built-ins the API process of ``fdx serve`` loads: what it looks up is a
# request-level scheduler and the chat output parsers (guided backends compile in the engine). None of these imports
# Paddle, so that process never does (Paddle's signal handlers would replace
# uvicorn's; docs/serving.md). The other built-ins do not import Paddle at
# module level either: a tensor parallel engine process loads them all and never
# loads Paddle (its ranks do; docs/benchmarks.md).
SERVING_PLUGINS: tuple[str, ...] = (
    "fdx.plugins.schedulers.global_redis",
    "fdx.plugins.parsers.tool_parsers",
    "fdx.plugins.parsers.reasoning_parsers",
)

# registration hook -> registry kind
KINDS: dict[str, str] = {
    "fdx_register_kv_schedulers": "kv_scheduler",
    "fdx_register_queue_policies": "queue_policy",
    "fdx_register_admission_rules": "admission_rule",
    "fdx_register_preemption_policies": "preemption_policy",
    "fdx_register_request_schedulers": "request_scheduler",
    "fdx_register_kv_caches": "kv_cache",
    "fdx_register_connectors": "connector",
    "fdx_register_token_processors": "token_processor",
    "fdx_register_backends": "backend",
    "fdx_register_attention_backends": "attention_backend",
    "fdx_register_samplers": "sampler",
    "fdx_register_model_runners": "model_runner",
    "fdx_register_guided_backends": "guided_backend",
    "fdx_register_models": "model",
    "fdx_register_weight_formats": "weight_format",
    "fdx_register_lora_loaders": "lora_loader",
    "fdx_register_moe_routers": "moe_router",
    "fdx_register_logits_processors": "logits_processor",
    "fdx_register_proposers": "proposer",
    "fdx_register_activation_functions": "activation_function",
    "fdx_register_tool_parsers": "tool_parser",
    "fdx_register_reasoning_parsers": "reasoning_parser",
    "fdx_register_observers": "observer",
}

# Registration hooks renamed with their kinds (issue 36), kept one release: what a plugin registers through the
# old name lands in the new kind, with one warning naming both; the old kind name finds the new registry.
DEPRECATED_HOOKS: dict[str, str] = {"fdx_register_resource_managers": "fdx_register_kv_schedulers",
                                    "fdx_register_schedulers": "fdx_register_request_schedulers"}


class Registries(dict):
    """kind -> {name: Registration}; an old kind name (``KIND_ALIASES``) reads the new kind's registry."""

    def __getitem__(self, kind: str) -> dict:
        return super().__getitem__(KIND_ALIASES.get(kind, kind))

    def __contains__(self, kind: object) -> bool:
        return super().__contains__(KIND_ALIASES.get(kind, kind) if isinstance(kind, str) else kind)

    def get(self, kind: str, default: Any = None) -> Any:
        return super().get(KIND_ALIASES.get(kind, kind), default)


OBSERVER_HOOKS = ("fdx_engine_started", "fdx_request_added", "fdx_step_finished", "fdx_request_finished")


class PluginError(RuntimeError):
    """A plugin registered a clashing name, or a name was not found."""


@dataclass(slots=True)
class Registration:
    name: str
    obj: Any
    plugin: str        # the plugin (module or entry point) that registered it
    package: str       # the distribution that shipped it ("fdx" for built-ins)


@dataclass(slots=True)
class EntryPoint:
    """One entry point of the ``fdx`` group, loaded or not."""
    name: str
    value: str         # "module:attr"
    package: str       # its distribution
    status: str = "loaded"     # loaded | disabled | broken
    matched: str = ""  # the FDX_DISABLED_PLUGINS name that disabled it


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


class PluginManager:
    def __init__(self, builtins: Iterable[str] = BUILTIN_PLUGINS,
                 load_entry_points: bool = True, disabled: Iterable[str] | None = None):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        if disabled is None:
            disabled = [s.strip() for s in os.environ.get(DISABLE_ENV, "").split(",") if s.strip()]
        self.disabled = set(disabled)
        self.matched: set[str] = set()            # disabled names that matched a plugin
        self.skipped: list[str] = []              # plugins not loaded because disabled
        self.entry_points: list[EntryPoint] = []  # every entry point of the group, loaded or not
        self.errors: dict[str, str] = {}          # plugin name -> why it is not loaded
        self.packages: dict[str, str] = {}        # plugin name -> distribution
        self.registries: dict[str, dict[str, Registration]] = Registries({k: {} for k in KINDS.values()})
        builtins = tuple(builtins)
        for modname in builtins:
            self._load(modname, lambda m=modname: importlib.import_module(m), "fdx")
        if load_entry_points:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                self._load_entry_point(ep)
        if load_entry_points and set(BUILTIN_PLUGINS) <= set(builtins):   # all there is to match
            for name in sorted(self.disabled - self.matched):
                log.warning("%s names %r, which matches no plugin, entry point or distribution",
                            DISABLE_ENV, name)
        self.pm.check_pending()
        self._collect()

    # -- loading -----------------------------------------------------------
    def _disabled_by(self, name: str, module: str, package: str | None = None) -> str | None:
        """The FDX_DISABLED_PLUGINS name that disables this plugin, if any:
        its entry-point or module name, the module's last part, a package
        the module is in (importing the module would run its ``__init__``),
        or its distribution's name (PEP 503-normalized)."""
        parts = module.split(".")
        names = {name, parts[-1]} | {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        for d in sorted(self.disabled):
            if d in names or (package is not None and normalize(d) == normalize(package)):
                self.matched.add(d)
                return d
        return None

    def _load_entry_point(self, ep) -> None:
        package = ep.dist.name if ep.dist else "?"
        entry = EntryPoint(ep.name, ep.value, package)
        self.entry_points.append(entry)
        entry.matched = self._disabled_by(ep.name, ep.value.split(":")[0].strip(), package) or ""
        if entry.matched:
            entry.status = "disabled"
            log.info("plugin %s (%s) disabled by %s=%s", ep.name, package, DISABLE_ENV, entry.matched)
            self.skipped.append(ep.name)
            return
        self._load(ep.name, ep.load, package, module=ep.value.split(":")[0].strip())
        if ep.name in self.errors:
            entry.status = "broken"

    def _load(self, name: str, loader, package: str, module: str | None = None) -> None:
        """``name``: the module (built-ins) or entry-point name; ``module``:
        the entry point's module."""
        if self._disabled_by(name, module or name):
            log.info("plugin %s disabled by %s", name, DISABLE_ENV)
            self.skipped.append(name)
            return
        if self.pm.has_plugin(name):
            return                                   # idempotent
        try:
            plugin = loader()
        except Exception as e:  # a broken plugin must not take fdx down
            self._broken(name, f"failed to load: {type(e).__name__}: {e}")
            return
        try:
            self.pm.register(plugin, name=name)
        except Exception as e:
            self._broken(name, f"failed to register: {e}")
            return
        self.packages[name] = package

    def _broken(self, name: str, why: str) -> None:
        self.errors[name] = why
        log.warning("fdx plugin %r %s", name, why)

    def add_plugin(self, plugin: Any, name: str | None = None, package: str = "local") -> None:
        """Register a plugin object (a module, a class instance) at run time,
        as an entry point would, and collect what it registers: a plugin
        written in a notebook or a test needs no package."""
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        if self.pm.has_plugin(name):
            return
        self.pm.register(plugin, name=name)
        self.packages[name] = package
        self._collect(only=name)

    def _collect(self, only: str | None = None) -> None:
        hooks = [*KINDS.items(), *((old, KINDS[new]) for old, new in DEPRECATED_HOOKS.items())]
        for hook_name, kind in hooks:
            hook = getattr(self.pm.hook, hook_name)
            # in registration order (built-ins first), not pluggy's call order
            for impl in hook.get_hookimpls():
                plugin = impl.plugin_name
                if only is not None and plugin != only:
                    continue
                if hook_name in DEPRECATED_HOOKS:
                    log.warning("plugin %r implements %s, which is deprecated: rename it %s (docs/plugins.md)",
                                plugin, hook_name, DEPRECATED_HOOKS[hook_name])
                try:
                    impl.function(register=self._registrar(kind, plugin))
                except PluginError:
                    raise
                except Exception as e:
                    self._broken(plugin, f"raised in {hook_name}: {type(e).__name__}: {e}")

    def _registrar(self, kind: str, plugin: str):
        def register(name: str, obj: Any) -> None:
            registry = self.registries[kind]
            if name in registry:
                other = registry[name].plugin
                raise PluginError(f"{kind} name {name!r} is registered twice: by plugin "
                                  f"{other!r} and by plugin {plugin!r}")
            registry[name] = Registration(name, obj, plugin, self.packages.get(plugin, "?"))
        return register

    # -- lookup ------------------------------------------------------------
    def get(self, kind: str, name: str) -> Any:
        kind = KIND_ALIASES.get(kind, kind)
        registry = self.registries[kind]
        if name not in registry:
            known = ", ".join(sorted(registry)) or "none"
            raise PluginError(f"no {kind} named {name!r}; available: {known}")
        return registry[name].obj

    def names(self, kind: str) -> list[str]:
        return sorted(self.registries[kind])

    def builtin_names(self, kind: str) -> list[str]:
        """Names fdx's own plugins registered, in registration order."""
        return [n for n, r in self.registries[kind].items() if r.package == "fdx"]

    @property
    def hook(self):
        return self.pm.hook

    def notify(self, hook_name: str, observers: Iterable[Any] = (), **kwargs: Any) -> None:
        """Call an observer hook, each implementation on its own: one that
        raises is logged and the others still run. ``observers``: ``Observer``
        instances (an engine's, from ``observability.observers``) called
        after the plugins' module-level implementations."""
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            try:
                impl.function(**{k: kwargs[k] for k in impl.argnames})
            except Exception as e:
                log.warning("observer %s of %s raised %s: %s", impl.plugin_name, hook_name,
                            type(e).__name__, e)
        for obs in observers:
            if not obs.observes(hook_name):
                continue
            method = getattr(obs, hook_name)         # one of the hooks Observer declares
            try:
                method(**{k: kwargs[k] for k in observer_argnames(method)})
            except Exception as e:
                log.warning("observer %s of %s raised %s: %s", obs.name or type(obs).__name__,
                            hook_name, type(e).__name__, e)

    def has_observers(self, hook_name: str, observers: Iterable[Any] = ()) -> bool:
        """Whether anything implements this observer hook (so its arguments are worth building)."""
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls()) or any(o.observes(hook_name) for o in observers)

    def report(self) -> str:
        lines = []
        for hook_name, kind in KINDS.items():
            lines.append(f"{hook_name}:")
            regs = self.registries[kind]
            if not regs:
                lines.append("    (none)")
            for reg in regs.values():
                lines.append(f"    {reg.name:<28} {reg.plugin} [{reg.package}]")
        observers = {}
        for hook_name in OBSERVER_HOOKS:
            impls = getattr(self.pm.hook, hook_name).get_hookimpls()
            observers[hook_name] = [i.plugin_name for i in impls]
        lines.append("observers:")
        for hook_name, plugins in observers.items():
            lines.append(f"    {hook_name}: {', '.join(plugins) or '(none)'}")
        lines.append(f"entry points ({ENTRY_POINT_GROUP!r} group):")
        if not self.entry_points:
            lines.append("    (none)")
        for ep in self.entry_points:
            why = f" (by {DISABLE_ENV} name {ep.matched!r})" if ep.matched else ""
            lines.append(f"    {ep.name:<28} {ep.value} [{ep.package}] {ep.status}{why}")
        if self.skipped:
            lines.append(f"disabled by {DISABLE_ENV}:")
            lines.extend(f"    {name}" for name in self.skipped)
        unmatched = sorted(self.disabled - self.matched)
        if unmatched:
            lines.append(f"names in {DISABLE_ENV} that match nothing: {', '.join(unmatched)}")
        if self.errors:
            lines.append("broken plugins:")
            for name, why in self.errors.items():
                lines.append(f"    {name}: {why}")
        return "\n".join(lines)


def observer_argnames(method) -> tuple[str, ...]:
    """The argument names of a bound observer method (cached on its function)."""
    func = getattr(method, "__func__", method)
    names = getattr(func, "_fdx_argnames", None)
    if names is None:
        import inspect
        names = tuple(n for n, p in inspect.signature(method).parameters.items()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        try:
            func._fdx_argnames = names
        except AttributeError:
            pass
    return names


_default: PluginManager | None = None
_serving: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    global _default
    if _default is None:
        _default = PluginManager()
    return _default


def get_serving_plugin_manager() -> PluginManager:
    """The API process's plugins: ``SERVING_PLUGINS`` and the entry points
    (a third-party request scheduler must not import
    Paddle at module level either)."""
    global _serving
    if _serving is None:
        _serving = PluginManager(builtins=SERVING_PLUGINS)
    return _serving


# -- constructing a plugin: the one place ---------------------------------------------------

_UNSET: Any = object()

# The per-kind constructor shapes before ``factory(settings, context)`` (docs/plugins.md, "Older constructor
# shapes"): an outside class still written to one is called so, with a DeprecationWarning (one adapter, here;
# every fdx plugin and base class is in the one shape, and one that were not would warn too).
OLD_SHAPES: dict[str, Callable[[Any, BuildContext], tuple[tuple, dict]]] = {
    "kv_scheduler": lambda s, c: ((c.config,), {"settings": s}),
    "queue_policy": lambda s, c: ((c.kv_cache, s), {}),
    "admission_rule": lambda s, c: ((c.config, s), {}),
    "preemption_policy": lambda s, c: ((c.config, s), {}),
    "request_scheduler": lambda s, c: ((c.config, c.engine, c.metrics, s), {}),
    "kv_cache": lambda s, c: ((c.num_blocks, c.block_size, c.config), {"settings": s}),
    "connector": lambda s, c: ((c.config, c.block_size), {"settings": s}),
    "token_processor": lambda s, c: ((c.tokenizer, s), {}),
    "logits_processor": lambda s, c: ((c.config, c.tokenizer, c.vocab_size, s), {}),
    "guided_backend": lambda s, c: ((c.tokenizer, c.vocab_size, c.eos_token_ids), {"settings": s}),
    "backend": lambda s, c: ((), {"settings": s}),
    "attention_backend": lambda s, c: ((s,), {}),
    "sampler": lambda s, c: ((), {"config": c.config, "settings": s}),
    "model_runner": lambda s, c: (((c.runner,) if c.assembly is None       # an executor: parallel.runner
                                   else (c.assembly, c.backend, c.dtype, c.progress, c.defer_tokenizer)), {}),
    "model": lambda s, c: ((c.hf_config, c.weights),
                           {} if c.weight_format is None else {"weight_format": c.weight_format}),
    "weight_format": lambda s, c: ((c.kernels, s), {}),
    "moe_router": lambda s, c: ((c.moe, s), {}),
    "lora_loader": lambda s, c: ((s,), {}),
    "proposer": lambda s, c: ((c.config, c.vocab_size, s), {}),
    "tool_parser": lambda s, c: ((c.tokenizer, c.tools, s), {}),
    "reasoning_parser": lambda s, c: ((c.tokenizer, s), {}),
    "observer": lambda s, c: ((c.config, s), {}),
}

# Kinds whose constructors load the checkpoint: a ValueError there is about the files
# (not a GGUF file, truncated, an unsupported architecture), already worded for the user,
# not about plugins.<kind>.<name>, so make_plugin passes it on as it is.
LOADING_KINDS = frozenset({"model_runner", "model"})

_shapes: dict[Any, bool] = {}
_warned: set = set()


def new_shape(cls: Any) -> bool:
    """Whether ``cls`` is constructed as ``cls(settings, context)``: its
    first two parameters are named ``settings`` and ``context``."""
    if cls not in _shapes:
        try:
            params = [p.name for p in inspect.signature(cls).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            params = []
        _shapes[cls] = params[:2] == ["settings", "context"]
    return _shapes[cls]


def make_plugin(context: BuildContext, key: str, settings: Any = _UNSET, cls: Any = None) -> Any:
    """The one place a plugin is constructed: the class ``context.kind`` /
    ``context.name`` (``key``: the config key that selected it, named by
    the ConfigError when nothing has that name), its validated settings
    (``plugins.<kind>.<name>``; ``settings`` when the caller validated them
    already), then ``cls(settings, context)``, or the kind's older shape
    for a class written to one. A ``ValueError`` or ``TypeError`` it raises
    is a ConfigError naming ``plugins.<kind>.<name>`` (not for the
    LOADING_KINDS, whose errors are about the checkpoint)."""
    kind, name, config = context.kind, context.name, context.config
    if cls is None:
        try:
            cls = context.plugins.get(kind, name)
        except PluginError as e:
            raise ConfigError(f"config key '{key}': {e}") from None
    if settings is _UNSET:
        settings = plugin_settings(kind, name, cls, (config.plugins.get(kind) or {}).get(name))
    if new_shape(cls):
        args, kwargs = (settings, context), {}
    else:
        args, kwargs = OLD_SHAPES[kind](settings, context)
        msg = (f"{kind} {name!r} ({cls.__module__}.{cls.__qualname__}) is constructed in the older "
               f"per-kind shape; write its constructor as __init__(self, settings, context) "
               f"(fdx.core.interfaces.BuildContext, docs/plugins.md)")
        warnings.warn(msg, DeprecationWarning, stacklevel=2)
        if cls not in _warned:                      # the log says it once a class
            _warned.add(cls)
            log.warning("%s", msg)
    log.debug("built %s %s: %s.%s", kind, name, cls.__module__, cls.__qualname__)
    try:
        return cls(*args, **kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        if str(e).startswith("config key "):               # it named the key itself
            raise ConfigError(str(e)) from None
        if kind in LOADING_KINDS:                          # the checkpoint's error, worded by the loader
            raise
        raise ConfigError(f"config key 'plugins.{kind}.{name}': {e}") from None
