"""The panel product (ops/csrc/panel_gemm.inc): many activation rows against a
quantized weight with AVX-512 VNNI, every kind (q2_k and q3_k with their scale per 16
folded into the panel's bytes), both layouts.

Reference: the weight dequantized by ``QuantizedTensor.dequantize`` (gguf's
dequantizer; wint8/4 in numpy) times x quantized as the kernels quantize it
(``int8_blocks``: per 32, per 256 for the k-quants), in float64; tolerance
1e-4 of the largest output (float32 accumulation), as tests/test_quant_kernels.py.

That the panel ran: the default call from the kind's threshold rows gives
bitwise the result of the call with kCodePanel (the panel at every row count),
and other bits than the call with kCodeNoPanel (the kernels below it). Under
backend.batch_invariant (kCodeInvariant) a row alone equals that row among 512,
bitwise: there the panel runs only for q4_0, q4_1, q5_1 and wint4, in the float
order of the kernel below it (TileM1Vnni, at every row count), so the forced panel
(kCodePanel) gives bitwise that kernel's product (kCodeNoPanel) at every row count.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from fdx.core.host import cpu_flags
from fdx.ops import cpp
from fdx.ops.probes import act_block, int8_blocks, random_quantized

KINDS = cpp.QUANT_KINDS
CODE_NO_PANEL, CODE_PANEL = cpp._CODE_NO_PANEL, cpp._CODE_PANEL

pytestmark = pytest.mark.skipif("avx512_vnni" not in cpu_flags(), reason="the panel product needs AVX-512 VNNI")


def product(w, x: np.ndarray, flags: int = 0, invariant: bool = False, variant: str = "avx512") -> np.ndarray:
    """The compiled product of build ``variant`` with the code bits ``flags`` (test_quant_panel_avx2 too)."""
    import paddle
    m = cpp._module_or_raise()
    data, scales = w.tensors()
    code = cpp.quant_code(w, invariant) | flags
    out = m.fdx_quant_matmul(paddle.to_tensor(x), data, scales, code, cpp._VARIANT_CODE[variant], w.shape[0],
                             w.shape[1], w.group_size)
    return out.numpy()


def panel_and_default(w, x: np.ndarray, values: np.ndarray, blk: int, what: str, variant: str = "avx512"):
    """The product of ``x`` with the panel forced (kCodePanel) and by default, each checked
    against float64 (``values``: the dequantized weight; x quantized per ``blk`` as the
    kernels quantize it) to 1e-4 of the largest output: (default, forced, float64, that
    largest output) (test_quant_panel_avx2 too)."""
    want = int8_blocks(x, blk).astype(np.float64) @ values.T
    scale = np.abs(want).max()
    forced = product(w, x, CODE_PANEL, variant=variant)
    assert np.abs(forced - want).max() <= 1e-4 * scale, what
    got = product(w, x, variant=variant)
    assert np.abs(got - want).max() <= 1e-4 * scale, what
    return got, forced, want, scale


def invariant_rows(kind: str, label: str, variant: str = "avx512"):
    """A 48 x 512 weight of ``kind`` and 512 activation rows (seeded by ``label``): under
    backend.batch_invariant rows 0, 17 and 511 alone equal themselves among the 512,
    bitwise; (the weight, the rows, the 512 rows' invariant product) (test_quant_panel_avx2 too)."""
    rng = np.random.default_rng(zlib.crc32(f"{label}/{kind}".encode()))
    w = weight(kind, 48, 512, False, rng)
    x = rng.standard_normal((512, 512)).astype(np.float32)
    many = product(w, x, invariant=True, variant=variant)
    for i in (0, 17, 511):
        np.testing.assert_array_equal(product(w, x[i:i + 1], invariant=True, variant=variant)[0], many[i],
                                      err_msg=f"{kind} row {i}")
    return w, x, many


def weight(kind: str, rows: int, cols: int, interleave: bool, rng):
    w = random_quantized(kind, rows, cols, rng)
    if interleave:
        assert w.repack(always=True), kind
    return w


@pytest.mark.parametrize("interleave", [False, True], ids=["plain", "interleaved"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_panel_matches_float64_and_runs_from_its_threshold(kind, interleave):
    rng = np.random.default_rng(zlib.crc32(f"panel/{kind}/{interleave}".encode()))
    blk = act_block(kind)
    threshold = cpp.QUANT_PANEL_MIN_ROWS_VNNI[kind]
    for rows, cols in ((36, 256), (72, 2048)):        # 36, 72: a last panel of 4 / 8 rows
        w = weight(kind, rows, cols, interleave, rng)
        values = w.dequantize().astype(np.float64)
        for m in sorted({1, 16, 17, 33, 64, 512, threshold - 1, threshold}):
            x = rng.standard_normal((m, cols)).astype(np.float32)
            what = f"{kind} {'interleaved' if interleave else 'plain'} M={m} {rows}x{cols}"
            got, forced, want, scale = panel_and_default(w, x, values, blk, what)
            if m >= threshold:
                np.testing.assert_array_equal(got, forced, err_msg=what)        # the panel ran
                old = product(w, x, CODE_NO_PANEL)
                assert np.abs(old - want).max() <= 1e-4 * scale, what
                assert not np.array_equal(old, got), what                     # and it is not the old path
            elif m == threshold - 1:                     # = kPanelMinRows (panel_gemm.inc): below, the old path
                np.testing.assert_array_equal(got, product(w, x, CODE_NO_PANEL), err_msg=what)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_k", "q6_k", "q4_1", "wint8", "q2_k", "q3_k"])
def test_a_row_is_the_same_alone_as_among_512_under_batch_invariant(kind):
    w, x, many = invariant_rows(kind, "panel-invariant")
    assert not np.array_equal(many, product(w, x)), kind   # the default path (the panel) is another order


M1_KINDS = tuple(cpp.QUANT_PANEL_M1_MIN_ROWS)


@pytest.mark.parametrize("interleave", [False, True], ids=["plain", "interleaved"])
@pytest.mark.parametrize("kind", M1_KINDS)
def test_the_invariant_panel_gives_each_row_its_one_row_bits(kind, interleave):
    """Under backend.batch_invariant the panel of q4_0, q4_1, q5_1 and wint4 (from
    QUANT_PANEL_M1_MIN_ROWS rows) runs in TileM1Vnni's float order: rows 0, 17 and 511 of
    512 equal the rows alone (1 row: TileM1Vnni), the forced panel equals TileM1Vnni at
    every row count (512 rows: every tile position; 1-5: the short last tiles), and it is
    within float32 of float64. A panel in its default order fails the first two."""
    rng = np.random.default_rng(zlib.crc32(f"panel-m1/{kind}/{interleave}".encode()))
    layout = "interleaved" if interleave else "plain"
    w = weight(kind, 72, 1024, interleave, rng)                # 72: a last panel of 8 weight rows
    x = rng.standard_normal((512, 1024)).astype(np.float32)
    many = product(w, x, invariant=True)
    for i in (0, 17, 511):
        np.testing.assert_array_equal(product(w, x[i:i + 1], invariant=True)[0], many[i],
                                      err_msg=f"{kind} {layout} row {i}")
    want = int8_blocks(x, 32).astype(np.float64) @ w.dequantize().astype(np.float64).T
    forced = product(w, x, CODE_PANEL, invariant=True)
    assert np.abs(forced - want).max() <= 1e-4 * np.abs(want).max(), f"{kind} {layout}"
    np.testing.assert_array_equal(forced, product(w, x, CODE_NO_PANEL, invariant=True), err_msg=f"{kind} {layout}")
    np.testing.assert_array_equal(forced, many, err_msg=f"{kind} {layout}")
    for m in (1, 2, 3, 5):
        np.testing.assert_array_equal(product(w, x[:m], CODE_PANEL, invariant=True), many[:m],
                                      err_msg=f"{kind} {layout} M={m}")
    assert not np.array_equal(forced, product(w, x, CODE_PANEL)), f"{kind} {layout}"   # the default order differs


def test_the_panel_thresholds_cover_the_kinds_it_takes():
    assert set(cpp.QUANT_PANEL_M1_MIN_ROWS) == {"q4_0", "q4_1", "q5_1", "wint4"}
    assert all(1 <= n <= 64 for n in cpp.QUANT_PANEL_M1_MIN_ROWS.values())
    assert set(cpp.QUANT_PANEL_MIN_ROWS_VNNI) == set(KINDS)
    assert all(1 <= n <= 64 for n in cpp.QUANT_PANEL_MIN_ROWS_VNNI.values())
