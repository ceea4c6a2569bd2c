"""Quantized weights kept as their blocks, and the products that read them.

This module is the seam between the weight-format plugins (which decide how
a linear layer's weights are stored, loaded and sharded) and the kernels
(which multiply by them). A ``QuantizedTensor`` holds a 2-D weight in numpy
order, ``[rows, cols]`` = HF's ``[out_features, in_features]``, exactly as
its format stores it:

- the GGML kinds (``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``,
  ``q4_k``, ``q5_k``, ``q6_k``, ...) as GGUF's raw bytes, one row of
  ``cols`` elements per output, blocks along ``cols``: ``data`` is uint8
  ``[rows, row_bytes]``;
- ``wint8``: int8 ``[rows, cols]`` with one float32 scale per row
  (FastDeploy's weight-only int8, per channel);
- ``wint4``: two 4-bit values a byte, ``[rows, cols // 2]`` uint8 (low
  nibble first, stored as value + 8), float32 scales ``[rows, cols //
  group_size]`` (per group).

Row operations (llama.cpp's Q/K un-permutation, column-parallel shards) are
row gathers on the raw bytes and never dequantize. A split along ``cols``
(row-parallel shards) is only possible on whole blocks.

``matmul`` and ``embedding`` choose their kernel from the active kernel
table (``fdx.core.kernels``); the reference path, which the probes compare
the kernels with, dequantizes with the ``gguf`` package (or numpy for the
wint kinds) and multiplies in Paddle fp32.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle
from paddle import Tensor

from fdx.core import kernels

WINT_KINDS = ("wint8", "wint4")

# Row-interleaved (repacked) layout: the kinds whose compiled products read their
# blocks four rows at a time from one stream (csrc/quant_kernels.h, kInterleave).
# A weight of these kinds whose rows are a multiple of INTERLEAVE is rewritten in
# place the first time the compiled kernels take it (``tensors()``, at load:
# ``prepare()``); any other (rows not a multiple of 4, a read-only buffer, another
# kind) keeps the plain layout. FDX_REPACK=0 turns it off (for benchmarks).
# REPACK_KINDS are listed where the interleaved tiles measured at least as fast as the
# plain ones on every machine tried (docs/benchmarks.md). PROBED_REPACK_KINDS (q4_0:
# 0.88-0.93x at one 2048x2048 row on a Zen 4 with the 256-bit tiles; wint4, q2_k, q3_k) are
# interleaved only where this machine's probe measured the interleaved layout faster
# for the build that runs (the kernel-table entry ``cpp.<kind>_interleave[.build]``,
# fdx.ops.probes: both layouts timed once, cached with the table; its finding says
# why not). FDX_REPACK=all interleaves them regardless (benchmarks, tests).
INTERLEAVE = 4
REPACK_KINDS = ("q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "wint8")
PROBED_REPACK_KINDS = ("q4_0", "wint4", "q2_k", "q3_k")


def interleave_kernel_name(kind: str, variant: str) -> str:
    """The kernel-table name of the per-machine layout choice for ``kind`` in one
    build: ``cpp.q4_0_interleave.avx512`` (usable: the interleaved layout measured faster)."""
    from fdx.ops import cpp

    return cpp.quant_kernel_name(kind, variant).replace("_matmul", "_interleave")


def interleave_chosen(kind: str) -> bool:
    """Whether ``kind`` is interleaved under the active kernel table: always for
    REPACK_KINDS; for PROBED_REPACK_KINDS where the probe chose it for the build
    ``matmul`` runs (or FDX_REPACK=all)."""
    import os

    if kind in REPACK_KINDS:
        return True
    if kind not in PROBED_REPACK_KINDS:
        return False
    if os.environ.get("FDX_REPACK") == "all":
        return True
    from fdx.ops import cpp

    table = kernels.active()
    for variant in cpp.QUANT_VARIANTS:          # matmul's order (KERNELS): the widest usable build
        if table.usable(cpp.quant_kernel_name(kind, variant)):
            return table.usable(interleave_kernel_name(kind, variant))
    return False


def ggml_type(kind: str):
    """The gguf package's enum member for a lower-case GGML kind name."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType[kind.upper()]
    except KeyError:
        raise ValueError(f"unknown quantized kind {kind!r}") from None


