"""Gated activations.

Which kernel runs comes from the backend's probed table
(``fdx.core.kernels``): the compiled kernel when ``cpp.silu_and_mul``
passed (float32 CPU tensors; csrc/fused_kernels.h: one pass, no zero
fill), else Paddle's fused ``swiglu`` when it passed, else the composed
reference (silu(a) * b).
"""
import paddle
import paddle.nn.functional as F

from fdx.core import kernels
from fdx.ops import cpp

__all__ = ["silu_and_mul"]


@kernels.implements("swiglu")
def _swiglu(x: paddle.Tensor) -> paddle.Tensor:
    return F.swiglu(x)


def _reference(x: paddle.Tensor) -> paddle.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def silu_and_mul(x: paddle.Tensor, impl: str | None = None) -> paddle.Tensor:
    """[N, 2I] -> [N, I]: silu(x[:, :I]) * x[:, I:].

    impl: "cpp" (the compiled kernel; float32 CPU tensors), "paddle"
    (Paddle's swiglu), "reference" (composed ops), or None: the probed
    table decides (see the module docstring). Never starts a build."""
    if impl is None:
        table = kernels.active()
        if (table.usable("cpp.silu_and_mul") and cpp.loaded() and x.dtype == paddle.float32
                and x.place.is_cpu_place()):
            impl = "cpp"
        else:
            impl = "paddle" if table.usable("swiglu") else "reference"
    if impl == "cpp":
        return cpp.silu_and_mul(x)
    if impl == "paddle":
        return _swiglu(x)
    if impl != "reference":
        raise ValueError(f"unknown silu_and_mul impl {impl!r}; expected 'cpp', 'paddle' or 'reference'")
    return _reference(x)
