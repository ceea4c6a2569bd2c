"""RMS norm, with an optional fused residual add.

Which kernel runs comes from the backend's probed table
(``fdx.core.kernels``): float32 CPU tensors of at least CPP_MIN_ROWS rows
take the compiled kernel when ``cpp.add_rms_norm`` / ``cpp.rms_norm``
passed (csrc/fused_kernels.h: the residual add, the norm and both outputs
in one pass); else Paddle's ``fused_rms_norm`` when it passed (on some
CPUs it dies by SIGILL: its probe finds that out in a child process); else
the composed reference.
"""
import paddle
import paddle.incubate.nn.functional as IF

from fdx.core import kernels
from fdx.ops import cpp

__all__ = ["rms_norm", "add_rms_norm", "CPP_MIN_ROWS"]

# Rows from which the compiled kernel beats Paddle's fused_rms_norm: below,
# Paddle's custom-op call (about 7 us more than a built-in op's) costs more
# than the kernel saves (python -m fdx.plugins.backends.bench_kernels: 0.7x
# at 1 row, 1.7x at 64). Where fused_rms_norm did not pass (it dies by SIGILL
# on CPUs without AVX-512), the compiled kernel takes every row count: the
# composed reference is ten Paddle ops (about 0.6 ms at one row).
CPP_MIN_ROWS = cpp.RMS_NORM_CPP_MIN_ROWS   # 32, kept in fdx.ops.cpp (its row-invariant step counts it)


def _impl(x: paddle.Tensor, impl: str | None, cpp_name: str) -> str:
    if impl is None:
        table = kernels.active()
        fused = table.usable("fused_rms_norm")
        # backend.batch_invariant: the compiled kernel at every row count (the decoder layer's)
        if ((x.shape[0] >= CPP_MIN_ROWS or not fused or table.batch_invariant) and table.usable(cpp_name)
                and cpp.loaded()
                and x.dtype == paddle.float32 and x.place.is_cpu_place()):
            return "cpp"
        return "fused" if fused else "reference"
    if impl not in ("cpp", "fused", "reference"):
        raise ValueError(f"unknown rms_norm impl {impl!r}; expected 'cpp', 'fused' or 'reference'")
    return impl


def _reference(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    xf = x if x.dtype == paddle.float32 else x.astype("float32")
    out = xf * paddle.rsqrt(paddle.mean(xf * xf, axis=-1, keepdim=True) + eps)
    out = out * (weight if weight.dtype == paddle.float32 else weight.astype("float32"))
    return out if x.dtype == paddle.float32 else out.astype(x.dtype)


@kernels.implements("fused_rms_norm")
def _fused(x: paddle.Tensor, weight: paddle.Tensor, eps: float, residual: paddle.Tensor | None = None):
    return IF.fused_rms_norm(x, weight, None, eps, x.ndim - 1, residual=residual)


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float, impl: str | None = None) -> paddle.Tensor:
    """x * rsqrt(mean(x^2, last dim) + eps) * weight; x is [..., H], weight [H].

    impl: "cpp" (compiled; float32 CPU tensors), "fused" (Paddle's
    fused_rms_norm), "reference" (composed ops) or None (the probed table
    decides, see the module docstring). Never starts a build."""
    impl = _impl(x, impl, "cpp.rms_norm")
    if impl == "cpp":
        return cpp.rms_norm(x, weight, eps)
    if impl == "reference":
        return _reference(x, weight, eps)
    return _fused(x, weight, eps)[0]


def add_rms_norm(
    x: paddle.Tensor, residual: paddle.Tensor, weight: paddle.Tensor, eps: float, impl: str | None = None
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); impl as in rms_norm."""
    impl = _impl(x, impl, "cpp.add_rms_norm")
    if impl == "cpp":
        return cpp.add_rms_norm(x, residual, weight, eps)
    if impl == "reference":
        summed = x + residual
        return _reference(summed, weight, eps), summed
    out, summed = _fused(x, weight, eps, residual)
    return out, summed
