"""Products with float32 ``[in, out]`` weights (the ``none`` format's linears
and tied LM head): the compiled product (csrc/f32_kernels.h: the weight streamed
once over the threads, one reduction order for a row at every row count) in the
widest build the active kernel table passed, else Paddle's matmul (MKL sgemm),
which is also the probes' reference."""
from __future__ import annotations

import paddle
from paddle import Tensor

from fdx.core import kernels
from fdx.ops import cpp

__all__ = ["matmul"]


def matmul(x: Tensor, w: Tensor) -> Tensor:
    """``x [..., in] @ w [in, out]``."""
    if x.dtype == paddle.float32 and w.dtype == paddle.float32 and cpp.loaded():
        variant = cpp.f32_build(kernels.active())
        if variant is not None:
            return cpp.F32_MATMULS[variant](x, w)
    return paddle.matmul(x, w)
