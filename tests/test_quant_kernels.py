"""The compiled products with quantized weights (ops/csrc/quant_kernels.h) against numpy.

The reference dequantizes with the ``gguf`` package (``gguf.quants.dequantize``;
wint8/wint4 with numpy here) and multiplies in float64. Weights: q8_0, q4_0,
q4_1, q5_0 and q5_1 quantized from normal values by ``gguf.quants.quantize``;
the k-quants, which gguf-py cannot quantize to, as random valid blocks
(fdx.ops.probes.random_blocks: random quants and sub-scales, sane fp16 scales).

Tolerances: below ``QUANT_BLAS_MIN_ROWS`` rows the kernels quantize the
activations to int8 in blocks of 32 (256 for the k-quants). Against x quantized the same way in
numpy (``int8_blocks``) the error is float32 accumulation only: 1e-4 of the
largest output. Against the unquantized x, each activation is off by at most
half a step (max|block| / 254), so each output by at most the sum over blocks
of that step times sum|w| over the block: checked as that bound (measured
about 5e-3 of the largest output on normal data). From that many rows they
dequantize and multiply in fp32: 1e-4 against the unquantized x.

Every build this CPU runs (the backend's probed table) is tested; one it does
not run (AVX-512 on an AVX2 machine) is skipped with the probe's finding, which
must then be a SIGILL, not a crash.
"""
from __future__ import annotations

import os
import pathlib
import zlib

import numpy as np
import pytest

from fdx.core import kernels
from fdx.core.host import cpu_flags
from fdx.core.kernels import KernelTable
from fdx.ops import cpp, quant
from fdx.ops.probes import act_block, int8_blocks, random_blocks
from fdx.plugins.backends import cpu, probing
from test_contracts import cpu_kernel_table

FAULTS = pathlib.Path(__file__).resolve().parent / "data" / "probe_faults"
GGUF_QUANTIZES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


def make_weight(kind: str, rows: int, cols: int, rng) -> tuple[quant.QuantizedTensor, np.ndarray]:
    """(the quantized weight, its values as the independent reference computes them)."""
    if kind == "wint8":
        w = quant.quantize_wint8(rng.standard_normal((rows, cols)).astype(np.float32))
        return w, w.data.astype(np.float64) * w.scales[:, None]
    if kind == "wint4":
        w = quant.quantize_wint4(rng.standard_normal((rows, cols)).astype(np.float32), 64)
        q = np.empty((rows, cols), np.float64)
        q[:, 0::2], q[:, 1::2] = (w.data & 15).astype(np.float64) - 8, (w.data >> 4).astype(np.float64) - 8
        return w, q * np.repeat(w.scales, 64, axis=1)
    from gguf.quants import dequantize, quantize
    qtype = quant.ggml_type(kind)
    if kind in GGUF_QUANTIZES:
        data = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    else:
        data = random_blocks(kind, rows, cols, rng)
    return quant.QuantizedTensor(kind, (rows, cols), data), dequantize(data, qtype).astype(np.float64)


def variant_fn(kind: str, variant: str):
    name = cpp.quant_kernel_name(kind, variant)
    finding = cpu_kernel_table().findings.get(name, "not probed")
    if finding is not None:
        if variant == "avx512" and "avx512bw" not in cpu_flags():
            assert finding == "SIGILL on this CPU", finding     # compiled, probed, died in the child: a finding
        pytest.skip(f"{name} does not run here: {finding}")
    return dict(quant.KERNELS[kind])[name]


def shapes(kind: str):
    k = kind.endswith("_k")
    return [(1, 37, 512), (1, 1, 256 if k else 64), (3, 129, 1536 if k else 576), (8, 40, 512),
            (13, 37, 768 if k else 640 if kind == "wint4" else 544),   # q8_0 on AVX-512 VNNI from 12 rows: odd blocks
            (cpp.QUANT_BLAS_MIN_ROWS - 1, 37, 512), (cpp.QUANT_BLAS_MIN_ROWS, 37, 512), (64, 70, 1536)]


def to_tensor(a):
    import paddle
    return paddle.to_tensor(a)


