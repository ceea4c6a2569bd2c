"""The few-row products a verification step runs: q8_0 and wint8 at 1-11 rows.

A speculated step scores k + 1 rows; the embedded model's LM head is q8_0. With
AVX-512 VNNI, q8_0 and wint8 take TileM1VnniQ8 below 12 rows (ops/csrc/
quant_kernels.inc), four weight rows a 512-bit register. Checked here by calling the
compiled product directly: against a float64 numpy product of the blocks dequantized
by the ``gguf`` package (wint8: numpy), with the activations quantized as the kernels
do (1e-4 of the largest output); bitwise, every row alone equals the same row inside
every row count 1-11 (so a verified row is the plain step's row); and that this tile
ran, not the 256-bit row tiles (kCodeRowTiles: the path before it). Under
backend.batch_invariant the row tiles still run.
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
        alone = np.concatenate([product(x[i:i + 1]) for i in range(max(FEW_ROWS))])
        for m in FEW_ROWS:
            got = product(x[:m])
            what = f"{kind} {rows} rows (interleaved {w.interleaved}) M={m}"
            assert got.shape == (m, rows) and np.abs(got - want[:m]).max() <= 1e-4 * scale, what
            assert np.array_equal(got, alone[:m]), what + ": a row differs from the row alone"
            if cpp._has_vnni():
                assert not np.array_equal(got, product(x[:m], cpp._CODE_ROW_TILES)), what + ": the row tiles ran"
        invariant = product(x[:5], cpp._CODE_INVARIANT)      # backend.batch_invariant: the row tiles, as before
        assert np.array_equal(invariant, product(x[:5], cpp._CODE_ROW_TILES)), kind
