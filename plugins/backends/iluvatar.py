"""The Iluvatar backend: Paddle's ``iluvatar_gpu`` custom device (CoreX)."""
from __future__ import annotations

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Backend

DEVICE = "iluvatar_gpu"


class IluvatarBackend(Backend):
    name = "iluvatar"
    priority = 5
    attention_backend = "paddle"   # GPU-capable Paddle reference; never the CPU kernel
    sampler = "host"
    model_runner = "default"
    dtypes = ("float32",)

    @classmethod
    def is_available(cls) -> bool:
        try:
            import paddle
            return DEVICE in paddle.device.get_all_custom_device_type()
        except Exception:
            return False

    def setup(self, config) -> None:
        import paddle
        paddle.set_device(f"{DEVICE}:0")

    def free_memory_bytes(self) -> int:
        import paddle
        return int(paddle.device.get_device_properties(f"{DEVICE}:0").total_memory * 0.9)


@hookimpl
def fdx_register_backends(register):
    register("iluvatar", IluvatarBackend)
