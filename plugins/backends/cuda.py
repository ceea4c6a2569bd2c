"""The CUDA backend: Paddle on an NVIDIA GPU (needs paddlepaddle-gpu).

The models and ops are device-agnostic Paddle code; this backend selects
the GPU and reports its free memory for KV sizing. The compiled CPU
attention kernel is not used here.
"""
from __future__ import annotations

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Backend


class CudaBackend(Backend):
    name = "cuda"
    priority = 10
    attention_backend = "paddle"   # GPU-capable Paddle reference; never the CPU kernel
    sampler = "host"
    model_runner = "default"
    dtypes = ("float32",)

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

    def free_memory_bytes(self) -> int:
        import paddle
        props = paddle.device.cuda.get_device_properties(0)
        used = paddle.device.cuda.memory_reserved(0)
        return int(props.total_memory - used)

    def describe(self) -> str:
        import paddle
        return f"cuda ({paddle.device.cuda.get_device_name(0)})"


@hookimpl
def fdx_register_backends(register):
    register("cuda", CudaBackend)
