"""EngineCore: loads the model through the plugins config names, and steps.

    sched = resource_manager.schedule()        # which requests, how many tokens
    out   = model_runner.execute(sched)        # one batched forward + sampling
    done  = resource_manager.update(sched, out)  # append tokens, stop checks, free blocks
"""
from __future__ import annotations

import itertools
import numbers
import logging
import time

from fdx.core.config import ConfigError, FdxConfig
from fdx.core.interfaces import Backend, StepStats
from fdx.core.plugins import PluginError, PluginManager, get_plugin_manager
from fdx.core.request import Request, RequestStatus
from fdx.core.sampling_params import SamplingParams

log = logging.getLogger("fdx.engine")

DEFAULT_MAX_MODEL_LEN = 8192


class EngineCore:
    def __init__(self, config: FdxConfig, plugins: PluginManager | None = None, progress: bool = True):
        self.config = config = config.model_copy(deep=True)
        self.plugins = plugins = plugins or get_plugin_manager()
        # resolve every plugin name before the (slow) model load, so a typo fails at once
        sc, dc = config.scheduler, config.decoding
        kv_cache_cls = self._pick("kv_cache", "cache.kv_cache", config.cache.kv_cache)
        token_processor_cls = self._pick("token_processor", "decoding.token_processor", dc.token_processor)
        resource_manager_cls = self._pick("resource_manager", "scheduler.resource_manager", sc.resource_manager)
        processors = [self._pick("logits_processor", "decoding.logits_processors", n) for n in dc.logits_processors]
        self.backend = self._select_backend()
        self.backend.setup(config)

        from fdx.core.checkpoint.loader import load_checkpoint
        ckpt = load_checkpoint(config.model.model, progress=progress)
        if ckpt.tokenizer is None:
            raise ValueError(f"the checkpoint at {ckpt.path} has no tokenizer (tokenizer.json); "
                             "fdx needs one to serve text")
        self.tokenizer = ckpt.tokenizer
        self.model_path = ckpt.path
        self.generation_config = ckpt.generation_config     # the model's sampling defaults (core/generation.py)
        arch = (ckpt.config.get("architectures") or ["?"])[0]
        if arch not in plugins.names("model"):
            raise ValueError(f"unsupported architecture {arch!r} in {ckpt.path}; "
                             f"supported: {', '.join(plugins.names('model'))}")
        self.model = self._pick("model", "model.model", arch)(ckpt.config, ckpt.weights)
        del ckpt

        self.max_model_len = self._resolve_lengths()
        num_blocks = self._resolve_num_blocks()
        self.kv_caches = self._allocate_kv(num_blocks)

        self.kv_cache = kv_cache_cls(num_blocks, config.cache.block_size, config)
        self.kv_cache.attach_kv_tensors(self.kv_caches, self.model.num_kv_heads, self.model_path)
        self.token_processor = token_processor_cls(self.tokenizer)
        self.resource_manager = resource_manager_cls(config, self.kv_cache, self.token_processor, self.max_model_len)

        from fdx.core.model_runner import ModelRunner
        from fdx.plugins.decoding.sampler import Sampler
        self.sampler = Sampler(processors, seed=config.seed)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.runner = ModelRunner(self.model, self.kv_caches, num_blocks, config.cache.block_size,
                                  self.sampler, set(self.eos_token_ids))
        self.step_count = 0
        self._ids = itertools.count()
        plugins.notify("fdx_engine_started", engine=self)

    # -- set-up ---------------------------------------------------------------
    def _pick(self, kind: str, key: str, name: str):
        try:
            return self.plugins.get(kind, name)
        except PluginError as e:
            raise ConfigError(f"config key '{key}': {e}") from None

    def _select_backend(self) -> Backend:
        name = self.config.backend.name
        if name != "auto":
            cls = self._pick("backend", "backend.name", name)
            if not cls.is_available():
                raise ConfigError(f"config key 'backend.name': backend {name!r} is not available here")
            return cls()
        candidates = sorted((r.obj for r in self.plugins.registries["backend"].values()),
                            key=lambda c: -c.priority)
        for cls in candidates:
            if cls.is_available():
                return cls()
        raise ConfigError("config key 'backend.name': no available backend")

    def _resolve_lengths(self) -> int:
        mc, sc = self.config.model, self.config.scheduler
        model_max = self.model.max_position_embeddings
        max_len = mc.max_model_len or min(model_max, DEFAULT_MAX_MODEL_LEN)
        if max_len > model_max:
            raise ConfigError(f"config key 'model.max_model_len': {max_len} exceeds the model's "
                              f"max_position_embeddings ({model_max})")
        mc.max_model_len = max_len
        if sc.max_num_batched_tokens is None:
            sc.max_num_batched_tokens = 2048 if sc.enable_chunked_prefill else max_len
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < max_len:
            raise ConfigError(
                f"config key 'scheduler.max_num_batched_tokens': {sc.max_num_batched_tokens} is below "
                f"max_model_len ({max_len}) with chunked prefill off; a long prompt could never run")
        return max_len

    def _bytes_per_block(self) -> int:
        m = self.model
        return 2 * m.num_layers * m.num_kv_heads * m.head_dim * self.config.cache.block_size * 4

    def _resolve_num_blocks(self) -> int:
        cc = self.config.cache
        need_per_seq = -(-self.max_model_len // cc.block_size)
        if cc.num_kv_blocks is None:
            by_memory = int(self.backend.free_memory_bytes() * cc.memory_fraction) // self._bytes_per_block()
            by_demand = need_per_seq * self.config.scheduler.max_num_seqs
            cc.num_kv_blocks = max(1, min(by_memory, by_demand))
        if cc.num_kv_blocks < need_per_seq:
            raise ConfigError(
                f"config key 'cache.num_kv_blocks': {cc.num_kv_blocks} blocks of {cc.block_size} tokens "
                f"cannot hold one sequence of max_model_len={self.max_model_len}; raise it to at least "
                f"{need_per_seq} or lower max_model_len")
        return cc.num_kv_blocks

    def _allocate_kv(self, num_blocks: int):
        import paddle
        m = self.model
        rows = m.num_kv_heads * num_blocks * self.config.cache.block_size
        return [(paddle.zeros([rows, m.head_dim], dtype="float32"),
                 paddle.zeros([rows, m.head_dim], dtype="float32")) for _ in range(m.num_layers)]

    # -- requests -------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def make_request(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str | None = None, prompt: str | None = None,
                     priority: int = 0, cache_salt: str | None = None) -> Request:
        """Validate and build a request (raises ValueError naming the problem)."""
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        params.validate()
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = self.model.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab
               for t in prompt_token_ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, but max_model_len is "
                             f"{self.max_model_len}: at most {self.max_model_len - 1} prompt tokens "
                             "leave room to generate")
        req = Request(request_id or self.new_request_id(), prompt_token_ids, params,
                      prompt=prompt, priority=priority, eos_token_ids=self.eos_token_ids,
                      max_model_len=self.max_model_len, cache_salt=cache_salt)
        return req

    def add_request(self, request: Request) -> Request:
        self.token_processor.start(request)
        self.resource_manager.add_request(request)
        self.plugins.notify("fdx_request_added", request=request)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        req = self.resource_manager.abort_request(request_id)
        if req is not None:
            self.plugins.notify("fdx_request_finished", request=req, output=None)
        return req

    def has_unfinished(self) -> bool:
        return self.resource_manager.has_unfinished()

    def shutdown(self) -> None:
        """Abort what is left and let the KV cache flush (a file tier writes its blocks)."""
        for req in list(getattr(self.resource_manager, "running", [])) + list(getattr(self.resource_manager, "waiting", [])):
            self.abort_request(req.request_id)
        self.kv_cache.close()

    # -- the loop ---------------------------------------------------------------
    def step(self) -> list[Request]:
        t0 = time.perf_counter()
        sched = self.resource_manager.schedule()
        changed = list(sched.finished_aborted)
        decode = sum(sr.num_new_tokens for sr in sched.scheduled if sr.context_len >= sr.request.num_prompt_tokens)
        if not sched.is_empty:
            out = self.runner.execute(sched)
            changed += self.resource_manager.update(sched, out)
        self.step_count += 1
        finished = [r for r in changed if r.is_finished]
        stats = StepStats(
            step=self.step_count, num_running=self.resource_manager.num_running,
            num_waiting=self.resource_manager.num_waiting,
            num_scheduled_tokens=sched.num_scheduled_tokens,
            num_prefill_tokens=sched.num_scheduled_tokens - decode, num_decode_tokens=decode,
            num_preempted=len(sched.preempted), kv_usage=self.kv_cache.usage,
            step_time_s=time.perf_counter() - t0, num_finished=len(finished))
        self.last_stats = stats
        self.plugins.notify("fdx_step_finished", scheduler_output=sched, step_stats=stats)
        for req in finished:
            if req.status is not RequestStatus.FINISHED_ABORTED:
                self.plugins.notify("fdx_request_finished", request=req, output=None)
        return changed
