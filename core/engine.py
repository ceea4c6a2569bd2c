"""EngineCore: builds every part from the plugins config names, and steps.

    sched = resource_manager.schedule()          # plain data: which requests, how many tokens
    out   = runner.execute(sched)                # one batched forward + logits processors + sampling
    done  = resource_manager.update(sched, out)  # append tokens, stop checks, free blocks
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from fdx.core import activations
from fdx.core.assembly import Assembly
from fdx.core.config import ConfigError, FdxConfig, plugin_settings
from fdx.core.interfaces import Backend, KVCacheSpec, Model, RequestStepInfo, StepContext, StepStats
from fdx.core.plugins import PluginError, PluginManager, get_plugin_manager
from fdx.core.request import Request, RequestStatus, check_prompt, request_output
from fdx.core.sampling_params import SamplingParams

log = logging.getLogger("fdx.engine")

DEFAULT_MAX_MODEL_LEN = 8192
# what a pooling request (model.task embed) runs with: its prompt's prefill and one (unused) token,
# after which the scheduler finishes it ("length") and frees its blocks like any other request
POOLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)


def select_backend(config: FdxConfig, plugins: PluginManager) -> Backend:
    """The backend ``backend.name`` names (auto: the available one with the
    highest priority), constructed with its settings; not yet set up."""
    def settings(name: str):
        return plugin_settings("backend", name, plugins.get("backend", name),
                               config.plugins.get("backend", {}).get(name))

    name = config.backend.name
    if name != "auto":
        try:
            cls = plugins.get("backend", name)
        except PluginError as e:
            raise ConfigError(f"config key 'backend.name': {e}") from None
        if not cls.is_available():
            raise ConfigError(f"config key 'backend.name': backend {name!r} is not available here")
        return cls(settings=settings(name))
    candidates = sorted(plugins.registries["backend"].items(), key=lambda kv: -kv[1].obj.priority)
    for reg_name, reg in candidates:
        if reg.obj.is_available():
            return reg.obj(settings=settings(reg_name))
    raise ConfigError("config key 'backend.name': no available backend")


@dataclass(slots=True, frozen=True)
class ModelShape:
    """What the engine reads of a model whose weights live in tensor
    parallel workers (the engine process loads none)."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    cfg: Any                            # the architecture's parsed config (intermediate_size, ...)
    can_shard: bool = True              # the class overrides Model.shard
    held: tuple[tuple[str, int], ...] = ()     # (kind, bytes) the workers hold, summed over the ranks

    def shardable(self) -> bool:
        return self.can_shard

    def weight_bytes(self) -> dict[str, int]:
        return dict(self.held)

    @classmethod
    def of(cls, model_cls, config: dict) -> "ModelShape":
        c = model_cls.parse_config(config)
        return cls(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size,
                   c.max_position_embeddings, c, model_cls.shardable())


