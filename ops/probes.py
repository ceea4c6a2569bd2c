"""One probe per kernel: a few small calls checked against the composed reference.

``PROBES[name](dtype)`` raises when the kernel is missing or its numbers
differ from the reference (``WrongResult``), and returns when it matched.
A kernel built for an instruction set this CPU lacks does not raise: it
kills the process with SIGILL. So the CPU backend runs these in a child
process (``python -m fdx.ops.probes NAME...``; fdx.plugins.backends.probing
reads what it reports), where a death is a finding, not a crash.

The child protocol, one line each on stdout: ``start NAME`` before a
probe, then ``done NAME`` with a JSON finding (null: passed; else why
not). A ``start`` with no ``done`` names the kernel that killed it.

A build for a named instruction set (``cpp.q4_1_matmul.avx512``: there are
ten such a set, and a CPU without it kills each) is probed in a fork of the
child (``isolated``), so its SIGILL is the same finding without a new child
(a Paddle import) per kernel.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from typing import Callable

import numpy as np

__all__ = ["PROBES", "WrongResult", "run", "main"]


class WrongResult(RuntimeError):
    """The kernel ran but its numbers differ from the reference."""


def _rng():
    return np.random.default_rng(0)


def _close(got, want, what: str, atol: float = 1e-4, rtol: float = 1e-4) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise WrongResult(f"wrong result ({what}: shape {list(got.shape)}, expected {list(want.shape)})")
    if not np.allclose(got, want, atol=atol, rtol=rtol):
        err = float(np.nanmax(np.abs(got - want))) if got.size else 0.0
        raise WrongResult(f"wrong result ({what}: max error {err:.3g})")


def _tensor(a: np.ndarray, dtype: str = "float32"):
    import paddle
    return paddle.to_tensor(a).astype(dtype)


def _norm_cases(dtype: str):
    rng = _rng()
    for rows, hidden in ((1, 64), (5, 576), (33, 64)):          # one row, a decode batch, past CPP_MIN_ROWS
        x = rng.standard_normal((rows, hidden)).astype(np.float32) * 3
        r = rng.standard_normal((rows, hidden)).astype(np.float32)
        w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        yield f"{rows}x{hidden}", _tensor(x, dtype), _tensor(r, dtype), _tensor(w, dtype)


def _probe_norm(impl: str, with_residual: bool) -> Callable[[str], None]:
    def probe(dtype: str = "float32") -> None:
        from fdx.ops import norm
        tol = 1e-4 if dtype == "float32" else 3e-2
        for what, x, r, w in _norm_cases(dtype):
            if with_residual:
                got, got_sum = norm.add_rms_norm(x, r, w, 1e-6, impl=impl)
                want, want_sum = norm.add_rms_norm(x, r, w, 1e-6, impl="reference")
                _close(got_sum.astype("float32").numpy(), want_sum.astype("float32").numpy(), what + " sum", tol, tol)
            else:
                got, want = norm.rms_norm(x, w, 1e-6, impl=impl), norm.rms_norm(x, w, 1e-6, impl="reference")
            _close(got.astype("float32").numpy(), want.astype("float32").numpy(), what, tol, tol)
    return probe


def _probe_fused_rms_norm(dtype: str = "float32") -> None:
    _probe_norm("fused", False)(dtype)
    _probe_norm("fused", True)(dtype)


def _probe_silu(impl: str) -> Callable[[str], None]:
    def probe(dtype: str = "float32") -> None:
        from fdx.ops import activation
        rng = _rng()
        tol = 1e-5 if dtype == "float32" else 3e-2
        for rows, inter in ((1, 64), (40, 1536)):
            x = _tensor(rng.standard_normal((rows, 2 * inter)).astype(np.float32) * 4, dtype)
            got = activation.silu_and_mul(x, impl=impl).astype("float32").numpy()
            want = activation.silu_and_mul(x, impl="reference").astype("float32").numpy()
            _close(got, want, f"{rows}x{inter}", tol, tol)
    return probe


def _probe_fused_rotary(dtype: str = "float32") -> None:
    """Both rotary styles through Paddle's kernel, against the matmul form."""
    import paddle
    from fdx.ops import rotary
    rng = _rng()
    x = _tensor(rng.standard_normal((3, 2, 8)).astype(np.float32), dtype)
    positions = paddle.to_tensor(np.array([0, 5, 2], dtype=np.int64))
    for neox in (True, False):
        rope = rotary.RotaryEmbedding(8, 16, 10000.0, is_neox_style=neox)
        want = rope._apply(x, positions, impl="matmul").astype("float32").numpy()
        got = rope._apply(x, paddle.to_tensor(positions.numpy()), impl="fused").astype("float32").numpy()
        _close(got, want, "neox style" if neox else "GPT-J style", 1e-4 if dtype == "float32" else 3e-2)


