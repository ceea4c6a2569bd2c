"""The ``paddle-block`` attention backend (Paddle's block_multihead_attention)
against the fake device layer: the kernel's host double
(tests/fake_paddle_kernels.py), itself checked against attention computed
independently the way Paddle's own unit test does, and fdx end to end on a
tiny random model against the CPU backend's tokens: mixed prefill and
decode steps, chunked prefill, prefix-cache hits, preemption and the swap
connector on the block-major KV layout. No GPU ran any of this."""
from __future__ import annotations

import logging

import numpy as np
import paddle
import pytest

from fake_paddle_kernels import FakeBlockMultiheadAttention
from fdx import SamplingParams
from fdx.ops import attention as ops_attention
from fdx.plugins.backends.block_attention import call_kernel, kernel_batch
from test_contracts import GREEDY, PROMPTS, FakeDevice, make_llm, prompts, token_ids, reference, tiny  # noqa: F401 (fixtures)


@pytest.fixture
def kernel(monkeypatch):
    """A CUDA fake device whose Paddle has block_multihead_attention (the double, float32 allowed)."""
    import paddle.incubate.nn.functional as IF
    from fdx.plugins.backends import gpu
    monkeypatch.setattr(gpu, "_logged", set())
    FakeDevice(monkeypatch, "cuda")
    double = FakeBlockMultiheadAttention(allow_float32=True)
    monkeypatch.setattr(IF, "block_multihead_attention", double)
    return double


# --- the double, against attention computed as Paddle's unit test does ---------------------------

