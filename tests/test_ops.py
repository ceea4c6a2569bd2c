"""fdx.ops against plain float64 numpy references."""
import os

import numpy as np
import paddle
import pytest

from fdx.ops import cpp
from fdx.ops.activation import silu_and_mul
from fdx.ops.attention import build_attention_metadata, paged_attention, write_kv
from fdx.ops.norm import add_rms_norm, rms_norm
from fdx.ops.rotary import RotaryEmbedding

ATOL = RTOL = 1e-4

# (impl, cpp_max_query_len): the compiled kernel for every sequence, and for
# decodes only with prefill chunks on the Paddle path (output assembly).
IMPLS = [
    pytest.param(("paddle", None), id="paddle"),
    pytest.param(("cpp", None), id="cpp"),
    pytest.param(("cpp", 1), id="cpp-decodes"),
]


@pytest.fixture(params=IMPLS)
def impl(request):
    name, max_q = request.param
    if name == "cpp" and not cpp.available():
        pytest.skip(f"compiled ops unavailable: {cpp.unavailable_reason()}")
    return {"impl": name, "cpp_max_query_len": max_q}


def t(a: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(np.ascontiguousarray(a))


# ---------------------------------------------------------------- norm, act


def ref_rms_norm(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("shape", [(7, 48), (5, 3, 16), (1, 576)])
def test_rms_norm(shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    out = rms_norm(t(x), t(w), 1e-6).numpy()
    np.testing.assert_allclose(out, ref_rms_norm(x, w, 1e-6), atol=ATOL, rtol=RTOL)


def test_add_rms_norm():
    rng = np.random.default_rng(1)
    x, r = rng.standard_normal((2, 6, 40)).astype(np.float32)
    w = rng.standard_normal(40).astype(np.float32)
    out, summed = add_rms_norm(t(x), t(r), t(w), 1e-5)
    np.testing.assert_allclose(summed.numpy(), x.astype(np.float64) + r, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(out.numpy(), ref_rms_norm(x.astype(np.float64) + r, w, 1e-5), atol=ATOL, rtol=RTOL)


def test_silu_and_mul():
    rng = np.random.default_rng(2)
    x = (3 * rng.standard_normal((9, 2 * 24))).astype(np.float32)
    a, b = x[:, :24].astype(np.float64), x[:, 24:]
    np.testing.assert_allclose(silu_and_mul(t(x)).numpy(), a / (1 + np.exp(-a)) * b, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------- rotary


def ref_rope(x, pos, base, neox, rotary_dim):
    """HF rotate_half (neox) / GPT-J rotate_every_two on the first rotary_dim dims."""
    x = x.astype(np.float64)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    inv = 1.0 / base ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    ang = pos[:, None].astype(np.float64) * inv[None, :]  # [N, rd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if neox:
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
        out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(rot.shape)
    return np.concatenate([out, rest], axis=-1)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [None, 16], ids=["full", "partial"])
def test_rotary(neox, rotary_dim):
    rng = np.random.default_rng(3)
    d, n, heads, kv_heads, base = 32, 11, 6, 2, 10000.0
    rope = RotaryEmbedding(d, 4096, base, is_neox_style=neox, rotary_dim=rotary_dim)
    pos = rng.integers(0, 4096, n)
    q = rng.standard_normal((n, heads, d)).astype(np.float32)
    k = rng.standard_normal((n, kv_heads, d)).astype(np.float32)
    qo, ko = rope(t(pos.astype(np.int64)), t(q), t(k))
    rd = rotary_dim or d
    np.testing.assert_allclose(qo.numpy(), ref_rope(q, pos, base, neox, rd), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(ko.numpy(), ref_rope(k, pos, base, neox, rd), atol=ATOL, rtol=RTOL)
    # Memoized cos/sin are per positions tensor: a new one is picked up.
    pos2 = rng.integers(0, 4096, n)
    qo2, _ = rope(t(pos2.astype(np.int64)), t(q), t(k))
    np.testing.assert_allclose(qo2.numpy(), ref_rope(q, pos2, base, neox, rd), atol=ATOL, rtol=RTOL)


def test_rotary_rejects_bad_rotary_dim():
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(32, 128, 10000.0, rotary_dim=15)


# ---------------------------------------------------------------- paged KV


class PagedSetup:
    """A random pool and per-sequence block tables with shuffled block ids."""

    def __init__(self, rng, totals, block_size, kv_heads, d, spare_blocks=3):
        need = [-(-n // block_size) for n in totals]
        self.num_blocks = sum(need) + len(totals) + spare_blocks
        self.num_slots = self.num_blocks * block_size
        ids = rng.permutation(self.num_blocks).tolist()
        self.tables = []
        for nb in need:
            extra = int(rng.integers(0, 2))  # tables may run past the needed blocks
            self.tables.append([ids.pop() for _ in range(nb)] + [ids.pop() for _ in range(extra)])
        self.block_size, self.kv_heads, self.d = block_size, kv_heads, d
        # NaN everywhere not written: reading a stale row poisons the output.
        nan = np.full((kv_heads * self.num_slots, d), np.nan, np.float32)
        self.k_cache, self.v_cache = t(nan), t(nan)

    def rows(self, seq, positions):
        table = np.asarray(self.tables[seq])
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        return np.arange(self.kv_heads)[:, None] * self.num_slots + slots[None, :]  # [KVH, n]

    def fill(self, seq, positions, k, v):
        """Write K/V [n, KVH, D] straight into the pool (context from earlier steps)."""
        rows = self.rows(seq, positions).reshape(-1)
        for cache, x in ((self.k_cache, k), (self.v_cache, v)):
            arr = cache.numpy()
            arr[rows] = x.transpose(1, 0, 2).reshape(-1, self.d)
            paddle.assign(t(arr), cache)

    def meta(self, query_lens, context_lens, seqs=None, **kw):
        tables = self.tables if seqs is None else [self.tables[s] for s in seqs]
        return build_attention_metadata(
            query_lens, context_lens, tables, self.block_size, self.kv_heads, self.num_slots, **kw
        )


def ref_attention(q, k, v, context_len, scale):
    """q [n, H, D] at positions context_len.. over K/V [L, KVH, D]; causal; HF repeat_kv."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kk = np.repeat(k.astype(np.float64), heads // kv_heads, axis=1)
    vv = np.repeat(v.astype(np.float64), heads // kv_heads, axis=1)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), kk) * scale
    allowed = np.arange(k.shape[0])[None, :] <= context_len + np.arange(q.shape[0])[:, None]
    s = np.where(allowed[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, vv)


def test_write_kv_rows_in_place():
    rng = np.random.default_rng(4)
    setup = PagedSetup(rng, [7, 5], block_size=4, kv_heads=3, d=8)
    meta = setup.meta([3, 5], [4, 0], impl="paddle")
    k = rng.standard_normal((8, 3, 8)).astype(np.float32)
    v = rng.standard_normal((8, 3, 8)).astype(np.float32)
    ptr = setup.k_cache.data_ptr()
    write_kv(setup.k_cache, setup.v_cache, t(k), t(v), meta)
    assert setup.k_cache.data_ptr() == ptr
    kc, vc = setup.k_cache.numpy(), setup.v_cache.numpy()
    table0, table1 = setup.tables
    expect_slots = [table0[p // 4] * 4 + p % 4 for p in (4, 5, 6)] + [table1[p // 4] * 4 + p % 4 for p in range(5)]
    assert meta.slot_mapping.numpy().tolist() == expect_slots
    assert meta.positions.numpy().tolist() == [4, 5, 6, 0, 1, 2, 3, 4]
    for tok, slot in enumerate(expect_slots):
        for h in range(3):
            np.testing.assert_array_equal(kc[h * setup.num_slots + slot], k[tok, h])
            np.testing.assert_array_equal(vc[h * setup.num_slots + slot], v[tok, h])
    assert np.isnan(kc).all(axis=1).sum() == kc.shape[0] - 8 * 3  # nothing else written


def run_step(setup, seqs, query_lens, context_lens, kv, q_all, heads, scale, impl):
    """One step: write the new tokens' K/V, attend, return outputs per sequence."""
    meta = setup.meta(query_lens, context_lens, list(seqs), **impl)
    ks, vs, qs = [], [], []
    for s, ql, cl in zip(seqs, query_lens, context_lens):
        ks.append(kv[s][0][cl : cl + ql])
        vs.append(kv[s][1][cl : cl + ql])
        qs.append(q_all[s][cl : cl + ql])
    write_kv(setup.k_cache, setup.v_cache, t(np.concatenate(ks)), t(np.concatenate(vs)), meta)
    out = paged_attention(t(np.concatenate(qs)), setup.k_cache, setup.v_cache, meta, scale).numpy()
    assert out.shape == (sum(query_lens), heads, setup.d)
    return np.split(out, np.cumsum(query_lens)[:-1])


def make_seqs(rng, totals, heads, kv_heads, d):
    kv = [
        (rng.standard_normal((n, kv_heads, d)).astype(np.float32), rng.standard_normal((n, kv_heads, d)).astype(np.float32))
        for n in totals
    ]
    q = [rng.standard_normal((n, heads, d)).astype(np.float32) for n in totals]
    return kv, q


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("d", [64, 128, 16])  # the kernel specializes 64 and 128 (an AVX2 prefill tile for both); 16 takes its generic path
def test_paged_attention_mixed_batch(impl, heads, kv_heads, block_size, d):
    rng = np.random.default_rng(100 + d)
    # (query_len, context_len): decodes with long/short/no context, prefill
    # chunks with and without context, in shuffled order.
    specs = [(1, 37), (1, 0), (9, 0), (1, 70), (5, 13), (1, 3), (20, 0), (3, 50), (1, 37), (2, 1)]
    specs = [specs[i] for i in rng.permutation(len(specs))]
    query_lens, context_lens = [s[0] for s in specs], [s[1] for s in specs]
    totals = [q + c for q, c in specs]
    setup = PagedSetup(rng, totals, block_size, kv_heads, d)
    kv, q_all = make_seqs(rng, totals, heads, kv_heads, d)
    for s, c in enumerate(context_lens):
        if c:
            setup.fill(s, np.arange(c), kv[s][0][:c], kv[s][1][:c])
    scale = d**-0.5
    outs = run_step(setup, range(len(specs)), query_lens, context_lens, kv, q_all, heads, scale, impl)
    for s, (ql, cl) in enumerate(specs):
        ref = ref_attention(q_all[s][cl : cl + ql], kv[s][0], kv[s][1], cl, scale)
        np.testing.assert_allclose(outs[s], ref, atol=ATOL, rtol=RTOL, err_msg=f"seq {s} q={ql} ctx={cl}")


@pytest.mark.parametrize("specs", [[(1, 255)] * 5, [(1, 10)], [(12, 0)], [(1, 5), (1, 6), (7, 2)]],
                         ids=["uniform-decode", "one-decode", "one-prefill", "decodes-first"])
def test_paged_attention_batch_shapes(impl, specs):
    rng = np.random.default_rng(7)
    heads, kv_heads, d, block_size = 6, 2, 128, 16
    query_lens, context_lens = [s[0] for s in specs], [s[1] for s in specs]
    totals = [q + c for q, c in specs]
    setup = PagedSetup(rng, totals, block_size, kv_heads, d)
    kv, q_all = make_seqs(rng, totals, heads, kv_heads, d)
    for s, c in enumerate(context_lens):
        setup.fill(s, np.arange(c), kv[s][0][:c], kv[s][1][:c])
    outs = run_step(setup, range(len(specs)), query_lens, context_lens, kv, q_all, heads, 0.3, impl)
    for s, (ql, cl) in enumerate(specs):
        ref = ref_attention(q_all[s][cl : cl + ql], kv[s][0], kv[s][1], cl, 0.3)
        np.testing.assert_allclose(outs[s], ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("specs,heads,kv_heads,d", [([(1, 300)], 6, 2, 128), ([(1, 200)], 9, 3, 64),
                                                     ([(1, 200), (1, 90)], 4, 1, 64), ([(1, 33)], 9, 3, 64)],
                         ids=["one-decode-d128", "one-decode-gqa3", "two-decodes-mqa", "short"])
def test_decode_attention_split_over_threads(threads, specs, heads, kv_heads, d):
    """A decode step with fewer (sequence, kv head) items than twice the threads splits
    each item's keys over the threads and merges the parts' softmaxes (AttendSplit);
    the outputs are full attention's, at every split (2 or 3 parts, uneven lengths)."""
    if not cpp.available():
        pytest.skip(f"compiled ops unavailable: {cpp.unavailable_reason()}")
    rng = np.random.default_rng(21)
    query_lens, context_lens = [s[0] for s in specs], [s[1] for s in specs]
    totals = [q + c for q, c in specs]
    setup = PagedSetup(rng, totals, 16, kv_heads, d)
    kv, q_all = make_seqs(rng, totals, heads, kv_heads, d)
    for s, c in enumerate(context_lens):
        setup.fill(s, np.arange(c), kv[s][0][:c], kv[s][1][:c])
    paddle.base.core.set_num_threads(threads)
    try:
        outs = run_step(setup, range(len(specs)), query_lens, context_lens, kv, q_all, heads, d**-0.5, {"impl": "cpp"})
    finally:
        paddle.base.core.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for s, (ql, cl) in enumerate(specs):
        ref = ref_attention(q_all[s][cl : cl + ql], kv[s][0], kv[s][1], cl, d**-0.5)
        np.testing.assert_allclose(outs[s], ref, atol=ATOL, rtol=RTOL, err_msg=f"seq {s} ctx={cl}")


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2)], ids=["gqa3", "gqa4"])
def test_chunked_steps_match_one_shot(impl, heads, kv_heads):
    """Fill the cache chunk by chunk over several steps (chunked prefill, then
    decodes, sequences joining late); every token's output equals full causal
    attention computed at once."""
    rng = np.random.default_rng(11)
    d, block_size = 16, 4
    totals = [30, 17, 41, 9]
    setup = PagedSetup(rng, totals, block_size, kv_heads, d)
    kv, q_all = make_seqs(rng, totals, heads, kv_heads, d)
    done = [0] * len(totals)
    got = [[] for _ in totals]
    step = 0
    while any(dn < n for dn, n in zip(done, totals)):
        seqs, qls, cls = [], [], []
        for s in rng.permutation(len(totals)):
            if done[s] >= totals[s] or (s == 3 and step < 2):  # seq 3 arrives late
                continue
            # a prefill chunk of random size while far from the end, else decodes
            left = totals[s] - done[s]
            ql = int(min(left, rng.integers(2, 12))) if left > 8 and rng.random() < 0.7 else 1
            seqs.append(s), qls.append(ql), cls.append(done[s])
        outs = run_step(setup, seqs, qls, cls, kv, q_all, heads, d**-0.5, impl)
        for s, ql, o in zip(seqs, qls, outs):
            got[s].append(o)
            done[s] += ql
        step += 1
    assert step > 5
    for s, n in enumerate(totals):
        ref = ref_attention(q_all[s], kv[s][0], kv[s][1], 0, d**-0.5)
        np.testing.assert_allclose(np.concatenate(got[s]), ref, atol=ATOL, rtol=RTOL, err_msg=f"seq {s}")


def test_metadata_rejects_bad_input():
    with pytest.raises(ValueError, match="block table"):
        build_attention_metadata([3], [4], [[0]], 4, 2, 64, impl="paddle")
    with pytest.raises(ValueError, match="differ in length"):
        build_attention_metadata([1, 1], [0], [[0]], 4, 2, 64, impl="paddle")
    with pytest.raises(ValueError, match="out of range"):
        build_attention_metadata([1], [0], [[16]], 4, 2, 64, impl="paddle")
    with pytest.raises(ValueError, match="impl"):
        build_attention_metadata([1], [0], [[0]], 4, 2, 64, impl="cuda")


def test_default_impl_respects_env(monkeypatch):
    monkeypatch.setenv("FDX_DISABLE_CPP_OPS", "1")
    assert not cpp.available()
    meta = build_attention_metadata([1], [0], [[0]], 4, 2, 64)
    assert meta.impl == "paddle"


def test_strided_views_from_fused_qkv(impl):
    """q/k/v sliced out of one fused projection (non-contiguous views) work
    through rotary, write_kv and paged_attention."""
    rng = np.random.default_rng(5)
    n, heads, kv_heads, d, bs = 6, 4, 2, 16, 4
    qkv = rng.standard_normal((n, (heads + 2 * kv_heads) * d)).astype(np.float32)
    fused = t(qkv)
    q = fused[:, : heads * d].reshape([n, heads, d])
    k = fused[:, heads * d : (heads + kv_heads) * d].reshape([n, kv_heads, d])
    v = fused[:, (heads + kv_heads) * d :].reshape([n, kv_heads, d])
    rope = RotaryEmbedding(d, 64, 10000.0)
    pos = np.arange(n)
    q, k = rope(t(pos.astype(np.int64)), q, k)
    setup = PagedSetup(rng, [n], bs, kv_heads, d)
    meta = setup.meta([n], [0], **impl)
    write_kv(setup.k_cache, setup.v_cache, k, v, meta)
    out = paged_attention(q, setup.k_cache, setup.v_cache, meta, 0.25).numpy()
    qn = ref_rope(qkv[:, : heads * d].reshape(n, heads, d), pos, 10000.0, True, d)
    kn = ref_rope(qkv[:, heads * d : (heads + kv_heads) * d].reshape(n, kv_heads, d), pos, 10000.0, True, d)
    vn = qkv[:, (heads + kv_heads) * d :].reshape(n, kv_heads, d)
    np.testing.assert_allclose(out, ref_attention(qn, kn, vn, 0, 0.25), atol=ATOL, rtol=RTOL)


def test_cpp_build_failure_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("FDX_DISABLE_CPP_OPS", raising=False)
    monkeypatch.setattr(cpp, "_SOURCES", [tmp_path / "missing.cc"])
    monkeypatch.setattr(cpp, "_tried", False)
    monkeypatch.setattr(cpp, "_module", None)
    monkeypatch.setattr(cpp, "_error", None)
    with caplog.at_level("WARNING", logger=cpp.__name__):
        assert not cpp.available()
        assert not cpp.available()
        assert build_attention_metadata([1], [0], [[0]], 4, 2, 64).impl == "paddle"
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    assert "missing.cc" in cpp.unavailable_reason()


@pytest.mark.parametrize("d,heads,kv_heads", [(64, 9, 3), (128, 4, 2), (16, 8, 2)], ids=["d64-gqa3", "d128", "d16"])
def test_a_query_rows_bits_do_not_depend_on_the_batch(d, heads, kv_heads):
    """Issue 40 item 4: a query row's output is the same bits whatever shares its step.
    Sequence 0 (150 tokens: three 64-key parts) is computed decode by decode alone on one
    thread (the row alone), then as one prefill, as prefill chunks beside other
    sequences' chunks and decodes (a resumed request recomputes its tokens this way),
    and as decodes beside others, on 1, 2 and 3 threads: every row array_equal. And
    full causal attention in float64 within the usual tolerance."""
    if not cpp.available():
        pytest.skip(f"compiled ops unavailable: {cpp.unavailable_reason()}")
    rng = np.random.default_rng(40)
    totals = [150, 70, 9, 131]
    setup = PagedSetup(rng, totals, 16, kv_heads, d)
    kv, q_all = make_seqs(rng, totals, heads, kv_heads, d)
    for s, n in enumerate(totals):
        setup.fill(s, np.arange(n), kv[s][0], kv[s][1])     # every key in place: steps only attend
    scale = d**-0.5

    def attend(steps, threads):
        """steps: lists of (seq, query_len, context_len); returns seq 0's rows by position."""
        got = {}
        paddle.base.core.set_num_threads(threads)
        try:
            for step in steps:
                meta = setup.meta([q for _, q, _ in step], [c for _, _, c in step], [s for s, _, _ in step],
                                  impl="cpp")
                q = t(np.concatenate([q_all[s][c:c + ql] for s, ql, c in step]))
                out = paged_attention(q, setup.k_cache, setup.v_cache, meta, scale).numpy()
                at = 0
                for s, ql, c in step:
                    if s == 0:
                        for i in range(ql):
                            got[c + i] = out[at + i]
                    at += ql
        finally:
            paddle.base.core.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        return np.stack([got[p] for p in range(totals[0])])

    alone = attend([[(0, 1, c)] for c in range(totals[0])], 1)
    ref = ref_attention(q_all[0], kv[0][0], kv[0][1], 0, scale)
    np.testing.assert_allclose(alone, ref, atol=ATOL, rtol=RTOL)
    one_prefill = [[(0, 150, 0)]]
    chunked = [[(1, 1, 60), (0, 37, 0), (2, 9, 0)], [(0, 50, 37), (3, 1, 130)], [(3, 1, 100), (0, 63, 87), (1, 5, 64)]]
    decodes = [[(3, 1, c % 131), (0, 1, c), (1, 1, c % 70)] for c in range(totals[0])]
    for threads in (1, 2, 3):
        for name, steps in (("one prefill", one_prefill), ("chunked", chunked), ("decodes", decodes)):
            got = attend(steps, threads)
            bad = [p for p in range(totals[0]) if not np.array_equal(got[p], alone[p])]
            assert not bad, f"{name}, {threads} threads: rows at positions {bad[:8]}... differ from the row alone"
