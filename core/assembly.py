"""The one assembly of an engine's parts, used by ``EngineCore``, every
tensor parallel rank (plugins/backends/tp.py) and the conformance kit
(core/testing.py).

``Assembly(config, plugins, backend)`` resolves every plugin the config
names once (a ConfigError naming the key when one is unknown; the
backend-chosen attention backend, sampler and runner once a backend is
given) and reads each one's settings (``plugins.<kind>.<name>``) once.
Then:

    scheduler side   kv_cache, connector, scheduling   (what schedules: the
                     scheduling core, running the KV scheduler config names)
    executor         where the model runs (executor_class, built by executor: in-process at TP 1,
                     parallel.runner's worker processes above)
    runner side      logits processors, attention, sampler, runner (what computes:
                     the executor builds it on each rank)

each built over what the caller holds (the KV block count, the model, its
KV tensors), so a rank builds only the runner side and the kit only the
scheduler side. Every part is constructed by ``Assembly.make``, which
hands it to ``fdx.core.plugins.make_plugin`` (the one constructor path,
also used by the parts built elsewhere: backend, model, weight format, MoE
router, proposer, LoRA loader, chat parsers, guided and request
schedulers): ``cls(settings, context)`` with a ``BuildContext``.
"""
from __future__ import annotations

import copy

from fdx.core.config import KIND_ALIASES, ConfigError, FdxConfig, plugin_settings
from fdx.core.interfaces import BuildContext, Executor, Observer, RunnerContext, SchedulingExtensions
from fdx.core.kernels import REFERENCE
from fdx.core.plugins import PluginError, PluginManager, make_plugin
from fdx.core.scheduling import SchedulingCore


