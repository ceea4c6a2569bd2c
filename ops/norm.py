"""RMS norm, with an optional fused residual add.

On CPU, once the compiled kernels are built or loaded (fdx.ops.cpp.prepare(),
which the ``cpu`` attention backend runs at start-up), float32 tensors of at
least CPP_MIN_ROWS rows take the compiled kernel (csrc/fused_kernels.h: the
residual add, the norm and both outputs in one pass). Else Paddle's
``fused_rms_norm`` (one kernel on CPU and on CUDA builds); a device without
it (some custom devices) switches to the composed reference with
``use_fused(False)``, which its backend does at start-up after probing the
kernel.
"""
import paddle
import paddle.incubate.nn.functional as IF

from fdx.ops import cpp

__all__ = ["rms_norm", "add_rms_norm", "use_fused"]

_fused = False


def use_fused(enabled: bool) -> None:
    """Choose Paddle's fused kernel (True) or the composed ops (False)."""
    global _fused
    _fused = bool(enabled)


# Rows from which the compiled kernel wins: below, Paddle's custom-op call
# (about 7 us more than a built-in op's) costs more than the kernel saves
# (python -m fdx.ops.bench_kernels: 0.7x at 1 row, 1.7x at 64).
CPP_MIN_ROWS = 32


def _impl(x: paddle.Tensor, impl: str | None) -> str:
    if impl is None:
        if (cpp.loaded() and x.dtype == paddle.float32 and x.place.is_cpu_place()
                and x.shape[0] >= CPP_MIN_ROWS):
            return "cpp"
        return "fused" if _fused else "reference"
    if impl not in ("cpp", "fused", "reference"):
        raise ValueError(f"unknown rms_norm impl {impl!r}; expected 'cpp', 'fused' or 'reference'")
    return impl


def _reference(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    xf = x.astype("float32")
    out = xf * paddle.rsqrt(paddle.mean(xf * xf, axis=-1, keepdim=True) + eps)
    return (out * weight.astype("float32")).astype(x.dtype)


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float, impl: str | None = None) -> paddle.Tensor:
    """x * rsqrt(mean(x^2, last dim) + eps) * weight; x is [..., H], weight [H].

    impl: "cpp" (compiled; float32 CPU tensors), "fused" (Paddle's
    fused_rms_norm), "reference" (composed ops) or None (see the module
    docstring). Never starts a build."""
    impl = _impl(x, impl)
    if impl == "cpp":
        return cpp.rms_norm(x, weight, eps)
    if impl == "reference":
        return _reference(x, weight, eps)
    return IF.fused_rms_norm(x, weight, None, eps, x.ndim - 1)[0]


def add_rms_norm(
    x: paddle.Tensor, residual: paddle.Tensor, weight: paddle.Tensor, eps: float, impl: str | None = None
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); impl as in rms_norm."""
    impl = _impl(x, impl)
    if impl == "cpp":
        return cpp.add_rms_norm(x, residual, weight, eps)
    if impl == "reference":
        summed = x + residual
        return _reference(summed, weight, eps), summed
    out, summed = IF.fused_rms_norm(x, weight, None, eps, x.ndim - 1, residual=residual)
    return out, summed
