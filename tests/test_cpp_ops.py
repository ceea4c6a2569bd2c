"""The compiled CPU kernels (ops/csrc/fused_kernels.h) against the Paddle ops
they replace: SiLU-and-mul against ``F.swiglu`` (and float64 numpy), RMS norm
(with the residual add) against ``fused_rms_norm`` and the composed ops, and the
fused q/k/v split + q/k RMS norm + rotary + KV-cache write against the
composed ops (split, rms_norm, RotaryEmbedding, write_kv), which test_ops.py
checks against numpy. Then a tiny random model generates greedily with the
compiled kernels on and with FDX_DISABLE_CPP_OPS=1: the same tokens.

Every test takes the ``impl`` fixture (param "cpp"), so conftest marks it
slow: it builds the kernels on a fresh machine.
"""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from fdx.core import kernels
from fdx.core.interfaces import AttentionContext
from fdx.ops import cpp
from fdx.ops.activation import silu_and_mul
from fdx.ops.attention import build_attention_metadata, write_kv
from fdx.ops.norm import add_rms_norm, rms_norm
from fdx.ops.rotary import RotaryEmbedding
from fdx.plugins.backends.attention import CpuAttention, PaddleAttention
from fdx.plugins.models.layers import Llama3RotaryEmbedding
from test_contracts import cpu_kernel_table, host_runs_fused_rms_norm


@pytest.fixture(params=["cpp"])
def impl(request, monkeypatch):
    """The compiled kernels, with the cpu backend's probed table installed
    (the ops' defaults read it)."""
    monkeypatch.delenv("FDX_DISABLE_CPP_OPS", raising=False)
    if not cpp.available():
        pytest.skip(f"compiled ops unavailable: {cpp.unavailable_reason()}")
    monkeypatch.setattr(kernels, "_active", cpu_kernel_table())
    return request.param


def t(a: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(np.ascontiguousarray(a))


# ---------------------------------------------------------------- SiLU and mul


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (64, 2 * 1536), (7, 2 * 24), (3, 2 * 17), (2, 5, 2 * 40)],
                         ids=["smollm-decode1", "smollm-64", "odd-rows", "odd-width", "3d"])
def test_silu_and_mul_matches_swiglu(impl, shape):
    rng = np.random.default_rng(sum(shape))
    x = (4 * rng.standard_normal(shape)).astype(np.float32)
    x.reshape(-1)[:6] = [-100.0, 100.0, -88.5, 89.0, 0.0, -0.0]     # exp under/overflow, zero
    got = silu_and_mul(t(x), impl=impl).numpy()
    ref = F.swiglu(t(x)).numpy()
    assert got.shape == ref.shape == shape[:-1] + (shape[-1] // 2,)
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-6)
    i = shape[-1] // 2
    a, b = x[..., :i].astype(np.float64), x[..., i:]
    np.testing.assert_allclose(got, a / (1 + np.exp(-a)) * b, rtol=2e-6, atol=1e-6)


def test_silu_and_mul_default_follows_the_kernels(impl, monkeypatch):
    calls = []
    real = cpp.silu_and_mul
    monkeypatch.setattr(cpp, "silu_and_mul", lambda x: (calls.append(1), real(x))[1])
    x = t(np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32))
    silu_and_mul(x)
    assert calls == [1]                                 # loaded: the compiled kernel
    monkeypatch.setenv("FDX_DISABLE_CPP_OPS", "1")
    np.testing.assert_allclose(silu_and_mul(x).numpy(), F.swiglu(x).numpy(), rtol=1e-6)
    assert calls == [1]                                 # disabled: Paddle's swiglu
    with pytest.raises(ValueError, match="silu_and_mul impl"):
        silu_and_mul(x, impl="cuda")


# ---------------------------------------------------------------- RMS norm


@pytest.mark.parametrize("shape", [(1, 576), (64, 576), (513, 576), (7, 3, 64), (5, 33)],
                         ids=["smollm-1", "smollm-64", "parallel-odd", "per-head-3d", "odd-width"])
