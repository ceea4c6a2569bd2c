"""EngineCore: builds every part from the plugins config names, and steps.

    sched = scheduling.schedule()                # plain data: which requests, how many tokens
    out   = executor.execute(sched)              # one batched forward + logits processors + sampling,
                                                 # on rank 0 in process or on every TP rank
    done  = scheduling.update(sched, out)        # append tokens, stop checks, free blocks
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from fdx.core import activations
from fdx.core.assembly import Assembly
from fdx.core.config import ConfigError, FdxConfig
from fdx.core.interfaces import Backend, BuildContext, KVCacheSpec, RequestStepInfo, StepContext, StepStats
from fdx.core.plugins import PluginError, PluginManager, get_plugin_manager, make_plugin
from fdx.core.request import Request, RequestStatus, check_prompt, request_output
from fdx.core.sampling_params import POOLING_PARAMS, SamplingParams

log = logging.getLogger("fdx.engine")

DEFAULT_MAX_MODEL_LEN = 8192


def select_backend(config: FdxConfig, plugins: PluginManager) -> Backend:
    """The backend ``backend.name`` names (auto: the available one with the
    highest priority), constructed with its settings; not yet set up."""
    def make(name: str, cls):
        return make_plugin(BuildContext(config, plugins, "backend", name), "backend.name", cls=cls)

    name = config.backend.name
    if name != "auto":
        try:
            cls = plugins.get("backend", name)
        except PluginError as e:
            raise ConfigError(f"config key 'backend.name': {e}") from None
        if not cls.is_available():
            raise ConfigError(f"config key 'backend.name': backend {name!r} is not available here")
        return make(name, cls)
    candidates = sorted(plugins.registries["backend"].items(), key=lambda kv: -kv[1].obj.priority)
    for reg_name, reg in candidates:
        if reg.obj.is_available():
            return make(reg_name, reg.obj)
    raise ConfigError("config key 'backend.name': no available backend")


class EngineCore:
    def __init__(self, config: FdxConfig, plugins: PluginManager | None = None, progress: bool = True,
                 defer_tokenizer: bool = False):
        """``defer_tokenizer``: hold a ``DeferredTokenizer`` (its eos ids, the
        rest built on first use): the serving engine process, whose API
        process tokenizes and detokenizes (entrypoints/serving/engine_proc.py)."""
        self.config = config = config.model_copy(deep=True)
        if config.parallel.data_parallel_size > 1:   # the API server starts one engine per rank
            raise ConfigError(f"config key 'parallel.data_parallel_size' ({config.parallel.data_parallel_size}): "
                              "data parallel is a server feature: `fdx serve --data-parallel-size N` runs N "
                              "engine processes behind one API server; LLM and fdx generate / chat / bench run one "
                              "engine (use --tensor-parallel-size to spread one engine over more processes)")
        self.plugins = plugins = plugins or get_plugin_manager()
        # every plugin name resolved before the (slow) model load, so a typo fails at once
        self.assembly = assembly = Assembly(config, plugins)
        self.observers = assembly.observers()    # observability.observers (a bad setting fails before the load)
        self.backend = self._select_backend()
        # where the model runs, at every tensor parallel size: it sets the backend up (in this process,
        # or in each rank's, taking rank 0's findings), loads the weights and reports their shape
        dtype = self._resolve_dtype()
        self.executor = assembly.executor(self.backend, dtype, progress, defer_tokenizer)
        try:
            self._set_up(dtype)
        except BaseException:
            self.executor.close()            # a config error after the load leaves no worker behind
            raise
        self.notify("fdx_engine_started", engine=self)

    # -- set-up ---------------------------------------------------------------
    def _set_up(self, dtype: str) -> None:
        """Everything over the loaded model: tokenizer and generation
        defaults, lengths, KV sizing through the executor, the scheduling
        parts and each rank's runner."""
        config, assembly = self.config, self.assembly
        ckpt, self.executor.checkpoint = self.executor.checkpoint, None
        if ckpt.tokenizer is None:
            raise ValueError(f"the checkpoint at {ckpt.path} has no tokenizer (tokenizer.json); "
                             "fdx needs one to serve text")
        self.tokenizer = ckpt.tokenizer                     # a DeferredTokenizer with defer_tokenizer
        if config.model.chat_template is not None:          # --chat-template: a file or the text
            self.tokenizer.set_chat_template(config.model.chat_template)
        self.model_path = ckpt.path
        from fdx.core.generation import chat_defaults_for
        from fdx.core.generation import resolve as resolve_generation_config
        # the model's sampling defaults (core/generation.py), as model.generation_config says
        self.generation_config = resolve_generation_config(config.model.generation_config, ckpt.generation_config)
        self.chat_defaults = chat_defaults_for(ckpt.is_default)   # fdx's, under them, for chat
        del ckpt
        self.shape = m = self.executor.shape       # what the engine reads of the model
        self.task = config.model.task               # generate, or embed: every request is a pooling one
        self.max_model_len = self._resolve_lengths()
        layout = assembly.classes["attention"].layout            # the kernel's
        spec = KVCacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, 0, config.cache.block_size,
                           self.backend.kv_cache_dtype(dtype), layout)
        check_kv_cache_dtype(config, spec.dtype, self.backend.name or "?")
        self.speculation = None            # speculative decoding (core/spec.py), when speculative.method is set
        if config.speculative.method is not None:    # first: a draft model's KV shares the KV budget
            from fdx.core.spec import Speculation
            self.speculation = Speculation(config, self.plugins, m.vocab_size)
        num_blocks = self._resolve_num_blocks(spec)
        self.kv_spec = KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, num_blocks,
                                   spec.block_size, spec.dtype, layout)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        # guided decoding: the engine's service (compiles, matchers, the step's bitmask), with
        # the admission rule build_parts adds
        from fdx.core.guided import GuidedDecoding
        self.guided = GuidedDecoding.from_config(config, self.plugins, self.tokenizer, m.vocab_size,
                                                 self.eos_token_ids)
        self.token_processor = assembly.token_processor(self.tokenizer)
        if self.speculation is not None:
            self.speculation.guided = self.guided          # guided requests speculate through its matchers
            # the gate times steps by this thread's CPU time where this thread computes them (core/spec.py)
            self.speculation.cpu_timed = (self.backend.name == "cpu"
                                          and config.parallel.tensor_parallel_size == 1)
        parts = self.build_parts(config, num_blocks)
        self.executor.allocate(self.kv_spec, parts["connector"])   # KV tensors and runner, on every rank
        self._install(parts)
        if self.speculation is not None and not config.backend.batch_invariant:
            self.speculation.say_row_limit(self.backend.row_invariant_rows(self.executor.weight_bytes(), m.head_dim))
        self.step_count = 0
        self.num_computed_tokens = 0
        self.num_recomputed_tokens = 0
        self.last_stats: StepStats | None = None
        self.last_schedule = None                  # the last step's SchedulerOutput
        self._ids = itertools.count()
        self.lora = self._lora_manager()           # None unless lora.enable_lora
        self._lora_users: dict[str, str] = {}      # request id -> the adapter it holds (LoRAManager.acquire)

    def build_parts(self, config: FdxConfig, num_blocks: int) -> dict:
        """The KV cache, connector and scheduling core for ``config`` (with
        ``num_blocks`` KV blocks in use), and its assembly."""
        a = self.assembly if config is self.config else Assembly(config, self.plugins, self.backend)
        parts = a.scheduler_side(num_blocks, self.token_processor, self.max_model_len,
                                 extra_rules=self.guided.admission_rules(config))
        return dict(config=config, assembly=a, processor_classes=[cls for _, cls in a.classes["processors"]],
                    **parts)

    def reconfigure(self, config: FdxConfig | None = None, **changes: Any) -> None:
        """Swap the scheduling parts (and the logits processors) of an idle
        engine, keeping the model and the KV tensors: ``changes`` are config
        keys (``policy="priority"``, ``preemption=...``, ``admission=[...]``,
        ``kv_scheduler=...``, ``kv_cache="prefix"``, ``max_num_seqs``,
        ``logits_processors=[...]``, ``num_kv_blocks`` up to what the
        tensors hold, ``plugins.<kind>.<name>`` settings); ``config``, a
        config whose explicitly set keys apply (a fresh ``FdxConfig.build``).
        A key that would need a reload (the model, its dtype or weights, the
        block size, max_model_len, the backend, tensor parallel, ...) is a
        ConfigError naming it, and nothing changes (core/reconfigure.py).
        The executor rebuilds the runner side on every rank."""
        from fdx.core.reconfigure import reconfigured
        if self.has_unfinished():
            raise RuntimeError(f"reconfigure needs an idle engine: {len(self.scheduling.requests())} "
                               "requests are unfinished (let them finish or abort them)")
        new = reconfigured(self.config, config, changes, kv_blocks=self.kv_spec.num_blocks)
        self._check_batch_budget(new)
        parts = self.build_parts(new, new.cache.num_kv_blocks)
        try:
            self.executor.reconfigure(parts["assembly"], parts["connector"])
        except BaseException:
            _close_parts(parts)
            raise
        _close_parts(self._install(parts))

    def _install(self, parts: dict) -> dict:
        """Make ``parts`` (from build_parts) the engine's; returns the old ones."""
        old = {k: getattr(self, k, None) for k in parts}
        for k, v in parts.items():
            setattr(self, k, v)
        self.scheduling.speculation = self.speculation
        return old

    @property
    def resource_manager(self):
        """Deprecated name of ``scheduling`` (kept one release): the
        scheduling core (``fdx.core.scheduling.SchedulingCore``) running the
        KV scheduler ``scheduler.kv_scheduler`` names."""
        return self.scheduling

    # what runs in this process: rank 0's parts under UniProcExecutor, None (or []) under tensor parallel
    @property
    def model(self):
        """The model, read-only, when it runs in this process (TP 1); None
        under tensor parallel. ``shape`` is what the engine reads of it."""
        return self.executor.model

    @property
    def runner(self):
        return self.executor.runner

    @property
    def kv_caches(self) -> list:
        return self.executor.kv_caches

    @property
    def attention(self):
        return self.executor.attention

    @property
    def sampler(self):
        return self.executor.sampler

    @property
    def logits_processors(self) -> list:
        return self.executor.logits_processors

    @property
    def kv_budget(self):
        """The KV sizing's figures (``core.memory.KVBudget``) when the
        executor profiled, else None."""
        return self.executor.budget

    def _select_backend(self) -> Backend:
        return select_backend(self.config, self.plugins)

    def _resolve_dtype(self) -> str:
        want, have = self.config.model.dtype, self.backend.dtypes
        if want == "auto":
            return have[0]
        if want not in have:
            raise ConfigError(f"config key 'model.dtype': the {self.backend.name} backend computes in "
                              f"{', '.join(have)}, not {want}")
        return want

    def _resolve_lengths(self) -> int:
        mc, sc = self.config.model, self.config.scheduler
        model_max = self.shape.max_position_embeddings
        max_len = mc.max_model_len or min(model_max, DEFAULT_MAX_MODEL_LEN)
        if max_len > model_max:
            raise ConfigError(f"config key 'model.max_model_len': {max_len} exceeds the model's "
                              f"max_position_embeddings ({model_max})")
        mc.max_model_len = max_len
        sc.max_num_batched_tokens = sc.token_budget(max_len)
        self._check_batch_budget(self.config)
        return max_len

    @staticmethod
    def _check_batch_budget(config: FdxConfig) -> None:
        sc, max_len = config.scheduler, config.model.max_model_len
        if not sc.enable_chunked_prefill and sc.token_budget(max_len) < max_len:
            raise ConfigError(
                f"config key 'scheduler.max_num_batched_tokens': {sc.token_budget(max_len)} is below "
                f"max_model_len ({max_len}) with chunked prefill off; a long prompt could never run")

    def _resolve_num_blocks(self, spec: KVCacheSpec) -> int:
        """cache.num_kv_blocks, else cache.kv_cache_memory_bytes' worth, else
        what max_num_seqs sequences of max_model_len need, capped by
        cache.memory_fraction (core/memory.py); logged with what it holds."""
        cc, sc = self.config.cache, self.config.scheduler
        need_per_seq = -(-self.max_model_len // cc.block_size)
        demand = need_per_seq * sc.max_num_seqs
        # under tensor parallel a block's bytes over all ranks: the ranks of one host share its memory
        key = "cache.num_kv_blocks"
        # a draft model (speculative decoding) holds as many tokens' KV as the target, plus its drafts' room:
        # a sized budget is shared by both (core/spec.py's draft_kv_bytes)
        draft_per_block, draft_fixed = (self.speculation.draft_kv_bytes(cc.block_size, sc.max_num_seqs)
                                        if self.speculation is not None else (0, 0))
        if cc.num_kv_blocks is not None:
            why = "cache.num_kv_blocks"
        elif cc.kv_cache_memory_bytes is not None:
            key = why = "cache.kv_cache_memory_bytes"
            cc.num_kv_blocks = max(1, (cc.kv_cache_memory_bytes - draft_fixed) // (spec.bytes_per_block + draft_per_block))
        else:
            kv_bytes = self.executor.kv_budget(sc.max_num_batched_tokens, sc.max_num_seqs, cc.memory_fraction)
            cc.num_kv_blocks = max(1, min(max(0, kv_bytes - draft_fixed) // (spec.bytes_per_block + draft_per_block),
                                          demand))
            why = (f"max_num_seqs {sc.max_num_seqs} x max_model_len {self.max_model_len}"
                   if cc.num_kv_blocks == demand else f"capped at cache.memory_fraction {cc.memory_fraction}")
        if cc.num_kv_blocks < need_per_seq:
            raise ConfigError(
                f"config key '{key}': {cc.num_kv_blocks} blocks of {cc.block_size} tokens "
                f"({spec.bytes_per_block} bytes each) cannot hold one sequence of max_model_len="
                f"{self.max_model_len}; raise it to at least {need_per_seq} blocks or lower max_model_len")
        log.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f sequences of max_model_len %d), %d bytes "
                 "(%.1f MiB); from %s", cc.num_kv_blocks, cc.block_size, cc.num_kv_blocks * cc.block_size,
                 cc.num_kv_blocks / need_per_seq, self.max_model_len, cc.num_kv_blocks * spec.bytes_per_block,
                 cc.num_kv_blocks * spec.bytes_per_block / (1 << 20), why)
        return cc.num_kv_blocks

    def _lora_manager(self):
        """lora.enable_lora: the adapter manager over the executor, with
        ``lora.lora_modules`` loaded (a bad one fails the start, saying why)."""
        lc = self.config.lora
        if not lc.enable_lora:
            if lc.lora_modules:
                raise ConfigError("config key 'lora.lora_modules': adapters are given but lora.enable_lora "
                                  "is off (--enable-lora)")
            return None
        from fdx.core.lora import LoRAManager, LoRARequest, make_loader
        make_loader(self.config, self.plugins)     # a bad lora.lora_loader fails the start, naming the key
        model = self.executor.model                # None under tensor parallel: the ranks' loads say it
        if model is not None and not model.supports_lora:
            raise ConfigError(f"config key 'lora.enable_lora': {type(model).__name__} does not apply LoRA "
                              "adapters (Model.supports_lora)")
        manager = LoRAManager(self.config, self.executor.load_lora, self.executor.unload_lora)
        if len(lc.lora_modules) > lc.max_loras:
            log.info("%d LoRA modules for %d slots (lora.max_loras): the first %d are loaded now, the rest "
                     "on first use", len(lc.lora_modules), lc.max_loras, lc.max_loras)
        for i, (name, path) in enumerate(lc.lora_modules.items()):
            try:
                manager.register(LoRARequest(name, i + 1, path), load_now=i < lc.max_loras)
            except ValueError as e:
                raise ConfigError(f"config key 'lora.lora_modules': {name}: {e}") from None
        return manager

    def load_lora_adapter(self, request: "LoRARequest") -> None:
        """Know and load ``request``'s adapter now (/v1/load_lora_adapter):
        ValueError saying why a bad one is refused."""
        if self.lora is None:
            raise ValueError("LoRA adapters need lora.enable_lora (--enable-lora)")
        self.lora.register(request, load_now=True)

    def unload_lora_adapter(self, name: str) -> None:
        """Forget adapter ``name`` (KeyError: unknown; ValueError: in use)."""
        if self.lora is None:
            raise KeyError(name)
        self.lora.unregister(name)

    def _release_lora(self, req: Request) -> None:
        name = self._lora_users.pop(req.request_id, None)
        if name is not None:
            self.lora.release(name)

    # -- requests -------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def make_request(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str | None = None, prompt: str | None = None,
                     priority: int = 0, cache_salt: str | None = None,
                     trace_headers: dict[str, str] | None = None, lora_request: Any = None) -> Request:
        """Validate and build a request (raises ValueError naming the problem).
        ``lora_request``: a fdx.core.lora.LoRARequest, or the name of an adapter
        the engine knows (its KV blocks are shared only with the same adapter's)."""
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        if self.task == "embed":        # a pooling request: one prefill, its pooled hidden state, done
            params = POOLING_PARAMS
        params.validate()
        vocab = self.shape.vocab_size
        check_prompt(prompt_token_ids, vocab, self.max_model_len)     # the server checked it already: the same rule
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(params, name)
            if ids is not None and any(t >= vocab for t in ids):
                raise ValueError(f"invalid sampling parameter {name}: token ids must be below the "
                                 f"vocabulary size {vocab}")
        for cls in self.processor_classes:
            cls.validate_params(params)
        self.guided.check(params)       # a kind the backend cannot compile is refused now
        activations.check(activations.parse(params.activations), self.shape,
                          lambda name: self.plugins.get("activation_function", name))
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        if lora_request is not None:
            lora_request = self._lora_request(lora_request)
            cache_salt = f"lora:{lora_request.lora_name}" + ("" if cache_salt is None else f":{cache_salt}")
        req = Request(request_id or self.new_request_id(), prompt_token_ids, params,
                      prompt=prompt, priority=priority, eos_token_ids=self.eos_token_ids,
                      max_model_len=self.max_model_len, cache_salt=cache_salt, pooling=self.task == "embed",
                      trace_headers=trace_headers)
        req.lora_request = lora_request
        return req

    def _lora_request(self, lora_request: Any):
        """A LoRARequest, or the one the engine knows by that name."""
        from fdx.core.lora import LoRARequest
        if self.lora is None:
            raise ValueError("lora_request: LoRA adapters need lora.enable_lora (--enable-lora)")
        if isinstance(lora_request, str):
            known = self.lora.known.get(lora_request)
            if known is None:
                raise ValueError(f"lora_request: no LoRA adapter named {lora_request!r} is loaded")
            return known
        if not isinstance(lora_request, LoRARequest):
            raise ValueError("lora_request must be a LoRARequest or an adapter name")
        return lora_request

    def add_request(self, request: Request) -> Request:
        """Queue a request from make_request; a constrained one starts its
        compile here (ValueError for one that failed before; GuidedRefused,
        a ValueError, when too many compile). An id already in the engine
        is refused with a ValueError: two requests under one id would share
        its runner state (a global scheduler's retry of a job still running
        here once crashed the engine that way), and one finished whose blocks a
        connector still holds for a transfer would have its blocks freed under
        the new one (a router's retry on a prefill instance lost its KV offer
        that way)."""
        rid = request.request_id
        if self.scheduling.holds_id(rid):
            raise ValueError(f"request id {rid!r} is already in the engine")
        if request.lora_request is not None:     # loaded (or refused) before anything else holds it
            self.lora.acquire(request.lora_request)
            self._lora_users[rid] = request.lora_name
        self.guided.add(rid, request.sampling_params)
        self.token_processor.start(request)
        if self.speculation is not None:
            self.speculation.add_request(request)
        self.scheduling.add_request(request)
        self.notify("fdx_request_added", request=request)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a waiting or running request (its blocks freed, the request
        returned with status FINISHED_ABORTED); None if unknown or done."""
        self.guided.remove(request_id)          # a compile it alone waits for is cancelled
        req = self.scheduling.abort_request(request_id)
        if req is not None:
            self._release_lora(req)
            self._finished(req)
        return req

    abort = abort_request

    def notify(self, hook_name: str, **kwargs) -> None:
        """Call an observer hook: the plugins' module-level implementations,
        then this engine's observers (observability.observers)."""
        self.plugins.notify(hook_name, self.observers, **kwargs)

    def _finished(self, req: Request) -> None:
        if self.speculation is not None:
            self.speculation.remove_request(req)
        if self.plugins.has_observers("fdx_request_finished", self.observers):
            self.notify("fdx_request_finished", request=req, output=request_output(req))

    def has_unfinished(self) -> bool:
        return self.scheduling.has_unfinished()

    def shutdown(self) -> None:
        """Abort what is left, let the KV cache and connector flush, and
        close the executor (its worker processes, under tensor parallel)."""
        for req in self.scheduling.requests():
            self.abort_request(req.request_id)
        if self.connector is not None:
            self.connector.close()
        self.kv_cache.close()
        self.guided.close()
        if self.speculation is not None:
            self.speculation.close()
        for obs in self.observers:
            try:
                obs.close()
            except Exception as e:                # an observer must not stop the shutdown
                log.warning("observer %s raised %s in close(): %s", obs.name, type(e).__name__, e)
        self.executor.close()

    @property
    def recompute_tax(self) -> float:
        """Recomputed tokens / all computed tokens since the engine started."""
        return self.num_recomputed_tokens / self.num_computed_tokens if self.num_computed_tokens else 0.0

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step: schedule, one batched forward, update. Returns the
        requests whose output changed in it: a new token, finished, ended
        without running (rejected on arrival; a failed guided compile, with
        ``error_status``), or a constrained request whose compile is done
        (no token yet: it may run now); ``req.is_finished`` tells which ended. The step's decision
        (a ``SchedulerOutput``) is then ``last_schedule``, its figures
        (``StepStats``) ``last_stats``. An idle engine's step schedules
        nothing and runs no forward."""
        t0 = time.perf_counter()
        rm = self.scheduling
        changed = self._guided_verdicts()
        spec = self.speculation
        if spec is not None:               # this step's k, from how many requests decode (the cost gate)
            decoding = [r for r in rm.running if r.num_tokens - r.num_computed_tokens == 1]
            spec.begin_step(len(decoding), decoding)
        sched = rm.schedule()
        if self.guided.entries:
            sched.guided = self._guided_step(sched)
        changed += rm.pop_finished()
        context = None
        num_recomputed = 0
        if not sched.is_empty or sched.kv_connector_metadata is not None:
            out = self.executor.execute(sched)
            if out.pooled:                 # pooling requests whose prompt is done: their embedding
                by_id = {r.request_id: r for r in rm.requests()}
                for rid, vector in out.pooled.items():
                    if rid in by_id:
                        by_id[rid].pooled = vector
            context = self._context(sched)
            changed += rm.update(sched, out)
            num_recomputed = out.num_recomputed_tokens
        self.step_count += 1
        self.num_computed_tokens += sched.total_num_scheduled_tokens
        self.num_recomputed_tokens += num_recomputed
        decode = 0 if context is None else sum(r.num_decode_tokens for r in context.requests)
        spec_counts = [0, 0, 0]
        if spec is not None:
            spec_counts = spec.step_counts
            spec.end_step(spec_counts[2] + sum(r.request_id in sched.num_scheduled_tokens for r in changed),
                          time.perf_counter() - t0, decode == sched.total_num_scheduled_tokens > 0)
        finished = [r for r in changed if r.is_finished]
        for req in finished:
            self.guided.remove(req.request_id)
            self._release_lora(req)
        stats = StepStats(
            step=self.step_count, num_running=rm.num_running, num_waiting=rm.num_waiting,
            num_scheduled_tokens=sched.total_num_scheduled_tokens,
            num_prefill_tokens=sched.total_num_scheduled_tokens - decode, num_decode_tokens=decode,
            num_preempted=len(sched.preempted_req_ids), kv_usage=self.kv_cache.usage,
            step_time_s=time.perf_counter() - t0, num_finished=len(finished),
            num_recomputed_tokens=num_recomputed, recompute_tax=self.recompute_tax,
            spec_num_drafts=spec_counts[0], spec_num_draft_tokens=spec_counts[1],
            spec_num_accepted_tokens=spec_counts[2], spec_gated=int(spec is not None and spec.step_k == 0))
        self.last_stats = stats
        self.last_schedule = sched
        self.notify("fdx_step_finished", scheduler_output=sched, step_stats=stats,
                    context=context or self._context(sched))
        for req in finished:     # aborted ones too: the connector's failures (abort_request's never come here)
            self._finished(req)
        return changed

    def _guided_verdicts(self) -> list[Request]:
        """Poll the guided compiles: the requests whose compile finished
        (they may run now) and those whose compile failed or timed out
        (rejected: finished, ``stop_reason`` the message, ``error_status``
        the HTTP status)."""
        if not self.guided.entries:
            return []
        ready, failed = self.guided.poll()
        by_id = {r.request_id: r for r in self.scheduling.requests()}
        out = [by_id[rid] for rid in ready if rid in by_id]
        for rid, message, status in failed:
            req = self.scheduling.abort_request(rid)
            if req is not None:
                req.status, req.stop_reason, req.error_status = RequestStatus.FINISHED_REJECTED, message, status
                out.append(req)
        return out

    def _guided_step(self, sched):
        """The bitmask rows of the constrained requests that sample this step."""
        by_id = {r.request_id: r for r in self.scheduling.requests()}
        rows = []
        for rid, n in sched.num_scheduled_tokens.items():
            req = by_id.get(rid)
            if rid in self.guided.entries and req is not None and req.num_computed_tokens + n >= req.num_tokens:
                rows.append((rid, req.output_token_ids))
        return self.guided.step_bitmask(rows, sched.spec_token_ids)

    def _context(self, sched) -> StepContext:
        """The StepContext of a step that ran, before update(): counts from
        each request's state as the scheduler left it."""
        by_id = {r.request_id: r for r in self.scheduling.requests()}
        infos = []
        for rid, n in sched.num_scheduled_tokens.items():
            req = by_id.get(rid)
            if req is None:
                continue
            ctx_len = req.num_computed_tokens
            prefill = max(0, min(ctx_len + n, req.num_prompt_tokens) - ctx_len)
            infos.append(RequestStepInfo(rid, prefill, n - prefill, ctx_len))
        kv = self.kv_cache
        return StepContext(engine=self, step=sched.step, requests=infos,
                           kv_blocks_used=kv.num_blocks - kv.num_free_blocks, kv_blocks_free=kv.num_free_blocks,
                           **self.executor.last_step_taps())


