"""The CUDA backend: Paddle on an NVIDIA GPU (needs paddlepaddle-gpu: the
``gpu`` extra, see docs/backends.md).

- dtype: bfloat16 on compute capability 8.0 and up, else float16 (float32
  on request); the KV cache in the model's dtype.
- kernels: Paddle's fused GPU kernels are probed at start-up
  (``fdx.plugins.backends.gpu``); fused_rms_norm and fused rotary run
  where present (and, for rotary, correct); attention is ``paddle-block`` (Paddle's block_multihead_attention over a
  block-major KV cache) when that kernel runs at the model's dtype, else
  the device-agnostic Paddle reference (``paddle``), never the compiled
  CPU kernel. The choice is logged once.
- sampling: the ``device`` sampler (logits stay on the GPU; only the
  sampled ids and requested logprobs are copied back).
- ``backend.model_runner: cuda-graph``: see fdx.plugins.backends.cuda_graph.
- memory: free = total - what Paddle's allocator reserved; KV sizing
  profiles one forward with the allocator's high-water mark.

Only ever run against a fake device layer (tests/test_backends.py,
tests/test_block_attention.py, tests/test_cuda_graph.py): no
GPU with paddlepaddle-gpu was reachable from where fdx is built.
"""
from __future__ import annotations

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Backend
from fdx.plugins.backends.gpu import cast_model, log_once, model_dtype, paddle_build_lacks_cuda, probe_kernels

KERNELS = ("fused_rms_norm", "fused_rotary_position_embedding",
           "variable_length_memory_efficient_attention", "block_multihead_attention")


class CudaBackend(Backend):
    name = "cuda"
    priority = 10
    attention_backend = "paddle"   # until setup: paddle-block when its probe runs, never the CPU kernel
    sampler = "device"
    model_runner = "default"
    dtypes = ("bfloat16", "float16", "float32")

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        import paddle
        major, _ = paddle.device.cuda.get_device_capability(0)
        if major < 8:                              # no bfloat16 before Ampere
            self.dtypes = ("float16", "float32")

    @classmethod
    def is_available(cls) -> bool:
        if paddle_build_lacks_cuda():          # known without loading Paddle
            return False
        try:
            import paddle
            return bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0
        except Exception:
            return False

    def setup(self, config) -> None:
        import paddle
        paddle.set_device("gpu:0")
        dtype = model_dtype(self, config)
        self.kernels = probe_kernels(self.name, KERNELS, dtype)
        why = self.kernels["block_multihead_attention"]
        self.attention_backend = "paddle-block" if why is None else "paddle"
        log_once(self.name, f"attention at {dtype}: paddle-block (block_multihead_attention)" if why is None else
                 f"attention at {dtype}: paddle, the ops/ reference (block_multihead_attention: {why})")

    def prepare_model(self, model, dtype: str) -> None:
        cast_model(model, dtype)

    def free_memory_bytes(self) -> int:
        import paddle
        cuda = paddle.device.cuda
        total = int(cuda.get_device_properties(0).total_memory)
        return max(0, total - int(max(cuda.memory_reserved(0), cuda.memory_allocated(0))))

    def profile_peak_bytes(self, run) -> int:
        import paddle
        cuda = paddle.device.cuda
        cuda.reset_max_memory_allocated(0)
        before = int(cuda.memory_allocated(0))
        run()
        cuda.synchronize(0)
        return max(0, int(cuda.max_memory_allocated(0)) - before)

    def describe(self) -> str:
        import paddle
        return f"cuda ({paddle.device.cuda.get_device_name(0)})"


@hookimpl
def fdx_register_backends(register):
    register("cuda", CudaBackend)
