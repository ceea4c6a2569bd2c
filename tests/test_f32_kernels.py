"""The compiled float32 product for a few rows (ops/csrc/f32_kernels.h) against numpy.

x [M, K] @ w [K, N] (the ``none`` format's [in, out] weights) in every build
this CPU runs (the backend's probed table; AVX-512 on an AVX2 machine is
skipped with its probe's finding, which must be a SIGILL), against numpy in
float64: float32 accumulation only, 1e-5 of the largest output. Shapes: the
odd ones (a column tail under a vector, a weight-row tail under a pass, one
column), every row count to past the two-row passes, and SmolLM2's. Then the
dispatch (fdx.ops.dense.matmul): the compiled product below f32_blas_min_rows
(of the build) rows, MKL from there, both numpy's numbers.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import pytest

from fdx.core import kernels
from fdx.core.host import cpu_flags
from fdx.ops import cpp, dense
from test_contracts import cpu_kernel_table

pytestmark = pytest.mark.skipif(not cpp.available(), reason=f"compiled ops unavailable: {cpp.unavailable_reason()}")

SHAPES = [(1, 1, 1), (3, 5, 7), (37, 129, 1), (64, 40, 2), (576, 960, 1), (576, 960, 5), (1536, 576, 4),
          (576, 3072, 7), (8, 16, 17), (300, 1000, 3), (576, 960, 12), (129, 70, 33), (300, 1000, 39),
          # AVX2 from 16 rows copies each weight panel first: k tails under a 128-row tile,
          # column tails, a wide weight (tiled only from 16 rows) under and over it, 12 row groups
          (200, 8200, 5), (200, 8200, 17), (130, 4100, 16), (300, 1000, 70)]


def f32_fn(variant: str):
    name = cpp.f32_kernel_name(variant)
    finding = cpu_kernel_table().findings.get(name, "not probed")
    if finding is not None:
        if variant == "avx512" and "avx512f" not in cpu_flags():
            assert finding == "SIGILL on this CPU", finding
        pytest.skip(f"{name} does not run here: {finding}")
    return cpp.F32_MATMULS[variant]


def numpy_case(k: int, n: int, m: int, seed: int = 0):
    rng = np.random.default_rng(seed + 1000 * k + n + m)
    return rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)


def assert_product(got: np.ndarray, x: np.ndarray, w: np.ndarray, what: str) -> None:
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert got.shape == want.shape, what
    err = float(np.abs(got - want).max()) / float(np.abs(want).max())
    assert err < 1e-5, f"{what}: max error {err:.3g} of the largest output"


@pytest.mark.parametrize("variant", cpp.QUANT_VARIANTS)
@pytest.mark.parametrize("k,n,m", SHAPES)
def test_product_matches_numpy(variant, k, n, m):
    fn = f32_fn(variant)
    x, w = numpy_case(k, n, m)
    assert_product(fn(paddle.to_tensor(x), paddle.to_tensor(w)).numpy(), x, w, f"{variant} {m}x{k} @ {k}x{n}")


@pytest.mark.parametrize("variant", cpp.QUANT_VARIANTS)
def test_every_row_count_and_a_3d_input(variant):
    """1..2 passes of rows plus every tail, and the register tiles' groups of 8 rows
    (AVX-512 from 12 rows; AVX2: 6 from 2 rows, copied panels from 16) to 40, on one
    weight; [2, 3, K] rows too."""
    fn = f32_fn(variant)
    x, w = numpy_case(96, 200, 40)
    wt = paddle.to_tensor(w)
    for m in range(1, 41):                  # AVX-512 keeps 12+ rows' outputs in registers, 8 a group, AVX2 2+, 6
        assert_product(fn(paddle.to_tensor(x[:m]), wt).numpy(), x[:m], w, f"{variant} {m} rows")
    x3 = x[:6].reshape(2, 3, 96)
    got = fn(paddle.to_tensor(x3), wt).numpy()
    assert got.shape == (2, 3, 200)
    assert_product(got.reshape(6, 200), x[:6], w, f"{variant} [2, 3, K]")


@pytest.mark.parametrize("variant", cpp.QUANT_VARIANTS)
def test_rows_on_two_threads(variant):
    """On two OpenMP threads a product splits the weight rows (each thread a
    partial product, the partials added by columns after a barrier; from 2 ** 16
    multiply-adds), at one row and at several: K tails under a pass of 8 (one row)
    or 4 (more), a K too short to split (31 < 16 a thread), SmolLM2's shapes."""
    import ctypes
    fn = f32_fn(variant)
    omp_threads = ctypes.CDLL(str(cpp._library)).omp_get_max_threads   # the extension's OpenMP runtime
    before = omp_threads()
    paddle.base.core.set_num_threads(2)
    try:
        assert omp_threads() == 2
        for k, n in ((576, 960), (1536, 576), (33, 3000), (47, 2000), (101, 700), (31, 2048), (300, 1000)):
            for m in (1, 3, 8, 13, 21, 39):
                x, w = numpy_case(k, n, m)
                assert_product(fn(paddle.to_tensor(x), paddle.to_tensor(w)).numpy(), x, w,
                               f"{variant} {m}x{k} @ {k}x{n}")
    finally:
        paddle.base.core.set_num_threads(before)


