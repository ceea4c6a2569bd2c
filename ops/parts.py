"""A fused weight's parts in one compiled product (csrc/fused_parts.h).

A fused q/k/v or gate/up whose parts a file stores in different GGML kinds
(Q4_K_M: q and k in Q4_K, v in Q6_K) is a ``RowStack``; multiplied part by
part, each part's product quantized the same activation rows again and ran
an op call of its own, then a concat. ``matmul`` runs them in one call
(``fdx_parts_matmul``): each row quantized once per activation form the
parts take (int8 per 32 for q8_0, q4_0/1, q5_0/1; int8 per 256 with per-16
sums for q4_k, q5_k, q6_k), then each part's product in its own columns of
the stacked output, by the same kernels and order as its own product (so
the same bits: tests/test_fused_parts.py).

Kernel-table names ``cpp.parts_matmul`` (portable), ``.avx2``, ``.avx512``
(probes in fdx.ops.probes); a build is used only where the table also
passed every part's own product in that build. None (the caller multiplies
part by part) for anything else: a part that is not GGML blocks, a kind
the entry does not know, or a row count from which a part's own product
would dequantize and use BLAS (``cpp.quant_blas_min_rows``, outside
backend.batch_invariant).
"""
from __future__ import annotations

from typing import Sequence

import paddle
from paddle import Tensor

from fdx.core import kernels
from fdx.ops import cpp

__all__ = ["PARTS_KERNEL_NAMES", "PARTS_KINDS", "matmul", "parts_kernel_name"]

PARTS_KINDS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")   # = kind < kWint8 (fused_parts.h)
MAX_PARTS = 3                                                                      # = kMaxFusedParts


def parts_kernel_name(variant: str) -> str:
    """``cpp.parts_matmul`` (portable), ``cpp.parts_matmul.avx2``, ``cpp.parts_matmul.avx512``."""
    return "cpp.parts_matmul" + ("" if variant == "portable" else f".{variant}")


PARTS_KERNEL_NAMES = tuple(parts_kernel_name(v) for v in ("portable", "avx2", "avx512"))   # AVX-512 probed last


def takes(parts: Sequence) -> bool:
    """Whether the entry takes these parts (fdx.ops.quant.QuantizedTensor each):
    two to MAX_PARTS of PARTS_KINDS, whole blocks, the same columns."""
    return (2 <= len(parts) <= MAX_PARTS and all(getattr(q, "kind", None) in PARTS_KINDS for q in parts)
            and len({q.shape[1] for q in parts}) == 1 and all(cpp.quant_supported(q) for q in parts))


@kernels.implements(*PARTS_KERNEL_NAMES)
def matmul(x: Tensor, parts: Sequence, variant: str | None = None) -> Tensor | None:
    """``x [..., cols] @ [parts stacked along rows].T -> [..., sum of rows]``,
    or None where the caller multiplies part by part (the module's text).
    ``variant``: that build, unchecked (the probes and tests)."""
    if x.dtype != paddle.float32 or not cpp.loaded() or not takes(parts):
        return None
    table = kernels.active()
    if variant is None:
        variant = next((v for v in cpp.QUANT_VARIANTS if table.usable(parts_kernel_name(v))
                        and all(table.usable(cpp.quant_kernel_name(q.kind, v)) for q in parts)), None)
        if variant is None:
            return None
    x2 = cpp._rows(x)
    invariant = table.batch_invariant
    if not invariant:
        for q in parts:
            blas = cpp.quant_blas_min_rows(q.kind, variant)
            if blas is not None and x2.shape[0] >= blas:
                return None
    datas = [q.tensors()[0] for q in parts]
    out = cpp._module_or_raise().fdx_parts_matmul(
        x2, datas, [cpp.quant_code(q, invariant) for q in parts], [int(q.shape[0]) for q in parts],
        int(parts[0].shape[1]), cpp._VARIANT_CODE[variant])
    return out if len(x.shape) == 2 else out.reshape(x.shape[:-1] + [out.shape[-1]])