class Assembly:
    def __init__(self, config: FdxConfig, plugins: PluginManager, backend=None):
        self.config, self.plugins = config, plugins
        self._settings: dict[str, dict] = {}
        self.check_settings()
        sc, dc, cc = config.scheduler, config.decoding, config.cache
        self.connector_name = cc.kv_connector
        builtin = plugins.builtin_names("logits_processor")
        self.processor_names = builtin + [n for n in dc.logits_processors if n not in builtin]
        pick = self.pick
        self.classes = {
            "kv_cache": pick("kv_cache", "cache.kv_cache", cc.kv_cache),
            "kv_scheduler": pick("kv_scheduler", "scheduler.kv_scheduler", sc.kv_scheduler),
            "queue_policy": pick("queue_policy", "scheduler.policy", sc.policy),
            "admission": [(n, pick("admission_rule", "scheduler.admission", n)) for n in sc.admission],
            "preemption": pick("preemption_policy", "scheduler.preemption", sc.preemption),
            "connector": (pick("connector", "cache.kv_connector", self.connector_name)
                          if self.connector_name else None),
            "processors": [(n, pick("logits_processor", "decoding.logits_processors", n))
                           for n in self.processor_names],
            "token_processor": pick("token_processor", "decoding.token_processor", dc.token_processor),
            "observers": [(n, pick("observer", "observability.observers", n))
                          for n in dict.fromkeys(config.observability.observers)],
        }
        self.backend = None
        if backend is not None:
            self.set_backend(backend)

    def set_backend(self, backend) -> None:
        """Resolve the parts the backend chooses (its attention backend,
        sampler and model runner; ``tp`` under tensor parallel)."""
        self.backend = backend
        pick, c = self.pick, self.classes
        c["attention"] = pick("attention_backend", "backend.name", backend.attention_backend)
        c["sampler"] = pick("sampler", "backend.name", backend.sampler)
        chosen = self.config.backend.model_runner
        key = "backend.model_runner" if chosen else "backend.name"      # config's pick, or the backend's
        self.runner_name = chosen or backend.model_runner
        c["runner"] = runner = pick("model_runner", key, self.runner_name)
        if isinstance(runner, type) and issubclass(runner, Executor):
            raise ConfigError(f"config key '{key}': {self.runner_name!r} is an executor (parallel.runner picks "
                              "it under tensor parallel), not a model runner")
        world = self.config.parallel.tensor_parallel_size
        if world > 1 and not runner.tensor_parallel:
            raise ConfigError(f"config key '{key}': the model runner {self.runner_name!r} does not run under "
                              f"tensor parallel (parallel.tensor_parallel_size={world}): it does not follow "
                              "rank 0's sampling (ModelRunner.tensor_parallel)")
        if chosen:                                          # it may refuse this backend (ConfigError)
            runner.check_backend(self.config, backend)

    def executor_class(self) -> type[Executor]:
        """Where the model runs: ``UniProcExecutor`` (core/executor.py) at
        ``parallel.tensor_parallel_size`` 1, else the executor
        ``parallel.runner`` names (registered with the model runners,
        ``tp`` by default: plugins/backends/tp.py)."""
        if self.config.parallel.tensor_parallel_size == 1:
            from fdx.core.executor import UniProcExecutor
            return UniProcExecutor
        name = self.config.parallel.runner
        cls = self.pick("model_runner", "parallel.runner", name)
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise ConfigError(f"config key 'parallel.runner': {name!r} is a model runner, not an executor "
                              "(fdx.core.interfaces.Executor); backend.model_runner picks the runner")
        return cls

    def executor(self, backend, dtype: str, progress: bool = True, defer_tokenizer: bool = False) -> Executor:
        """The executor (``executor_class``) over ``backend``, built as every
        plugin is (``make_plugin``)."""
        cls = self.executor_class()
        tp = self.config.parallel.tensor_parallel_size > 1
        name = self.config.parallel.runner if tp else "uniproc"
        ctx = BuildContext(config=self.config, plugins=self.plugins, kind="model_runner", name=name, backend=backend,
                           kernels=backend.kernels, assembly=self, dtype=dtype, progress=progress,
                           defer_tokenizer=defer_tokenizer)
        return make_plugin(ctx, "parallel.runner", self.settings("model_runner", name) if tp else {}, cls)

    # -- lookups --------------------------------------------------------------------
    def pick(self, kind: str, key: str, name: str):
        try:
            return self.plugins.get(kind, name)
        except PluginError as e:
            raise ConfigError(f"config key '{key}': {e}") from None

    def settings(self, kind: str, name: str | None):
        """What the plugin ``kind``/``name`` is constructed with: its
        ``Settings`` instance when the class declares one (validated once,
        here), else the ``plugins.<kind>.<name>`` dict; a fresh copy each call.
        An old kind name (``resource_manager``, ``scheduler``) reads the new kind's."""
        kind = KIND_ALIASES.get(kind, kind)
        by_name = self._settings.setdefault(kind, {})
        if name not in by_name:
            try:
                cls = self.plugins.get(kind, name or "")
            except PluginError:
                cls = None
            by_name[name] = plugin_settings(kind, name or "", cls, {})
        return copy.deepcopy(by_name[name])

    def check_settings(self) -> None:
        """Every ``plugins.<kind>.<name>`` names a registered plugin, with a
        mapping its ``Settings`` schema (if any) accepts."""
        kinds = self.plugins.registries
        for kind, by_name in self.config.plugins.items():
            if kind not in kinds:
                raise ConfigError(f"config key 'plugins.{kind}': no such plugin kind; "
                                  f"kinds: {', '.join(sorted(kinds))}")
            for name, value in (by_name or {}).items():
                if name not in kinds[kind]:
                    raise ConfigError(f"config key 'plugins.{kind}.{name}': no {kind} named {name!r}; "
                                      f"available: {', '.join(sorted(kinds[kind])) or 'none'}")
                if not isinstance(value, dict):
                    raise ConfigError(f"config key 'plugins.{kind}.{name}' must be a mapping of settings")
                self._settings.setdefault(kind, {})[name] = plugin_settings(
                    kind, name, kinds[kind][name].obj, value)
                rm = self.config.scheduler.kv_scheduler
                if kind == "kv_scheduler" and value and name != rm:   # e.g. --kv-cache-ratio under v1
                    raise ConfigError(f"config key 'plugins.{kind}.{name}.{next(iter(value))}': a setting of the "
                                      f"{name} KV scheduler, but scheduler.kv_scheduler is {rm}: it would do "
                                      f"nothing (--kv-cache-ratio is v0's: its prefill-first steps split the "
                                      f"blocks between prompts and decodes; v1 mixes them in one step and has "
                                      f"no such share); set --kv-scheduler {name} or drop it")

    def make(self, kind: str, name: str, cls=None, key: str | None = None, **fields):
        """Construct the plugin ``kind``/``name`` (``cls``: its class, when
        already resolved) with its settings and a ``BuildContext`` of
        ``fields`` (``make_plugin``); ``key``: the config key that selects it."""
        ctx = BuildContext(config=self.config, plugins=self.plugins, kind=KIND_ALIASES.get(kind, kind), name=name,
                           backend=self.backend, kernels=self.backend.kernels if self.backend is not None else REFERENCE,
                           **fields)
        return make_plugin(ctx, key or f"plugins.{kind}", self.settings(kind, name), cls)

    def observers(self) -> list:
        """The observers ``observability.observers`` selects, each built with
        its settings (``plugins.observer.<name>``)."""
        built = []
        for name, cls in self.classes["observers"]:
            if not (isinstance(cls, type) and issubclass(cls, Observer)):
                raise ConfigError(f"config key 'observability.observers': {name!r} does not subclass "
                                  "fdx.core.interfaces.Observer")
            obs = self.make("observer", name, cls)
            obs.name = name
            built.append(obs)
        return built

    # -- the scheduler side ---------------------------------------------------------------
    def token_processor(self, tokenizer=None):
        """The token processor, with the engine's tokenizer (for stop
        strings; None where no request has any: the conformance kit) and its
        settings."""
        name = self.config.decoding.token_processor
        return self.make("token_processor", name, self.classes["token_processor"], tokenizer=tokenizer)

    def extensions(self, kv_cache, connector=None, extra_rules=()) -> SchedulingExtensions:
        c, make = self.classes, self.make
        sc = self.config.scheduler
        return SchedulingExtensions(
            queue_policy=make("queue_policy", sc.policy, c["queue_policy"], kv_cache=kv_cache),
            admission_rules=[make("admission_rule", n, cls) for n, cls in c["admission"]] + list(extra_rules),
            preemption_policy=make("preemption_policy", sc.preemption, c["preemption"]),
            connector=connector)

    def scheduler_side(self, num_blocks: int, token_processor, max_model_len: int, extra_rules=()) -> dict:
        """The KV cache manager (``num_blocks``), the connector and the
        scheduling core running the KV scheduler, with its extensions (``extra_rules``: admission
        rules the engine adds, e.g. guided decoding's)."""
        config, c, make = self.config, self.classes, self.make
        sc, cc = config.scheduler, config.cache
        kv_cache = make("kv_cache", cc.kv_cache, c["kv_cache"], num_blocks=num_blocks, block_size=cc.block_size)
        connector = None
        if c["connector"] is not None:
            connector = make("connector", self.connector_name, c["connector"], block_size=cc.block_size)
        policy = make("kv_scheduler", sc.kv_scheduler, c["kv_scheduler"])
        # the engine's scheduling core, running the policy (engine.scheduling)
        scheduling = SchedulingCore(config, kv_cache, max_model_len,
                                    self.extensions(kv_cache, connector, extra_rules), policy, token_processor)
        return dict(kv_cache=kv_cache, connector=connector, scheduling=scheduling)

    # -- the runner side ------------------------------------------------------------------
    def attention(self):
        name = self.backend.attention_backend
        return self.make("attention_backend", name, self.classes["attention"])

    def runner_side(self, model, kv_caches: list, kv_spec, tokenizer, eos_token_ids, connector=None,
                    attention=None, rank: int = 0, world_size: int = 1, share_sampled=None) -> dict:
        """Logits processors, attention backend, sampler and the runner the
        config names over ``model`` and its KV tensors: what an executor
        builds on each rank (processors on rank 0 only: the one that samples)."""
        config, c, s, make, b = self.config, self.classes, self.settings, self.make, self.backend
        processors = [make("logits_processor", n, cls, tokenizer=tokenizer, vocab_size=model.vocab_size)
                      for n, cls in c["processors"]] if rank == 0 else []
        attention = attention if attention is not None else self.attention()
        sampler = make("sampler", b.sampler, c["sampler"])
        # the tensors' layout (num_slots) stays that of the whole allocation, even when the pool
        # the KV cache manages uses fewer of its blocks
        runner = make("model_runner", self.runner_name, c["runner"], runner=RunnerContext(
            config=config, model=model, kv_caches=kv_caches, kv_spec=kv_spec, attention=attention,
            sampler=sampler, logits_processors=processors, eos_token_ids=frozenset(eos_token_ids),
            connector=connector, settings=s("model_runner", self.runner_name), kernels=b.kernels,
            rank=rank, world_size=world_size, share_sampled=share_sampled, plugins=self.plugins),
                      eos_token_ids=frozenset(eos_token_ids), tokenizer=tokenizer)
        return dict(logits_processors=processors, processor_classes=[cls for _, cls in c["processors"]],
                    attention=attention, sampler=sampler, runner=runner)