def _close_parts(parts: dict) -> None:
    """Close the connector and KV cache of ``parts`` (from build_parts)."""
    if parts.get("connector") is not None:
        parts["connector"].close()
    if parts.get("kv_cache") is not None:
        parts["kv_cache"].close()


def check_kv_cache_dtype(config, kv_dtype: str, backend: str) -> None:
    """cache.kv_cache_dtype other than auto: what the backend gave, and no KV connector
    (they move float rows: splitwise, swap, offload). A ConfigError naming the key otherwise."""
    want = config.cache.kv_cache_dtype
    if want == "auto":
        return
    from fdx.core.config import ConfigError
    if kv_dtype != want:
        raise ConfigError(f"config key 'cache.kv_cache_dtype': {want} is not supported by the {backend} backend "
                          f"here (the CPU backend in one process has it; tensor parallel and GPU backends do "
                          f"not); use cache.kv_cache_dtype=auto")
    if config.parallel.tensor_parallel_size > 1:
        raise ConfigError(f"config key 'cache.kv_cache_dtype': {want} with parallel.tensor_parallel_size > 1 "
                          "is not supported; use cache.kv_cache_dtype=auto")
    if config.cache.kv_connector is not None:
        raise ConfigError(f"config key 'cache.kv_cache_dtype': {want} with cache.kv_connector="
                          f"{config.cache.kv_connector!r} is not supported (connectors move float KV rows); "
                          "use one or the other")
