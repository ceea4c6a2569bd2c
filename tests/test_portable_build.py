"""The portable kernels build and run alone, with no x86 extension (issue 40 item 5).

ops/csrc keeps the x86 builds in translation units of their own, which fdx.ops.cpp
compiles apart from the bindings' unit and links with it: isa_avx2.cc (the float32
product, main's AVX2 attention tiles and decode split, the batch-invariant attention's
AVX2 primitives) and isa_avx512.cc (the float32 product, the batch-invariant attention's
AVX-512 primitives), the only ones of these
kernels that include <immintrin.h>; paged_attention_kernel.h calls them only where
__builtin_cpu_supports says the CPU runs them. So a compiler or CPU without x86 loses
only those builds. Shown here on this x86 host: the kernel headers are compiled with
FDX_NO_X86 and the x86 extensions off (-mno-avx -mno-avx2 -mno-fma -mno-f16c
-mno-sse4.2 -mno-sse4.1, and the source checks that none is on and that <immintrin.h>
was not included), behind a few C functions (tests/data/portable_kernels_check.cc),
with no reference to an x86 build left; the float32 product, the RMS norm and the
paged attention (both kernels) then run and match numpy and the Paddle path. The x86
units compile to nothing under FDX_NO_X86. (The quantized products, quant_kernels.h,
are helper repack's: they join the isa units there.)
"""
from __future__ import annotations

import ctypes
import pathlib
import shutil
import subprocess

import numpy as np
import pytest


CSRC = pathlib.Path(__file__).resolve().parent.parent / "ops" / "csrc"
DRIVER = pathlib.Path(__file__).resolve().parent / "data" / "portable_kernels_check.cc"
NO_X86 = ["-DFDX_NO_X86", "-mno-avx", "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-sse4.2", "-mno-sse4.1"]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on PATH")]


def f32p(a):
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    out = tmp_path_factory.mktemp("portable") / "portable_check.so"
    subprocess.run(["g++", "-O2", "-std=c++17", "-fopenmp", "-shared", "-fPIC", *NO_X86, f"-I{CSRC}",
                    str(DRIVER), "-o", str(out)], check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(out))


def test_the_x86_units_are_empty_without_x86(tmp_path):
    for unit in ("isa_avx2.cc", "isa_avx512.cc"):
        obj = tmp_path / f"{unit}.o"
        subprocess.run(["g++", "-O2", "-std=c++17", "-fopenmp", "-c", *NO_X86, f"-I{CSRC}", str(CSRC / unit),
                        "-o", str(obj)], check=True, capture_output=True, text=True)
        symbols = subprocess.run(["nm", "-C", "--defined-only", str(obj)], capture_output=True, text=True).stdout
        assert "Matmul" not in symbols and "Attention" not in symbols, symbols


def test_the_portable_unit_calls_no_x86_build(lib):
    symbols = subprocess.run(["nm", "-C", "-u", lib._name], capture_output=True, text=True, check=True).stdout
    assert "Avx" not in symbols, symbols