@pytest.mark.parametrize("variant", cpp.QUANT_VARIANTS)
@pytest.mark.parametrize("kind", cpp.QUANT_KINDS)
def test_each_build_matches_the_gguf_dequantized_product(kind, variant):
    fn = variant_fn(kind, variant)
    # a seed stable across processes: hash() of a str is salted per process (PYTHONHASHSEED),
    # so the data changed run to run and one draw (wint4 portable, a 1x64 product whose exact
    # values nearly cancel) failed the relative tolerance once
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{variant}".encode()))
    for m, rows, cols in shapes(kind):
        w, values = make_weight(kind, rows, cols, rng)
        x = rng.standard_normal((m, cols)).astype(np.float32)
        got = fn(to_tensor(x), w).numpy()
        assert got.shape == (m, rows) and got.dtype == np.float32
        exact = x.astype(np.float64) @ values.T
        scale = np.abs(exact).max()
        what = f"{kind} {variant} M={m} {rows}x{cols}"
        blas = cpp.quant_blas_min_rows(kind, variant)
        if blas is None or m < blas:
            blk = act_block(kind)
            as_quantized = int8_blocks(x, blk).astype(np.float64) @ values.T
            assert np.abs(got - as_quantized).max() <= 1e-4 * scale, what
            step = np.abs(x.reshape(m, -1, blk)).max(axis=2) / 254                     # [M, blocks]
            bound = step.astype(np.float64) @ np.abs(values).reshape(rows, -1, blk).sum(axis=2).T
            assert (np.abs(got - exact) <= 1.001 * bound + 1e-4 * scale).all(), what
        else:
            assert np.abs(got - exact).max() <= 1e-4 * scale, what


@pytest.mark.parametrize("kind", ["q4_1", "q6_k", "wint4"])
def test_leading_dims_zero_rows_and_strided_input(kind):
    fn = variant_fn(kind, "portable")
    rng = np.random.default_rng(1)
    w, values = make_weight(kind, 24, 512, rng)
    x = rng.standard_normal((2, 3, 512)).astype(np.float32)
    got = fn(to_tensor(x), w).numpy()
    want = int8_blocks(x.reshape(6, 512), act_block(kind)).astype(np.float64) @ values.T
    assert got.shape == (2, 3, 24)
    assert np.abs(got.reshape(6, 24) - want).max() <= 1e-4 * np.abs(want).max()
    wide = to_tensor(rng.standard_normal((4, 1024)).astype(np.float32))[:, :512]     # a strided view
    want = int8_blocks(wide.numpy(), act_block(kind)).astype(np.float64) @ values.T
    assert np.abs(fn(wide, w).numpy() - want).max() <= 1e-4 * np.abs(want).max()


def test_shapes_the_kernels_cannot_take_use_the_reference():
    rng = np.random.default_rng(2)
    w = quant.quantize_wint8(rng.standard_normal((5, 40)).astype(np.float32))      # 40 columns: no whole blocks of 32
    assert not cpp.quant_supported(w)
    x = rng.standard_normal((2, 40)).astype(np.float32)
    assert cpp.quant_matmul_portable(to_tensor(x), w) is None
    with kernels.using(KernelTable({cpp.quant_kernel_name("wint8", "portable"): None})):
        got = quant.matmul(to_tensor(x), w).numpy()
    np.testing.assert_allclose(got, x @ w.dequantize().T, rtol=1e-5, atol=1e-5)


def test_quant_matmul_takes_the_widest_build_the_table_passed(monkeypatch):
    calls = []
    fake = {v: (lambda v: lambda x, w: calls.append(v) or quant.reference_matmul(x, w))(v) for v in cpp.QUANT_VARIANTS}
    monkeypatch.setitem(quant.KERNELS, "q8_0",
                        tuple((cpp.quant_kernel_name("q8_0", v), fake[v]) for v in cpp.QUANT_VARIANTS))
    rng = np.random.default_rng(3)
    w, _ = make_weight("q8_0", 4, 64, rng)
    x = to_tensor(rng.standard_normal((1, 64)).astype(np.float32))
    names = {v: cpp.quant_kernel_name("q8_0", v) for v in cpp.QUANT_VARIANTS}
    cases = [({"avx512": None, "avx2": None, "portable": None}, "avx512"),
             ({"avx512": "SIGILL on this CPU", "avx2": None, "portable": None}, "avx2"),
             ({"avx512": "SIGILL on this CPU", "avx2": "wrong result", "portable": None}, "portable")]
    for findings, expected in cases:
        with kernels.using(KernelTable({names[v]: f for v, f in findings.items()})):
            quant.matmul(x, w)
        assert calls.pop() == expected
    with kernels.using(KernelTable({names["portable"]: "refused"})):
        quant.matmul(x, w)                                 # nothing usable: the reference, no kernel called
    assert not calls