def test_the_dense_product_takes_the_compiled_kernel_below_the_threshold(monkeypatch):
    """fdx.ops.dense.matmul under the cpu table: compiled below f32_blas_min_rows
    (seen by which function ran), MKL at and above, numpy's numbers either way;
    under a table without it (or another dtype), Paddle's matmul."""
    table = cpu_kernel_table()
    variant = cpp.f32_build(table)
    if variant is None:
        pytest.skip("no build of the float32 product passed its probe here")
    ran: list[int] = []
    real = cpp.F32_MATMULS[variant]
    monkeypatch.setitem(cpp.F32_MATMULS, variant, lambda x, w: (ran.append(x.shape[0]), real(x, w))[1])
    limit = cpp.f32_blas_min_rows(variant)
    x, w = numpy_case(576, 960, limit + 1)
    wt = paddle.to_tensor(w)
    with kernels.using(table):
        for m in (1, limit - 1, limit, limit + 1):
            assert_product(dense.matmul(paddle.to_tensor(x[:m]), wt).numpy(), x[:m], w, f"{m} rows")
    assert ran == [1, limit - 1]
    with kernels.using(kernels.REFERENCE):
        assert_product(dense.matmul(paddle.to_tensor(x[:1]), wt).numpy(), x[:1], w, "reference table")
    assert ran == [1, limit - 1]
    # backend.batch_invariant: the compiled product at every row count (MKL's order depends on the rows)
    with kernels.using(dataclasses.replace(table, batch_invariant=True)):
        for m in (limit, limit + 1):
            assert_product(dense.matmul(paddle.to_tensor(x[:m]), wt).numpy(), x[:m], w, f"{m} rows, invariant")
    assert ran == [1, limit - 1, limit, limit + 1]


@pytest.mark.parametrize("variant", cpp.QUANT_VARIANTS)
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_threads(variant):
    """Issue 40 item 4: a row of a product of M rows is, bitwise, the row computed alone
    on one thread, at every M (one-row passes, 4-row passes, register tiles, copied
    panels) and on 1, 2 and 3 threads, for a narrow, a wide (LM-head-like) and a tall weight."""
    import ctypes
    fn = f32_fn(variant)
    omp_threads = ctypes.CDLL(str(cpp._library)).omp_get_max_threads
    before = omp_threads()
    try:
        for k, n in ((576, 576), (576, 5000), (1536, 200), (40, 100)):
            x, w = numpy_case(k, n, 512, seed=40)
            wt = paddle.to_tensor(w)
            paddle.base.core.set_num_threads(1)
            alone = {i: fn(paddle.to_tensor(x[i:i + 1]), wt).numpy()[0] for i in (0, 5, 17, 129, 511)}
            for threads in (1, 2, 3):
                paddle.base.core.set_num_threads(threads)
                for m in (1, 2, 7, 8, 16, 33, 130, 512):
                    got = fn(paddle.to_tensor(x[:m]), wt).numpy()
                    for i in alone:
                        if i < m:
                            assert np.array_equal(got[i], alone[i]), (
                                f"{variant} {k}x{n}: row {i} of {m} on {threads} threads differs from it alone")
            assert_product(got, x, w, f"{variant} {k}x{n} 512 rows")
    finally:
        paddle.base.core.set_num_threads(before)