# A small mixed step for the attention probes: a prefill over an empty context,
# a chunk over a cached context, and two decodes; 4 query / 2 KV heads, block 4.
_HEADS, _KV_HEADS, _HEAD_DIM, _BLOCK, _BLOCKS = 4, 2, 64, 4, 16
_QUERY_LENS, _CONTEXT_LENS = [5, 3, 1, 1], [0, 6, 9, 2]
_TABLES = [[0, 1], [2, 3, 4], [5, 6, 7], [8]]


def _probe_paged_attention(dtype: str = "float32") -> None:
    from fdx.ops import attention
    rng = _rng()
    slots = _BLOCKS * _BLOCK
    k_cache = _tensor(rng.standard_normal((_KV_HEADS * slots, _HEAD_DIM)).astype(np.float32))
    v_cache = _tensor(rng.standard_normal((_KV_HEADS * slots, _HEAD_DIM)).astype(np.float32))
    q = _tensor(rng.standard_normal((sum(_QUERY_LENS), _HEADS, _HEAD_DIM)).astype(np.float32))
    outs = {}
    for impl in ("cpp", "paddle"):
        meta = attention.build_attention_metadata(_QUERY_LENS, _CONTEXT_LENS, _TABLES, _BLOCK, _KV_HEADS, slots,
                                                  impl=impl, num_heads=_HEADS)
        outs[impl] = attention.paged_attention(q, k_cache, v_cache, meta, _HEAD_DIM ** -0.5).numpy()
    _close(outs["cpp"], outs["paddle"], "mixed prefill and decode", 1e-4, 1e-4)