def test_float32_product_and_rms_norm(lib):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((7, 300)).astype(np.float32)
    w = rng.standard_normal((300, 130)).astype(np.float32)
    out = np.empty((7, 130), np.float32)
    lib.check_f32_matmul(f32p(w), ctypes.c_int64(300), ctypes.c_int64(130), f32p(x), ctypes.c_int64(7), f32p(out))
    want = x.astype(np.float64) @ w
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()
    g = rng.standard_normal(300).astype(np.float32)
    normed = np.empty_like(x)
    lib.check_rms_norm(f32p(x), f32p(g), ctypes.c_float(1e-6), ctypes.c_int64(7), ctypes.c_int64(300), f32p(normed))
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(normed, x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * g, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("invariant", [0, 1])
def test_paged_attention(lib, invariant):
    """A prefill chunk and a decode in one step against causal attention in float64."""
    rng = np.random.default_rng(7)
    heads, kv_heads, d, bs = 6, 2, 64, 16
    specs = [(20, 80), (1, 130)]                        # (query_len, context_len)
    num_blocks = 20
    k = rng.standard_normal((kv_heads * num_blocks * bs, d)).astype(np.float32)
    v = rng.standard_normal((kv_heads * num_blocks * bs, d)).astype(np.float32)
    tables = np.array([list(range(0, 7)) + [0] * 3, list(range(7, 16)) + [0]], np.int32)
    info, at = [], 0
    for ql, cl in specs:
        info.append([at, ql, cl, at])
        at += ql
    q = rng.standard_normal((at, heads, d)).astype(np.float32)
    out = np.empty_like(q)
    seq_info = np.array(info, np.int32)
    lib.check_attention(f32p(q), f32p(k), f32p(v), f32p(out), f32p(seq_info), f32p(tables),
                        ctypes.c_int64(tables.shape[1]), ctypes.c_int64(heads), ctypes.c_int64(kv_heads),
                        ctypes.c_int64(d), ctypes.c_int64(bs), ctypes.c_int64(num_blocks * bs), ctypes.c_float(0.125),
                        ctypes.c_int64(len(specs)), ctypes.c_int(invariant))
    g = heads // kv_heads
    for s, (ql, cl) in enumerate(specs):
        slots = np.array([tables[s][p // bs] * bs + p % bs for p in range(cl + ql)])
        for h in range(heads):
            kk = k[(h // g) * num_blocks * bs + slots].astype(np.float64)
            vv = v[(h // g) * num_blocks * bs + slots].astype(np.float64)
            for t in range(ql):
                sc = kk[:cl + t + 1] @ q[info[s][0] + t, h].astype(np.float64) * 0.125
                p = np.exp(sc - sc.max())
                want = (p / p.sum()) @ vv[:cl + t + 1]
                np.testing.assert_allclose(out[info[s][0] + t, h], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("invariant", [0, 1])
def test_paged_attention_matches_the_paddle_path(lib, invariant):
    """Prefill chunks over a context and decodes of several sequences: the portable
    unit's attention against fdx.ops.attention's Paddle path on the same cache."""
    import paddle

    from fdx.ops import attention
    rng = np.random.default_rng(8)
    heads, kv_heads, d, bs, num_blocks = 9, 3, 64, 16, 40
    specs = [(37, 0), (1, 70), (5, 200), (1, 15)]           # (query_len, context_len)
    k = rng.standard_normal((kv_heads * num_blocks * bs, d)).astype(np.float32)
    v = rng.standard_normal((kv_heads * num_blocks * bs, d)).astype(np.float32)
    perm = rng.permutation(num_blocks).tolist()
    tables, at = [], 0
    for ql, cl in specs:
        need = (ql + cl + bs - 1) // bs
        tables.append(perm[at:at + need])
        at += need
    width = max(len(t) for t in tables)
    table_arr = np.array([t + [0] * (width - len(t)) for t in tables], np.int32)
    info, row = [], 0
    for ql, cl in specs:
        info.append([row, ql, cl, row])
        row += ql
    q = rng.standard_normal((row, heads, d)).astype(np.float32)
    out = np.empty_like(q)
    lib.check_attention(f32p(q), f32p(k), f32p(v), f32p(out), f32p(np.array(info, np.int32)), f32p(table_arr),
                        ctypes.c_int64(width), ctypes.c_int64(heads), ctypes.c_int64(kv_heads), ctypes.c_int64(d),
                        ctypes.c_int64(bs), ctypes.c_int64(num_blocks * bs), ctypes.c_float(0.125),
                        ctypes.c_int64(len(specs)), ctypes.c_int(invariant))
    meta = attention.build_attention_metadata([ql for ql, _ in specs], [cl for _, cl in specs], tables, bs, kv_heads,
                                              num_blocks * bs, impl="paddle", num_heads=heads)
    want = attention.paged_attention(paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v), meta, 0.125)
    np.testing.assert_allclose(out, want.numpy(), rtol=2e-5, atol=2e-5)
