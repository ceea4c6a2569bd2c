"""The ``paddle-block`` attention backend: Paddle's fused GPU kernel
``paddle.incubate.nn.functional.block_multihead_attention`` over a
block-major KV cache (``KVCacheSpec.layout == "block_major"``: per layer k
and v of shape [num_blocks, num_kv_heads, block_size, head_dim], the
kernel's own layout).

What the kernel does (Paddle's kernel source and its unit test
test/legacy_test/test_block_multihead_attention.py): one call per layer
takes the step's packed q|k|v rows [tokens, (H + 2 * KVH) * D] and, per
sequence of the batch,

- an *encoder* sequence (``seq_lens_encoder[i] = n > 0``,
  ``seq_lens_decoder[i] = 0``): causal attention over its n new tokens
  only, which it writes to cache positions 0..n-1;
- a *decoder* sequence (``seq_lens_encoder[i] = 0``,
  ``seq_lens_decoder[i] = c > 0``, one token): writes the token at
  position c and attends over positions 0..c of its blocks.

Tokens are located through the padded-batch offsets every Paddle kernel of
this family takes: with ``max_seq_len`` >= every sequence's new tokens,
``cum_offsets[i] = i * max_seq_len - cu_seqlens_q[i]`` and each token of
sequence i has ``padding_offsets = cum_offsets[i]``. The scale is
1/sqrt(head_dim); rotary is off here (``rope_emb=None``) because fdx's
models rotate q and k before attention.

What it cannot do, and what runs instead: a sequence with new tokens on
top of cached ones (a chunked-prefill continuation, or a prompt after a
prefix-cache or KV-connector hit) is neither, since the kernel's encoder
path neither reads nor offsets past cached positions. Those sequences run
the ops/ reference (``fdx.ops.attention`` on the same block-major cache),
in the same step as the kernel's; everything else (new prompts, decodes,
preempted requests recomputed from scratch) runs the kernel. The kernel is
registered for bfloat16 and float16 only: the cuda backend probes it at the
model's dtype and uses ``paddle`` (the reference) when that fails.

Never run on a GPU: tested against a host double of the kernel written
from Paddle's documentation and unit test (tests/fake_paddle_kernels.py).
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fdx.core import kernels
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import AttentionBackend, KVCacheSpec

if TYPE_CHECKING:
    import paddle
    from fdx.ops import attention as ops_attention


@functools.cache
def _ops():
    """fdx.ops.attention, imported on first use: Paddle loads only where
    attention runs (never in a tensor parallel engine process)."""
    from fdx.ops import attention
    return attention


@dataclass
class KernelBatch:
    """The kernel's per-step inputs for the sequences it runs (int32, on the device,
    except the two max lengths, which the kernel wants on the host)."""
    num_tokens: int
    seq_lens_encoder: paddle.Tensor      # [bsz]
    seq_lens_decoder: paddle.Tensor      # [bsz]
    seq_lens_this_time: paddle.Tensor    # [bsz]
    padding_offsets: paddle.Tensor       # [tokens]
    cum_offsets: paddle.Tensor           # [bsz]
    cu_seqlens_q: paddle.Tensor          # [bsz + 1]
    cu_seqlens_k: paddle.Tensor          # [bsz + 1]
    block_tables: paddle.Tensor          # [bsz, max blocks], -1 past each table
    max_enc_len_this_time: paddle.Tensor  # [1], CPU
    max_dec_len_this_time: paddle.Tensor  # [1], CPU
    max_seq_len: int


@dataclass
class BlockAttentionMetadata:
    positions: paddle.Tensor                       # int64 [N], every token of the step
    num_tokens: int
    kernel: KernelBatch | None                     # the sequences the kernel runs
    reference: ops_attention.AttentionMetadata | None   # the others (the ops/ reference)
    kernel_rows: paddle.Tensor | None              # int64: their token rows (None: all, in order)
    reference_rows: paddle.Tensor | None
    out_perm: paddle.Tensor | None                 # restores batch order after [kernel, reference]
    pending: tuple[Any, Any] | None = None         # this layer's k, v for the kernel (write_kv -> forward)
    kernel_args: tuple | None = None               # (query_lens, context_lens, tables, spec, heads) of
    kernel_as_reference: ops_attention.AttentionMetadata | None = None   # its sequences, should it fail


def kernel_batch(query_lens: np.ndarray, context_lens: np.ndarray, tables: list[list[int]],
                 place: Any = None) -> KernelBatch:
    """The kernel's inputs for sequences that are all new prompts (context 0) or
    decodes (one token on a context)."""
    q = np.asarray(query_lens, dtype=np.int64)
    c = np.asarray(context_lens, dtype=np.int64)
    if ((c > 0) & (q != 1)).any():
        raise ValueError("block_multihead_attention runs new prompts and single-token decodes only")
    bsz = len(q)
    max_seq_len = int(q.max())
    cu = np.zeros(bsz + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    cum_offsets = np.arange(bsz) * max_seq_len - cu[:-1]
    width = max(1, max(len(t) for t in tables))
    bt = np.full((bsz, width), -1, dtype=np.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    enc = np.where(c == 0, q, 0)
    dec = np.where(c == 0, 0, c)
    import paddle

    def i32(a):
        return paddle.to_tensor(np.ascontiguousarray(a, dtype=np.int32))
    cpu = paddle.CPUPlace()
    return KernelBatch(
        num_tokens=int(cu[-1]), seq_lens_encoder=i32(enc), seq_lens_decoder=i32(dec), seq_lens_this_time=i32(q),
        padding_offsets=i32(np.repeat(cum_offsets, q)), cum_offsets=i32(cum_offsets), cu_seqlens_q=i32(cu),
        cu_seqlens_k=i32(cu), block_tables=paddle.to_tensor(bt),
        max_enc_len_this_time=paddle.to_tensor(np.array([enc.max()], dtype=np.int32), place=cpu),
        max_dec_len_this_time=paddle.to_tensor(np.array([dec.max()], dtype=np.int32), place=cpu),
        max_seq_len=max_seq_len)


@kernels.implements("block_multihead_attention")
def call_kernel(qkv, k_cache, v_cache, kb: KernelBatch, block_size: int):
    """One block_multihead_attention call; returns fmha_out [tokens, H * D]."""
    import paddle.incubate.nn.functional as IF
    return IF.block_multihead_attention(
        qkv, k_cache, v_cache, kb.seq_lens_encoder, kb.seq_lens_decoder, kb.seq_lens_this_time,
        kb.padding_offsets, kb.cum_offsets, kb.cu_seqlens_q, kb.cu_seqlens_k, kb.block_tables,
        None, None,                  # pre_key_cache, pre_value_cache
        None, None, None, None,      # cache k/v quant and dequant scales
        None, None, None, None,      # qkv_out_scale, qkv_bias, out_shift, out_smooth
        kb.max_enc_len_this_time, kb.max_dec_len_this_time,
        None, None, None,            # rope_emb (fdx rotates before attention), mask (causal), tgt_mask
        max_seq_len=kb.max_seq_len, block_size=block_size, use_neox_style=False,
        compute_dtype="default")[0]


class PaddleBlockAttention(AttentionBackend):
    """The kernel's first call in a process decides: if it raises (a shape
    the start-up probe did not cover, say), that is logged once and every
    sequence runs the reference from then on; after one call that worked,
    errors propagate."""
    name = "paddle-block"
    layout = "block_major"
    status = "Paddle block_multihead_attention (new prompts and decodes), the ops/ reference for the rest"

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        self.kernel_state = "untried"            # "works", or why it failed

    def build_metadata(self, query_lens, context_lens, block_tables, spec: KVCacheSpec, num_heads: int):
        import paddle
        ops_attention = _ops()
        if spec.layout != self.layout:
            raise ValueError(f"paddle-block attention needs the block_major KV layout, not {spec.layout!r}")
        q = np.asarray(query_lens, dtype=np.int64)
        c = np.asarray(context_lens, dtype=np.int64)
        if not (len(q) == len(c) == len(block_tables)) or not len(q):
            raise ValueError("query_lens, context_lens and block_tables must be non-empty and of one length")
        starts = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=starts[1:])
        n = int(starts[-1])
        seq_of_token = np.repeat(np.arange(len(q)), q)
        positions = np.arange(n) - starts[seq_of_token] + c[seq_of_token]
        on_kernel = ((c == 0) | (q == 1)) & (self.kernel_state in ("untried", "works"))
        k_ids, r_ids = np.flatnonzero(on_kernel), np.flatnonzero(~on_kernel)
        kernel = reference = kernel_rows = reference_rows = out_perm = None
        kernel_args = None
        if k_ids.size:
            kernel_args = (q[k_ids].tolist(), c[k_ids].tolist(), [block_tables[i] for i in k_ids], spec, num_heads)
            kernel = kernel_batch(*kernel_args[:3])
        if r_ids.size:
            reference = ops_attention.build_attention_metadata(
                q[r_ids].tolist(), c[r_ids].tolist(), [block_tables[i] for i in r_ids], spec.block_size,
                spec.num_kv_heads, spec.num_slots, impl="paddle", num_heads=num_heads, layout=self.layout)
        if k_ids.size and r_ids.size:
            rows_k = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in k_ids])
            rows_r = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in r_ids])
            kernel_rows, reference_rows = paddle.to_tensor(rows_k), paddle.to_tensor(rows_r)
            out_perm = paddle.to_tensor(np.argsort(np.concatenate([rows_k, rows_r])).astype(np.int64))
        return BlockAttentionMetadata(paddle.to_tensor(positions), n, kernel, reference, kernel_rows,
                                      reference_rows, out_perm, kernel_args=kernel_args)

    def write_kv(self, k_cache, v_cache, k, v, metadata: BlockAttentionMetadata) -> None:
        import paddle
        ops_attention = _ops()
        m = metadata
        if m.kernel is not None:            # the kernel writes its sequences' K/V itself, in forward
            m.pending = (k, v) if m.kernel_rows is None else (paddle.gather(k, m.kernel_rows),
                                                              paddle.gather(v, m.kernel_rows))
            if m.kernel_as_reference is not None:   # it failed earlier in this step: the reference writes
                ops_attention.write_kv(k_cache.reshape([-1, k.shape[-1]]), v_cache.reshape([-1, v.shape[-1]]),
                                       *m.pending, m.kernel_as_reference)
        if m.reference is not None:
            kr = k if m.reference_rows is None else paddle.gather(k, m.reference_rows)
            vr = v if m.reference_rows is None else paddle.gather(v, m.reference_rows)
            ops_attention.write_kv(k_cache.reshape([-1, k.shape[-1]]), v_cache.reshape([-1, v.shape[-1]]),
                                   kr, vr, m.reference)

    def forward(self, q, k_cache, v_cache, metadata: BlockAttentionMetadata, scale: float):
        import paddle
        ops_attention = _ops()
        m = metadata
        n, heads, d = q.shape
        outs = []
        if m.kernel is not None:
            if m.pending is None:
                raise RuntimeError("paddle-block attention: forward before write_kv in this layer")
            k, v = m.pending
            m.pending = None
            qk = q if m.kernel_rows is None else paddle.gather(q, m.kernel_rows)
            t = m.kernel.num_tokens
            if m.kernel_as_reference is None:
                qs = qk if math.isclose(scale, d ** -0.5, rel_tol=1e-6) else qk * (scale * math.sqrt(d))
                # (the kernel's scale is 1/sqrt(D): another one is folded into q)
                qkv = paddle.concat([qs.reshape([t, heads * d]), k.reshape([t, -1]), v.reshape([t, -1])], axis=1)
                try:
                    outs.append(call_kernel(qkv, k_cache, v_cache, m.kernel, k_cache.shape[2])
                                .reshape([t, heads, d]))
                    self.kernel_state = "works"
                except Exception as e:
                    if self.kernel_state == "works":
                        raise
                    self._give_up(e, m, k_cache, v_cache, k, v)
            if m.kernel_as_reference is not None:
                outs.append(ops_attention.paged_attention(qk, k_cache.reshape([-1, d]), v_cache.reshape([-1, d]),
                                                          m.kernel_as_reference, scale))
        if m.reference is not None:
            qr = q if m.reference_rows is None else paddle.gather(q, m.reference_rows)
            outs.append(ops_attention.paged_attention(qr, k_cache.reshape([-1, d]), v_cache.reshape([-1, d]),
                                                      m.reference, scale))
        out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
        return out if m.out_perm is None else paddle.gather(out, m.out_perm)

    def _give_up(self, error: Exception, m: BlockAttentionMetadata, k_cache, v_cache, k, v) -> None:
        """The kernel's first call failed: the reference from now on (this step's
        kernel sequences too, from this layer on)."""
        ops_attention = _ops()
        self.kernel_state = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        logging.getLogger("fdx.backends.gpu").warning(
            "paddle-block: block_multihead_attention failed on its first call (%s): the ops/ reference "
            "attention runs instead", self.kernel_state)
        q_lens, c_lens, tables, spec, heads = m.kernel_args
        m.kernel_as_reference = ops_attention.build_attention_metadata(
            q_lens, c_lens, tables, spec.block_size, spec.num_kv_heads, spec.num_slots, impl="paddle",
            num_heads=heads, layout=self.layout)
        ops_attention.write_kv(k_cache.reshape([-1, k.shape[-1]]), v_cache.reshape([-1, v.shape[-1]]), k, v,
                               m.kernel_as_reference)


@hookimpl
def fdx_register_attention_backends(register):
    register("paddle-block", PaddleBlockAttention)
