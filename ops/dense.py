"""Products with float32 ``[in, out]`` weights (the ``none`` format's linears
and tied LM head): from fdx.ops.cpp.F32_MIN_ROWS to fewer than
f32_blas_min_rows(build) activation rows the compiled product (csrc/f32_kernels.h: the weight streamed once over
the threads) in the widest build the active kernel table passed, else
Paddle's matmul (MKL sgemm), which is also the probes' reference.
``lora_matmul``: the LoRA adapters' shrink and expand; under
backend.batch_invariant the compiled product at every row count (a row's
bits independent of the other rows)."""
from __future__ import annotations

import paddle
from paddle import Tensor

from fdx.core import kernels
from fdx.ops import cpp

__all__ = ["lora_matmul", "matmul"]


def matmul(x: Tensor, w: Tensor) -> Tensor:
    """``x [..., in] @ w [in, out]``."""
    rows = x.shape[0] if len(x.shape) == 2 else int(x.numel()) // x.shape[-1]
    if x.dtype == paddle.float32 and w.dtype == paddle.float32 and cpp.loaded() and rows >= cpp.F32_MIN_ROWS:
        table = kernels.active()
        variant = cpp.f32_build(table)
        # backend.batch_invariant: the compiled product at every row count (MKL's order depends on the rows)
        if variant is not None and (table.batch_invariant or rows < cpp.f32_blas_min_rows(variant)):
            return cpp.F32_MATMULS[variant](x, w)
    return paddle.matmul(x, w)


def lora_matmul(x: Tensor, w: Tensor) -> Tensor:
    """``x [rows, in] @ w [in, out]`` (float32), the LoRA shrink and expand
    (fdx.core.lora.StepLoRA). Under backend.batch_invariant every row's bits do
    not depend on the other rows: the compiled product (test_f32_kernels: a row
    of M equals it alone, at every M and thread count) at every row count, or
    without a compiled build one 1-row product per row. Otherwise Paddle's
    matmul: MKL, several times faster on a long prompt's rows at an adapter's
    thin shapes, its order depending on the row count (as the base products'
    is then)."""
    table = kernels.active()
    if not table.batch_invariant:
        return paddle.matmul(x, w)
    if cpp.loaded():
        variant = cpp.f32_build(table)
        if variant is not None:
            return cpp.F32_MATMULS[variant](x, w)
    if x.shape[0] <= 1:
        return paddle.matmul(x, w)
    return paddle.concat([paddle.matmul(x[i:i + 1], w) for i in range(x.shape[0])], axis=0)
