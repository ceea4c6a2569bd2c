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
- "cpp": a compiled CPU kernel (ops/csrc/paged_attention.cc) reading blocks in
  place for sequences with query_len <= cpp_max_query_len; longer chunks use
  the Paddle per-sequence path, whose GEMMs are faster for them.
The default is "cpp" when it builds (see fdx.ops.cpp), else "paddle";
FDX_DISABLE_CPP_OPS=1 forces "paddle".
"""
from dataclasses import dataclass, field

import numpy as np
import paddle
import paddle.nn.functional as F

__all__ = [
    "AttentionMetadata",
    "DecodeGroup",
    "PrefillSeq",
    "CppGroup",
    "build_attention_metadata",
    "write_kv",
    "paged_attention",
    "default_impl",
    "CPP_MAX_QUERY_LEN",
]

# Sequences with at most this many new tokens go to the compiled kernel.
CPP_MAX_QUERY_LEN = 16
_NEG = np.float32(-1e30)  # additive mask value: exp() underflows to exactly 0


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
    kv_write_index: paddle.Tensor  # int64 [N * KVH]: row of (token t, head h) at t * KVH + h
    decode: DecodeGroup | None  # Paddle path: batched single-token sequences
    prefills: list[PrefillSeq]  # Paddle path: per-sequence chunks
    cpp: CppGroup | None  # compiled-kernel sequences
    # Output assembly: pieces (cpp, decode, prefills) ordered by first token;
    # out_perm (int64 [N]) restores batch order after concatenating them, None
    # when the concatenation is already in order.
    piece_order: list[tuple[str, int]] = field(default_factory=list)
    out_perm: paddle.Tensor | None = None


def default_impl() -> str:
    """'cpp' if the compiled kernel is usable, else 'paddle'."""
    from fdx.ops import cpp

    return "cpp" if cpp.available() else "paddle"


def _seq_slots(table: np.ndarray, start: int, stop: int, block_size: int) -> np.ndarray:
    pos = np.arange(start, stop)
    return table[pos // block_size] * block_size + pos % block_size


def _validate(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_kv_heads: int,
    num_slots: int,
) -> None:
    if not len(query_lens) == len(context_lens) == len(block_tables):
        raise ValueError(
            f"query_lens, context_lens and block_tables differ in length: "
            f"{len(query_lens)}, {len(context_lens)}, {len(block_tables)}"
        )
    if not query_lens:
        raise ValueError("empty batch: no sequences")
    if block_size < 1 or num_kv_heads < 1 or num_slots < 1:
        raise ValueError(f"bad block_size/num_kv_heads/num_slots: {block_size}, {num_kv_heads}, {num_slots}")
    num_blocks = num_slots // block_size
    for i, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables)):
        if q < 1 or c < 0:
            raise ValueError(f"sequence {i}: query_len must be >= 1 and context_len >= 0, got {q}, {c}")
        need = -(-(q + c) // block_size)
        if len(table) < need:
            raise ValueError(f"sequence {i}: block table has {len(table)} blocks, needs {need} for {q + c} tokens")
        if need and (min(table[:need]) < 0 or max(table[:need]) >= num_blocks):
            raise ValueError(f"sequence {i}: block id out of range [0, {num_blocks})")


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
    cpp_max_query_len: int = CPP_MAX_QUERY_LEN,
) -> AttentionMetadata:
    """Index tensors and masks for one step (see the module docstring).

    impl: "paddle", "cpp" or None (default_impl()). num_heads, if given,
    builds the decode mask now instead of in the first layer.
    """
    _validate(query_lens, context_lens, block_tables, block_size, num_kv_heads, num_slots)
    impl = default_impl() if impl is None else impl
    if impl not in ("paddle", "cpp"):
        raise ValueError(f"unknown attention impl {impl!r}; expected 'paddle' or 'cpp'")
    query_lens, context_lens = [int(q) for q in query_lens], [int(c) for c in context_lens]
    tables = [np.asarray(t, dtype=np.int64) for t in block_tables]
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    n = int(starts[-1])

    positions = np.concatenate([np.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
    slots = np.concatenate(
        [_seq_slots(t, c, c + q, block_size) for t, q, c in zip(tables, query_lens, context_lens)]
    )
    heads = np.arange(num_kv_heads, dtype=np.int64) * num_slots
    write_index = (slots[:, None] + heads[None, :]).reshape(-1)  # [N, KVH] token-major

    seq_ids = range(len(query_lens))
    if impl == "cpp":
        cpp_ids = [i for i in seq_ids if query_lens[i] <= cpp_max_query_len]
        decode_ids: list[int] = []
    else:
        cpp_ids = []
        decode_ids = [i for i in seq_ids if query_lens[i] == 1]
    taken = set(cpp_ids) | set(decode_ids)
    prefill_ids = [i for i in seq_ids if i not in taken]

    meta = AttentionMetadata(
        impl=impl,
        num_tokens=n,
        num_kv_heads=num_kv_heads,
        num_slots=num_slots,
        block_size=block_size,
        query_lens=query_lens,
        context_lens=context_lens,
        query_starts=starts[:-1].tolist(),
        positions=paddle.to_tensor(positions.astype(np.int64)),
        slot_mapping=paddle.to_tensor(slots.astype(np.int64)),
        kv_write_index=paddle.to_tensor(write_index),
        decode=_decode_group(decode_ids, starts, context_lens, tables, block_size, heads) if decode_ids else None,
        prefills=[_prefill_seq(i, starts, query_lens, context_lens, tables, block_size, heads) for i in prefill_ids],
        cpp=_cpp_group(cpp_ids, starts, query_lens, context_lens, tables) if cpp_ids else None,
    )
    _plan_output(meta)
    if num_heads is not None and meta.decode is not None and meta.decode.needs_mask:
        meta.decode.mask(num_kv_heads, num_heads // num_kv_heads)
    return meta


def _decode_group(ids, starts, context_lens, tables, block_size, heads) -> DecodeGroup:
    token_ids = starts[ids]
    lens = np.asarray([context_lens[i] + 1 for i in ids], dtype=np.int64)
    t_max = int(lens.max())
    width = max(len(tables[i]) for i in ids)
    padded = np.zeros((len(ids), width), dtype=np.int64)  # padding points at block 0: masked
    for row, i in enumerate(ids):
        padded[row, : len(tables[i])] = tables[i]
    pos = np.arange(t_max)
    pos = np.where(pos[None, :] < lens[:, None], pos[None, :], 0)  # [S, T]; padding -> position 0
    slots = np.take_along_axis(padded, pos // block_size, axis=1) * block_size + pos % block_size
    kv_index = (heads[None, :, None] + slots[:, None, :]).reshape(-1)  # [S, KVH, T]
    contiguous = bool((np.diff(token_ids) == 1).all())
    return DecodeGroup(
        seq_ids=list(ids),
        token_ids=token_ids,
        token_slice=(int(token_ids[0]), int(token_ids[-1]) + 1) if contiguous else None,
        token_index=None if contiguous else paddle.to_tensor(token_ids),
        max_len=t_max,
        kv_index=paddle.to_tensor(kv_index),
        lens=lens,
        needs_mask=bool((lens != t_max).any()),
    )


def _prefill_seq(i, starts, query_lens, context_lens, tables, block_size, heads) -> PrefillSeq:
    q, c = query_lens[i], context_lens[i]
    total = q + c
    slots = _seq_slots(tables[i], 0, total, block_size)
    kv_index = (heads[:, None] + slots[None, :]).reshape(-1)  # [KVH, L]
    allowed = np.arange(total)[None, :] <= (c + np.arange(q))[:, None]  # [q, L]
    mask = np.where(allowed, np.float32(0), _NEG).astype(np.float32)
    return PrefillSeq(
        seq_id=i,
        token_start=int(starts[i]),
        query_len=q,
        context_len=c,
        kv_index=paddle.to_tensor(kv_index),
        mask=paddle.to_tensor(mask),
    )


def _cpp_group(ids, starts, query_lens, context_lens, tables) -> CppGroup:
    width = max(len(tables[i]) for i in ids)
    block_tables = np.zeros((len(ids), width), dtype=np.int32)
    info = np.zeros((len(ids), 4), dtype=np.int32)
    out_start = 0
    token_ids = []
    for row, i in enumerate(ids):
        block_tables[row, : len(tables[i])] = tables[i]
        info[row] = (starts[i], query_lens[i], context_lens[i], out_start)
        token_ids.append(np.arange(starts[i], starts[i] + query_lens[i]))
        out_start += query_lens[i]
    return CppGroup(
        seq_ids=list(ids),
        token_ids=np.concatenate(token_ids),
        seq_info=paddle.to_tensor(info),
        block_tables=paddle.to_tensor(block_tables),
        num_tokens=out_start,
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
    from fdx.ops import cpp

    group = meta.cpp
    return cpp.paged_attention(
        q, k_cache, v_cache, group.seq_info, group.block_tables, scale, meta.num_kv_heads, meta.block_size,
        group.num_tokens,
    )
