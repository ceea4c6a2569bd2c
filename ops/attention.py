"""Causal attention over a paged, head-major KV cache.

Cache layout, per layer: k_cache and v_cache are float32 [KVH * num_slots, D];
the row of (kv head h, slot s) is h * num_slots + s, and
slot = block_id * block_size + offset_in_block. The rows of one head in one
block are contiguous, so a block is read where it lies.

A step's tokens are each sequence's new tokens, concatenated in order.
`build_attention_metadata` does all the index and mask math once per step (in
numpy); every layer then calls `write_kv` (the new tokens' K/V) and
`paged_attention` (which reads context + new tokens back from the cache).

GQA follows Hugging Face's repeat_kv: query head h uses kv head h // G with
G = H // KVH; repeated KV heads are never materialized.

Two implementations, picked per step by `build_attention_metadata(impl=...)`:
- "paddle": eager Paddle. Single-token queries (decodes) are batched: one row
  gather [S, KVH, Tmax] from the pool, grouped matmul-softmax-matmul and a
  pre-expanded length mask. Longer queries (prefill chunks) run per sequence.
- "cpp": a compiled CPU kernel (ops/csrc/) reading blocks where they lie, for
  every sequence (or, with cpp_max_query_len, those with at most that many
  new tokens; longer chunks then take the Paddle per-sequence path). Measured
  here it beat the Paddle path at every size, prefill included.
The default is "cpp" when the backend's probed table (fdx.core.kernels)
passed ``cpp.paged_attention`` and the kernels are loaded, else "paddle";
FDX_DISABLE_CPP_OPS=1 forces "paddle".
"""
from dataclasses import dataclass, field

import numpy as np
import paddle
import paddle.nn.functional as F

from fdx.core import kernels
from fdx.ops import cpp

__all__ = [
    "AttentionMetadata",
    "DecodeGroup",
    "PrefillSeq",
    "CppGroup",
    "build_attention_metadata",
    "write_kv",
    "paged_attention",
    "default_impl",
]

_NEG = np.float32(-1e30)  # additive mask value: exp() underflows to exactly 0


def _index_tensor(a: np.ndarray) -> paddle.Tensor:
    """``paddle.to_tensor(a)`` for a step's index arrays, built by Paddle's
    tensor constructor directly: to_tensor's argument handling is about 10
    of its 25 us, and a batch-1 step makes several."""
    try:
        place = paddle.base.framework._current_expected_place_()
        return paddle.base.core.eager.Tensor(value=np.ascontiguousarray(a), place=place, stop_gradient=True)
    except (AttributeError, TypeError):       # another Paddle's internals: the public call
        return paddle.to_tensor(a)


@dataclass
class DecodeGroup:
    """Single-token sequences, attended together (Paddle path)."""

    seq_ids: list[int]  # batch sequence indices, in token order
    token_ids: np.ndarray  # their token rows in the batch [S]
    token_slice: tuple[int, int] | None  # (start, stop) when token_ids is a contiguous run
    token_index: paddle.Tensor | None  # int64 [S] when it is not
    max_len: int  # Tmax: longest context + 1
    kv_index: paddle.Tensor  # int64 [S * KVH * Tmax]: cache rows, ordered [S, KVH, Tmax]
    lens: np.ndarray  # context + 1 per sequence [S]
    needs_mask: bool  # False when every length equals Tmax
    # Additive length masks [S, KVH, G, Tmax] per group size G, built on first use.
    masks: dict[int, paddle.Tensor] = field(default_factory=dict)

    def mask(self, num_kv_heads: int, group: int) -> paddle.Tensor:
        if group not in self.masks:
            valid = np.arange(self.max_len)[None, :] < self.lens[:, None]  # [S, T]
            m = np.where(valid, np.float32(0), _NEG).astype(np.float32)
            m = np.broadcast_to(m[:, None, None, :], (len(self.lens), num_kv_heads, group, self.max_len))
            self.masks[group] = paddle.to_tensor(np.ascontiguousarray(m))
        return self.masks[group]


@dataclass
class PrefillSeq:
    """One sequence with query_len > 1, attended on its own (Paddle path)."""

    seq_id: int
    token_start: int  # its first token row in the batch
    query_len: int
    context_len: int
    kv_index: paddle.Tensor  # int64 [KVH * (context_len + query_len)]: rows, ordered [KVH, L]
    mask: paddle.Tensor  # additive causal mask [query_len, L]; broadcast over leading dims


