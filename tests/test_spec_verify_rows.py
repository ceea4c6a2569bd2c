"""The few-row products a verification step runs: q8_0 and wint8 at 1-11 rows.

A speculated step scores k + 1 rows; the embedded model's LM head is q8_0. With
AVX-512 VNNI, q8_0 and wint8 take TileM1VnniQ8 at 1-11 rows (ops/csrc/
quant_kernels.inc), four weight rows a 512-bit register, not the 256-bit row tiles
(kCodeRowTiles: the path before). Checked here by calling the compiled product
directly: against a float64 numpy product of the blocks dequantized by the ``gguf``
package (wint8: numpy), with the activations quantized as the kernels do (1e-4 of
the largest output); which path ran (not the row tiles' bits); bitwise, a row's
output does not depend on M or on the rows beside it (so a verified row is the
plain step's row). Under backend.batch_invariant the row tiles still run.
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
        invariant = product(x[:5], cpp._CODE_INVARIANT)      # backend.batch_invariant: the row tiles, as before
        assert np.array_equal(invariant, product(x[:5], cpp._CODE_ROW_TILES)), kind


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
