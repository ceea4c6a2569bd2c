"""The CUDA backend: Paddle on an NVIDIA GPU (needs paddlepaddle-gpu: the
``gpu`` extra, see docs/backends.md).

- dtype: bfloat16 on compute capability 8.0 and up, else float16 (float32
  on request); the KV cache in the model's dtype.
- kernels: Paddle's fused GPU kernels are probed at start-up
  (``fdx.plugins.backends.gpu``); fused_rms_norm runs where present,
  attention is the device-agnostic Paddle reference (``paddle`` attention
  backend), never the compiled CPU kernel.
- memory: free = total - what Paddle's allocator reserved; KV sizing
  profiles one forward with the allocator's high-water mark.

Only ever run against a fake device layer (tests/test_backends.py): no
GPU with paddlepaddle-gpu was reachable from where fdx is built.
"""
from __future__ import annotations

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Backend
from fdx.plugins.backends.gpu import cast_model, probe_kernels

KERNELS = ("fused_rms_norm", "fused_rotary_position_embedding",
           "variable_length_memory_efficient_attention", "block_multihead_attention")


class CudaBackend(Backend):
    name = "cuda"
    priority = 10
    attention_backend = "paddle"   # GPU-capable Paddle reference; never the CPU kernel
    sampler = "host"
    model_runner = "default"
    dtypes = ("bfloat16", "float16", "float32")

    def __init__(self, settings=None):
        super().__init__(settings)
        import paddle
        major, _ = paddle.device.cuda.get_device_capability(0)
        if major < 8:                              # no bfloat16 before Ampere
            self.dtypes = ("float16", "float32")
        self.kernels: dict[str, str | None] = {}

    @classmethod
    def is_available(cls) -> bool:
        try:
            import paddle
            return bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0
        except Exception:
            return False

    def setup(self, config) -> None:
        import paddle
        paddle.set_device("gpu:0")
        self.kernels = probe_kernels(self.name, KERNELS)

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