def _probe_rope_write_kv(dtype: str = "float32") -> None:
    """The fused q/k/v split + q/k norm + rotary + KV write against the composed ops."""
    import paddle
    from fdx.ops import attention, cpp, norm, rotary
    rng = _rng()
    slots = _BLOCKS * _BLOCK
    n, d = sum(_QUERY_LENS), _HEAD_DIM
    q_size, kv_size = _HEADS * d, _KV_HEADS * d
    meta = attention.build_attention_metadata(_QUERY_LENS, _CONTEXT_LENS, _TABLES, _BLOCK, _KV_HEADS, slots,
                                              impl="paddle")
    qkv = _tensor(rng.standard_normal((n, q_size + 2 * kv_size)).astype(np.float32))
    q_w = _tensor((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    k_w = _tensor((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    for neox in (True, False):
        for qk_norm in (False, True):
            rope = rotary.RotaryEmbedding(d, 64, 10000.0, is_neox_style=neox)
            caches = [paddle.zeros([_KV_HEADS * slots, d]) for _ in range(4)]
            got_q = cpp.rope_write_kv(qkv, meta.positions, meta.slot_mapping, caches[0], caches[1], rope.cos_cache,
                                      rope.sin_cache, q_w if qk_norm else None, k_w if qk_norm else None, _HEADS,
                                      _KV_HEADS, d, neox, 1e-6)
            q, k, v = paddle.split(qkv, [q_size, kv_size, kv_size], axis=-1)
            q, k, v = q.reshape([n, _HEADS, d]), k.reshape([n, _KV_HEADS, d]), v.reshape([n, _KV_HEADS, d])
            if qk_norm:
                q, k = norm.rms_norm(q, q_w, 1e-6, impl="reference"), norm.rms_norm(k, k_w, 1e-6, impl="reference")
            q, k = rope._apply(q, meta.positions, impl="matmul"), rope._apply(k, meta.positions, impl="matmul")
            attention.write_kv(caches[2], caches[3], k, v, meta)
            what = f"{'neox' if neox else 'GPT-J'} style{', q/k norm' if qk_norm else ''}"
            _close(got_q.numpy(), q.numpy(), what + ": q")
            _close(caches[0].numpy(), caches[2].numpy(), what + ": k cache")
            _close(caches[1].numpy(), caches[3].numpy(), what + ": v cache")


# --- quantized products (fdx.ops.quant, csrc/quant_kernels.h) ------------------------------

def random_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Valid GGML blocks of ``kind`` as uint8 [rows, row_bytes]: random quants and
    sub-scales, the fp16 super-block scales set to sane values (gguf-py cannot
    quantize to the k-quants; any bytes are valid quants)."""
    from fdx.ops.quant import block_shape
    elems, nbytes = block_shape(kind)
    data = rng.integers(0, 256, (rows, cols // elems * nbytes), dtype=np.uint8)
    blocks = data.reshape(rows, cols // elems, nbytes)
    offsets = {"q4_1": (0, 2), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q2_k": (80, 82),
               "q3_k": (108,)}.get(kind, (0,))  # d, m
    for at in offsets:
        half = rng.uniform(0.002, 0.02, blocks.shape[:2]).astype(np.float16)
        blocks[..., at:at + 2] = half.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return data


def int8_blocks(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x [M, cols] float32 as the compiled products see it: each block of 32
    (256 for the k-quants: ``act_block``) quantized to int8 with scale
    max|x| / 127 (round half to even), in fp32."""
    x = np.asarray(x, np.float32)
    b = x.reshape(x.shape[0], -1, block)
    amax = np.abs(b).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(b * inv) * (amax / np.float32(127))).astype(np.float32).reshape(x.shape)


def act_block(kind: str) -> int:
    """The block the compiled products quantize activations in for ``kind``:
    256 for the k-quants (one scale per super-block: integer sub-block sums), else 32."""
    return 256 if kind.endswith("_k") else 32


def random_quantized(kind: str, rows: int, cols: int, rng):
    """A random weight of ``kind``: wint8/wint4 quantized from normal values, GGML kinds as random blocks."""
    from fdx.ops import quant
    if kind in quant.WINT_KINDS:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return quant.quantize_wint8(w) if kind == "wint8" else quant.quantize_wint4(w, 64)
    return quant.QuantizedTensor(kind, (rows, cols), random_blocks(kind, rows, cols, rng))


def _probe_quant(kind: str, variant: str) -> Callable[[str], None]:
    """One build of ``kind``'s product against gguf's dequantized weights: one
    row over enough weights to use every thread, a small batch (a tile and a
    tail), one past 12 rows over an odd count of blocks (the AVX-512 VNNI
    tiles of the kinds with blocks of 32, on a CPU that has VNNI), and a
    prefill-sized one (the dequantize + BLAS path, or the int8 tiles where
    cpp.quant_blas_min_rows says so). The int8 path
    is compared with x quantized as it quantizes it (int8_blocks), so the
    tolerance is float32 rounding."""
    def probe(dtype: str = "float32") -> None:
        from fdx.ops import cpp, quant
        name = cpp.quant_kernel_name(kind, variant)
        fn = dict(quant.KERNELS[kind])[name]
        rng = _rng()
        odd = 512 if kind == "wint4" or kind.endswith("_k") else 544      # the VNNI tiles' last pair: one block
        blas = cpp.quant_blas_min_rows(kind, variant)
        for rows, cols, m in ((129, 512, 1), (37, 512, 5), (37, odd, 13), (37, 512, cpp.QUANT_BLAS_MIN_ROWS + 1)):
            w = random_quantized(kind, rows, cols, rng)
            x = rng.standard_normal((m, cols)).astype(np.float32)
            got = fn(_tensor(x), w).numpy()
            xs = x if blas is not None and m >= blas else int8_blocks(x, act_block(kind))
            want = xs.astype(np.float64) @ w.dequantize().astype(np.float64).T
            scale = float(np.abs(want).max()) or 1.0
            _close(got / scale, want / scale, f"{m}x{cols} @ {rows}x{cols}", atol=1e-4, rtol=0)
    return probe


def _quant_probes() -> dict[str, Callable[[str], None]]:
    from fdx.ops.cpp import QUANT_KINDS, QUANT_VARIANTS, quant_kernel_name
    from fdx.ops.quant import PROBED_REPACK_KINDS, interleave_kernel_name
    return {**{quant_kernel_name(k, v): _probe_quant(k, v) for v in QUANT_VARIANTS for k in QUANT_KINDS},
            **{interleave_kernel_name(k, v): _probe_interleave(k, v) for v in QUANT_VARIANTS
               for k in PROBED_REPACK_KINDS}}


# The weight the layout choice times: 16384 x 2048 (q4_0: 38 MB), larger than a Zen's
# L3, streamed from memory as a model's weights are at decode.
INTERLEAVE_PROBE_SHAPE = (16384, 2048)
# The activation rows it times (decode at batch 1 and a small batch); the layout is
# chosen when the geometric mean of the two speed ratios is at least 1 (the AVX2 build
# on a Zen 5: 1.00-1.04x at 1 row, 0.81-0.85x at 8; AVX-512 VNNI: 1.8-2.0x and 2.7-2.9x).
INTERLEAVE_PROBE_ROWS = (1, 8)


def _probe_interleave(kind: str, variant: str) -> Callable[[str], None]:
    """The per-machine layout choice for a kind of fdx.ops.quant.PROBED_REPACK_KINDS
    in one build: its interleaved product against float64 numpy (1, 5, 13 rows),
    then both layouts of one weight timed at 1 and 8 activation rows, calls
    alternated, best of 15 each (the best of many is what a busy machine leaves
    least disturbed). Passes (the layout is chosen) when the interleaved one is
    at least as fast (geometric mean of the two ratios); else WrongResult says
    by how much it lost."""
    def probe(dtype: str = "float32") -> None:
        import time

        from fdx.ops import cpp, quant
        fn = dict(quant.KERNELS[kind])[cpp.quant_kernel_name(kind, variant)]
        rng = _rng()
        for m in (1, 5, 13):
            w = random_quantized(kind, 36, 512, rng).prepare(interleave=True)
            if not w.interleaved:
                raise WrongResult(f"{kind} was not repacked")
            x = rng.standard_normal((m, 512)).astype(np.float32)
            want = int8_blocks(x, act_block(kind)).astype(np.float64) @ w.dequantize().astype(np.float64).T
            scale = float(np.abs(want).max()) or 1.0
            _close(fn(_tensor(x), w).numpy() / scale, want / scale, f"interleaved {m}x512 @ 36x512", atol=1e-4, rtol=0)
        rows, cols = INTERLEAVE_PROBE_SHAPE
        if kind == "wint4":
            data = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
            plain = quant.QuantizedTensor(kind, (rows, cols), data, rng.uniform(0.01, 0.02, (rows, cols // 128))
                                          .astype(np.float32), 128)
        else:
            plain = quant.QuantizedTensor(kind, (rows, cols), random_blocks(kind, rows, cols, rng))
        inter = quant.QuantizedTensor(kind, plain.shape, plain.data.copy(), plain.scales, plain.group_size)
        plain.prepare(interleave=False)
        inter.prepare(interleave=True)
        ratios = []
        for m in INTERLEAVE_PROBE_ROWS:
            x = _tensor(rng.standard_normal((m, cols)).astype(np.float32))
            best = {False: float("inf"), True: float("inf")}
            for i in range(30):
                layout = bool(i % 2)
                t0 = time.perf_counter()
                fn(x, inter if layout else plain).numpy()
                best[layout] = min(best[layout], time.perf_counter() - t0)
            ratios.append(best[False] / best[True])
        if float(np.prod(ratios)) < 1.0:
            raise WrongResult(f"the plain layout is faster here (interleaved at "
                              f"{' / '.join(f'{r:.2f}x' for r in ratios)} its speed at "
                              f"{' / '.join(map(str, INTERLEAVE_PROBE_ROWS))} rows of {rows}x{cols})")
    return probe


def _probe_f32(variant: str) -> Callable[[str], None]:
    """One build of the float32 product (csrc/f32_kernels.h) against numpy in
    float64: one row over odd shapes (a column tail, a weight-row tail), a few
    rows over a weight large enough to use every thread, and 13 rows (the
    AVX-512 build's register tiles)."""
    def probe(dtype: str = "float32") -> None:
        from fdx.ops import cpp
        fn = cpp.F32_MATMULS[variant]
        rng = _rng()
        for k, n, m in ((37, 129, 1), (64, 40, 3), (300, 1000, 5), (300, 1000, 13)):
            w = rng.standard_normal((k, n)).astype(np.float32)
            x = rng.standard_normal((m, k)).astype(np.float32)
            got = fn(_tensor(x), _tensor(w)).numpy()
            want = x.astype(np.float64) @ w.astype(np.float64)
            _close(got / np.abs(want).max(), want / np.abs(want).max(), f"{m}x{k} @ {k}x{n}", atol=1e-5, rtol=0)
    return probe


PROBES: dict[str, Callable[[str], None]] = {
    "fused_rms_norm": _probe_fused_rms_norm,
    "swiglu": _probe_silu("paddle"),
    "fused_rotary_position_embedding": _probe_fused_rotary,
    "cpp.rms_norm": _probe_norm("cpp", False),
    "cpp.add_rms_norm": _probe_norm("cpp", True),
    "cpp.silu_and_mul": _probe_silu("cpp"),
    "cpp.paged_attention": _probe_paged_attention,
    "cpp.rope_write_kv": _probe_rope_write_kv,
    **_quant_probes(),
    **{f"cpp.f32_matmul{'' if v == 'portable' else '.' + v}": _probe_f32(v) for v in ("avx512", "avx2", "portable")},
}


# --- the grouped expert products (fdx.ops.moe, csrc/moe_kernels.h) ------------------------------

def moe_reference(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, gate_up, down,
                  as_kernels: bool = True) -> np.ndarray:
    """fdx.ops.moe.experts in float64 numpy on the dequantized experts, one (row, slot)
    at a time (the probes' and tests' reference). ``as_kernels``: each
    quantized product's input rounded to int8 blocks first, as the compiled
    products quantize their activations (fdx.ops.probes.int8_blocks), so the
    remaining difference is float rounding."""
    def acts(a: np.ndarray, stack) -> np.ndarray:
        if not as_kernels or stack.kind == "f32":
            return np.asarray(a, np.float64)
        return int8_blocks(np.asarray(a, np.float32), act_block(stack.kind)).astype(np.float64)

    x = np.asarray(x, np.float32)
    inter = down.shape[1]
    out = np.zeros((x.shape[0], down.shape[0]))
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)
        gu = acts(x[rows], gate_up) @ gate_up.expert(int(e)).astype(np.float64).T
        g, u = gu[:, :inter], gu[:, inter:]
        with np.errstate(over="ignore"):            # silu of a very negative gate: 0
            y = acts(g / (1 + np.exp(-g)) * u, down) @ down.expert(int(e)).astype(np.float64).T
        out[rows] += weights[rows, slots, None].astype(np.float64) * y
    return out


MOE_PROBE_KINDS = ("f32", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "wint8", "wint4")


def random_stack(kind: str, experts: int, rows: int, cols: int, rng):
    """Random experts of ``kind`` (the probes' random weights), repacked where the dense path repacks."""
    from fdx.ops.moe import ExpertStack, stack_from_weights
    if kind == "f32":
        return ExpertStack("f32", (rows, cols), (rng.standard_normal((experts, cols, rows)) * 0.1).astype(np.float32))
    qs = [random_quantized(kind, rows, cols, rng) for _ in range(experts)]
    for q in qs:
        q.repack()
    return stack_from_weights(kind, (rows, cols), [q.data for q in qs],
                              None if qs[0].scales is None else [q.scales for q in qs], qs[0].group_size,
                              qs[0].interleaved)


def _probe_moe(variant: str) -> Callable[[str], None]:
    """``fdx_moe_experts`` of one build against the float64 reference, every
    format, 8 experts, top-2, hidden 256, 5 rows (a k-quant needs 256 columns)."""
    def run(dtype: str = "float32") -> None:
        import paddle
        from fdx.ops.moe import experts
        rng = np.random.default_rng(0)
        n, k, h, inter, e = 5, 2, 256, 256, 8
        x = rng.standard_normal((n, h)).astype(np.float32)
        ids = np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int64)
        w = rng.random((n, k)).astype(np.float32)
        for kind in MOE_PROBE_KINDS:
            gu, dn = random_stack(kind, e, 2 * inter, h, rng), random_stack(kind, e, h, inter, rng)
            got = experts(paddle.to_tensor(x), ids, w, gu, dn, variant).numpy()
            want = moe_reference(x, ids, w, gu, dn)
            scale = np.abs(want).max()
            err = float(np.abs(got - want).max() / scale)
            if not err < 1e-4:
                raise WrongResult(f"wrong result ({kind}: max relative error {err:.3g})")
    return run


def _moe_probes() -> dict[str, Callable[[str], None]]:
    return {"cpp.moe_experts" + ("" if v == "portable" else "." + v): _probe_moe(v)
            for v in ("avx512", "avx2", "portable")}


PROBES.update(_moe_probes())
# --- end of the grouped expert products ---------------------------------------------------------



# --- a fused weight's parts in one product (fdx.ops.parts) ---------------------------------------
# Part kinds the probe (and tests/test_fused_parts.py) stack: both activation forms, alone and mixed.
PARTS_PROBE_STACKS = (("q4_k", "q4_k", "q6_k"), ("q4_0", "q8_0"), ("q5_k", "q4_1", "q5_0"), ("q6_k", "q5_1"))


def _probe_parts(variant: str) -> Callable[[str], None]:
    """``fdx_parts_matmul`` of one build against float64 numpy over each part's
    dequantized blocks, x quantized as that part's kind quantizes it
    (``int8_blocks``), 1, 5 and 13 rows; raises WrongResult."""
    def run(dtype: str = "float32") -> None:
        from fdx.ops.parts import matmul
        rng = np.random.default_rng(0)
        for kinds in PARTS_PROBE_STACKS:
            parts = [random_quantized(k, 8 * (i + 1), 512, rng) for i, k in enumerate(kinds)]
            for m in (1, 5, 13):
                x = rng.standard_normal((m, 512)).astype(np.float32)
                got = matmul(_tensor(x), parts, variant).numpy()
                want = np.concatenate([int8_blocks(x, act_block(q.kind)).astype(np.float64)
                                       @ q.dequantize().astype(np.float64).T for q in parts], axis=1)
                err = float(np.abs(got - want).max() / (np.abs(want).max() or 1.0))
                if not err < 1e-4:
                    raise WrongResult(f"wrong result ({'+'.join(kinds)}, {m} rows: max relative error {err:.3g})")
    return run


PROBES.update({"cpp.parts_matmul" + ("" if v == "portable" else "." + v): _probe_parts(v)
               for v in ("avx512", "avx2", "portable")})


def run(names, dtype: str = "float32", probes: dict[str, Callable[[str], None]] | None = None
        ) -> dict[str, str | None]:
    """Run the probes (default: PROBES) in this process: name -> None
    (passed) or why not. Only for kernels that cannot kill the process (GPU
    builds); on a CPU the backend runs them in a child (``main``)."""
    probes = PROBES if probes is None else probes
    found: dict[str, str | None] = {}
    for name in names:
        try:
            probes[name](dtype)
            found[name] = None
        except WrongResult as e:
            found[name] = str(e)
        except Exception as e:                       # a missing kernel raises whatever the build raises
            text = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            found[name] = "not in this Paddle build" if "is not registered" in text else text
    return found


ISOLATED_SUFFIXES = (".avx2", ".avx512")       # builds for an instruction set the compiler flags may lack


def isolated(name: str) -> bool:
    """Whether the child probes ``name`` in a fork of itself (see the module docstring)."""
    return name.endswith(ISOLATED_SUFFIXES)


def run_forked(name: str, dtype: str = "float32", probes: dict[str, Callable[[str], None]] | None = None
               ) -> str | None:
    """``run([name])`` in a fork: its finding, or how the fork died (the
    words plugins/backends/probing.py uses for a dead child)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:                                     # the fork: probe, report, leave without cleanup
        os.close(read_end)
        try:
            os.write(write_end, json.dumps(run([name], dtype, probes)[name]).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return "SIGILL on this CPU" if sig == signal.SIGILL else f"killed by {signal.Signals(sig).name}"
    return json.loads(report) if report else f"the probe process exited with status {os.WEXITSTATUS(status)}"


def main(argv: list[str] | None = None, probes: dict[str, Callable[[str], None]] | None = None) -> int:
    """``python -m fdx.ops.probes [--threads N] NAME...``: the child side (see the module docstring);
    ``probes``: the table to run from (default: PROBES; the cpu backend's child adds the probes
    of kernels whose reference lives above ops, fdx.plugins.backends.probe_child)."""
    args = list(sys.argv[1:] if argv is None else argv)
    threads = 1
    if args[:1] == ["--threads"]:
        threads, args = int(args[1]), args[2:]
    import paddle
    paddle.set_device("cpu")
    paddle.base.core.set_num_threads(threads)
    if any(name.startswith("cpp.") for name in args):
        from fdx.ops import cpp
        cpp.prepare()                                # loads what the parent built (never builds here)
    out = sys.stdout
    for name in args:
        print(f"start {name}", file=out, flush=True)
        finding = run_forked(name, probes=probes) if isolated(name) else run([name], probes=probes)[name]
        print(f"done {name} {json.dumps(finding)}", file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

