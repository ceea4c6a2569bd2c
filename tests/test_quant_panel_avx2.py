"""The AVX2 build's panel product (ops/csrc/panel_gemm_avx2.inc): many activation rows
against a quantized weight with maddubs, the 4- to 6-bit kinds, q2_k/q3_k and q8_0/wint8
(the sign trick), both layouts; called in the AVX2 variant explicitly (what an AVX2-only
CPU runs).

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

q8_0 and wint8 also with weights of -128 and 127 against activation rows quantized to
+-127 of one sign (the largest pair sums maddubs sees), where a kernel that saturates its
int16 sums fails (checked with one that adds two groups in int16).
"""
from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

from fdx.core.host import cpu_flags
from fdx.ops import cpp
from fdx.ops.probes import act_block, int8_blocks, random_quantized
from test_quant_panel import invariant_rows, panel_and_default, product as panel_product, weight

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
            what = f"{kind} {'interleaved' if interleave else 'plain'} M={m} {rows}x{cols}"
            got, forced, want, scale = panel_and_default(w, x, values, blk, what, variant="avx2")
            if m >= threshold:
                np.testing.assert_array_equal(got, forced, err_msg=what)        # the panel ran
                old = product(w, x, CODE_NO_PANEL)
                assert np.abs(old - want).max() <= 1e-4 * scale, what
                if kind.endswith("_k"):
                    assert not np.array_equal(old, got), what                 # and it is not the old path
                elif m >= (32 if kind in ("q8_0", "wint8") else 16):   # OctMatmul (kOctMinRows):
                    np.testing.assert_array_equal(old, got, err_msg=what)   # the same integer block sums, float order
                else:                                    # the row tiles: another float order
                    assert not np.array_equal(old, got), what
            elif m == 1 and not kind.endswith("_k"):   # the row tiles' order: kCodePanel reached the panel
                assert not np.array_equal(forced, got), what
            else:                                        # = kPanelMinRows (panel_gemm_avx2.inc): below, the old path
                np.testing.assert_array_equal(got, product(w, x, CODE_NO_PANEL), err_msg=what)


@pytest.mark.parametrize("kind", ["q4_0", "q6_k", "q5_k", "q3_k", "q8_0", "wint8"])
def test_batch_invariant_and_row_tiles_keep_the_old_paths(kind):
    w, x, many = invariant_rows(kind, "panel-avx2-invariant", variant="avx2")
    panel = product(w, x)
    assert not np.array_equal(many, panel), kind   # the default path (the panel) is another order
    # kCodeRowTiles: the row tiles, with or without kCodePanel
    np.testing.assert_array_equal(product(w, x, CODE_ROW_TILES), product(w, x, CODE_ROW_TILES | CODE_PANEL))
    assert not np.array_equal(product(w, x, CODE_ROW_TILES), panel), kind


def test_the_avx2_panel_thresholds_cover_the_kinds_it_takes():
    assert set(KINDS) <= set(cpp.QUANT_KINDS)
    assert {"q8_0", "wint8", "q2_k", "q3_k"} <= set(KINDS)
    assert all(n is None or 1 <= n <= 512 for n in cpp.QUANT_AVX2_PANEL_MIN_ROWS.values())


# --- q8_0 and wint8: the sign trick (PanelPartEight) ------------------------------------------

EIGHT_ROWS = (1, 2, 7, 8, 33, 128, 512)