def test_rms_norm_matches_paddle(impl, shape):
    rng = np.random.default_rng(shape[0])
    x = (3 * rng.standard_normal(shape)).astype(np.float32)
    r = rng.standard_normal(shape).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(shape[-1])).astype(np.float32)
    paddle_impl = "fused" if host_runs_fused_rms_norm() else "reference"    # Paddle's own kernel where it runs
    got = rms_norm(t(x), t(w), 1e-5, impl=impl).numpy()
    np.testing.assert_allclose(got, rms_norm(t(x), t(w), 1e-5, impl=paddle_impl).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, rms_norm(t(x), t(w), 1e-5, impl="reference").numpy(), rtol=1e-5, atol=1e-6)
    out, summed = add_rms_norm(t(x), t(r), t(w), 1e-5, impl=impl)
    ref_out, ref_summed = add_rms_norm(t(x), t(r), t(w), 1e-5, impl=paddle_impl)
    assert out.shape == summed.shape == list(shape)
    np.testing.assert_array_equal(summed.numpy(), ref_summed.numpy())
    np.testing.assert_allclose(out.numpy(), ref_out.numpy(), rtol=1e-5, atol=1e-6)
    xr = x.astype(np.float64) + r
    np.testing.assert_allclose(out.numpy(), xr / np.sqrt((xr * xr).mean(-1, keepdims=True) + 1e-5) * w,
                               rtol=1e-5, atol=1e-5)


def test_rms_norm_default_follows_the_kernels(impl, monkeypatch):
    calls = []
    real = cpp.add_rms_norm
    monkeypatch.setattr(cpp, "add_rms_norm", lambda *a: (calls.append(1), real(*a))[1])
    from fdx.ops import norm
    x = t(np.random.default_rng(0).standard_normal((norm.CPP_MIN_ROWS, 8)).astype(np.float32))
    add_rms_norm(x, x, x[0], 1e-6)
    assert calls == [1]
    add_rms_norm(x[1:], x[1:], x[0], 1e-6)      # fewer rows: fused_rms_norm where it runs, else still compiled
    expected = [1] if host_runs_fused_rms_norm() else [1, 1]
    assert calls == expected
    monkeypatch.setenv("FDX_DISABLE_CPP_OPS", "1")
    add_rms_norm(x, x, x[0], 1e-6)
    assert calls == expected
    with pytest.raises(ValueError, match="rms_norm impl"):
        rms_norm(x, x[0], 1e-6, impl="cuda")


# ---------------------------------------------------------------- rope + KV write


