"""A mixture-of-experts layer's routed experts in one compiled call
(csrc/moe_kernels.h, ``fdx_moe_experts``): the step's (row, slot) places
grouped by expert, each chosen expert's rows multiplied by its gate+up,
SwiGLU, its down, each through the dense path's own row kernel for the
weight format (GGUF blocks, wint8/wint4, float32), and each row's k slots
weighted and summed in slot order. Under backend.batch_invariant a row's
bits do not depend on the other rows (the row kernels' invariant path;
float32's always is).

``ExpertStack`` holds one matrix of every expert stacked, ``[E, rows,
row_bytes]`` blocks (plus scales) or float32 ``[E, in, out]``; the model
(fdx.plugins.models.moe_layers) builds it from its experts' weights.
``experts`` returns None where no build passed its probe (``cpp.moe_experts``,
``.avx2``, ``.avx512`` in the kernel table, and the format's dense kernel of
the same build): the caller then runs its per-expert loop. The probe and
the float64 reference are in fdx.ops.probes (``moe_reference``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
from paddle import Tensor

from fdx.core import kernels
from fdx.ops import cpp

__all__ = ["ExpertStack", "MOE_KERNEL_NAMES", "experts", "moe_kernel_name", "stack_from_weights"]

F32_CODE = -1                       # = fdx::moe::kF32Experts


def moe_kernel_name(variant: str) -> str:
    """``cpp.moe_experts`` (portable), ``cpp.moe_experts.avx2``, ``cpp.moe_experts.avx512``."""
    return "cpp.moe_experts" + ("" if variant == "portable" else f".{variant}")


MOE_KERNEL_NAMES = tuple(moe_kernel_name(v) for v in ("portable", "avx2", "avx512"))   # AVX-512 probed last


@dataclass(eq=False)
class ExpertStack:
    """One matrix of every expert: ``kind`` a fdx.ops.quant kind or "f32";
    ``shape`` each expert's (rows, cols) = (out, in); ``data`` uint8 ``[E,
    rows, row_bytes]`` (rows interleaved when ``interleaved``) or float32
    ``[E, cols, rows]``; ``scales`` float32 ``[E, ...]`` for wint8/wint4."""
    kind: str
    shape: tuple[int, int]
    data: np.ndarray
    scales: np.ndarray | None = None
    group_size: int = 0
    interleaved: bool = False
    _tensors: tuple | None = None

    @property
    def num_experts(self) -> int:
        return int(self.data.shape[0])

    def code(self, invariant: bool) -> int:
        if self.kind == "f32":
            return F32_CODE
        return cpp.quant_code(self, invariant)       # its kind, interleaved rows, invariant

    def dense_kernel(self, variant: str) -> str:
        """The kernel-table name of the dense product this stack's experts multiply by."""
        return cpp.f32_kernel_name(variant) if self.kind == "f32" else cpp.quant_kernel_name(self.kind, variant)

    def tensors(self) -> tuple[Tensor, Tensor | None]:
        """(data, scales) as Paddle CPU tensors over the stack's own memory (no copy)."""
        if self._tensors is None:
            from paddle.utils.dlpack import from_dlpack
            self._tensors = (from_dlpack(self.data), None if self.scales is None else from_dlpack(self.scales))
        return self._tensors

    def expert(self, e: int) -> np.ndarray:
        """Expert e's matrix, float32 ``[rows, cols]`` (the reference's values)."""
        if self.kind == "f32":
            return np.ascontiguousarray(self.data[e].T)
        from fdx.ops.quant import QuantizedTensor
        q = QuantizedTensor(self.kind, self.shape, self.data[e], None if self.scales is None else self.scales[e],
                            self.group_size, self.interleaved)
        return q.dequantize()


def build(table) -> str | None:
    """The widest build of ``fdx_moe_experts`` the kernel table ``table`` passed, or None."""
    return next((v for v in cpp.QUANT_VARIANTS if table.usable(moe_kernel_name(v))), None)


@kernels.implements(*MOE_KERNEL_NAMES)
def experts(x: Tensor, ids: np.ndarray, weights: np.ndarray, gate_up: ExpertStack, down: ExpertStack,
            variant: str | None = None) -> Tensor | None:
    """``sum_j weights[:, j] * down[ids[:, j]](silu(gate) * up)`` for x ``[N, H]``
    float32, ids int64 ``[N, k]``, weights float32 ``[N, k]``; gate_up's
    experts are ``[2I, H]`` (gate rows first), down's ``[H, I]``. None when
    no build passed its probes for both formats, or (outside
    backend.batch_invariant) when an expert has as many rows as the dense
    products give to BLAS (QUANT_BLAS_MIN_ROWS; float32: f32_blas_min_rows):
    the caller's per-expert loop then does. ``variant``: that build, unchecked
    (the probes and tests)."""
    table = kernels.active()
    variant_given = variant
    if variant is None:
        variant = next((v for v in cpp.QUANT_VARIANTS if table.usable(moe_kernel_name(v))
                        and table.usable(gate_up.dense_kernel(v)) and table.usable(down.dense_kernel(v))), None)
        if variant is None:
            return None
    if x.dtype != paddle.float32 or not cpp.loaded():
        return None
    invariant = table.batch_invariant
    if not invariant and variant_given is None:
        # as the dense products: an expert with this many rows is faster dequantized (or float32) in BLAS
        most = int(np.bincount(np.asarray(ids).reshape(-1)).max()) if np.size(ids) else 0
        for s in (gate_up, down):       # the dense products' switch points (None: this kind never goes to BLAS)
            start = cpp.f32_blas_min_rows(variant) if s.kind == "f32" else cpp.quant_blas_min_rows(s.kind, variant)
            if start is not None and most >= start:
                return None
    gu_data, gu_scales = gate_up.tensors()
    d_data, d_scales = down.tensors()
    return cpp._module_or_raise().fdx_moe_experts(
        x if x.is_contiguous() else x.contiguous(), paddle.to_tensor(np.ascontiguousarray(ids, dtype=np.int64)),
        paddle.to_tensor(np.ascontiguousarray(weights, dtype=np.float32)), gu_data, gu_scales, d_data, d_scales,
        gate_up.code(invariant), down.code(invariant), cpp._VARIANT_CODE[variant], gate_up.num_experts,
        down.shape[1], gate_up.group_size, down.group_size)


def stack_from_weights(kind: str, shape: tuple[int, int], datas: list[np.ndarray], scales: list | None,
                       group_size: int, interleaved: bool) -> ExpertStack:
    """An ExpertStack of per-expert arrays (one copy, np.stack)."""
    return ExpertStack(kind, shape, np.ascontiguousarray(np.stack(datas)),
                       None if scales is None else np.ascontiguousarray(np.stack(scales), dtype=np.float32),
                       group_size, interleaved)