@dataclass
class CppGroup:
    """Sequences for the compiled kernel; its output rows follow seq order."""

    seq_ids: list[int]
    token_ids: np.ndarray  # their token rows in the batch, in output order
    seq_info: paddle.Tensor  # int32 [S, 4]: q_start, query_len, context_len, out_start
    block_tables: paddle.Tensor  # int32 [S, max_blocks], padded with 0
    num_tokens: int


@dataclass
class AttentionMetadata:
    """Everything precomputed once per step and shared by all layers."""

    impl: str  # "paddle" or "cpp"
    num_tokens: int  # N
    num_kv_heads: int
    num_slots: int
    block_size: int
    query_lens: list[int]
    context_lens: list[int]
    query_starts: list[int]  # first token row of each sequence
    positions: paddle.Tensor  # int64 [N]
    slot_mapping: paddle.Tensor  # int64 [N]
    kv_write_rows: np.ndarray  # int64 [N * KVH]: row of (token t, head h) at t * KVH + h
    decode: DecodeGroup | None  # Paddle path: batched single-token sequences
    prefills: list[PrefillSeq]  # Paddle path: per-sequence chunks
    cpp: CppGroup | None  # compiled-kernel sequences
    # Output assembly: pieces (cpp, decode, prefills) ordered by first token;
    # out_perm (int64 [N]) restores batch order after concatenating them, None
    # when the concatenation is already in order.
    piece_order: list[tuple[str, int]] = field(default_factory=list)
    out_perm: paddle.Tensor | None = None
    _kv_write_index: paddle.Tensor | None = field(default=None, repr=False)

    @property
    def kv_write_index(self) -> paddle.Tensor:
        """kv_write_rows as a tensor, made on first use: the composed KV write
        reads it, the compiled kernels take slot_mapping (one tensor less a step)."""
        if self._kv_write_index is None:
            self._kv_write_index = _index_tensor(self.kv_write_rows)
        return self._kv_write_index


def default_impl() -> str:
    """'cpp' if the probed table passed the compiled kernel and it is
    loaded, else 'paddle'. Never starts a build."""
    return "cpp" if kernels.active().usable("cpp.paged_attention") and cpp.loaded() else "paddle"


