"""``UniProcExecutor``: the model on rank 0, in the engine's process
(``parallel.tensor_parallel_size`` 1). The tensor parallel executor
(plugins/backends/tp.py) runs the same runner class in N worker processes;
the engine cannot tell them apart (contract: ``fdx.core.interfaces.Executor``).
"""
from __future__ import annotations

from typing import Any

from fdx.core.interfaces import BuildContext, Executor, KVCacheSpec, ModelRunnerOutput, ModelShape, SchedulerOutput
from fdx.core.loading import model_loader


class UniProcExecutor(Executor):
    """Sets the backend up here, loads the model, profiles one forward for
    the KV budget, allocates the KV tensors and runs the config's runner."""

    def __init__(self, settings: Any, context: BuildContext):
        assembly, backend, progress, defer_tokenizer = (context.assembly, context.backend, context.progress,
                                                        context.defer_tokenizer)
        self.assembly, self.backend, self.dtype = assembly, backend, context.dtype
        config = assembly.config
        backend.setup(config)
        assembly.set_backend(backend)        # after setup: a backend may choose its attention by a probe
        # in model.quantization's format, by model I/O (core/loading.py: the engine imports none of it)
        self.model, self.checkpoint = model_loader().load_model(config, assembly.plugins, backend.kernels,
                                                                progress, defer_tokenizer)
        backend.prepare_model(self.model, self.dtype)
        self.tokenizer = self.checkpoint.tokenizer
        self.shape = ModelShape.of(self.model)
        self.attention = assembly.attention()
        self.kv_spec: KVCacheSpec | None = None
        self.runner = None                   # built by allocate()

    def kv_budget(self, num_tokens: int, num_seqs: int, memory_fraction: float) -> int:
        from fdx.core.memory import kv_budget
        m = self.shape
        spec = KVCacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, 0, self.assembly.config.cache.block_size,
                           self.backend.kv_cache_dtype(self.dtype), self.attention.layout)
        self.budget = kv_budget(self.backend, self.model, self.attention, spec, num_tokens, num_seqs,
                                memory_fraction)
        return self.budget.kv_bytes

    def allocate(self, kv_spec: KVCacheSpec, connector=None) -> None:
        if self.kv_spec is not None:
            raise RuntimeError("the KV cache is allocated once")
        self.kv_spec, self.kv_caches = kv_spec, self.backend.allocate_kv_cache(kv_spec)
        self._build(self.assembly, connector)

    def _build(self, assembly, connector) -> None:
        parts = assembly.runner_side(self.model, self.kv_caches, self.kv_spec, self.tokenizer,
                                     self.tokenizer.eos_token_ids, connector=connector, attention=self.attention)
        self.runner, self.sampler = parts["runner"], parts["sampler"]
        self.logits_processors = parts["logits_processors"]

    def reconfigure(self, assembly, connector=None) -> None:
        self._build(assembly, connector)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def last_step_taps(self) -> dict[str, Any]:
        return self.runner.last_step_taps()

    def load_lora(self, name: str, path: str) -> None:
        from fdx.core.lora import make_loader, read_adapter
        config = self.assembly.config
        adapter = read_adapter(make_loader(config, self.assembly.plugins), path, self.model,
                               config.lora.max_lora_rank)
        self.model.load_lora(name, adapter)

    def unload_lora(self, name: str) -> None:
        self.model.unload_lora(name)

    def weight_bytes(self) -> dict[str, int]:
        return dict(self.model.weight_bytes())      # Model.weight_bytes: {} for a class that does not say

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
