"""The CPU backend: Paddle on the host, fp32, threads set to the cores we have."""
from __future__ import annotations

import logging
import os

from fdx.core.hookspecs import hookimpl
from fdx.core.host import available_cores
from fdx.core.interfaces import Backend

log = logging.getLogger("fdx.backends.cpu")


def host_free_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


class CpuBackend(Backend):
    name = "cpu"
    priority = 0
    attention_backend = "cpu"   # the compiled CPU kernel, Paddle fallback
    sampler = "host"
    model_runner = "default"
    dtypes = ("float32",)

    @classmethod
    def is_available(cls) -> bool:
        return True

    def setup(self, config) -> None:
        threads = config.backend.num_threads or available_cores()
        # Paddle sets OMP_NUM_THREADS=1 on import; the OpenMP runtime reads
        # it when it starts (first parallel region, after this), and
        # set_num_threads sets MKL's and OpenMP's count directly.
        import paddle
        os.environ["OMP_NUM_THREADS"] = str(threads)
        paddle.set_device("cpu")
        paddle.base.core.set_num_threads(threads)
        self.num_threads = threads

    def free_memory_bytes(self) -> int:
        return host_free_memory_bytes()

    def describe(self) -> str:
        return f"cpu ({getattr(self, 'num_threads', '?')} threads, fp32)"


@hookimpl
def fdx_register_backends(register):
    register("cpu", CpuBackend)
