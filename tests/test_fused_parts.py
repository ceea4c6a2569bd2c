"""A fused weight's parts in one product (fdx.ops.parts, csrc/fused_parts.h).

A q/k/v or gate/up whose parts a file stores in different GGML kinds (Q4_K_M:
q and k in Q4_K, v in Q6_K; SmolLM2's Q4_K_M: Q5_0 beside Q8_0) is multiplied
in one call that quantizes each activation row once per activation form.
Checked against an independent float64 numpy product of the dequantized
blocks, bitwise against each part's own compiled product (the same kernels
over the same quantized rows), a row alone against the same row in a batch
(bitwise), in every build this CPU runs (AVX-512, AVX2, portable), and the
loader's stacking: same-kind neighbours concatenated, the rest a BlockStack
whose product equals the part-by-part one.
"""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

from fdx.core import kernels
from fdx.core.interfaces import BuildContext, RowStack
from fdx.ops import cpp, parts
from fdx.ops.probes import PARTS_PROBE_STACKS, act_block, int8_blocks, random_quantized
from fdx.plugins.models.weight_formats import AutoFormat, BlockStack, BlockWeight, stack
from test_contracts import cpu_kernel_table

pytestmark = pytest.mark.skipif(not cpp.available(), reason=f"compiled ops unavailable: {cpp.unavailable_reason()}")

STACKS = (("q4_k", "q4_k", "q6_k"), ("q4_k", "q6_k"), ("q5_0", "q8_0"), *PARTS_PROBE_STACKS[1:])
ROWS = (1, 2, 7, 8, 13, 33)


def usable(variant: str) -> None:
    table = cpu_kernel_table()
    name = parts.parts_kernel_name(variant)
    if not table.usable(name):
        pytest.skip(f"{name} does not run here: {table.why_not(name)}")


def random_parts(kinds, rng, cols: int = 512):
    """Random blocks of each kind (rows 8, 16, 24, ...: interleaved where the dense path repacks)."""
    ps = [random_quantized(k, 8 * (i + 1), cols, rng) for i, k in enumerate(kinds)]
    for q in ps:
        q.prepare()
    return ps


def tensor(a):
    import paddle
    return paddle.to_tensor(np.ascontiguousarray(a, dtype=np.float32))


@pytest.mark.parametrize("variant", cpp.QUANT_VARIANTS)
@pytest.mark.parametrize("kinds", STACKS, ids="+".join)
def test_one_call_equals_numpy_and_each_part_bitwise(variant, kinds):
    usable(variant)
    rng = np.random.default_rng(zlib.crc32("+".join(kinds).encode()))
    ps = random_parts(kinds, rng)
    for m in ROWS:
        x = rng.standard_normal((m, 512)).astype(np.float32)
        got = parts.matmul(tensor(x), ps, variant).numpy()
        assert got.shape == (m, sum(q.shape[0] for q in ps))
        each = np.concatenate([cpp.QUANT_MATMULS[variant](tensor(x), q).numpy() for q in ps], axis=1)
        assert np.array_equal(got, each), f"{m} rows: not the per-part product's bits"
        want = np.concatenate([int8_blocks(x, act_block(q.kind)).astype(np.float64)
                               @ q.dequantize().astype(np.float64).T for q in ps], axis=1)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-4, f"{m} rows: max relative error {err:.3g} against float64 numpy"


@pytest.mark.parametrize("variant", cpp.QUANT_VARIANTS)
@pytest.mark.parametrize("kinds", [("q4_k", "q6_k"), ("q4_0", "q8_0"), ("q5_k", "q4_1", "q5_0")], ids="+".join)
def test_a_row_alone_equals_it_in_a_batch(variant, kinds):
    """Under backend.batch_invariant (the kinds with blocks of 32 otherwise take
    another tile order from 12 rows on a VNNI CPU, as their own product does)."""
    usable(variant)
    rng = np.random.default_rng(7)
    ps = random_parts(kinds, rng)
    x = rng.standard_normal((33, 512)).astype(np.float32)
    invariant = dataclasses.replace(cpu_kernel_table(), batch_invariant=True)
    with kernels.using(invariant):
        batched = parts.matmul(tensor(x), ps, variant).numpy()
        for i in (0, 5, 12, 32):
            alone = parts.matmul(tensor(x[i:i + 1]), ps, variant).numpy()
            assert np.array_equal(alone[0], batched[i]), f"row {i}"
        for n in (2, 7, 8, 13):
            assert np.array_equal(parts.matmul(tensor(x[:n]), ps, variant).numpy(), batched[:n]), f"{n} rows"


def test_refused_where_each_part_would_take_blas_or_is_not_blocks():
    """None (the caller multiplies part by part) from the rows at which a
    part's own product dequantizes for BLAS, for one part, for wint parts."""
    rng = np.random.default_rng(3)
    ps = random_parts(("q4_0", "q8_0"), rng)
    table = cpu_kernel_table()
    variant = next((v for v in cpp.QUANT_VARIANTS if table.usable(parts.parts_kernel_name(v))), None)
    if variant is None:
        pytest.skip("no build of cpp.parts_matmul runs here")
    x = tensor(rng.standard_normal((4, 512)))
    with kernels.using(table):
        assert parts.matmul(x, ps) is not None
        assert parts.matmul(x, ps[:1]) is None
        assert parts.matmul(x, [random_quantized("wint8", 8, 512, rng), ps[0]]) is None
        blas = [cpp.quant_blas_min_rows(q.kind, variant) for q in ps]
        if any(b is not None for b in blas):
            m = min(b for b in blas if b is not None)
            assert parts.matmul(tensor(rng.standard_normal((m, 512))), ps) is None
    with kernels.using(kernels.REFERENCE):
        assert parts.matmul(x, ps) is None                     # nothing probed: part by part (the reference)


def test_loading_concatenates_same_kind_neighbours_and_stacks_the_rest():
    """A Q4_K_M q/k/v (Q4_K, Q4_K, Q6_K) is one Q4_K weight of q and k's rows
    beside v: a BlockStack, whose product (one call) equals the three parts'
    one by one bitwise, and whose row gathers (a tensor-parallel shard) stay
    one."""
    rng = np.random.default_rng(5)
    q, k, v = (BlockWeight(random_quantized(kind, rows, 512, rng))
               for kind, rows in (("q4_k", 16), ("q4_k", 8), ("q6_k", 8)))
    plain = [w.q.dequantize() for w in (q, k, v)]
    fused = AutoFormat({}, BuildContext(kernels=cpu_kernel_table())).fuse([q, k, v])
    assert type(fused) is BlockStack
    assert [(p.kind, p.shape[0]) for p in fused.parts] == [("q4_k", 24), ("q6_k", 8)]
    assert np.array_equal(fused.dequantize(), np.concatenate(plain))
    assert type(stack([q, k])) is BlockWeight                      # one kind: one weight
    x = tensor(rng.standard_normal((5, 512)))
    with kernels.using(cpu_kernel_table()):
        one_call = fused.matmul(x).numpy()
        by_part = RowStack([q, k, v]).matmul(x).numpy()
        assert np.array_equal(one_call, by_part)
        shard = fused.take_rows(np.arange(4, 28))
        assert type(shard) is BlockStack and [p.shape[0] for p in shard.parts] == [20, 4]
        assert np.array_equal(shard.matmul(x).numpy(), one_call[:, 4:28])