def block_shape(kind: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML kind."""
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[ggml_type(kind)]


@dataclass(eq=False)
class QuantizedTensor:
    kind: str
    shape: tuple[int, int]
    data: np.ndarray
    scales: np.ndarray | None = None
    group_size: int = 0
    interleaved: bool = False          # data in the repacked layout (see REPACK_KINDS)
    _tensors: tuple | None = field(default=None, init=False, repr=False)
    _layout: bool | None = field(default=None, init=False, repr=False)   # prepare(interleave=...)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + (0 if self.scales is None else self.scales.nbytes))

    def plain_data(self, rows: np.ndarray | None = None) -> np.ndarray:
        """``data`` (or its rows ``rows``) in the plain layout, one row after
        another: ``data`` itself when not interleaved, else a copy."""
        if not self.interleaved:
            return self.data if rows is None else self.data[rows]
        block = self._block_bytes()
        n = self.data.shape[1] // block
        groups = self.data.reshape(-1, n, INTERLEAVE, block)            # [row groups, blocks, 4, block bytes]
        if rows is None:
            return np.ascontiguousarray(groups.transpose(0, 2, 1, 3)).reshape(self.data.shape)
        rows = np.asarray(rows).reshape(-1)
        return np.ascontiguousarray(groups[rows // INTERLEAVE, :, rows % INTERLEAVE]).reshape(rows.size, -1)

    def _block_bytes(self) -> int:
        if self.kind == "wint8":
            return 32
        if self.kind == "wint4":
            return 16
        return block_shape(self.kind)[1]

    def repack(self, always: bool = False) -> bool:
        """Rewrite ``data`` into the interleaved layout (blocks j of rows
        4g..4g+3 next to each other), a few row groups at a time: in place (no
        second copy of the weight); True if it is (now) interleaved. A weight
        whose rows are not a multiple of INTERLEAVE or of a kind not chosen here
        (``interleave_chosen``; ``always``: any of REPACK_KINDS and
        PROBED_REPACK_KINDS) keeps the plain layout. A read-only buffer (a GGUF
        file's memmap) is read once into one new buffer in the interleaved
        layout, and each ~1 MiB of the file's pages is let go of as soon as it is
        copied (``_release_file_pages``): one copy resident, not two."""
        if self.interleaved:
            return True
        data = self.data
        chosen = self.kind in REPACK_KINDS + PROBED_REPACK_KINDS if always else interleave_chosen(self.kind)
        if not chosen or self.shape[0] % INTERLEAVE or not data.flags.c_contiguous or data.ndim != 2:
            return False
        out = data if data.flags.writeable else np.empty(data.shape, np.uint8)
        block = self._block_bytes()
        n = data.shape[1] // block
        step = INTERLEAVE * max(1, (1 << 20) // max(1, INTERLEAVE * data.shape[1]))   # ~1 MiB of rows a pass
        for r0 in range(0, data.shape[0], step):
            part = data[r0:r0 + step]
            g = part.reshape(-1, INTERLEAVE, n, block)
            out[r0:r0 + step].reshape(-1, n, INTERLEAVE, block)[...] = g.transpose(0, 2, 1, 3).copy()
            if out is not data:
                _release_file_pages(part)
        self.data = out
        self.interleaved = True
        return True

    def dequantize(self, rows: np.ndarray | None = None) -> np.ndarray:
        """float32 ``[len(rows) or rows, cols]``: the reference values."""
        data = self.plain_data(rows)
        scales = None if self.scales is None else (self.scales if rows is None else self.scales[rows])
        if self.kind == "wint8":
            return data.astype(np.float32) * scales[:, None]
        if self.kind == "wint4":
            low = (data & 0x0F).astype(np.int8) - 8
            high = (data >> 4).astype(np.int8) - 8
            q = np.stack([low, high], axis=-1).reshape(data.shape[0], -1).astype(np.float32)
            return (q.reshape(q.shape[0], -1, self.group_size) * scales[:, :, None]).reshape(q.shape)
        from gguf.quants import dequantize

        return np.ascontiguousarray(dequantize(data, ggml_type(self.kind)), dtype=np.float32)

    def prepare(self, interleave: bool | None = None) -> "QuantizedTensor":
        """Make the Paddle views the compiled kernels read (once, at load:
        ``data`` and ``scales`` must not be replaced afterwards); returns self.
        ``interleave``: None, the layout ``tensors()`` chooses; True, interleaved
        wherever the weight allows (``repack(always=True)``); False, plain
        (benchmarks, the layout probe)."""
        if self._tensors is None:
            self._layout = interleave
        self.tensors()
        return self

    def tensors(self) -> tuple[Tensor, Tensor | None]:
        """(data, scales) as Paddle CPU tensors over this tensor's own memory
        (DLPack, no copy), made on first use and kept."""
        if self._tensors is None:
            import os

            from paddle.utils.dlpack import from_dlpack

            self.data = np.ascontiguousarray(self.data)
            if self._layout is not None:
                if self._layout:
                    self.repack(always=True)
            elif os.environ.get("FDX_REPACK", "1") != "0":
                self.repack()
            scales = None
            if self.scales is not None:
                self.scales = np.ascontiguousarray(self.scales, dtype=np.float32)
                scales = from_dlpack(self.scales)
            self._tensors = (from_dlpack(self.data), scales)
        return self._tensors

    def take_rows(self, index: np.ndarray) -> "QuantizedTensor":
        """The rows ``index`` (a permutation or a shard), still quantized."""
        index = np.asarray(index)
        return QuantizedTensor(self.kind, (int(index.size), self.shape[1]),
                               self.plain_data(index) if self.interleaved else np.ascontiguousarray(self.data[index]),
                               None if self.scales is None else np.ascontiguousarray(self.scales[index]),
                               self.group_size)


def _release_file_pages(a: np.ndarray) -> None:
    """Drop the whole pages under ``a`` from this process's resident set when ``a``
    is a view of a file mapping (np.memmap, mmap): the file's bytes stay in the
    page cache and are read again if ever touched (a read-only mapping: nothing
    is lost). Anything else: nothing."""
    import ctypes
    import mmap

    base = a
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    if base is None:
        return
    page = mmap.PAGESIZE
    start = -(-a.ctypes.data // page) * page
    stop = (a.ctypes.data + a.nbytes) // page * page
    if stop > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), 4)   # MADV_DONTNEED


# --- quantizing on load (wint8 / wint4 of an fp32 checkpoint) ------------------------------

def quantize_wint8(w: np.ndarray) -> QuantizedTensor:
    """Symmetric per-row int8: scale = max|row| / 127."""
    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(axis=1) / 127.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return QuantizedTensor("wint8", w.shape, q, scale.astype(np.float32))


def quantize_wint4(w: np.ndarray, group_size: int = 128) -> QuantizedTensor:
    """Symmetric per-group int4 in [-7, 7] (stored + 8), two a byte."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    if cols % group_size or group_size % 2:
        raise ValueError(f"wint4: {cols} columns are not a whole number of groups of {group_size}")
    g = w.reshape(rows, cols // group_size, group_size)
    scale = np.abs(g).max(axis=2) / 7.0
    scale[scale == 0] = 1.0
    q = (np.clip(np.rint(g / scale[:, :, None]), -7, 7).astype(np.int8) + 8).astype(np.uint8)
    q = q.reshape(rows, cols // 2, 2)
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).astype(np.uint8)
    return QuantizedTensor("wint4", (rows, cols), packed, scale.astype(np.float32), group_size)


# --- products ----------------------------------------------------------------------------

def reference_matmul(x: Tensor, w: QuantizedTensor) -> Tensor:
    """``x [M, cols] @ w.T -> [M, rows]`` on dequantized fp32 values."""
    return paddle.matmul(x, paddle.to_tensor(w.dequantize()), transpose_y=True)


def matmul(x: Tensor, w: QuantizedTensor) -> Tensor:
    """``x [M, cols] @ w.T -> [M, rows]``, by the best of ``w.kind``'s kernels
    that the active table probed good, else the reference."""
    table = kernels.active()
    for name, fn in KERNELS.get(w.kind, ()):
        if table.usable(name):
            out = fn(x, w)                  # None: a shape the kernels cannot take (no whole blocks)
            if out is not None:
                return out
            break
    return reference_matmul(x, w)


def embedding(ids: np.ndarray, w: QuantizedTensor) -> Tensor:
    """Rows ``ids`` of a quantized table, as fp32 ``[len(ids), cols]``."""
    ids = np.asarray(ids).reshape(-1)
    if w.kind == "q8_0":        # the common tied table: its few rows without gguf's generic path (~10x)
        return paddle.to_tensor(q8_0_rows(w.plain_data(ids), np.arange(ids.size)))
    return paddle.to_tensor(w.dequantize(ids))


def q8_0_rows(data: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of q8_0 blocks (34 bytes: a float16 scale d, 32 int8 q; w = d * q) as float32."""
    blocks = data[ids].reshape(len(ids), -1, 34)
    d = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).astype(np.float32)
    return (d * blocks[:, :, 2:].view(np.int8)).reshape(len(ids), -1)


# kind -> its kernels, best first: (kernel-table name, function(x, w) -> Tensor, or None
# for a shape it cannot take).
# Each name also needs a probe in fdx.ops.probes and a place in the backend's
# list of kernels it probes (fdx.plugins.backends.cpu).
KERNELS: dict[str, tuple[tuple[str, object], ...]] = {}


def _register_compiled() -> None:
    from fdx.ops import cpp

    for kind in cpp.QUANT_KINDS:          # one build per instruction set, the widest first
        KERNELS[kind] = tuple((cpp.quant_kernel_name(kind, v), cpp.QUANT_MATMULS[v]) for v in cpp.QUANT_VARIANTS)


_register_compiled()