def make_rope(kind: str, d: int, max_pos: int = 4096):
    if kind == "llama3":
        scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
        return Llama3RotaryEmbedding(d, max_pos, 5e5, True, scaling)
    if kind == "partial":
        return RotaryEmbedding(d, max_pos, 1e4, is_neox_style=True, rotary_dim=d // 2)
    return RotaryEmbedding(d, max_pos, 1e4, is_neox_style=(kind == "neox"))


class Pool:
    """A step of sequences over a random paged cache (shuffled block ids)."""

    def __init__(self, rng, n_tokens, kv_heads, d, block_size=16):
        # split N tokens over sequences: one prefill chunk with context, the rest decodes
        qlens = [n_tokens] if n_tokens <= 2 else [n_tokens - (n_tokens // 2)] + [1] * (n_tokens // 2)
        ctx = rng.integers(0, 300, len(qlens)).tolist()
        need = [-(-(q + c) // block_size) for q, c in zip(qlens, ctx)]
        num_blocks = sum(need) + 4
        ids = rng.permutation(num_blocks).tolist()
        tables = [[ids.pop() for _ in range(nb)] for nb in need]
        self.num_slots = num_blocks * block_size
        self.meta = build_attention_metadata(qlens, ctx, tables, block_size, kv_heads, self.num_slots,
                                             impl="paddle")
        self.init = rng.standard_normal((kv_heads * self.num_slots, d)).astype(np.float32)

    def caches(self):
        return t(self.init.copy()), t(self.init.copy())


def composed(qkv, positions, k_cache, v_cache, meta, h, kvh, d, rope, q_norm, k_norm, eps):
    """The model's Paddle path (plugins/models/layers.py), the oracle."""
    n = qkv.shape[0]
    q, k, v = paddle.split(qkv, [h * d, kvh * d, kvh * d], axis=-1)
    q, k, v = q.reshape([n, h, d]), k.reshape([n, kvh, d]), v.reshape([n, kvh, d])
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = rope(positions, q, k)
    write_kv(k_cache, v_cache, k, v, meta)
    return q


CASES = {  # id -> (heads, kv_heads, head_dim, rope kind, qk_norm)
    "smollm-9/3x64-neox": (9, 3, 64, "neox", False),
    "mha-4x32-interleaved": (4, 4, 32, "interleaved", False),
    "gqa-8/2x128-qknorm": (8, 2, 128, "neox", True),
    "gqa-6/2x16-interleaved-qknorm": (6, 2, 16, "interleaved", True),
    "llama3-4/1x64": (4, 1, 64, "llama3", False),
    "partial-rotary-4/2x32": (4, 2, 32, "partial", False),
    "odd-d-2/1x24-qknorm": (2, 1, 24, "interleaved", True),
}


@pytest.mark.parametrize("n", [1, 7, 64, 301])
@pytest.mark.parametrize("case", list(CASES))
def test_rope_write_kv_matches_composed_ops(impl, case, n):
    h, kvh, d, kind, qk_norm = CASES[case]
    rng = np.random.default_rng(n * 31 + d)
    rope = make_rope(kind, d)
    pool = Pool(rng, n, kvh, d)
    meta, eps = pool.meta, 1e-6
    qkv = t((2 * rng.standard_normal((n, (h + 2 * kvh) * d))).astype(np.float32))
    q_norm = t((1 + 0.3 * rng.standard_normal(d)).astype(np.float32)) if qk_norm else None
    k_norm = t((1 + 0.3 * rng.standard_normal(d)).astype(np.float32)) if qk_norm else None

    k_ref, v_ref = pool.caches()
    q_ref = composed(qkv, meta.positions, k_ref, v_ref, meta, h, kvh, d, rope, q_norm, k_norm, eps).numpy()

    k_got, v_got = pool.caches()
    ptr = k_got.data_ptr()
    q_got = cpp.rope_write_kv(qkv, meta.positions, meta.slot_mapping, k_got, v_got, rope.cos_cache, rope.sin_cache,
                              q_norm, k_norm, h, kvh, rope.rotary_dim, rope.is_neox_style, eps)
    assert q_got.shape == [n, h, d] and q_got.is_contiguous()
    assert k_got.data_ptr() == ptr                                   # written in place
    np.testing.assert_allclose(q_got.numpy(), q_ref, rtol=1e-5, atol=1e-5)
    # every row: the new tokens' K rotated and V copied; all the others untouched
    np.testing.assert_allclose(k_got.numpy(), k_ref.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(v_got.numpy(), v_ref.numpy())
    assert (k_got.numpy() != pool.init).any(axis=1).sum() == n * kvh


def test_cpu_backend_offers_the_fused_path_and_paddle_does_not(impl, monkeypatch):
    rng = np.random.default_rng(9)
    h, kvh, d = 9, 3, 64
    rope = make_rope("neox", d)
    pool = Pool(rng, 5, kvh, d)
    qkv = t(rng.standard_normal((5, (h + 2 * kvh) * d)).astype(np.float32))
    layout = dict(num_heads=h, num_kv_heads=kvh, head_dim=d, rope=rope, q_norm=None, k_norm=None, eps=1e-6)
    k_ref, v_ref = pool.caches()
    q_ref = composed(qkv, pool.meta.positions, k_ref, v_ref, pool.meta, h, kvh, d, rope, None, None, 1e-6)
    k_got, v_got = pool.caches()
    ctx = AttentionContext(CpuAttention(), pool.meta)
    q_got = ctx.rope_write_kv(qkv, pool.meta.positions, k_got, v_got, **layout)
    np.testing.assert_allclose(q_got.numpy(), q_ref.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k_got.numpy(), k_ref.numpy(), rtol=1e-5, atol=1e-5)
    assert AttentionContext(PaddleAttention(), pool.meta).rope_write_kv(qkv, pool.meta.positions, k_got, v_got,
                                                                          **layout) is None
    monkeypatch.setenv("FDX_DISABLE_CPP_OPS", "1")
    assert ctx.rope_write_kv(qkv, pool.meta.positions, k_got, v_got, **layout) is None
    assert AttentionContext(CpuAttention(), pool.meta).rope_write_kv(qkv, pool.meta.positions, k_got, v_got,
                                                                       **layout) is None


def test_rope_write_kv_rejects_bad_input(impl):
    rng = np.random.default_rng(2)
    h, kvh, d = 4, 2, 16
    rope = make_rope("neox", d, max_pos=32)
    pool = Pool(rng, 3, kvh, d)
    k, v = pool.caches()
    qkv = t(rng.standard_normal((3, (h + 2 * kvh) * d)).astype(np.float32))
    args = (k, v, rope.cos_cache, rope.sin_cache, None, None, h, kvh, d, True, 1e-6)
    ok_pos, ok_slots = t(np.array([0, 1, 2])), t(np.array([0, 1, 2]))
    with pytest.raises(Exception, match="outside the rotary table"):
        cpp.rope_write_kv(qkv, t(np.array([0, 32, 1])), ok_slots, *args)
    with pytest.raises(Exception, match="outside the cache"):
        cpp.rope_write_kv(qkv, ok_pos, t(np.array([0, pool.num_slots, 1])), *args)
    with pytest.raises(Exception, match="qkv must be"):
        cpp.rope_write_kv(qkv[:, :-1], ok_pos, ok_slots, *args)
    assert np.array_equal(k.numpy(), pool.init)                       # nothing written on an error


# ---------------------------------------------------------------- end to end


@pytest.mark.parametrize("name", ["llama-untied-bias-llama3", "qwen3-untied-bias-hd32", "ernie-untied-bias-hd32"])
def test_greedy_generation_same_with_and_without_compiled_ops(impl, name, monkeypatch):
    """A batch of sequences (prefill, then decodes at different lengths)
    through a tiny random model: cpu backend with the compiled kernels, then
    FDX_DISABLE_CPP_OPS=1 (all Paddle); same greedy tokens, close logits."""
    from tests.test_models import PagedRunner, build_case, prompt

    case = build_case(name, seed=4)
    fused, silu, norm = [], [], []
    real_fused, real_silu, real_norm = cpp.rope_write_kv, cpp.silu_and_mul, cpp.add_rms_norm
    monkeypatch.setattr(cpp, "rope_write_kv", lambda *a: (fused.append(1), real_fused(*a))[1])
    monkeypatch.setattr(cpp, "silu_and_mul", lambda x: (silu.append(1), real_silu(x))[1])
    monkeypatch.setattr(cpp, "add_rms_norm", lambda *a: (norm.append(1), real_norm(*a))[1])
    monkeypatch.setattr(cpp, "f32_blas_min_rows", lambda variant: cpp.QUANT_BLAS_MIN_ROWS)

    def generate(impl_name):
        runner = PagedRunner(case.fdx_model(), num_blocks=64, seed=3, impl=impl_name)
        # 130 prompt rows of float32 layers, past the rows the fused layer takes them for (held at
        # QUANT_BLAS_MIN_ROWS, 128, on every build), so the first step runs the composed layer (the
        # compiled ops counted below), the decodes the fused one
        prompts = {"a": prompt(63, 1), "b": prompt(5, 2), "c": prompt(62, 3)}
        assert 63 + 5 + 62 >= cpp.QUANT_BLAS_MIN_ROWS
        logits = runner.step(list(prompts.items()), rows="last")
        tokens = {s: [] for s in prompts}
        all_logits = [np.concatenate(logits)]
        for step in range(24):
            for s, row in zip(prompts, logits):
                tokens[s].append(int(row[-1].argmax()))
            batch = [(s, [tokens[s][-1]]) for s in prompts if not (s == "b" and step >= 16)]   # b stops early
            logits = runner.step(batch, rows="last")
            all_logits.append(np.concatenate(logits))
        return tokens, all_logits

    on_tokens, on_logits = generate("cpp")
    assert fused and silu and norm                                 # the compiled kernels ran
    monkeypatch.setenv("FDX_DISABLE_CPP_OPS", "1")
    counts = len(fused), len(silu), len(norm)
    off_tokens, off_logits = generate("paddle")
    assert (len(fused), len(silu), len(norm)) == counts            # and now they did not
    assert on_tokens == off_tokens
    assert all(len(set(v)) > 3 for v in on_tokens.values())       # real trajectories
    for a, b in zip(on_logits, off_logits):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_the_stack_structs_are_laid_out_from_the_library():
    """decoder_stack's ctypes structs are built from the layout the library reports
    (fdx_stack_layout: each field's offset, size and kind), not mirrored by hand: each
    field sits at the C offset with the C size, the structs have the C sizes; a layout
    that cannot be placed fails loudly instead of passing garbage to C."""
    import ctypes
    made = cpp.structs_from_layout("S 24\nS.a 0 4 f\nS.b 8 16 i\n")      # padding after a float
    assert ctypes.sizeof(made["S"]) == 24 and made["S"].b.offset == 8 and made["S"].b.size == 16
    for bad in ("S 16\nS.a 0 8 p\nS.b 4 8 i\n", "S 8\nS.a 0 8 q\n", "S 4\nS.a 0 8 p\n", "S.a 0\n"):
        with pytest.raises(RuntimeError):
            cpp.structs_from_layout(bad)
    if not cpp.available():
        pytest.skip(f"compiled ops unavailable: {cpp.unavailable_reason()}")
    library = ctypes.CDLL(str(cpp._library))
    library.fdx_stack_layout.restype = ctypes.c_char_p
    lines = library.fdx_stack_layout().decode().splitlines()
    binding = cpp._stack_binding()
    classes = {"FdxStackLayer": binding.Layer, "FdxStackStep": binding.Step}
    assert "FdxStackStep.residual_in" in {line.split()[0] for line in lines}
    for line in lines:
        name, offset, *rest = line.split()
        if "." not in name:
            assert ctypes.sizeof(classes[name]) == int(offset)
            continue
        struct, field = name.split(".")
        got = getattr(classes[struct], field)
        assert (got.offset, got.size) == (int(offset), int(rest[0])), line
    assert binding.max_parts == 3


def _attention_case(specs, h=9, kvh=3, d=64, bs=16, num_blocks=240, seed=11):
    """q for the rows of ``specs`` [(query_len, context_len)], caches, seq_info, tables (disjoint blocks)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((kvh * num_blocks * bs, d)).astype(np.float32)
    v = rng.standard_normal((kvh * num_blocks * bs, d)).astype(np.float32)
    width = num_blocks // len(specs)
    tables = rng.permutation(num_blocks)[:len(specs) * width].reshape(len(specs), width).astype(np.int32)
    return k, v, tables


def _invariant_attention(q, k, v, specs, tables, threads=2, h=9, kvh=3, bs=16, invariant=True, scale=0.125,
                         default_kernels=None):
    """cpp.paged_attention on sequences ``specs`` [(query_len, context_len)], q rows in order
    (tests/test_batch_invariance.py too); ``default_kernels``: its test-only switch."""
    info, at = [], 0
    for ql, cl in specs:
        info.append([at, ql, cl, at])
        at += ql
    paddle.base.core.set_num_threads(threads)
    try:
        return cpp.paged_attention(t(q), t(k), t(v), paddle.to_tensor(np.array(info, np.int32)),
                                   paddle.to_tensor(np.ascontiguousarray(tables)), scale, kvh, bs, at,
                                   invariant=invariant, default_kernels=default_kernels).numpy()
    finally:
        paddle.base.core.set_num_threads(2)


@pytest.mark.parametrize("h, kvh, d", [(9, 3, 64), (8, 2, 128)])
def test_default_attention_gives_a_batch_1_verify_row_its_decode_rows_bits(impl, h, kvh, d):
    """Issue 37: in the default mode (not backend.batch_invariant) a step of one
    sequence and T <= 16 query tokens (a speculative step's k + 1 verified rows)
    gives each row the bits a one-token step at its position gives (a decode
    step), on 1 and 2 threads, so greedy speculation at batch 1 keeps decoding's
    tokens. (Before, such a step ran the prefill tiles and a decode row the
    split over the threads: other last bits.)"""
    ctx = 300                                           # several parts of keys, split over the threads
    k, v, tables = _attention_case([None] * 2, h=h, kvh=kvh, d=d)
    q = np.random.default_rng(13).standard_normal((16, h, d)).astype(np.float32)
    for threads in (1, 2):
        decode = [_invariant_attention(q[t:t + 1], k, v, [(1, ctx + t)], tables[:1], threads, h, kvh,
                                       invariant=False)[0] for t in range(16)]
        for rows in (2, 9, 16):
            got = _invariant_attention(q[:rows], k, v, [(rows, ctx)], tables[:1], threads, h, kvh, invariant=False)
            for t in range(rows):
                assert np.array_equal(got[t], decode[t]), f"row {t} of {rows}, head_dim {d}, {threads} threads"


@pytest.mark.slow
def test_invariant_attention_rows_do_not_depend_on_the_batch(impl):
    """Issue 40 item 4: the batch-invariant attention (backend.batch_invariant) gives a
    query row the same bits as a decode row, in a prefill of 64 tokens, in chunks of 7, in
    a batch with other decodes and prefills, on 1 and 2 threads; and numpy's numbers."""
    h, kvh, d, ctx = 9, 3, 64, 200
    k, v, tables = _attention_case([None] * 4)
    rng = np.random.default_rng(12)
    q = rng.standard_normal((64, h, d)).astype(np.float32)
    full = _invariant_attention(q, k, v, [(64, ctx)], tables[:1])
    slots = np.array([tables[0][p // 16] * 16 + p % 16 for p in range(ctx + 64)])
    g = h // kvh
    for tok in (0, 31, 63):                  # numpy in float64, causal
        for head in range(h):
            kk = k[(head // g) * (k.shape[0] // kvh) + slots]
            vv = v[(head // g) * (v.shape[0] // kvh) + slots]
            sc = kk[:ctx + tok + 1].astype(np.float64) @ q[tok, head].astype(np.float64) * 0.125
            p = np.exp(sc - sc.max())
            np.testing.assert_allclose(full[tok, head], (p / p.sum()) @ vv[:ctx + tok + 1], rtol=1e-4, atol=1e-5)
    for threads in (1, 2):
        chunks = np.concatenate([_invariant_attention(q[i:i + 7], k, v, [(min(7, 64 - i), ctx + i)], tables[:1],
                                                      threads) for i in range(0, 64, 7)])
        assert np.array_equal(chunks, full), f"chunks of 7 on {threads} threads"
        for tok in (0, 40, 63):
            alone = _invariant_attention(q[tok:tok + 1], k, v, [(1, ctx + tok)], tables[:1], threads)
            assert np.array_equal(alone[0], full[tok]), f"decode row {tok} on {threads} threads"
            other = rng.standard_normal((1 + 1 + 30, h, d)).astype(np.float32)
            batch = np.concatenate([other[:1], q[tok:tok + 1], other[1:]])
            got = _invariant_attention(batch, k, v, [(1, 50), (1, ctx + tok), (1, 700), (30, 10)],
                                       tables[[1, 0, 2, 3]], threads)
            assert np.array_equal(got[1], full[tok]), f"row {tok} in a batch on {threads} threads"


# ---------------------------------------------------------------- the default mode's own kernels
# Where the CPU runs the invariant kernel's AVX-512 primitives and head_dim % 32 == 0, the default
# mode takes the batch-invariant kernel at every step (paged_attention_kernel.h InvariantStep), so
# the tests above reach the default kernels there only at other head_dims. They still run on
# AVX2-only CPUs and in multi-sequence steps there: cpp.paged_attention's test-only
# ``default_kernels`` forces them, build by build.


def _numpy_attention(q, k, v, specs, tables, h, kvh, bs, scale):
    """Causal paged attention of the rows of ``specs`` [(query_len, context_len)] in float64."""
    g, slots = h // kvh, k.shape[0] // kvh
    out, at = [], 0
    for s, (ql, cl) in enumerate(specs):
        pos = np.arange(cl + ql)
        rows = tables[s][pos // bs] * bs + pos % bs
        seq = np.empty((ql, h, q.shape[2]))
        for head in range(h):
            kk = k[(head // g) * slots + rows].astype(np.float64)
            vv = v[(head // g) * slots + rows].astype(np.float64)
            sc = q[at:at + ql, head].astype(np.float64) @ kk.T * scale               # [ql, cl + ql]
            sc[pos[None, :] > cl + np.arange(ql)[:, None]] = -np.inf                 # causal
            p = np.exp(sc - sc.max(1, keepdims=True))
            seq[:, head] = (p / p.sum(1, keepdims=True)) @ vv
        out.append(seq)
        at += ql
    return np.concatenate(out)


def _default_builds():
    """The builds of the default kernels this host runs: the AVX2 one (isa_avx2.cc) where the CPU
    has AVX2 + FMA and the x86 units are built; the portable one (AttendTile, this CPU's flags)."""
    from fdx.core.host import cpu_flags
    x86 = {"avx2", "fma"} <= set(cpu_flags()) and "-DFDX_NO_X86" not in cpp._cflags()
    return ["avx2", "portable"] if x86 else ["portable"]


DEFAULT_STEPS = {  # id -> [(query_len, context_len)]
    "batch-1-decode": [(1, 700)],                    # 2 threads: AVX2 AttendSplit (2 parts an item)
    "decodes": [(1, 700), (1, 40), (1, 333)],        # AVX2 AttendOne; AttendTile of 1 token
    "verify-9": [(9, 500)],                          # one sequence, <= 16 tokens: AttendPrefill
    "prefill": [(45, 100), (33, 0), (1, 200)],       # tiles of 32 and 13 tokens, one of 1 (AttendOne), a decode
}


@pytest.mark.parametrize("build", ["avx2", "portable"])
@pytest.mark.parametrize("h, kvh, d", [(9, 3, 64), (8, 2, 128), (6, 2, 80)])
def test_default_attention_kernels_match_numpy(impl, build, h, kvh, d):
    """The default mode's kernels (cpp.paged_attention's test-only ``default_kernels``): the AVX2
    build's AttendSplit, AttendOne and AttendPrefill (head_dim 64 and 128; others run the portable
    AttendTile), the portable build's AttendTile (here compiled for this CPU), on decode steps
    with and without the batch-1 split, a verify-sized step and prefill tiles, 1 and 2 threads,
    against float64 numpy. Each step's output is not the batch-invariant kernel's bits (so the
    switch did route away from it), and only the AVX2 batch-1 split depends on the threads."""
    if build not in _default_builds():
        pytest.skip(f"this host does not run the {build} build of the attention")
    k, v, tables = _attention_case([None] * 3, h=h, kvh=kvh, d=d)
    rng = np.random.default_rng(d + h)
    scale = d ** -0.5
    for name, specs in DEFAULT_STEPS.items():
        q = rng.standard_normal((sum(ql for ql, _ in specs), h, d)).astype(np.float32)
        want = _numpy_attention(q, k, v, specs, tables, h, kvh, 16, scale)
        run = lambda threads, **kw: _invariant_attention(q, k, v, specs, tables[:len(specs)], threads, h, kvh,  # noqa: E731
                                                         scale=scale, **kw)
        got = {threads: run(threads, invariant=False, default_kernels=build) for threads in (1, 2)}
        for threads, out in got.items():
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=f"{name} on {threads} threads")
            assert not np.array_equal(out, run(threads)), f"{name} on {threads} threads: the invariant kernel's bits"
        split = build == "avx2" and d in (64, 128) and name == "batch-1-decode"
        assert np.array_equal(got[1], got[2]) != split, f"{name}: AttendSplit {'did not run' if split else 'ran'}"


def test_default_kernels_switch_routes_by_build(impl):
    """``default_kernels`` names the build: "avx2" and "portable" are other kernels at head_dim 64
    (other bits), the same one at head_dim 80 (the AVX2 build takes 64 and 128 only);
    ``invariant`` wins over it; an unknown build is refused. Where the default mode itself takes
    the invariant kernel (AVX-512, head_dim % 32 == 0) its bits are the invariant kernel's."""
    from fdx.core.host import cpu_flags
    specs = [(9, 300), (1, 200)]
    for h, kvh, d in ((9, 3, 64), (6, 2, 80)):
        k, v, tables = _attention_case(specs, h=h, kvh=kvh, d=d)
        q = np.random.default_rng(d).standard_normal((10, h, d)).astype(np.float32)
        run = lambda **kw: _invariant_attention(q, k, v, specs, tables, 1, h, kvh, scale=d ** -0.5, **kw)  # noqa: E731
        portable = run(invariant=False, default_kernels="portable")
        if "avx2" in _default_builds():
            assert np.array_equal(run(invariant=False, default_kernels="avx2"), portable) == (d == 80), d
        invariant = run(invariant=True)
        assert np.array_equal(run(invariant=True, default_kernels="portable"), invariant)
        if d % 32 == 0 and "avx512f" in cpu_flags() and "avx2" in _default_builds():
            assert np.array_equal(run(invariant=False), invariant)
    with pytest.raises(ValueError, match="default_kernels 'avx512'"):
        run(invariant=False, default_kernels="avx512")
