"""The Iluvatar backend: Paddle's ``iluvatar_gpu`` custom device (CoreX).

- dtype: float16 (float32 on request), the KV cache in the model's dtype.
- kernels: the subset Paddle's iluvatar plugin provides is probed at
  start-up (fused_rms_norm and fused rotary, used where present; the attention kernels
  FastDeploy brings for this device are its own compiled ops, which fdx
  does not have): attention is the Paddle reference.
- sampling: the ``device`` sampler (only ids and requested logprobs come back).
- memory: the device's own query (total memory from its properties, less
  what Paddle's allocator reserved); a device that reports none is an
  error that names ``cache.num_kv_blocks``, the way around it.

Only ever run against a fake device layer (tests/test_backends.py).
"""
from __future__ import annotations

from fdx.core.config import ConfigError
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Backend
from fdx.plugins.backends.gpu import cast_model, paddle_lacks_custom_devices, probe_kernels

DEVICE = "iluvatar_gpu"
KERNELS = ("fused_rms_norm", "fused_rotary_position_embedding")


class IluvatarBackend(Backend):
    name = "iluvatar"
    priority = 5
    attention_backend = "paddle"   # GPU-capable Paddle reference; never the CPU kernel
    sampler = "device"             # logits stay on the device
    model_runner = "default"
    dtypes = ("float16", "float32")

    @classmethod
    def is_available(cls) -> bool:
        if paddle_lacks_custom_devices():      # known without loading Paddle
            return False
        try:
            import paddle
            return DEVICE in paddle.device.get_all_custom_device_type()
        except Exception:
            return False

    def setup(self, config) -> None:
        import paddle
        paddle.set_device(f"{DEVICE}:0")
        self.kernels = probe_kernels(self.name, KERNELS)

    def prepare_model(self, model, dtype: str) -> None:
        cast_model(model, dtype)

    def free_memory_bytes(self) -> int:
        import paddle
        device = f"{DEVICE}:0"
        total = int(getattr(paddle.device.get_device_properties(device), "total_memory", 0) or 0)
        if total <= 0:
            raise ConfigError(f"config key 'cache.num_kv_blocks': the {DEVICE} device reports no memory "
                              "(total_memory is 0), so the KV cache cannot be sized from it; set "
                              "cache.num_kv_blocks")
        return max(0, total - int(paddle.device.max_memory_reserved(device)))

    def profile_peak_bytes(self, run) -> int:
        import paddle
        device = f"{DEVICE}:0"
        paddle.device.reset_max_memory_allocated(device)
        before = int(paddle.device.max_memory_allocated(device))
        run()
        paddle.device.synchronize(device)
        return max(0, int(paddle.device.max_memory_allocated(device)) - before)


@hookimpl
def fdx_register_backends(register):
    register("iluvatar", IluvatarBackend)