def extreme_weight(kind: str, rows: int, cols: int, interleave: bool, rng):
    """A random ``kind`` weight whose first rows are the quants that make maddubs saturate
    if a kernel gets it wrong: row 0 all -128, row 1 all 127, row 2 -128 and 127 in turn
    (q8_0's blocks hold any int8; wint8's quantizer stops at -127, its kernels take -128)."""
    from fdx.ops.quant import QuantizedTensor
    pattern = np.zeros((3, cols), np.int8)
    pattern[0], pattern[1] = -128, 127
    pattern[2, 0::2], pattern[2, 1::2] = -128, 127
    if kind == "q8_0":
        w = random_quantized(kind, rows, cols, rng)
        blocks = w.data.reshape(rows, cols // 32, 34)
        blocks[:3, :, 2:] = pattern.reshape(3, cols // 32, 32).view(np.uint8)
    else:
        q = np.clip(np.rint(rng.standard_normal((rows, cols)) * 40), -128, 127).astype(np.int8)
        q[:3] = pattern
        w = QuantizedTensor("wint8", (rows, cols), q, rng.uniform(0.001, 0.01, rows).astype(np.float32))
    if interleave:
        assert w.repack(always=True), kind
    return w


def extreme_rows(m: int, cols: int, rng) -> np.ndarray:
    """m activation rows, the first three quantized to +127 everywhere, -127 everywhere and
    -127 / +127 in turn (every product with extreme_weight's rows at its largest, of one
    sign), the rest normal (each block's largest quantizes to +-127)."""
    x = rng.standard_normal((m, cols)).astype(np.float32)
    pattern = np.ones((3, cols), np.float32)
    pattern[1] = -1
    pattern[2, 0::2] = -1
    x[:3] = pattern[:min(3, m)]
    return x


@pytest.mark.parametrize("interleave", [False, True], ids=["plain", "interleaved"])
@pytest.mark.parametrize("kind", ["q8_0", "wint8"])
def test_the_eight_bit_panel_is_exact_at_the_extremes(kind, interleave):
    """|w| = 128 against |x| = 127 of w's sign: a pair sum of 32512, every group; a kernel that
    took u = w + 128 (255 x 127 x 2) or added two groups' pair sums in int16 saturates here."""
    rng = np.random.default_rng(zlib.crc32(f"panel-avx2-eight/{kind}/{interleave}".encode()))
    threshold = cpp.QUANT_AVX2_PANEL_MIN_ROWS[kind] or 1 << 30
    for rows, cols in ((36, 256), (76 if interleave else 77, 2048)):
        w = extreme_weight(kind, rows, cols, interleave, rng)
        values = w.dequantize().astype(np.float64)
        assert values[0].max() < 0 and values[1].min() > 0, kind
        for m in EIGHT_ROWS:
            x = extreme_rows(m, cols, rng)
            xq = int8_blocks(x)
            blocks = x[:3].reshape(min(3, m), -1, 32)
            assert np.all(np.abs(np.rint(blocks * (127 / np.abs(blocks).max(axis=2, keepdims=True)))) == 127)
            want = xq.astype(np.float64) @ values.T
            scale = np.abs(want).max()
            what = f"{kind} {'interleaved' if interleave else 'plain'} M={m} {rows}x{cols}"
            forced = product(w, x, CODE_PANEL)
            assert np.abs(forced - want).max() <= 1e-4 * scale, what
            # the extreme pairs alone, row by row: within float32 rounding of each result
            k = min(3, m)
            assert np.allclose(forced[:k, :3], want[:k, :3], rtol=1e-5, atol=0), what
            got = product(w, x)
            assert np.abs(got - want).max() <= 1e-4 * scale, what
            old = product(w, x, CODE_NO_PANEL)
            if m >= threshold:
                np.testing.assert_array_equal(got, forced, err_msg=what)        # the panel ran
            else:
                np.testing.assert_array_equal(got, old, err_msg=what)           # below: the old path
            if m >= 32:   # OctMatmul (kOctMinRows): the same integer block sums and float order
                np.testing.assert_array_equal(old, forced, err_msg=what)
            elif m == 1:  # the row tiles (another float order): kCodePanel reached the panel
                assert not np.array_equal(old, forced), what


@pytest.mark.parametrize("kind", ["q8_0", "wint8"])
def test_an_eight_bit_panel_row_does_not_depend_on_its_neighbours(kind):
    """5 activation rows a tile, tails of 1-4: the same instructions for each row."""
    rng = np.random.default_rng(zlib.crc32(f"panel-avx2-eight-rows/{kind}".encode()))
    w = extreme_weight(kind, 44, 512, False, rng)
    x = extreme_rows(33, 512, rng)
    many = product(w, x, CODE_PANEL)
    for lo, hi in ((0, 1), (0, 2), (3, 7), (7, 11), (29, 33), (0, 33)):
        np.testing.assert_array_equal(product(w, x[lo:hi], CODE_PANEL), many[lo:hi], err_msg=f"{kind} {lo}:{hi}")