@dataclass
class _Batch:
    """The step's sequences as numpy arrays (internal to the builder)."""

    query_lens: np.ndarray  # int64 [B]
    context_lens: np.ndarray  # int64 [B]
    starts: np.ndarray  # int64 [B + 1]: first token row of each sequence, then N
    tables: np.ndarray  # int64 [B, W]: block tables padded with block 0
    block_size: int
    heads: np.ndarray  # int64 [KVH]: h * num_slots (head_major) or h * block_size (block_major)
    block_stride: int  # rows between blocks: block_size (head_major) or KVH * block_size (block_major)

    def slots(self, seqs: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slots of (sequence, position) pairs (broadcast together)."""
        bs = self.block_size
        return self.tables[seqs, positions // bs] * bs + positions % bs

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """Row of head 0 of each slot; add ``heads`` for the other heads."""
        bs = self.block_size
        return slots if self.block_stride == bs else slots // bs * self.block_stride + slots % bs


def _padded_tables(block_tables: list[list[int]]) -> np.ndarray:
    width = max(1, max(len(t) for t in block_tables))
    out = np.zeros((len(block_tables), width), dtype=np.int64)
    for row, table in enumerate(block_tables):
        out[row, : len(table)] = table
    return out


def _validate(
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    block_tables: list[list[int]],
    tables: np.ndarray,
    block_size: int,
    num_kv_heads: int,
    num_slots: int,
) -> None:
    if block_size < 1 or num_kv_heads < 1 or num_slots < 1:
        raise ValueError(f"bad block_size/num_kv_heads/num_slots: {block_size}, {num_kv_heads}, {num_slots}")
    if (bad := np.flatnonzero((query_lens < 1) | (context_lens < 0))).size:
        i = int(bad[0])
        raise ValueError(
            f"sequence {i}: query_len must be >= 1 and context_len >= 0, got {query_lens[i]}, {context_lens[i]}"
        )
    need = -(-(query_lens + context_lens) // block_size)
    have = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    if (bad := np.flatnonzero(have < need)).size:
        i = int(bad[0])
        raise ValueError(
            f"sequence {i}: block table has {have[i]} blocks, needs {need[i]} for "
            f"{query_lens[i] + context_lens[i]} tokens"
        )
    num_blocks = num_slots // block_size
    used = np.arange(tables.shape[1])[None, :] < need[:, None]
    if (bad := np.flatnonzero((used & ((tables < 0) | (tables >= num_blocks))).any(axis=1))).size:
        raise ValueError(f"sequence {int(bad[0])}: block id out of range [0, {num_blocks})")


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_kv_heads: int,
    num_slots: int,
    *,
    impl: str | None = None,
    num_heads: int | None = None,
    cpp_max_query_len: int | None = None,
    layout: str = "head_major",
) -> AttentionMetadata:
    """Index tensors and masks for one step (see the module docstring).

    impl: "paddle", "cpp" or None (default_impl()). cpp_max_query_len: with
    impl "cpp", longer sequences take the Paddle path (None: none do).
    num_heads, if given, builds the Paddle path's decode mask now instead of
    in the first layer. layout: "head_major" (the module docstring) or
    "block_major" (caches [num_blocks, KVH, block_size, D], seen as rows
    [-1, D]; Paddle path only).
    """
    if not len(query_lens) == len(context_lens) == len(block_tables):
        raise ValueError(
            f"query_lens, context_lens and block_tables differ in length: "
            f"{len(query_lens)}, {len(context_lens)}, {len(block_tables)}"
        )
    if not len(query_lens):
        raise ValueError("empty batch: no sequences")
    impl = default_impl() if impl is None else impl
    if impl not in ("paddle", "cpp"):
        raise ValueError(f"unknown attention impl {impl!r}; expected 'paddle' or 'cpp'")
    qlens = np.asarray(query_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    tables = _padded_tables(block_tables)
    _validate(qlens, ctx, block_tables, tables, block_size, num_kv_heads, num_slots)
    starts = np.zeros(len(qlens) + 1, dtype=np.int64)
    np.cumsum(qlens, out=starts[1:])
    if layout not in ("head_major", "block_major") or (layout == "block_major" and impl == "cpp"):
        raise ValueError(f"layout {layout!r} with impl {impl!r}: the compiled kernel reads head_major only")
    heads = np.arange(num_kv_heads, dtype=np.int64)
    batch = (_Batch(qlens, ctx, starts, tables, block_size, heads * num_slots, block_size)
             if layout == "head_major" else
             _Batch(qlens, ctx, starts, tables, block_size, heads * block_size, num_kv_heads * block_size))
    n = int(starts[-1])

    seq_of_token = np.repeat(np.arange(len(qlens)), qlens)
    positions = np.arange(n) - starts[seq_of_token] + ctx[seq_of_token]
    slots = batch.slots(seq_of_token, positions)
    write_index = (batch.rows(slots)[:, None] + batch.heads[None, :]).reshape(-1)  # [N, KVH] token-major

    every = np.arange(len(qlens))
    if impl == "cpp" and (cpp_max_query_len is None or int(qlens.max()) <= cpp_max_query_len):
        cpp_ids, decode_ids, prefill_ids = every, every[:0], every[:0]     # the usual CPU step: all compiled
    else:
        if impl == "cpp":
            cpp_ids, decode_ids = np.flatnonzero(qlens <= cpp_max_query_len), every[:0]
        else:
            cpp_ids, decode_ids = every[:0], np.flatnonzero(qlens == 1)
        prefill_ids = np.setdiff1d(every, np.concatenate([cpp_ids, decode_ids]))

    meta = AttentionMetadata(
        impl=impl,
        num_tokens=n,
        num_kv_heads=num_kv_heads,
        num_slots=num_slots,
        block_size=block_size,
        query_lens=qlens.tolist(),
        context_lens=ctx.tolist(),
        query_starts=starts[:-1].tolist(),
        positions=_index_tensor(positions),
        slot_mapping=_index_tensor(slots),
        kv_write_rows=write_index,
        decode=_decode_group(decode_ids, batch) if decode_ids.size else None,
        prefills=[_prefill_seq(int(i), batch) for i in prefill_ids],
        cpp=_cpp_group(cpp_ids, batch) if cpp_ids.size else None,
    )
    _plan_output(meta)
    if num_heads is not None and meta.decode is not None and meta.decode.needs_mask:
        meta.decode.mask(num_kv_heads, num_heads // num_kv_heads)
    return meta


def _decode_group(ids: np.ndarray, batch: _Batch) -> DecodeGroup:
    token_ids = batch.starts[ids]
    lens = batch.context_lens[ids] + 1
    t_max = int(lens.max())
    pos = np.arange(t_max)[None, :]
    pos = np.where(pos < lens[:, None], pos, 0)  # [S, T]; padding reads position 0, masked
    slots = batch.slots(ids[:, None], pos)
    kv_index = (batch.heads[None, :, None] + batch.rows(slots)[:, None, :]).reshape(-1)  # [S, KVH, T]
    contiguous = bool((np.diff(token_ids) == 1).all())
    return DecodeGroup(
        seq_ids=ids.tolist(),
        token_ids=token_ids,
        token_slice=(int(token_ids[0]), int(token_ids[-1]) + 1) if contiguous else None,
        token_index=None if contiguous else paddle.to_tensor(token_ids),
        max_len=t_max,
        kv_index=paddle.to_tensor(kv_index),
        lens=lens,
        needs_mask=bool((lens != t_max).any()),
    )


def _prefill_seq(i: int, batch: _Batch) -> PrefillSeq:
    q, c = int(batch.query_lens[i]), int(batch.context_lens[i])
    total = q + c
    slots = batch.slots(i, np.arange(total))
    kv_index = (batch.heads[:, None] + batch.rows(slots)[None, :]).reshape(-1)  # [KVH, L]
    allowed = np.arange(total)[None, :] <= (c + np.arange(q))[:, None]  # [q, L]
    return PrefillSeq(
        seq_id=i,
        token_start=int(batch.starts[i]),
        query_len=q,
        context_len=c,
        kv_index=paddle.to_tensor(kv_index),
        mask=paddle.to_tensor(np.where(allowed, np.float32(0), _NEG)),
    )


def _cpp_group(ids: np.ndarray, batch: _Batch) -> CppGroup:
    qlens = batch.query_lens[ids]
    out_starts = np.zeros(len(ids), dtype=np.int64)
    np.cumsum(qlens[:-1], out=out_starts[1:])
    info = np.stack([batch.starts[ids], qlens, batch.context_lens[ids], out_starts], axis=1)
    num_tokens = int(qlens.sum())
    group_of_row = np.repeat(np.arange(len(ids)), qlens)
    token_ids = np.arange(num_tokens) - out_starts[group_of_row] + batch.starts[ids][group_of_row]
    return CppGroup(
        seq_ids=ids.tolist(),
        token_ids=token_ids,
        seq_info=_index_tensor(info.astype(np.int32)),
        block_tables=_index_tensor(batch.tables[ids].astype(np.int32)),
        num_tokens=num_tokens,
    )


def _plan_output(meta: AttentionMetadata) -> None:
    pieces: list[tuple[int, str, int, np.ndarray]] = []  # (first token, kind, index, token rows)
    if meta.cpp is not None:
        pieces.append((int(meta.cpp.token_ids[0]), "cpp", 0, meta.cpp.token_ids))
    if meta.decode is not None:
        pieces.append((int(meta.decode.token_ids[0]), "decode", 0, meta.decode.token_ids))
    for j, p in enumerate(meta.prefills):
        pieces.append((p.token_start, "prefill", j, np.arange(p.token_start, p.token_start + p.query_len)))
    pieces.sort(key=lambda piece: piece[0])
    meta.piece_order = [(kind, j) for _, kind, j, _ in pieces]
    if len(pieces) == 1 and meta.cpp is not None and len(meta.cpp.token_ids) == meta.num_tokens:
        return                  # every token in the compiled group, in batch order (its token_ids are arange)
    order = np.concatenate([rows for *_, rows in pieces])
    if not (order == np.arange(meta.num_tokens)).all():
        meta.out_perm = paddle.to_tensor(np.argsort(order).astype(np.int64))


def write_kv(
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Write the step's new K/V ([N, KVH, D]) into the caches, in place."""
    n, kvh, d = k.shape
    if n != meta.num_tokens or kvh != meta.num_kv_heads:
        raise ValueError(f"k has shape {list(k.shape)}, metadata expects [{meta.num_tokens}, {meta.num_kv_heads}, D]")
    if k_cache.dtype == paddle.int8:        # cache.kv_cache_dtype int8: quantized by the compiled kernel
        cpp.kv8_write(k, v, meta.slot_mapping, k_cache, v_cache)
        return
    paddle.scatter_(k_cache, meta.kv_write_index, k.reshape([n * kvh, d]), overwrite=True)
    paddle.scatter_(v_cache, meta.kv_write_index, v.reshape([n * kvh, d]), overwrite=True)


def paged_attention(
    q: paddle.Tensor,
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> paddle.Tensor:
    """Causal attention of q [N, H, D] over the cached context + new tokens -> [N, H, D]."""
    n, num_heads, d = q.shape
    kvh = meta.num_kv_heads
    if n != meta.num_tokens or num_heads % kvh:
        raise ValueError(f"q has shape {list(q.shape)}: expected {meta.num_tokens} tokens and heads divisible by {kvh}")
    if k_cache.dtype == paddle.int8 and meta.piece_order != [("cpp", 0)]:
        raise ValueError("an int8 KV cache (cache.kv_cache_dtype int8) is read by the compiled attention "
                         "kernel only; this step's metadata has Paddle-path pieces")
    outs = []
    for kind, j in meta.piece_order:
        if kind == "cpp":
            outs.append(_cpp_attention(q, k_cache, v_cache, meta, scale))
        elif kind == "decode":
            outs.append(_decode_attention(q, k_cache, v_cache, meta, scale))
        else:
            outs.append(_prefill_attention(q, k_cache, v_cache, meta.prefills[j], kvh, scale))
    out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
    if meta.out_perm is not None:
        out = paddle.index_select(out, meta.out_perm, axis=0)
    return out


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> paddle.Tensor:
    group = meta.decode
    _, num_heads, d = q.shape
    kvh = meta.num_kv_heads
    g = num_heads // kvh
    s, t = len(group.seq_ids), group.max_len
    if group.token_slice is not None:
        a, b = group.token_slice
        qd = q if (a, b) == (0, q.shape[0]) else q[a:b]
    else:
        qd = paddle.index_select(q, group.token_index, axis=0)
    qd = paddle.scale(qd, scale).reshape([s, kvh, g, d])
    k = paddle.gather(k_cache, group.kv_index, axis=0).reshape([s, kvh, t, d])
    v = paddle.gather(v_cache, group.kv_index, axis=0).reshape([s, kvh, t, d])
    scores = paddle.matmul(qd, k, transpose_y=True)  # [S, KVH, G, T]
    if group.needs_mask:
        scores = scores + group.mask(kvh, g)
    out = paddle.matmul(F.softmax(scores, axis=-1), v)  # [S, KVH, G, D]
    return out.reshape([s, num_heads, d])


def _prefill_attention(q, k_cache, v_cache, seq: PrefillSeq, kvh: int, scale: float) -> paddle.Tensor:
    _, num_heads, d = q.shape
    g = num_heads // kvh
    ql, total = seq.query_len, seq.query_len + seq.context_len
    qs = q[seq.token_start : seq.token_start + ql]
    # [ql, KVH, G, D] -> [KVH, G*ql, D]: rows g*ql + t, so the [ql, L] mask
    # broadcasts over leading dims only.
    qs = paddle.scale(qs, scale).reshape([ql, kvh, g, d]).transpose([1, 2, 0, 3]).contiguous()
    qs = qs.reshape([kvh, g * ql, d])
    k = paddle.gather(k_cache, seq.kv_index, axis=0).reshape([kvh, total, d])
    v = paddle.gather(v_cache, seq.kv_index, axis=0).reshape([kvh, total, d])
    scores = paddle.matmul(qs, k, transpose_y=True).reshape([kvh, g, ql, total]) + seq.mask
    probs = F.softmax(scores, axis=-1).reshape([kvh, g * ql, total])
    out = paddle.matmul(probs, v).reshape([kvh, g, ql, d])  # [KVH, G, ql, D]
    return out.transpose([2, 0, 1, 3]).contiguous().reshape([ql, num_heads, d])


def _cpp_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> paddle.Tensor:
    group = meta.cpp
    return cpp.paged_attention(
        q, k_cache, v_cache, group.seq_info, group.block_tables, scale, meta.num_kv_heads, meta.block_size,
        group.num_tokens, kernels.active().batch_invariant,
    )