def naive(q, k, v, causal):
    """q [T, H, D], k/v [S, KVH, D] -> [T, H, D] (GQA by repetition, numpy float64)."""
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[-1])
    if causal:
        s = s + np.triu(np.full(s.shape[1:], -np.inf), 1 + s.shape[2] - s.shape[1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v)


def padding_offsets_as_paddles_test(bsz, max_seq_len, lens):
    """get_padding_offset of test/legacy_test/test_block_multihead_attention.py, in numpy."""
    cum = np.zeros(bsz + 1, dtype=np.int64)
    cum[1:] = np.cumsum(max_seq_len - np.asarray(lens))
    padding, cu = [], np.zeros(bsz + 1, dtype=np.int64)
    for i in range(bsz):
        padding += [cum[i]] * lens[i]
        cu[i + 1] = (i + 1) * max_seq_len - cum[i + 1]
    return np.array(padding), cum[:-1], cu


def test_kernel_inputs_follow_paddles_padding_convention():
    lens, ctx = [3, 1, 5, 1], [0, 7, 0, 2]
    kb = kernel_batch(lens, ctx, [[4, 5], [0, 1], [2, 3], [6]])
    padding, cum, cu = padding_offsets_as_paddles_test(4, 5, lens)
    assert kb.max_seq_len == 5 and kb.num_tokens == 10
    assert kb.padding_offsets.numpy().tolist() == padding.tolist()
    assert kb.cum_offsets.numpy().tolist() == cum.tolist()
    assert kb.cu_seqlens_q.numpy().tolist() == kb.cu_seqlens_k.numpy().tolist() == cu.tolist()
    assert kb.seq_lens_encoder.numpy().tolist() == [3, 0, 5, 0]
    assert kb.seq_lens_decoder.numpy().tolist() == [0, 7, 0, 2]
    assert kb.block_tables.numpy().tolist() == [[4, 5], [0, 1], [2, 3], [6, -1]]
    with pytest.raises(ValueError, match="new prompts and single-token decodes only"):
        kernel_batch([2], [3], [[0, 1]])                     # a chunk on a context: not the kernel's


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_double_encoder_then_decoder_as_paddles_unit_test(heads, kv_heads):
    rng = np.random.default_rng(0)
    d, bs, lens = 16, 4, [5, 3]
    width = (heads + 2 * kv_heads) * d
    tables = [[3, 0], [2, 5]]
    kc = paddle.zeros([6, kv_heads, bs, d])
    vc = paddle.zeros([6, kv_heads, bs, d])
    double = FakeBlockMultiheadAttention(allow_float32=True)
    x = rng.standard_normal((sum(lens), width)).astype(np.float32)
    out = call_with(double, x, kc, vc, kernel_batch(lens, [0, 0], tables), bs)
    q, k, v = split(x, heads, kv_heads, d)
    want = np.concatenate([naive(q[:5], k[:5], v[:5], True), naive(q[5:], k[5:], v[5:], True)])
    np.testing.assert_allclose(out, want, atol=1e-5)
    # the cache holds each token's K/V at block_tables[i][pos // bs], pos % bs (block_cache_to_naive_cache)
    for i, start in ((0, 0), (1, 5)):
        for pos in range(lens[i]):
            blk = tables[i][pos // bs]
            np.testing.assert_array_equal(kc.numpy()[blk, :, pos % bs], k[start + pos])
            np.testing.assert_array_equal(vc.numpy()[blk, :, pos % bs], v[start + pos])
    # one decode step each: the new token at position len, attending over the cache
    y = rng.standard_normal((2, width)).astype(np.float32)
    out = call_with(double, y, kc, vc, kernel_batch([1, 1], lens, tables), bs)
    q2, k2, v2 = split(y, heads, kv_heads, d)
    want = np.concatenate([naive(q2[:1], np.concatenate([k[:5], k2[:1]]), np.concatenate([v[:5], v2[:1]]), False),
                           naive(q2[1:], np.concatenate([k[5:], k2[1:]]), np.concatenate([v[5:], v2[1:]]), False)])
    np.testing.assert_allclose(out, want, atol=1e-5)
    assert (double.calls, double.encoder_tokens, double.decoder_tokens) == (2, 8, 2)


def split(x, heads, kv_heads, d):
    n = x.shape[0]
    return (x[:, :heads * d].reshape(n, heads, d), x[:, heads * d:(heads + kv_heads) * d].reshape(n, kv_heads, d),
            x[:, (heads + kv_heads) * d:].reshape(n, kv_heads, d))


def call_with(double, x, kc, vc, kb, bs):
    import paddle.incubate.nn.functional as IF
    real = IF.block_multihead_attention
    IF.block_multihead_attention = double
    try:
        return call_kernel(paddle.to_tensor(x), kc, vc, kb, bs).numpy().reshape(x.shape[0], -1, kc.shape[3])
    finally:
        IF.block_multihead_attention = real


def test_double_checks_the_call_against_the_installed_signature():
    double = FakeBlockMultiheadAttention(allow_float32=True)
    kc = paddle.zeros([2, 1, 4, 8])
    kb = kernel_batch([2], [0], [[0]])
    args = [paddle.zeros([2, 24]), kc, kc, kb.seq_lens_encoder, kb.seq_lens_decoder, kb.seq_lens_this_time,
            kb.padding_offsets, kb.cum_offsets, kb.cu_seqlens_q, kb.cu_seqlens_k, kb.block_tables]
    double(*args, max_seq_len=2, block_size=4)
    with pytest.raises(TypeError):
        double(*args, max_seq_len=2, block_size=4, softmax_scale=0.5)          # no such argument
    with pytest.raises(TypeError):
        double(*args, *([None] * 15), 2, 4, False, False, 1, 127.0, -127.0, -1, "default", 1e4, "extra")
    with pytest.raises(AssertionError, match="block_size 8"):
        double(*args, max_seq_len=2, block_size=8)                              # not the caches' block size
    with pytest.raises(AssertionError, match="padding_offsets must be int32"):
        double(*args[:6], kb.padding_offsets.astype("int64"), *args[7:], max_seq_len=2, block_size=4)
    with pytest.raises(NotImplementedError, match="no kernel for paddle.float32"):
        FakeBlockMultiheadAttention()(*args, max_seq_len=2, block_size=4)    # the real registration


# --- fdx end to end on the fake device ---------------------------------------------------------------

def test_paddle_block_end_to_end_equals_the_cpu_backend(tiny, reference, kernel, monkeypatch):
    calls = []
    real = ops_attention.paged_attention
    monkeypatch.setattr(ops_attention, "paged_attention", lambda *a, **k: (calls.append(a[3].num_tokens),
                                                                           real(*a, **k))[1])
    llm = make_llm(tiny, dtype="float32")
    eng = llm.engine
    assert eng.backend.name == "cuda" and eng.attention.name == "paddle-block"
    assert eng.kv_spec.layout == "block_major"
    assert list(eng.kv_caches[0][0].shape) == [48, 2, 4, 16]
    kernel.calls = 0
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference      # prompts and decodes in mixed steps
    assert kernel.encoder_tokens >= sum(map(len, PROMPTS)) and kernel.decoder_tokens > 0
    assert not calls                                                    # nothing needed the reference


def test_chunks_prefix_hits_and_preemption_mix_the_kernel_and_the_reference(tiny, reference, kernel,
                                                                             monkeypatch):
    calls = []
    real = ops_attention.paged_attention
    monkeypatch.setattr(ops_attention, "paged_attention", lambda *a, **k: (calls.append(a[3].num_tokens),
                                                                           real(*a, **k))[1])
    llm = make_llm(tiny, dtype="float32", kv_cache="prefix", num_kv_blocks=16, max_num_batched_tokens=16,
                   max_num_seqs=3)
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference      # chunks (16-token budget), preemption
    assert calls, "no chunk continuation reached the reference"
    assert llm.engine.num_recomputed_tokens > 0                         # a preemption happened
    hits = llm.engine.kv_cache.stats()["prefix_cache_hits"]
    calls.clear()
    again = token_ids(llm.generate(prompts(), GREEDY))                  # prefix-cache hits now
    assert again == reference
    assert llm.engine.kv_cache.stats()["prefix_cache_hits"] > hits and calls   # a hit's rest: the reference


def test_swap_connector_reads_and_writes_block_major_blocks(tiny, reference, kernel):
    llm = make_llm(tiny, dtype="float32", kv_cache="prefix", num_kv_blocks=16, swap_max_blocks=64,
                   max_num_seqs=2)
    first = token_ids(llm.generate(prompts(), GREEDY))
    again = token_ids(llm.generate(prompts(), GREEDY))
    stats = llm.engine.connector.stats()
    assert first == again == reference
    assert stats["swap_loaded_blocks"] > 0, stats


SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True, logprobs=2)
SCORED = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def scored_reference(tiny):
    """Greedy tokens with their top-2 logprobs on the CPU backend's default parts (module scope:
    built before the function-scoped fake CUDA device of ``kernel``)."""
    llm = make_llm(tiny, dtype="float32")
    assert llm.engine.backend.name == "cpu"
    return llm.generate(prompts(), SCORED)


def test_sampled_requests_and_logprobs_on_paddle_block(tiny, scored_reference, kernel):
    """Logprobs on paddle-block equal the CPU backend's (same logits up to float error), and
    a seeded sampled request repeats there. (The seeded draws themselves are not compared
    across backends: the device sampler's random stream is its own. This test once compared
    two paddle-block engines with each other, which could not fail.)"""
    llm = make_llm(tiny, dtype="float32")
    assert llm.engine.attention.name == "paddle-block"
    scored = llm.generate(prompts(), SCORED)
    assert token_ids(scored) == token_ids(scored_reference)
    for got, ref in zip(scored, scored_reference):
        assert len(got.outputs[0].logprobs) == 8
        for pos_got, pos_ref in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert set(pos_got) == set(pos_ref)
            assert all(abs(pos_got[t].logprob - pos_ref[t].logprob) < 1e-4 for t in pos_got)
    a, b = llm.generate(prompts(), SAMPLED), llm.generate(prompts(), SAMPLED)
    assert token_ids(a) == token_ids(b) != token_ids(scored)
    assert all(len(o.outputs[0].logprobs) == 8 for o in a)


# --- selection ---------------------------------------------------------------------------------------

def test_cuda_picks_paddle_block_only_where_the_kernel_runs_at_the_models_dtype(tiny, monkeypatch, caplog):
    import paddle.incubate.nn.functional as IF
    from fdx.plugins.backends import gpu
    monkeypatch.setattr(gpu, "_logged", set())
    FakeDevice(monkeypatch, "cuda")
    monkeypatch.setattr(IF, "block_multihead_attention", FakeBlockMultiheadAttention())   # bf16/fp16 only
    with caplog.at_level(logging.INFO, logger="fdx.backends.gpu"):
        half = make_llm(tiny).engine                        # auto: bfloat16 (not run: no half matmul here)
        fp32 = make_llm(tiny, dtype="float32").engine
    assert half.attention.name == "paddle-block" and half.kv_spec.layout == "block_major"
    assert half.kv_spec.dtype == "bfloat16" and list(half.kv_caches[0][0].shape) == [48, 2, 4, 16]
    assert fp32.attention.name == "paddle" and fp32.kv_spec.layout == "head_major"
    assert fp32.backend.kernels["block_multihead_attention"].startswith("NotImplementedError: ")
    text = caplog.text
    assert "attention at bfloat16: paddle-block (block_multihead_attention)" in text
    assert "attention at float32: paddle, the ops/ reference (block_multihead_attention: NotImplementedError" \
        in text


def test_cuda_without_the_kernel_uses_the_reference(tiny, reference, monkeypatch):
    import paddle.incubate.nn.functional as IF
    FakeDevice(monkeypatch, "cuda")

    def missing(*a, **k):
        raise RuntimeError("(NotFound) The kernel `block_multihead_attention` is not registered")
    monkeypatch.setattr(IF, "block_multihead_attention", missing)
    llm = make_llm(tiny, dtype="float32")
    assert llm.engine.attention.name == "paddle" and llm.engine.kv_spec.layout == "head_major"
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference


def test_a_wrong_kernel_result_fails_the_probe(tiny, monkeypatch):
    import paddle.incubate.nn.functional as IF
    FakeDevice(monkeypatch, "cuda")
    double = FakeBlockMultiheadAttention(allow_float32=True)

    def off_by_one(*a, **k):
        out = double(*a, **k)
        return (out[0] + 1, *out[1:])
    monkeypatch.setattr(IF, "block_multihead_attention", off_by_one)
    eng = make_llm(tiny, dtype="float32").engine
    assert eng.attention.name == "paddle"
    assert "wrong result at float32" in eng.backend.kernels["block_multihead_attention"]


def test_a_kernel_that_fails_on_its_first_real_call_gives_way_to_the_reference(tiny, reference, monkeypatch,
                                                                               caplog):
    """The probe ran at head_dim 64; this build (say) has no kernel for the model's 16."""
    import paddle.incubate.nn.functional as IF
    from fdx.plugins.backends import gpu
    monkeypatch.setattr(gpu, "_logged", set())
    FakeDevice(monkeypatch, "cuda")
    double = FakeBlockMultiheadAttention(allow_float32=True)

    def no_head_dim_16(*a, **k):
        if a[1].shape[3] == 16:
            raise RuntimeError("(Unimplemented) head_dim 16 is not compiled")
        return double(*a, **k)
    monkeypatch.setattr(IF, "block_multihead_attention", no_head_dim_16)
    with caplog.at_level(logging.WARNING, logger="fdx.backends.gpu"):
        llm = make_llm(tiny, dtype="float32")
        assert llm.engine.attention.name == "paddle-block"
        assert token_ids(llm.generate(prompts(), GREEDY)) == reference
    assert llm.engine.attention.kernel_state.startswith("RuntimeError: (Unimplemented) head_dim 16")
    assert caplog.text.count("block_multihead_attention failed on its first call") == 1


def test_a_scale_other_than_the_kernels_is_folded_into_q(kernel):
    from fdx.core.interfaces import KVCacheSpec
    from fdx.plugins.backends.block_attention import PaddleBlockAttention
    rng = np.random.default_rng(5)
    spec = KVCacheSpec(1, 2, 16, 8, 4, "float32", "block_major")
    att = PaddleBlockAttention()
    meta = att.build_metadata([5], [0], [[2, 6]], spec, 4)
    q, k, v = (paddle.to_tensor(rng.standard_normal((5, h, 16)).astype(np.float32)) for h in (4, 2, 2))
    kc, vc = paddle.zeros(spec.shape()), paddle.zeros(spec.shape())
    att.write_kv(kc, vc, k, v, meta)
    out = att.forward(q, kc, vc, meta, 0.1).numpy()
    g = np.repeat
    s = np.einsum("thd,shd->hts", q.numpy(), g(k.numpy(), 2, axis=1)) * 0.1 + np.triu(np.full((5, 5), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), g(v.numpy(), 2, axis=1))
    np.testing.assert_allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("layout", ["head_major", "block_major"])
def test_kv_rows_address_each_block_where_the_layout_puts_it(layout):
    from fdx.core.interfaces import KVCacheSpec
    spec = KVCacheSpec(1, 3, 8, 5, 4, "float32", layout)
    t = paddle.zeros(spec.shape())
    marks = {}
    for block, head, off in [(0, 0, 0), (4, 2, 3), (2, 1, 1), (3, 0, 2)]:
        value = float(1 + len(marks))
        if layout == "block_major":
            t[block, head, off] = paddle.full([8], value)      # the kernel's [blocks, heads, block_size, dim]
        else:
            t[head * spec.num_slots + block * 4 + off] = paddle.full([8], value)
        marks[(block, head, off)] = value
    view = spec.row_view(t).numpy()
    for (block, head, off), value in marks.items():
        assert (view[spec.kv_rows([block * 4 + off])[head, 0]] == value).all()
    spec.row_view(t)[int(spec.kv_rows([5])[1, 0])] = paddle.full([8], 7.0)   # a write through the view
    assert float(t.numpy().sum()) == 8 * (1 + 2 + 3 + 4 + 7)


# --- fused rotary ---------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Ernie4_5ForCausalLM"])
def test_fused_rotary_runs_where_its_probe_matches_both_styles(arch, tiny_checkpoints, monkeypatch):
    import paddle.incubate.nn.functional as IF
    from fake_paddle_kernels import FakeFusedRotary
    path = str(tiny_checkpoints[arch][0])
    want = token_ids(make_llm(path).generate(prompts(), GREEDY))
    FakeDevice(monkeypatch, "cuda")
    double = FakeFusedRotary()
    monkeypatch.setattr(IF, "fused_rotary_position_embedding", double)
    llm = make_llm(path, dtype="float32")
    assert llm.engine.backend.kernels["fused_rotary_position_embedding"] is None
    double.calls = 0
    assert token_ids(llm.generate(prompts(), GREEDY)) == want
    assert double.calls > 0


def test_a_rotary_kernel_with_the_other_style_convention_fails_its_probe(tiny, reference, monkeypatch):
    """Had Paddle's use_neox_rotary_style meant what the name says in HF terms,
    the probe would catch it and fdx would keep its own rotary."""
    import paddle.incubate.nn.functional as IF
    from fake_paddle_kernels import FakeFusedRotary
    FakeDevice(monkeypatch, "cuda")
    double = FakeFusedRotary()
    monkeypatch.setattr(IF, "fused_rotary_position_embedding",
                        lambda *a, use_neox_rotary_style=True, **k: double(
                            *a, use_neox_rotary_style=not use_neox_rotary_style, **k))
    llm = make_llm(tiny, dtype="float32")
    assert "wrong result" in llm.engine.backend.kernels["fused_rotary_position_embedding"]
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference
