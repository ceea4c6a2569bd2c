"""Host doubles of Paddle GPU kernels the CPU wheel does not have, for the
fake device layer (tests/test_backends.py, tests/test_device_parity.py).

``FakeBlockMultiheadAttention`` stands in for
``paddle.incubate.nn.functional.block_multihead_attention``. It is written
from Paddle's documentation of the wrapper, its unit test
(test/legacy_test/test_block_multihead_attention.py) and its GPU kernel's
source (block_multi_head_attention_kernel.cu), not from fdx:

- every call is first bound to the installed wrapper's
  ``inspect.signature`` (so argument names, order and count are the real
  ones), then dtypes, shapes and the KV layout [num_blocks, kv_heads,
  block_size, head_dim] are checked as the kernel needs them;
- tokens are located the kernel's way, through ``padding_offsets`` and
  ``max_seq_len`` (encoder and cache writes) and ``cum_offsets`` (the
  decoder's token of each sequence), so wrong offsets give wrong results;
- an encoder sequence (seq_lens_encoder > 0) attends causally over its new
  tokens only, written to cache positions 0..n-1; a decoder sequence
  (seq_lens_encoder 0, seq_lens_decoder c > 0, one token) writes its token
  at position c and attends over positions 0..c; a sequence with neither
  (a padding row) is skipped, its output rows left 0; scale 1/sqrt(head_dim);
  query head h reads KV head h // (heads / kv_heads);
- the caches are updated in place; returns (out, qkv, key_cache, value_cache).

It implements only what fdx uses (no rotary, masks, pre-caches or
quantization: those raise). The real kernel is registered for bfloat16 and
float16; ``allow_float32=True`` also takes float32, because the host has
no half-precision matmul to run a model in (fdx probes the kernel at the
model's dtype, so on a real GPU float32 never reaches it).
"""
from __future__ import annotations

import inspect

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF

REAL_BLOCK_MHA = IF.block_multihead_attention         # the installed wrapper, before any test replaces it
SIGNATURE = inspect.signature(REAL_BLOCK_MHA)
UNSUPPORTED = ("pre_key_cache", "pre_value_cache", "cache_k_quant_scales", "cache_v_quant_scales",
               "cache_k_dequant_scales", "cache_v_dequant_scales", "qkv_out_scale", "qkv_bias", "out_shift",
               "out_smooth", "rope_emb", "mask", "tgt_mask")


def _ints(t, name: str, shapes: list[tuple[int, ...]]) -> np.ndarray:
    assert t.dtype == paddle.int32, f"{name} must be int32, got {t.dtype}"
    assert tuple(t.shape) in shapes, f"{name} has shape {list(t.shape)}, expected one of {shapes}"
    return t.numpy().reshape(-1).astype(np.int64)


def _host(t) -> np.ndarray:
    return t.astype("float32").numpy()


class FakeBlockMultiheadAttention:
    def __init__(self, allow_float32: bool = False):
        self.allow_float32 = allow_float32
        self.calls = 0
        self.encoder_tokens = 0
        self.decoder_tokens = 0

    def __call__(self, *args, **kwargs):
        a = SIGNATURE.bind(*args, **kwargs)            # TypeError on a name or count the wrapper lacks
        a.apply_defaults()
        a = a.arguments
        for name in UNSUPPORTED:
            if a[name] is not None:
                raise NotImplementedError(f"the double does not implement {name}")
        assert not a["use_dynamic_cachekv_quant"] and a["out_scale"] <= 0, "no quantization in the double"
        qkv, kc, vc = a["qkv"], a["key_cache"], a["value_cache"]
        dtypes = {paddle.float16, paddle.bfloat16} | ({paddle.float32} if self.allow_float32 else set())
        if qkv.dtype not in dtypes:
            raise NotImplementedError(f"block_multihead_attention has no kernel for {qkv.dtype}")
        assert kc.dtype == vc.dtype == qkv.dtype, f"cache dtypes {kc.dtype}, {vc.dtype} != qkv {qkv.dtype}"
        assert a["compute_dtype"] in ("default", "bf16", "fp16", "fp32")
        assert len(kc.shape) == 4 and list(kc.shape) == list(vc.shape), f"caches {kc.shape}, {vc.shape}"
        num_blocks, kvh, bs, d = kc.shape
        assert bs == a["block_size"], f"block_size {a['block_size']} != the caches' {bs}"
        assert len(qkv.shape) == 2 and qkv.shape[1] % d == 0, f"qkv {qkv.shape} with head_dim {d}"
        heads = qkv.shape[1] // d - 2 * kvh
        assert heads > 0 and heads % kvh == 0, f"{heads} query heads over {kvh} KV heads"
        tokens = qkv.shape[0]
        bsz = a["cum_offsets"].shape[0]
        lens = [(bsz,), (bsz, 1)]
        enc = _ints(a["seq_lens_encoder"], "seq_lens_encoder", lens)
        dec = _ints(a["seq_lens_decoder"], "seq_lens_decoder", lens)
        now = _ints(a["seq_lens_this_time"], "seq_lens_this_time", lens)
        padding = _ints(a["padding_offsets"], "padding_offsets", [(tokens,)])
        cum = _ints(a["cum_offsets"], "cum_offsets", [(bsz,)])
        cu_q = _ints(a["cu_seqlens_q"], "cu_seqlens_q", [(bsz + 1,), (bsz + 1, 1)])
        cu_k = _ints(a["cu_seqlens_k"], "cu_seqlens_k", [(bsz + 1,), (bsz + 1, 1)])
        tables = a["block_tables"]
        assert tables.dtype == paddle.int32 and len(tables.shape) == 2 and tables.shape[0] == bsz
        tables = tables.numpy().astype(np.int64)
        max_len = a["max_seq_len"]
        for name, lens_ in (("max_enc_len_this_time", enc), ("max_dec_len_this_time", dec)):
            t = a[name]
            if t is not None:                          # read on the host at launch: sizing, so a bound
                assert t.place.is_cpu_place(), f"{name} must be on the CPU"
                assert t.dtype == paddle.int32 and t.shape == [1], name
                bound = int(t.numpy()[0])
                assert bound >= lens_.max() and (bound > 0) == (lens_.max() > 0), f"{name} {bound}: not a bound"
        assert now.sum() == tokens and (cu_q == np.concatenate([[0], np.cumsum(now)])).all(), "cu_seqlens_q"
        assert (cu_k == cu_q).all(), "cu_seqlens_k (no pre-cache: the same as cu_seqlens_q)"
        assert max_len >= now.max(), f"max_seq_len {max_len} < a sequence's {now.max()} tokens"
        for i in range(bsz):
            if enc[i] > 0:
                assert dec[i] == 0 and now[i] == enc[i], f"sequence {i}: encoder with a context or odd length"
            elif dec[i] > 0:
                assert now[i] == 1, f"sequence {i}: decoder with {now[i]} tokens"
            else:                                      # no encoder tokens, no context: the decoder skips it
                assert now[i] <= 1, f"sequence {i}: {now[i]} tokens but neither encoder nor decoder"

        x = _host(qkv)
        q = x[:, :heads * d].reshape(tokens, heads, d)
        k = x[:, heads * d:(heads + kvh) * d].reshape(tokens, kvh, d)
        v = x[:, (heads + kvh) * d:].reshape(tokens, kvh, d)
        kcache, vcache = _host(kc), _host(vc)
        written: list[tuple[int, int, int]] = []       # (block, offset, token)

        def slot(i: int, pos: int) -> tuple[int, int]:
            block = int(tables[i, pos // bs])
            assert 0 <= block < num_blocks, f"sequence {i}: block id {block} out of range"
            return block, pos % bs

        # encoder tokens, located as the kernel does: (t + padding_offsets[t]) = i * max_seq_len + pos
        ori = np.arange(tokens) + padding
        seq, pos = ori // max_len, ori % max_len
        enc_tokens = [t for t in range(tokens) if enc[seq[t]] > 0]
        for t in enc_tokens:
            assert cu_q[seq[t]] <= t < cu_q[seq[t] + 1], f"token {t}: padding_offsets disagree with cu_seqlens_q"
            written.append((*slot(seq[t], pos[t]), t))
        # each decoder's token: i * max_seq_len - cum_offsets[i]
        dec_token = {i: i * max_len - int(cum[i]) for i in range(bsz) if enc[i] == 0 and dec[i] > 0}
        for i, t in dec_token.items():
            written.append((*slot(i, int(dec[i])), t))
        for block, off, t in written:
            kcache[block, :, off], vcache[block, :, off] = k[t], v[t]

        out = np.zeros((tokens, heads, d), dtype=np.float32)
        group = heads // kvh
        scale = 1.0 / np.sqrt(d)
        for i in range(bsz):
            if enc[i] > 0:
                rows = np.arange(cu_q[i], cu_q[i + 1])
                kk, vv = k[rows], v[rows]                          # the new tokens only
                causal = np.tril(np.ones((len(rows), len(rows)), dtype=bool))
                qs = q[rows]
            elif i in dec_token:
                n = int(dec[i]) + 1
                blocks = [slot(i, p) for p in range(n)]
                kk = np.stack([kcache[b, :, o] for b, o in blocks])  # [n, kvh, d] from the cache
                vv = np.stack([vcache[b, :, o] for b, o in blocks])
                rows = np.array([dec_token[i]])
                causal = np.ones((1, n), dtype=bool)
                qs = q[rows]
            else:
                continue
            kk, vv = np.repeat(kk, group, axis=1), np.repeat(vv, group, axis=1)
            s = np.einsum("thd,shd->hts", qs, kk) * scale
            s = np.where(causal[None], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[rows] = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), vv)

        if written:                                                   # in place, as the kernel
            for cache, host in ((kc, kcache), (vc, vcache)):
                paddle.assign(paddle.to_tensor(host).astype(cache.dtype), output=cache)
        self.calls += 1
        self.encoder_tokens += len(enc_tokens)
        self.decoder_tokens += len(dec_token)
        fmha = paddle.to_tensor(out.reshape(tokens, heads * d)).astype(qkv.dtype)
        return fmha, qkv, kc, vc


REAL_FUSED_ROPE = IF.fused_rotary_position_embedding
ROPE_SIGNATURE = inspect.signature(REAL_FUSED_ROPE)


class FakeFusedRotary:
    """Stands in for ``fused_rotary_position_embedding``, from its docstring:
    q/k/v [batch, seq, heads, head_dim] (time_major False), sin and cos
    [1, seq, 1, head_dim] (or [seq, head_dim]); ``use_neox_rotary_style=True``
    rotates every two adjacent numbers, False the front and back halves;
    out = x * cos + rotated(x) * sin. Returns (out_q, out_k, out_v), None
    where an input was None. Takes only the sin/cos form fdx uses."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        a = ROPE_SIGNATURE.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        assert a["position_ids"] is None and not a["time_major"], "the double takes sin/cos per token only"
        sin, cos = a["sin"], a["cos"]
        assert sin is not None and cos is not None
        outs = []
        for x in (a["q"], a["k"], a["v"]):
            if x is None:
                outs.append(None)
                continue
            assert len(x.shape) == 4 and x.shape[-1] % 2 == 0, f"q/k/v {x.shape}"
            b, s, h, d = x.shape
            assert list(sin.shape) in ([1, s, 1, d], [s, d]) and list(cos.shape) == list(sin.shape)
            assert sin.dtype == cos.dtype == x.dtype, f"sin/cos {sin.dtype} with x {x.dtype}"
            xs = _host(x)
            sn, cs = _host(sin).reshape(1, s, 1, d), _host(cos).reshape(1, s, 1, d)
            if a["use_neox_rotary_style"]:                      # adjacent pairs
                rot = np.stack([-xs[..., 1::2], xs[..., 0::2]], axis=-1).reshape(xs.shape)
            else:                                               # halves
                rot = np.concatenate([-xs[..., d // 2:], xs[..., :d // 2]], axis=-1)
            outs.append(paddle.to_tensor(xs * cs + rot * sn).astype(x.dtype))
        self.calls += 1
        return tuple(outs)


REAL_FUSED_RMS_NORM = IF.fused_rms_norm
RMS_NORM_SIGNATURE = inspect.signature(REAL_FUSED_RMS_NORM)


class FakeFusedRmsNorm:
    """Stands in for a device's ``fused_rms_norm`` on a host whose own CPU
    kernel cannot run (Paddle 3.3.1's dies by SIGILL without AVX-512), from
    its docstring: normalize over the axes from ``begin_norm_axis``, with
    ``residual`` added first; returns (out, x + residual) with a residual,
    else (out, None). Computed in float64 numpy, returned in x's dtype."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        a = RMS_NORM_SIGNATURE.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        assert a["norm_bias"] is None and a["bias"] is None and a["quant_scale"] == -1, "fdx passes none of these"
        self.calls += 1
        x = _host(a["x"]).astype(np.float64)
        if a["residual"] is not None:
            x = x + _host(a["residual"])
        axes = tuple(range(a["begin_norm_axis"], x.ndim))
        out = x / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + a["epsilon"]) * _host(a["norm_weight"])
        dtype = a["x"].dtype
        summed = paddle.to_tensor(x.astype(np.float32)).astype(dtype) if a["residual"] is not None else None
        return paddle.to_tensor(out.astype(np.float32)).astype(dtype), summed