def test_the_backend_probes_every_build_of_every_kind():
    assert set(cpu.QUANT_KERNELS) == set(cpp.quant_kernel_names()) <= set(cpu.KERNELS)
    choices = cpu.op_choices(cpu_kernel_table())["quant_matmul"]
    if "avx512bw" not in cpu_flags() and "avx2" in cpu_flags():
        assert choices.startswith(",".join(cpp.QUANT_KINDS) + "=avx2 (avx512: SIGILL on this CPU)"), choices


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["wrong", "sigill"])
def test_a_probe_refuses_a_wrong_or_dying_build(tmp_path, monkeypatch, fault):
    """The real probe child, with the fault injector on its path."""
    cpu_kernel_table()                                     # the compiled kernels are built before the child loads them
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FDX_TEST_FAULTS", f"cpp.q4_1_matmul={fault}")
    found = probing._probe(["cpp.q4_1_matmul", "cpp.q4_0_matmul"], 1, tmp_path / "log")
    if fault == "wrong":
        assert found["cpp.q4_1_matmul"].startswith("wrong result (1x512 @ 129x512: max error")
    else:
        assert found["cpp.q4_1_matmul"] == "SIGILL on this CPU"
    assert found["cpp.q4_0_matmul"] is None                # the next build is probed on (in a new child after a death)


@pytest.mark.slow
def test_an_instruction_set_build_dies_in_a_fork_and_the_child_goes_on(tmp_path, monkeypatch):
    """A SIGILL of an isolated build is its finding, and the same child probes the next kernel."""
    cpu_kernel_table()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FDX_TEST_FAULTS", "cpp.q4_1_matmul.avx2=sigill")
    log = tmp_path / "children.log"
    monkeypatch.setenv("FDX_TEST_PROBE_LOG", str(log))
    found = probing._probe(["cpp.q4_1_matmul.avx2", "cpp.q4_0_matmul"], 1, tmp_path / "log")
    assert found == {"cpp.q4_1_matmul.avx2": "SIGILL on this CPU", "cpp.q4_0_matmul": None}
    assert log.read_text().count("child") == 1


def test_q8_0_embedding_rows_equal_gguf_dequantize():
    """The q8_0 table's own row path (no gguf call) against gguf's dequantization
    of the same rows: equal bits, repeated and unordered ids included."""
    from gguf.quants import dequantize
    w = quant.QuantizedTensor("q8_0", (40, 96), random_blocks("q8_0", 40, 96, np.random.default_rng(3)))
    ids = np.array([7, 0, 39, 7, 12])
    want = dequantize(w.data[ids], quant.ggml_type("q8_0")).astype(np.float32)
    got = quant.embedding(ids, w).numpy()
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)


AVX2_TILE_ROWS = (1, 2, 7, 8, 33, 128, 512)


