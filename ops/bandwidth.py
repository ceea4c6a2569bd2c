"""The memory read rate of the compiled kernels' threads (fdx.ops.cpp.read_bandwidth),
importable without Paddle: ``python -m fdx.ops.bandwidth LIBRARY THREADS MIB ROUNDS``
prints it from a process of its own, whose buffer is not on the caller's
resident high-water mark."""
from __future__ import annotations

import ctypes
import sys


def read_bandwidth(library: str, threads: int, mib: int, rounds: int) -> float:
    """GB/s, best of ``rounds``, at which ``threads`` OpenMP threads of the
    compiled kernels' ``library`` read a buffer of ``mib`` MiB together."""
    fn = ctypes.CDLL(library).fdx_read_bandwidth
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_double
    import numpy as np
    buf = np.ones(mib << 20, dtype=np.uint8)           # written: every page resident before the timing
    return float(fn(buf.ctypes.data, buf.nbytes, threads, rounds))


if __name__ == "__main__":
    print(read_bandwidth(sys.argv[1], *map(int, sys.argv[2:5])))