class EngineCore:
    def __init__(self, config: FdxConfig, plugins: PluginManager | None = None, progress: bool = True,
                 defer_tokenizer: bool = False):
        """``defer_tokenizer``: hold a ``DeferredTokenizer`` (its eos ids, the
        rest built on first use): the serving engine process, whose API
        process tokenizes and detokenizes (core/serving/engine_proc.py)."""
        self.config = config = config.model_copy(deep=True)
        self.plugins = plugins = plugins or get_plugin_manager()
        # every plugin name resolved before the (slow) model load, so a typo fails at once
        self.assembly = assembly = Assembly(config, plugins)
        self.observers = assembly.observers()    # observability.observers (a bad setting fails before the load)
        self.backend = self._select_backend()
        dtype = self._resolve_dtype()
        # a runner whose model lives in worker processes (tensor parallel): each worker sets the backend
        # up (device, threads, kernel probe) and this process takes rank 0's findings, so it never
        # loads Paddle (docs/benchmarks.md)
        in_workers = config.parallel.tensor_parallel_size > 1 and not config.backend.model_runner
        if not in_workers:
            self.backend.setup(config)
        assembly.set_backend(self.backend)       # after setup: a backend may choose its attention by a probe
        launch = getattr(assembly.classes["runner"], "launch", None)

        from fdx.core.checkpoint.loader import is_default_model, load_metadata
        from fdx.core.checkpoint.model import check_model_class, load_model, weight_format
        from fdx.core.generation import chat_defaults_for
        if launch is not None:
            weight_format(config, plugins, self.backend.kernels)   # a bad model.quantization fails before any worker
            ckpt = load_metadata(config.model.model, defer_tokenizer=defer_tokenizer)
        else:   # in model.quantization's format
            self.model, ckpt = load_model(config, plugins, self.backend.kernels, progress, defer_tokenizer)
        if ckpt.tokenizer is None:
            raise ValueError(f"the checkpoint at {ckpt.path} has no tokenizer (tokenizer.json); "
                             "fdx needs one to serve text")
        self.tokenizer = ckpt.tokenizer                     # a DeferredTokenizer with defer_tokenizer
        if config.model.chat_template is not None:          # --chat-template: a file or the text
            self.tokenizer.set_chat_template(config.model.chat_template)
        self.model_path = ckpt.path
        from fdx.core.generation import resolve as resolve_generation_config
        # the model's sampling defaults (core/generation.py), as model.generation_config says
        self.generation_config = resolve_generation_config(config.model.generation_config, ckpt.generation_config)
        self.chat_defaults = chat_defaults_for(is_default_model(ckpt.path))   # fdx's, under them, for chat
        arch = (ckpt.config.get("architectures") or ["?"])[0]
        if arch not in plugins.names("model"):
            raise ValueError(f"unsupported architecture {arch!r} in {ckpt.path}; "
                             f"supported: {', '.join(plugins.names('model'))}")
        model_cls = assembly.pick("model", "model.model", arch)
        check_model_class(model_cls, arch, config)      # before a tensor-parallel launch
        self.executor = None
        self.task = config.model.task               # generate, or embed: every request is a pooling one
        if self.task == "embed" and launch is not None:
            raise ConfigError("config key 'model.task': embed runs the model in this process; it does not run "
                              f"with the {config.parallel.tensor_parallel_size}-worker tensor parallel runner "
                              "(set tensor_parallel_size=1)")
        if launch is not None and model_cls.parse_config.__func__ is not Model.parse_config.__func__:
            self.model = ModelShape.of(model_cls, ckpt.config)     # the workers load the weights
            self.executor = launch(config, self.model)
            held = getattr(self.executor, "weight_bytes", None) or {}
            self.model = replace(self.model, held=tuple(held.items()))
            adopt = getattr(self.executor, "adopt_setup", None)      # rank 0's kernels, attention, threads
            if adopt is not None:
                adopt(self.backend)
                assembly.set_backend(self.backend)
        else:
            if launch is not None:      # a model class with no parse_config: its shape from a copy, here
                self.backend.setup(config)
                assembly.set_backend(self.backend)
                self.model, ckpt = load_model(config, plugins, self.backend.kernels, progress, defer_tokenizer)
            self.backend.prepare_model(self.model, dtype)
        del ckpt

        self.max_model_len = self._resolve_lengths()
        m, cc = self.model, config.cache
        layout = getattr(assembly.classes["attention"], "layout", "head_major")  # the kernel's
        spec = KVCacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, 0, cc.block_size,
                           self.backend.kv_cache_dtype(dtype), layout)
        num_blocks = self._resolve_num_blocks(spec)
        self.kv_spec = KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, num_blocks,
                                   spec.block_size, spec.dtype, layout)
        # with tensor parallel the workers hold the KV cache, each its share of the heads
        tp = config.parallel.tensor_parallel_size > 1
        self.kv_caches = [] if tp else self.backend.allocate_kv_cache(self.kv_spec)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        # guided decoding: the engine's service (compiles, matchers, the step's bitmask), with
        # the admission rule build_parts adds
        from fdx.core.guided import GuidedDecoding
        self.guided = GuidedDecoding.from_config(config, self.plugins, self.tokenizer, m.vocab_size,
                                                 self.eos_token_ids)
        self.token_processor = assembly.token_processor()
        self._install(self.build_parts(config, num_blocks))
        self.guided_ready: list[str] = []          # this step's guided verdicts (_guided_verdicts)
        self.guided_rejected: dict[str, tuple[str, int]] = {}
        self.step_count = 0
        self.num_computed_tokens = 0
        self.num_recomputed_tokens = 0
        self.last_stats: StepStats | None = None
        self.last_schedule = None                  # the last step's SchedulerOutput
        self._ids = itertools.count()
        self.notify("fdx_engine_started", engine=self)

    # -- set-up ---------------------------------------------------------------
    def build_parts(self, config: FdxConfig, num_blocks: int, runner_side: bool = True) -> dict:
        """The KV cache, connector, scheduling core and (``runner_side``)
        runner for ``config``, over this engine's model and KV tensors
        (``num_blocks`` of them in use)."""
        a = self.assembly if config is self.config else Assembly(config, self.plugins, self.backend)
        parts = a.scheduler_side(num_blocks, self.token_processor, self.max_model_len,
                                 extra_rules=self.guided.admission_rules(config))
        if runner_side:
            parts.update(a.runner_side(self.model, self.kv_caches, self.kv_spec, self.tokenizer,
                                       self.eos_token_ids, connector=parts["connector"], executor=self.executor))
        return dict(config=config, assembly=a, **parts)

    def reconfigure(self, config: FdxConfig | None = None, **changes: Any) -> None:
        """Swap the scheduling parts (and the logits processors) of an idle
        engine, keeping the model and the KV tensors: ``changes`` are config
        keys (``policy="priority"``, ``preemption=...``, ``admission=[...]``,
        ``resource_manager=...``, ``kv_cache="prefix"``, ``max_num_seqs``,
        ``logits_processors=[...]``, ``num_kv_blocks`` up to what the
        tensors hold, ``plugins.<kind>.<name>`` settings); ``config``, a
        config whose explicitly set keys apply (a fresh ``FdxConfig.build``).
        A key that would need a reload (the model, its dtype or weights, the
        block size, max_model_len, the backend, tensor parallel, ...) is a
        ConfigError naming it, and nothing changes (core/reconfigure.py)."""
        from fdx.core.reconfigure import reconfigured
        if self.has_unfinished():
            raise RuntimeError(f"reconfigure needs an idle engine: {len(self.resource_manager.requests())} "
                               "requests are unfinished (let them finish or abort them)")
        tp = self.executor is not None
        new = reconfigured(self.config, config, changes, kv_blocks=self.kv_spec.num_blocks, tensor_parallel=tp)
        self._check_batch_budget(new)
        parts = self.build_parts(new, new.cache.num_kv_blocks, runner_side=not tp)
        if tp:          # the workers' runner stays: it still drops the ids that left it
            parts["resource_manager"].left_runner = list(self.resource_manager.left_runner)
        old = self._install(parts)
        if old["connector"] is not None:
            old["connector"].close()
        old["kv_cache"].close()

    def _install(self, parts: dict) -> dict:
        """Make ``parts`` (from build_parts) the engine's; returns the old ones."""
        old = {k: getattr(self, k, None) for k in parts}
        for k, v in parts.items():
            setattr(self, k, v)
        return old

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
        model_max = self.model.max_position_embeddings
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
        cc = self.config.cache
        need_per_seq = -(-self.max_model_len // cc.block_size)
        if cc.num_kv_blocks is None and self.executor is not None:    # the workers profile their shards
            sc = self.config.scheduler
            kv_bytes = self.executor.profile(sc.max_num_batched_tokens, sc.max_num_seqs, cc.memory_fraction)
            # a block's bytes over all ranks: the ranks of one host share its memory (conservative on GPUs)
            cc.num_kv_blocks = max(1, min(kv_bytes // spec.bytes_per_block, need_per_seq * sc.max_num_seqs))
        if cc.num_kv_blocks is None:       # memory_fraction of what one largest-batch forward leaves
            from fdx.core.memory import kv_budget
            attention = self.assembly.attention()
            self.kv_budget = kv_budget(self.backend, self.model, attention, spec,
                                       self.config.scheduler.max_num_batched_tokens,
                                       self.config.scheduler.max_num_seqs, cc.memory_fraction)
            by_memory = self.kv_budget.kv_bytes // spec.bytes_per_block
            by_demand = need_per_seq * self.config.scheduler.max_num_seqs
            cc.num_kv_blocks = max(1, min(by_memory, by_demand))
        if cc.num_kv_blocks < need_per_seq:
            raise ConfigError(
                f"config key 'cache.num_kv_blocks': {cc.num_kv_blocks} blocks of {cc.block_size} tokens "
                f"cannot hold one sequence of max_model_len={self.max_model_len}; raise it to at least "
                f"{need_per_seq} or lower max_model_len")
        return cc.num_kv_blocks

    # -- requests -------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def make_request(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str | None = None, prompt: str | None = None,
                     priority: int = 0, cache_salt: str | None = None,
                     trace_headers: dict[str, str] | None = None) -> Request:
        """Validate and build a request (raises ValueError naming the problem)."""
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        if self.task == "embed":        # a pooling request: one prefill, its pooled hidden state, done
            params = POOLING_PARAMS
        params.validate()
        vocab = self.model.vocab_size
        check_prompt(prompt_token_ids, vocab, self.max_model_len)     # the server checked it already: the same rule
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(params, name)
            if ids is not None and any(t >= vocab for t in ids):
                raise ValueError(f"invalid sampling parameter {name}: token ids must be below the "
                                 f"vocabulary size {vocab}")
        for cls in self.processor_classes:
            cls.validate_params(params)
        self.guided.check(params)       # a kind the backend cannot compile is refused now
        activations.check(activations.parse(params.activations), self.model,
                          lambda name: self.plugins.get("activation_function", name))
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        return Request(request_id or self.new_request_id(), prompt_token_ids, params,
                       prompt=prompt, priority=priority, eos_token_ids=self.eos_token_ids,
                       max_model_len=self.max_model_len, cache_salt=cache_salt, pooling=self.task == "embed",
                       trace_headers=trace_headers)

    def add_request(self, request: Request) -> Request:
        """Queue a request from make_request; a constrained one starts its
        compile here (ValueError for one that failed before; GuidedRefused,
        a ValueError, when too many compile). An id already in the engine
        is refused with a ValueError: two requests under one id would share
        its runner state (a global scheduler's retry of a job still running
        here once crashed the engine that way)."""
        rid = request.request_id
        if any(r.request_id == rid for r in self.resource_manager.requests()):
            raise ValueError(f"request id {rid!r} is already in the engine")
        self.guided.add(rid, request.sampling_params)
        self.token_processor.start(request)
        self.resource_manager.add_request(request)
        self.notify("fdx_request_added", request=request)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a waiting or running request (its blocks freed, the request
        returned with status FINISHED_ABORTED); None if unknown or done."""
        self.guided.remove(request_id)          # a compile it alone waits for is cancelled
        req = self.resource_manager.abort_request(request_id)
        if req is not None:
            self._finished(req)
        return req

    abort = abort_request

    def stop_request(self, request_id: str, stop_reason: int | str | None = None,
                     num_output_tokens: int | None = None) -> Request | None:
        """End a running or waiting request as stopped (``finish_reason``
        "stop"): what the output processor calls when a stop string ends a
        sequence (core/output.py), in process or, for ``fdx serve``, in the
        API process (an ``EngineAbort`` with reason "stop"). Its blocks are
        freed now, as on an abort; observers see it finished with
        ``stop_reason`` and its first ``num_output_tokens`` output tokens
        (the ones the caller kept: the engine may have computed one or two
        more before the stop reached it). None if unknown or done."""
        self.guided.remove(request_id)
        req = self.resource_manager.abort_request(request_id)
        if req is not None:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_reason
            if num_output_tokens is not None:
                del req.output_token_ids[num_output_tokens:]
                if req.logprobs is not None:
                    del req.logprobs[num_output_tokens:]
            self._finished(req)
        return req

    def notify(self, hook_name: str, **kwargs) -> None:
        """Call an observer hook: the plugins' module-level implementations,
        then this engine's observers (observability.observers)."""
        self.plugins.notify(hook_name, self.observers, **kwargs)

    def _finished(self, req: Request) -> None:
        if self.plugins.has_observers("fdx_request_finished", self.observers):
            self.notify("fdx_request_finished", request=req, output=request_output(req))

    def has_unfinished(self) -> bool:
        return self.resource_manager.has_unfinished()

    def shutdown(self) -> None:
        """Abort what is left and let the KV cache and connector flush."""
        for req in self.resource_manager.requests():
            self.abort_request(req.request_id)
        if self.connector is not None:
            self.connector.close()
        self.kv_cache.close()
        self.guided.close()
        for obs in self.observers:
            try:
                obs.close()
            except Exception as e:                # an observer must not stop the shutdown
                log.warning("observer %s raised %s in close(): %s", obs.name, type(e).__name__, e)
        close = getattr(self.runner, "close", None)     # a runner with processes of its own (tp)
        if close is not None:
            close()

    @property
    def recompute_tax(self) -> float:
        """Recomputed tokens / all computed tokens since the engine started."""
        return self.num_recomputed_tokens / self.num_computed_tokens if self.num_computed_tokens else 0.0

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step: schedule, one batched forward, update. Returns the
        requests whose output changed in it (a new token, finished, or
        ended without running: rejected on arrival, a failed guided
        compile); ``req.is_finished`` tells which ended. The step's decision
        (a ``SchedulerOutput``) is then ``last_schedule``, its figures
        (``StepStats``) ``last_stats``. An idle engine's step schedules
        nothing and runs no forward."""
        t0 = time.perf_counter()
        rm = self.resource_manager
        rejected = self._guided_verdicts()
        sched = rm.schedule()
        if self.guided.entries:
            sched.guided = self._guided_step(sched)
        changed = rejected + rm.pop_finished()
        context = None
        num_recomputed = 0
        if not sched.is_empty or sched.kv_connector_metadata is not None:
            out = self.runner.execute(sched)
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
        finished = [r for r in changed if r.is_finished]
        for req in finished:
            self.guided.remove(req.request_id)
        stats = StepStats(
            step=self.step_count, num_running=rm.num_running, num_waiting=rm.num_waiting,
            num_scheduled_tokens=sched.total_num_scheduled_tokens,
            num_prefill_tokens=sched.total_num_scheduled_tokens - decode, num_decode_tokens=decode,
            num_preempted=len(sched.preempted_req_ids), kv_usage=self.kv_cache.usage,
            step_time_s=time.perf_counter() - t0, num_finished=len(finished),
            num_recomputed_tokens=num_recomputed, recompute_tax=self.recompute_tax)
        self.last_stats = stats
        self.last_schedule = sched
        self.notify("fdx_step_finished", scheduler_output=sched, step_stats=stats,
                    context=context or self._context(sched))
        for req in finished:
            if req.status is not RequestStatus.FINISHED_ABORTED:   # abort_request told them already
                self._finished(req)
        return changed

    def _guided_verdicts(self) -> list[Request]:
        """Poll the guided compiles: ``guided_ready`` (request ids that may
        now run) and ``guided_rejected`` ({request id: (message, HTTP
        status)}) for this step; the rejected requests, finished."""
        self.guided_ready, self.guided_rejected = [], {}
        if not self.guided.entries:
            return []
        self.guided_ready, failed = self.guided.poll()
        out = []
        for rid, message, status in failed:
            req = self.resource_manager.abort_request(rid)
            if req is not None:
                req.status, req.stop_reason = RequestStatus.FINISHED_REJECTED, message
                self.guided_rejected[rid] = (message, status)
                out.append(req)
        return out

    def _guided_step(self, sched):
        """The bitmask rows of the constrained requests that sample this step."""
        by_id = {r.request_id: r for r in self.resource_manager.requests()}
        rows = []
        for rid, n in sched.num_scheduled_tokens.items():
            req = by_id.get(rid)
            if rid in self.guided.entries and req is not None and req.num_computed_tokens + n >= req.num_tokens:
                rows.append((rid, req.output_token_ids))
        return self.guided.step_bitmask(rows)

    def _context(self, sched) -> StepContext:
        """The StepContext of a step that ran, before update(): counts from
        each request's state as the scheduler left it."""
        by_id = {r.request_id: r for r in self.resource_manager.requests()}
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
                           **self.runner.last_step_taps())