@pytest.mark.parametrize("kind", sorted(cpp.QUANT_AVX2_TILE_MIN_ROWS))
def test_avx2_many_row_tiles_against_numpy_and_their_own_rows(kind):
    """The AVX2 build's many-row tiles (csrc/avx2_tiles.inc: the 32-block kinds and, per
    super-block, the k-quants but q3_k; from
    cpp.QUANT_AVX2_TILE_MIN_ROWS rows; the kernel under the AVX2 switch points
    cpp.QUANT_BLAS_MIN_ROWS_AVX2), called directly at every row count, against a
    float64 numpy product of the gguf-dequantized blocks with the activations
    quantized as the kernels do (1e-4 of the largest output). Which path ran: below
    the tiles' row count the bits are the row tiles' (kCodeRowTiles), from it they
    are not (another order of the float sums). Bitwise: from that count a row's
    output does not depend on M or on the rows beside it (one SIMD lane a pair), so
    any row set computed alone equals the same rows inside 512. Interleaved (36
    rows, where repacked) and plain weights with an odd tile tail (37 rows)."""
    variant_fn(kind, "avx2")                                   # skips where the AVX2 build does not run
    module = cpp._module_or_raise()
    start = cpp.QUANT_AVX2_TILE_MIN_ROWS[kind]
    rng = np.random.default_rng(zlib.crc32(f"{kind}/avx2-tiles".encode()))
    cols = 512 if kind.endswith("_k") else 384 if kind == "wint4" else 352   # 11 blocks of 32 (wint4: 6 groups of 64)
    x = rng.standard_normal((max(AVX2_TILE_ROWS), cols)).astype(np.float32)
    xq = int8_blocks(x, act_block(kind)).astype(np.float64)
    for rows in (36, 37):
        w, values = make_weight(kind, rows, cols, rng)
        w.prepare()
        data, scales = w.tensors()

        def product(xs, extra=0):   # the panel product off (kCodeNoPanel): tests/test_quant_panel_avx2.py
            return module.fdx_quant_matmul(to_tensor(xs), data, scales, cpp.quant_code(w) | cpp._CODE_NO_PANEL | extra,
                                           cpp._VARIANT_CODE["avx2"], rows, cols, w.group_size).numpy()

        want = xq @ values.T
        scale = np.abs(want).max()
        got = {m: product(x[:m]) for m in AVX2_TILE_ROWS + (start - 1, start)}
        for m, g in got.items():
            what = f"{kind} avx2 {rows} rows (interleaved {w.interleaved}) M={m}"
            assert g.shape == (m, rows) and np.abs(g - want[:m]).max() <= 1e-4 * scale, what
            row_tiles = product(x[:m], cpp._CODE_ROW_TILES)
            if m < start:
                assert np.array_equal(g, row_tiles), what + ": not the row tiles"
            else:
                assert not np.array_equal(g, row_tiles), what + ": the row tiles ran, not the many-row tiles"
                assert np.array_equal(g, got[512][:m]), what + ": differs from the same rows within 512"
        for lo in (5, 100, 333):                               # a row set of its own, elsewhere in the 512
            alone = product(x[lo:lo + start + 3])
            assert np.array_equal(alone, got[512][lo:lo + start + 3]), f"{kind} rows {lo}..: not their bits in 512"
        invariant = product(x[:33], cpp._CODE_INVARIANT)       # backend.batch_invariant: the row tiles
        assert np.array_equal(invariant, product(x[:33], cpp._CODE_ROW_TILES))


def test_avx2_switch_points():
    """The AVX2 build dequantizes for BLAS only where measured slower (q8_0 and wint8,
    past their panel product, from 1024 and 768 rows); its tiled kinds (q3_k: the panel
    product, no tile of its own) start below QUANT_BLAS_MIN_ROWS."""
    for kind in cpp.QUANT_KINDS:
        blas = cpp.quant_blas_min_rows(kind, "avx2")
        tile = cpp.QUANT_AVX2_TILE_MIN_ROWS.get(kind) or cpp.QUANT_AVX2_PANEL_MIN_ROWS.get(kind)
        if tile is None:
            assert blas == cpp.QUANT_BLAS_MIN_ROWS, kind
        else:
            assert tile < cpp.QUANT_BLAS_MIN_ROWS and (blas is None or blas > tile), kind
    assert cpp.quant_blas_min_rows("q4_0", "avx2") is None and cpp.quant_blas_min_rows("q8_0", "avx2") == 1024
    assert cpp.quant_blas_min_rows("wint8", "avx2") == 768 > 512 > cpp.QUANT_AVX2_PANEL_MIN_ROWS["wint8"]
    assert cpp.quant_blas_min_rows("q4_k", "avx2") is None and cpp.quant_blas_min_rows("q3_k", "avx2") is None
    assert cpp.quant_blas_min_rows("q4_0", "portable") == cpp.QUANT_BLAS_MIN_ROWS
