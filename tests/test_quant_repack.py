"""Repacked (row-interleaved) quantized weights and batch-invariant quantized products.

Every kind x every build this CPU runs (portable, avx2, avx512) x the plain and
the interleaved layout (issue 34 items 1-2, issue 40 item 4): the compiled
product ``fdx_quant_matmul`` called directly (the int8 path at every row count,
as ``backend.batch_invariant`` runs it) against a float64 numpy product of the
blocks dequantized by the ``gguf`` package (wint8/4: numpy), with the
activations quantized as the kernels quantize them (``int8_blocks``: per 32, per
256 for the k-quants), so the tolerance is float32 accumulation: 1e-4 of the
largest output. Then bitwise: each row computed alone equals the same row
inside every row count (1, 2, 3, 7, 8, 33, 512). A weight whose rows are not a
multiple of 4 keeps the plain layout; repacking is undone exactly.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from fdx.ops import cpp, quant
from fdx.ops.probes import act_block, int8_blocks, random_quantized
from test_contracts import cpu_kernel_table

ROW_COUNTS = (1, 2, 3, 7, 8, 33, 512)


@pytest.fixture(scope="module")
def module():
    return cpp._module_or_raise()


def _variant_ok(kind: str, variant: str) -> None:
    finding = cpu_kernel_table().findings.get(cpp.quant_kernel_name(kind, variant), "not probed")
    if finding is not None:
        pytest.skip(f"{kind} {variant} does not run here: {finding}")


def _product(module, w: quant.QuantizedTensor, x: np.ndarray, variant: str) -> np.ndarray:
    import paddle
    data, scales = w.tensors()
    code = cpp.quant_code(w, invariant=True)
    return module.fdx_quant_matmul(paddle.to_tensor(x), data, scales, code, cpp._VARIANT_CODE[variant],
                                   w.shape[0], w.shape[1], w.group_size).numpy()


@pytest.mark.parametrize("variant", cpp.QUANT_VARIANTS)
@pytest.mark.parametrize("kind", cpp.QUANT_KINDS)
def test_each_layout_and_row_count_against_numpy_and_rows_alone(module, kind, variant):
    _variant_ok(kind, variant)
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{variant}/repack".encode()))
    cols = 512
    x = rng.standard_normal((max(ROW_COUNTS), cols)).astype(np.float32)
    xq = int8_blocks(x, act_block(kind)).astype(np.float64)
    for rows, want_interleaved in ((36, kind in quant.REPACK_KINDS), (38, False)):   # 38 rows: plain
        w = random_quantized(kind, rows, cols, rng)
        values = w.dequantize().astype(np.float64)
        plain = w.data.copy()
        w.prepare()
        assert w.interleaved == want_interleaved, (kind, rows)
        if want_interleaved:
            assert not np.array_equal(w.data, plain) and np.array_equal(w.plain_data(), plain)
            assert np.array_equal(w.dequantize(), quant.QuantizedTensor(kind, w.shape, plain, w.scales,
                                                                        w.group_size).dequantize())
        alone = np.concatenate([_product(module, w, x[i:i + 1], variant) for i in range(max(ROW_COUNTS))])
        want = xq @ values.T
        scale = np.abs(want).max()
        assert np.abs(alone - want).max() <= 1e-4 * scale, f"{kind} {variant} {rows} rows"
        for m in ROW_COUNTS:
            got = _product(module, w, x[:m], variant)
            assert got.shape == (m, rows) and got.dtype == np.float32
            bad = np.flatnonzero((got != alone[:m]).any(axis=1))
            assert bad.size == 0, f"{kind} {variant} {rows} rows: rows {bad[:5]} differ from alone at M={m}"


@pytest.mark.parametrize("variant", cpp.QUANT_VARIANTS)
def test_default_path_at_many_rows_against_numpy(module, variant):
    """The default (not batch-invariant) code at every row count: from 12 rows the
    kinds with blocks of 32 take the AVX-512 VNNI tiles where the CPU has them
    (issue 34 item 3: prefill without dequantizing), another order of the float
    sums than below 12 rows, so the check is numpy's at 1e-4, and bitwise only
    among the row counts on one side (a row's bits do not depend on its tile).
    The k-quants, q4_1 and q5_1 take their VNNI tiles at every row count there;
    their 256-bit path (an AVX-512 CPU without VNNI) is checked too (kCodeRowTiles)."""
    import paddle
    _variant_ok("q8_0", variant)                            # one build for every kind
    rng = np.random.default_rng(zlib.crc32(f"{variant}/many".encode()))
    for kind in cpp.QUANT_KINDS:
        n = 256 if kind.endswith("_k") else 384 if kind == "wint4" else 352   # 11 blocks: an odd last pair
        x = rng.standard_normal((max(ROW_COUNTS), n)).astype(np.float32)
        xq = int8_blocks(x, act_block(kind)).astype(np.float64)
        for rows in (36, 38):                               # interleaved where repacked, plain
            w = random_quantized(kind, rows, n, rng).prepare()
            want = xq @ w.dequantize().astype(np.float64).T
            data, scales = w.tensors()
            got = {m: module.fdx_quant_matmul(paddle.to_tensor(x[:m]), data, scales, cpp.quant_code(w),
                                              cpp._VARIANT_CODE[variant], rows, n, w.group_size).numpy()
                   for m in ROW_COUNTS}
            for m, g in got.items():
                assert np.abs(g - want[:m]).max() <= 1e-4 * np.abs(want).max(), f"{kind} {variant} {rows} M={m}"
            assert np.array_equal(got[33], got[512][:33]), f"{kind} {variant} {rows}: 33 rows vs 512"
            assert np.array_equal(got[7], got[8][:7]) and np.array_equal(got[1], got[2][:1]), f"{kind} {variant}"
            if (kind.endswith("_k") or kind in ("q4_1", "q5_1")) and variant == "avx512":
                # the 256-bit path, which an AVX-512 CPU without VNNI takes (here: the VNNI tiles)
                code = cpp.quant_code(w) | cpp._CODE_ROW_TILES
                old = {m: module.fdx_quant_matmul(paddle.to_tensor(x[:m]), data, scales, code,
                                                  cpp._VARIANT_CODE[variant], rows, n, w.group_size).numpy()
                       for m in (1, 7, 33)}
                for m, g in old.items():
                    assert np.abs(g - want[:m]).max() <= 1e-4 * np.abs(want).max(), f"{kind} 256-bit {rows} M={m}"
                assert np.array_equal(old[1], old[7][:1]) and np.array_equal(old[7], old[33][:7]), kind


def test_take_rows_and_embedding_read_the_interleaved_layout():
    rng = np.random.default_rng(3)
    for kind in ("q8_0", "q4_k"):                 # both in REPACK_KINDS
        w = random_quantized(kind, 16, 256, rng)
        ref = w.dequantize()
        w.prepare()
        assert w.interleaved
        idx = np.array([5, 0, 15, 6])
        assert np.array_equal(w.take_rows(idx).dequantize(), ref[idx])
        assert np.array_equal(quant.embedding(idx, w).numpy(), ref[idx])
