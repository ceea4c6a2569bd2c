"""The AVX2 build's panel product (ops/csrc/panel_gemm_avx2.inc): many activation rows
against a quantized weight with maddubs, the 4- to 6-bit kinds and q2_k/q3_k, both layouts; called in
the AVX2 variant explicitly (what an AVX2-only CPU runs).

Reference: the weight dequantized by ``QuantizedTensor.dequantize`` (gguf's
dequantizer; wint4 in numpy) times x quantized as the kernels quantize it
(``int8_blocks``: per 32, per 256 for the k-quants), in float64; tolerance 1e-4 of the
largest output (float32 accumulation), as tests/test_quant_panel.py.

That the panel ran: the default call from the kind's threshold rows gives bitwise the
result of the call with kCodePanel (the panel at every row count), and other bits than
the call with kCodeNoPanel (the tiles below it; for the kinds with blocks of 32 OctMatmul
gives the panel's bits: the same integer block sums, the same order of the float sums,
checked; that kCodePanel reaches the panel shows at 1 row, where the row tiles take
another order); one row below the threshold the
default call is the kCodeNoPanel one. Under backend.batch_invariant (kCodeInvariant) and
kCodeRowTiles the panel does not run: the old paths' bits.
"""
from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

from fdx.core.host import cpu_flags
from fdx.ops import cpp
from fdx.ops.probes import act_block, int8_blocks
from test_quant_panel import product as panel_product, weight

KINDS = tuple(cpp.QUANT_AVX2_PANEL_MIN_ROWS)
CODE_NO_PANEL, CODE_PANEL, CODE_ROW_TILES = cpp._CODE_NO_PANEL, cpp._CODE_PANEL, cpp._CODE_ROW_TILES

pytestmark = pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= set(cpu_flags()),
                                reason="the AVX2 build needs AVX2, FMA and F16C")


product = functools.partial(panel_product, variant="avx2")


@pytest.mark.parametrize("interleave", [False, True], ids=["plain", "interleaved"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_avx2_panel_matches_float64_and_runs_from_its_threshold(kind, interleave):
    rng = np.random.default_rng(zlib.crc32(f"panel-avx2/{kind}/{interleave}".encode()))
    blk = act_block(kind)
    threshold = cpp.QUANT_AVX2_PANEL_MIN_ROWS[kind] or 1 << 30      # None: only with kCodePanel
    # last panels of 4 and 5 (plain) / 4 (interleaved: whole groups of 4 rows) weight rows
    for rows, cols in ((36, 256), (76 if interleave else 77, 2048)):
        w = weight(kind, rows, cols, interleave, rng)
        values = w.dequantize().astype(np.float64)
        for m in sorted({1, 16, 17, 33, 64, 512} | ({threshold - 1, threshold} if threshold <= 512 else set())):
            x = rng.standard_normal((m, cols)).astype(np.float32)
            want = int8_blocks(x, blk).astype(np.float64) @ values.T
            scale = np.abs(want).max()
            forced = product(w, x, CODE_PANEL)
            what = f"{kind} {'interleaved' if interleave else 'plain'} M={m} {rows}x{cols}"
            assert np.abs(forced - want).max() <= 1e-4 * scale, what
            got = product(w, x)
            assert np.abs(got - want).max() <= 1e-4 * scale, what
            if m >= threshold:
                np.testing.assert_array_equal(got, forced, err_msg=what)        # the panel ran
                old = product(w, x, CODE_NO_PANEL)
                assert np.abs(old - want).max() <= 1e-4 * scale, what
                if kind.endswith("_k"):
                    assert not np.array_equal(old, got), what                 # and it is not the old path
                else:   # OctMatmul: the same integer block sums, the same float order
                    np.testing.assert_array_equal(old, got, err_msg=what)
            elif m == 1 and not kind.endswith("_k"):   # the row tiles' order: kCodePanel reached the panel
                assert not np.array_equal(forced, got), what
            else:                                        # = kPanelMinRows (panel_gemm_avx2.inc): below, the old path
                np.testing.assert_array_equal(got, product(w, x, CODE_NO_PANEL), err_msg=what)


@pytest.mark.parametrize("kind", ["q4_0", "q6_k", "q5_k", "q3_k"])
def test_batch_invariant_and_row_tiles_keep_the_old_paths(kind):
    rng = np.random.default_rng(zlib.crc32(f"panel-avx2-invariant/{kind}".encode()))
    w = weight(kind, 48, 512, False, rng)
    x = rng.standard_normal((512, 512)).astype(np.float32)
    many = product(w, x, invariant=True)
    for i in (0, 17, 511):
        np.testing.assert_array_equal(product(w, x[i:i + 1], invariant=True)[0], many[i], err_msg=f"{kind} row {i}")
    panel = product(w, x)
    assert not np.array_equal(many, panel), kind   # the default path (the panel) is another order
    # kCodeRowTiles: the row tiles, with or without kCodePanel
    np.testing.assert_array_equal(product(w, x, CODE_ROW_TILES), product(w, x, CODE_ROW_TILES | CODE_PANEL))
    assert not np.array_equal(product(w, x, CODE_ROW_TILES), panel), kind


def test_the_avx2_panel_thresholds_cover_the_kinds_it_takes():
    assert set(KINDS) <= set(cpp.QUANT_KINDS) and not {"q8_0", "wint8"} & set(KINDS)
    assert all(n is None or 1 <= n <= 512 for n in cpp.QUANT_AVX2_PANEL_MIN_ROWS.values())
