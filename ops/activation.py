"""Gated activations.

On CPU, once the compiled kernels are built or loaded (fdx.ops.cpp.prepare(),
which the ``cpu`` attention backend runs at start-up), ``silu_and_mul`` runs
the compiled kernel (csrc/fused_kernels.h: one pass, no zero fill); else,
and on every other device, Paddle's fused ``swiglu``.
"""
import paddle
import paddle.nn.functional as F

from fdx.ops import cpp

__all__ = ["silu_and_mul"]


def silu_and_mul(x: paddle.Tensor, impl: str | None = None) -> paddle.Tensor:
    """[N, 2I] -> [N, I]: silu(x[:, :I]) * x[:, I:].

    impl: "cpp" (the compiled kernel; float32 CPU tensors), "paddle", or
    None: "cpp" when the compiled kernels are loaded and x is a float32 CPU
    tensor, else "paddle". Never starts a build."""
    if impl is None:
        impl = "cpp" if cpp.loaded() and x.dtype == paddle.float32 and x.place.is_cpu_place() else "paddle"
    if impl == "cpp":
        return cpp.silu_and_mul(x)
    if impl != "paddle":
        raise ValueError(f"unknown silu_and_mul impl {impl!r}; expected 'cpp' or 'paddle'")
    return F.swiglu(x)
