"""The few-row products a verification step runs, and q8_0 / wint8 under backend.batch_invariant.

A speculated step at batch 1 scores k + 1 rows where a decode step scores 1, so greedy
speculation keeps decoding's tokens only if every product gives a row the same bits at
1..k+1 rows. ``cpp.row_invariant_rows(kind, variant)`` says up to how many rows the
default mode does, per kind and build; checked here for every kind the compiled
products take, both layouts, and the float32 product, in every build this CPU runs:
each row of an M-row product bitwise equal to that row alone at every M up to it (and
at it), and not at the next row count (so the figure is the switch, not a guess).

With AVX-512 VNNI, q8_0 and wint8 take TileM1VnniQ8 at 1-11 rows (q8_0 up to its panel
product; ops/csrc/quant_kernels.inc), four weight rows a 512-bit register, not the 256-bit row tiles
(kCodeRowTiles: the path before); under backend.batch_invariant (kCodeInvariant) at
every row count. Checked by calling the compiled product directly: against a float64
numpy product of the blocks dequantized by the ``gguf`` package (wint8: numpy), with
the activations quantized as the kernels do; which path ran (not the row tiles' bits);
bitwise, a row's output does not depend on M or on the rows beside it.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from fdx.ops import cpp, quant
from fdx.ops.probes import act_block, int8_blocks, random_quantized
from test_contracts import cpu_kernel_table

FEW_ROWS = tuple(range(1, 12))


@pytest.mark.parametrize("kind", ("q8_0", "wint8"))
def test_few_row_products_against_numpy_alone_and_not_the_row_tiles(kind):
    import paddle
    finding = cpu_kernel_table().findings.get(cpp.quant_kernel_name(kind, "avx512"), "not probed")
    if finding is not None:
        pytest.skip(f"{kind} avx512 does not run here: {finding}")
    module = cpp._module_or_raise()
    rng = np.random.default_rng(zlib.crc32(f"{kind}/verify-rows".encode()))
    cols = 352                                              # 11 blocks of 32
    x = rng.standard_normal((max(FEW_ROWS), cols)).astype(np.float32)
    xq = int8_blocks(x, act_block(kind)).astype(np.float64)
    for rows in (36, 38):                                   # interleaved (repacked), plain with a tail of 2
        w = random_quantized(kind, rows, cols, rng).prepare()
        assert w.interleaved == (rows == 36) and kind in quant.REPACK_KINDS
        data, scales = w.tensors()

        def product(xs, extra=0):
            return module.fdx_quant_matmul(paddle.to_tensor(xs), data, scales, cpp.quant_code(w) | extra,
                                           cpp._VARIANT_CODE["avx512"], rows, cols, w.group_size).numpy()

        want = xq @ w.dequantize().astype(np.float64).T
        scale = np.abs(want).max()
        got = {m: product(x[:m]) for m in FEW_ROWS}
        for m, g in got.items():
            what = f"{kind} {rows} rows (interleaved {w.interleaved}) M={m}"
            assert g.shape == (m, rows) and np.abs(g - want[:m]).max() <= 1e-4 * scale, what
            row_tiles = product(x[:m], cpp._CODE_ROW_TILES)
            if not cpp._has_vnni():
                assert np.array_equal(g, row_tiles), what + ": not the row tiles"
            else:
                assert not np.array_equal(g, row_tiles), what + ": the row tiles ran"
                assert np.array_equal(g, got[11][:m]), what + ": a row differs from the same row within 11"
        for lo in (1, 4, 9):                                # a pair of rows of its own, elsewhere in the 11
            assert np.array_equal(product(x[lo:lo + 2]), got[11][lo:lo + 2]), f"{kind} rows {lo}..: not their bits"
        invariant = product(x[:5], cpp._CODE_INVARIANT)      # backend.batch_invariant: the same tile
        assert np.array_equal(invariant, got[5]), kind


def test_the_q8_0_tile_at_the_decoder_layer_cases_shapes():
    """The q8_0 products of test_decoder_layer's stack cases that failed with TileM1VnniQ8
    (q8_0-extras seed 5 and q8_0 seed 8: their layers' qkv 256 x 128, o 128 x 128, gate/up
    512 x 128, down 128 x 256, all interleaved, at the step's 10 rows, and each row alone):
    against float64 numpy to 1e-6 of the largest output (the tile's own float32 rounding;
    those failures were one activation rounded to int8 the other way, see
    test_decoder_layer's test_near_boundary_cases_differ_by_one_rounding_flip), and the
    256-bit row tiles' products to the same."""
    import paddle
    from test_decoder_layer import stack_case
    finding = cpu_kernel_table().findings.get(cpp.quant_kernel_name("q8_0", "avx512"), "not probed")
    if finding is not None:
        pytest.skip(f"q8_0 avx512 does not run here: {finding}")
    module = cpp._module_or_raise()
    rng = np.random.default_rng(zlib.crc32(b"q8_0/decoder-layer-shapes"))
    for kind, seed in (("q8_0-extras", 5), ("q8_0", 8)):
        layers = stack_case(kind, seed)[0]
        for layer in layers:
            for parts in layer.fused.weights:
                (w,) = parts
                rows, cols = w.shape
                assert w.kind == "q8_0" and w.interleaved, (kind, w.shape)
                data, scales = w.tensors()
                x = (rng.standard_normal((10, cols)) * (1 + 20 * rng.random((10, cols)) ** 8)).astype(np.float32)

                def product(xs, extra=0):
                    return module.fdx_quant_matmul(paddle.to_tensor(xs), data, scales, cpp.quant_code(w) | extra,
                                                   cpp._VARIANT_CODE["avx512"], rows, cols, w.group_size).numpy()

                want = int8_blocks(x, 32).astype(np.float64) @ w.dequantize().astype(np.float64).T
                scale = np.abs(want).max()
                got, row_tiles = product(x), product(x, cpp._CODE_ROW_TILES)
                alone = np.concatenate([product(x[i:i + 1]) for i in range(len(x))])
                what = f"{kind} seed {seed} {w.shape}"
                assert np.abs(got - want).max() <= 1e-6 * scale, what
                assert np.abs(row_tiles - want).max() <= 1e-6 * scale, what + ": the row tiles"
                assert np.array_equal(got, alone), what + ": a row differs from alone"


@pytest.mark.parametrize("kind", ("q4_1", "q5_1", "q4_0"))
def test_m1vnni_takes_up_to_11_rows_in_one_tile_with_each_rows_bits(kind):
    """TileM1Vnni (q4_1, q5_1, q4_0: the embedded model's layers) takes a verification
    step's 9-11 rows in one tile (before: a tile of 8 and one of the rest). Its
    promise holds there too: against numpy, and every row alone equals the same row
    inside every row count 1-11 (backend.batch_invariant runs the same tile)."""
    import paddle
    finding = cpu_kernel_table().findings.get(cpp.quant_kernel_name(kind, "avx512"), "not probed")
    if finding is not None:
        pytest.skip(f"{kind} avx512 does not run here: {finding}")
    module = cpp._module_or_raise()
    rng = np.random.default_rng(zlib.crc32(f"{kind}/verify-rows-m1".encode()))
    cols = 352
    x = rng.standard_normal((max(FEW_ROWS), cols)).astype(np.float32)
    xq = int8_blocks(x, act_block(kind)).astype(np.float64)
    for rows in (36, 38):
        w = random_quantized(kind, rows, cols, rng).prepare(True if kind in quant.PROBED_REPACK_KINDS else None)
        data, scales = w.tensors()

        def product(xs):
            return module.fdx_quant_matmul(paddle.to_tensor(xs), data, scales, cpp.quant_code(w),
                                           cpp._VARIANT_CODE["avx512"], rows, cols, w.group_size).numpy()

        want = xq @ w.dequantize().astype(np.float64).T
        alone = np.concatenate([product(x[i:i + 1]) for i in range(max(FEW_ROWS))])
        assert np.abs(alone - want).max() <= 1e-4 * np.abs(want).max(), f"{kind} {rows} rows"
        for m in FEW_ROWS:
            assert np.array_equal(product(x[:m]), alone[:m]), f"{kind} {rows} rows M={m}: a row differs from alone"


# --- backend.batch_invariant: q8_0 and wint8 take TileM1VnniQ8 at every row count -----------

INVARIANT_ROWS = (0, 5, 17, 511)


def _rows_apart(product, x) -> list[int]:
    """Which of INVARIANT_ROWS of ``product`` over all of ``x`` (512 rows) are not bitwise
    that row's product alone."""
    many = product(x)
    return [i for i in INVARIANT_ROWS if not np.array_equal(product(x[i:i + 1])[0], many[i])]


@pytest.mark.parametrize("interleave", [False, True], ids=["plain", "interleaved"])
@pytest.mark.parametrize("kind", ("q8_0", "wint8"))
def test_invariant_q8_rows_alone_equal_them_among_512(kind, interleave):
    """Under backend.batch_invariant rows 0, 5, 17 and 511 of a 512-row product are
    bitwise those rows alone (TileM1VnniQ8 at every row count, in tiles of up to 11
    rows, 64-row chunks and both threads' shares), the product is numpy's in float64 to
    1e-6 of its largest output, and it is not the 256-bit row tiles' (kCodeRowTiles, what
    the mode ran before). The check can fail: Q8VnniMatmul's 512 rows against a 1-row
    product, and the default mode's (its panel product from 16 rows, 12 for wint8), are apart."""
    import paddle
    finding = cpu_kernel_table().findings.get(cpp.quant_kernel_name(kind, "avx512"), "not probed")
    if finding is not None:
        pytest.skip(f"{kind} avx512 does not run here: {finding}")
    module = cpp._module_or_raise()
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{interleave}/invariant-512".encode()))
    rows, cols = (48, 576) if interleave else (50, 576)     # plain: a last tile of 2 weight rows
    w = random_quantized(kind, rows, cols, rng).prepare(interleave=interleave)
    assert w.interleaved == interleave
    data, scales = w.tensors()
    x = rng.standard_normal((512, cols)).astype(np.float32)

    def with_code(code):
        return lambda xs: module.fdx_quant_matmul(paddle.to_tensor(xs), data, scales, code,
                                                  cpp._VARIANT_CODE["avx512"], rows, cols, w.group_size).numpy()

    invariant = with_code(cpp.quant_code(w, invariant=True))
    what = f"{kind} {'interleaved' if interleave else 'plain'}"
    assert _rows_apart(invariant, x) == [], what
    got = invariant(x)
    want = int8_blocks(x, 32).astype(np.float64) @ w.dequantize().astype(np.float64).T
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), what
    if cpp._has_vnni():
        assert not np.array_equal(got, with_code(cpp.quant_code(w, invariant=True) | cpp._CODE_ROW_TILES)(x)), what
        assert np.array_equal(got[:9], with_code(cpp.quant_code(w))(x[:9])), what + ": not the default's few-row tile"
        # Q8VnniMatmul at 512 rows against the 1 row's tile (q8_0: kCodeRowTiles, main's choice; wint8:
        # kCodeNoPanel, the default's kernel below its panel), and the default's panel product: apart
        q8vnni = cpp._CODE_ROW_TILES if kind == "q8_0" else cpp._CODE_NO_PANEL
        for extra in (q8vnni, 0):
            assert _rows_apart(with_code(cpp.quant_code(w) | extra), x) != [], f"{what} default {extra}"


# --- the default mode: up to how many rows a row keeps its 1-row bits --------------------------

def _builds(name_of) -> list[str]:
    table = cpu_kernel_table()
    return [v for v in cpp.QUANT_VARIANTS if table.findings.get(name_of(v), "not probed") is None]


def _rows_to_check(limit: int) -> list[int]:
    """Every row count to 40 (a verify step's k + 1 and past), the limit and the one after."""
    return sorted(set(range(1, min(limit, 40) + 1)) | {limit, limit + 1})


def _holds_exactly_to(product, x: np.ndarray, limit: int, what: str) -> None:
    """Each row of product(x[:m]) is that row alone for every m up to ``limit``, and some
    row is not at limit + 1."""
    alone = np.concatenate([product(x[i:i + 1]) for i in range(limit + 1)])
    for m in _rows_to_check(limit):
        same = np.array_equal(product(x[:m]), alone[:m])
        if m <= limit:
            assert same, f"{what}: at {m} rows a row is not its 1-row bits (row_invariant_rows says {limit})"
        else:
            assert not same, f"{what}: at {m} rows every row still has its 1-row bits (row_invariant_rows: {limit})"


@pytest.mark.parametrize("kind", cpp.QUANT_KINDS)
def test_default_mode_rows_keep_their_one_row_bits_up_to_row_invariant_rows(kind):
    """Every build this CPU runs, plain and interleaved (forced for the kinds whose layout
    the probe chooses): the default mode's product as the kernel table calls it
    (cpp.QUANT_MATMULS: the compiled product, dequantize + BLAS from its threshold) keeps
    each row's 1-row bits up to cpp.row_invariant_rows(kind, build) rows and no further;
    at least through a verify step's 11 rows. Against numpy (float64) too, 1e-4."""
    import paddle
    from fdx.core import kernels
    builds = _builds(lambda v: cpp.quant_kernel_name(kind, v))
    if not builds:
        pytest.skip(f"no build of {kind} runs here")
    rng = np.random.default_rng(zlib.crc32(f"{kind}/default-rows".encode()))
    cols = 512
    table = cpu_kernel_table()
    assert not table.batch_invariant
    with kernels.using(table):
        for variant in builds:
            limit = cpp.row_invariant_rows(kind, variant)
            assert limit >= 11, f"{kind} {variant}: a verify step's 11 rows"
            x = rng.standard_normal((limit + 1, cols)).astype(np.float32)
            xq = int8_blocks(x[:12], act_block(kind)).astype(np.float64)
            for rows, interleave in ((36, True), (38, False)):
                w = random_quantized(kind, rows, cols, rng).prepare(interleave=interleave)
                assert w.interleaved == interleave, (kind, rows)
                what = f"{kind} {variant} {'interleaved' if interleave else 'plain'}"

                def product(xs):
                    return cpp.QUANT_MATMULS[variant](paddle.to_tensor(xs), w).numpy()

                want = xq @ w.dequantize().astype(np.float64).T
                assert np.abs(product(x[:12]) - want).max() <= 1e-4 * np.abs(want).max(), what
                _holds_exactly_to(product, x, limit, what)


def test_float32_rows_keep_their_one_row_bits_up_to_row_invariant_rows():
    """The float32 product (fdx.ops.dense's choice for one build: the compiled product
    below f32_blas_min_rows, MKL's sgemm from there) keeps each row's 1-row bits up to
    cpp.row_invariant_rows("f32", build) rows and no further, in every build this CPU runs,
    and the dispatch itself (dense.matmul under the probed table) up to its widest build's."""
    import paddle
    from fdx.core import kernels
    from fdx.ops import dense
    builds = _builds(cpp.f32_kernel_name)
    if not builds:
        pytest.skip("no build of the float32 product runs here")
    rng = np.random.default_rng(zlib.crc32(b"f32/default-rows"))
    k, n = 96, 200                                          # a column tail past the register tiles
    wt = paddle.to_tensor(rng.standard_normal((k, n)).astype(np.float32))
    table = cpu_kernel_table()
    for variant in builds:
        limit = cpp.row_invariant_rows("f32", variant)
        assert limit >= 11, variant
        x = rng.standard_normal((limit + 1, k)).astype(np.float32)

        def product(xs):
            t = paddle.to_tensor(xs)
            if xs.shape[0] < cpp.f32_blas_min_rows(variant):
                return cpp.F32_MATMULS[variant](t, wt).numpy()
            return paddle.matmul(t, wt).numpy()

        want = x[:12].astype(np.float64) @ wt.numpy().astype(np.float64)
        assert np.abs(product(x[:12]) - want).max() <= 1e-5 * np.abs(want).max(), variant
        _holds_exactly_to(product, x, limit, f"f32 {variant}")
    widest = cpp.f32_build(table)
    with kernels.using(table):
        limit = cpp.row_invariant_rows("f32", widest)
        x = rng.standard_normal((limit + 1, k)).astype(np.float32)
        _holds_exactly_to(lambda xs: dense.matmul(paddle.to_tensor(xs), wt).numpy(), x, limit, f"dense {widest}")


def test_invariant_fused_q8_0_part_has_its_own_products_bits():
    """Under backend.batch_invariant a fused weight's q8_0 part (fdx.ops.parts: one
    PartsMatmul over the parts) has the bits of its own product, TileM1VnniQ8 at every
    row count: at 1, 9, 13 and 64 rows, beside a q5_0 part and a q4_0 part."""
    import dataclasses

    import paddle
    from fdx.core import kernels
    from fdx.ops import parts
    table = cpu_kernel_table()
    if not table.usable(parts.parts_kernel_name("avx512")):
        pytest.skip("the avx512 parts product does not run here")
    rng = np.random.default_rng(zlib.crc32(b"q8_0/invariant-parts"))
    ps = [random_quantized(k, r, 576, rng).prepare() for k, r in (("q5_0", 24), ("q8_0", 48), ("q4_0", 16))]
    x = rng.standard_normal((64, 576)).astype(np.float32)
    with kernels.using(dataclasses.replace(table, batch_invariant=True)):
        for m in (1, 9, 13, 64):
            t = paddle.to_tensor(x[:m])
            fused = parts.matmul(t, ps, "avx512").numpy()
            each = np.concatenate([cpp.QUANT_MATMULS["avx512"](t, q).numpy() for q in ps], axis=1)
            assert np.array_equal(fused, each), f"{m} rows: a part's bits differ fused and alone"
            if m > 1:
                assert np.array_equal(fused[1:2, 24:72], parts.matmul(t[1:2], ps, "avx512").numpy()[:, 24:72]), m
