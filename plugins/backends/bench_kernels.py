"""Per-call timings of the compiled elementwise kernels against the Paddle
ops they replace (ops/csrc/fused_kernels.h).

    python -m fdx.plugins.backends.bench_kernels
    python -m fdx.plugins.backends.bench_kernels --quant [q4_1,q8_0,...]
    python -m fdx.plugins.backends.bench_kernels --prefill [q4_k,q6_k,...] --iters 7 [--variant avx2] [--force-panel]
    python -m fdx.plugins.backends.bench_kernels --decode [q4_k,q5_k,q6_k] --iters 21

Not a test. For SmolLM2-135M's shapes (9/3 heads x 64, intermediate 1536)
at 64 decode rows and a 512-token prefill, and a Qwen3-like layer (q/k RMS
norm, 16/8 heads x 128): SiLU-and-mul against F.swiglu, residual + RMS norm
against Paddle's fused_rms_norm, and the fused q/k/v
split + q/k norm + rotary + KV write against the composed ops (split,
reshape, rms_norm, RotaryEmbedding, write_kv), each timed interleaved with
its reference (median and min wall microseconds per call, and the ratio of
medians).

With --quant: the products with quantized weights (fdx.ops.quant.matmul,
whichever build the CPU backend's probed table picks) at SmolLM2-135M's
shapes (out x in: 576x576 q/o, 1536x576 gate/up, 576x1536 down, 49152x576
the LM head; the k-quants only where the columns are whole blocks of 256) for 1,
8 and 64 activation rows, in microseconds and GB/s of
weight bytes read, against Paddle's fp32 matmul over the same weight held
[in, out] (its fast layout), timed interleaved in the same run.

With --layer: one SmolLM2-135M-shaped decoder layer (576 hidden, 9/3
heads x 64, 1536 intermediate) over random blocks of each kind, for 1, 8
and 32 sequences decoding over 128 cached tokens: the composed layer (the
cpu attention backend, its whole-layer kernel off) against the one
compiled call (fdx.ops.cpp.decoder_layer), under the probed table, timed
interleaved.
"""
import argparse
import os
import time

import numpy as np
import paddle
import paddle.nn.functional as F

from fdx.ops import cpp
from fdx.ops.attention import build_attention_metadata, write_kv
from fdx.ops.norm import add_rms_norm, rms_norm
from fdx.ops.rotary import RotaryEmbedding


CLOCK = time.perf_counter          # --cpu-time: time.thread_time (1 thread: immune to other jobs' preemption)


def _interleaved(fns: dict, iters: int) -> dict:
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()                                           # warm-up (memo, allocator)
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = CLOCK()
            fn()
            times[name].append(1e6 * (CLOCK() - t0))
    return {name: np.asarray(ts) for name, ts in times.items()}


def _report(label: str, times: dict) -> None:
    (ref, ref_t), (new, new_t) = times.items()
    print(f"{label:<44} {ref} med {np.median(ref_t):8.1f} us (min {ref_t.min():8.1f}) | "
          f"{new} med {np.median(new_t):8.1f} us (min {new_t.min():8.1f}) | "
          f"{np.median(ref_t) / np.median(new_t):5.2f}x")


def bench_silu(n: int, inter: int, iters: int) -> None:
    x = paddle.randn([n, 2 * inter])
    _report(f"silu_and_mul [{n}, 2x{inter}]",
            _interleaved({"swiglu": lambda: F.swiglu(x), "cpp": lambda: cpp.silu_and_mul(x)}, iters))



def bench_add_rms_norm(n: int, hidden: int, iters: int) -> None:
    x, r, w = paddle.randn([n, hidden]), paddle.randn([n, hidden]), paddle.randn([hidden])
    _report(f"add_rms_norm [{n}, {hidden}]", _interleaved({
        "fused_rms_norm": lambda: add_rms_norm(x, r, w, 1e-5, impl="fused"),
        "cpp": lambda: add_rms_norm(x, r, w, 1e-5, impl="cpp")}, iters))


def bench_rope_write(n: int, heads: int, kv_heads: int, d: int, qk_norm: bool, iters: int, ctx: int = 192) -> None:
    rng = np.random.default_rng(0)
    qlens = [1] * n if n <= 64 else [n]
    ctxs = [ctx] * len(qlens) if n <= 64 else [0]
    bs = 16
    need = [-(-(q + c) // bs) for q, c in zip(qlens, ctxs)]
    num_blocks = sum(need) + 4
    ids = rng.permutation(num_blocks).tolist()
    tables = [[ids.pop() for _ in range(nb)] for nb in need]
    meta = build_attention_metadata(qlens, ctxs, tables, bs, kv_heads, num_blocks * bs, impl="paddle")
    k_cache = paddle.zeros([kv_heads * num_blocks * bs, d])
    v_cache = paddle.zeros([kv_heads * num_blocks * bs, d])
    rope = RotaryEmbedding(d, 4096, 1e4)
    qkv = paddle.randn([n, (heads + 2 * kv_heads) * d])
    qn = paddle.ones([d]) if qk_norm else None
    kn = paddle.ones([d]) if qk_norm else None
    pos = meta.positions

    def composed():
        q, k, v = paddle.split(qkv, [heads * d, kv_heads * d, kv_heads * d], axis=-1)
        q, k, v = q.reshape([n, heads, d]), k.reshape([n, kv_heads, d]), v.reshape([n, kv_heads, d])
        if qk_norm:
            q, k = rms_norm(q, qn, 1e-6), rms_norm(k, kn, 1e-6)
        q, k = rope(pos, q, k)
        write_kv(k_cache, v_cache, k, v, meta)
        return q

    def fused():
        return cpp.rope_write_kv(qkv, pos, meta.slot_mapping, k_cache, v_cache, rope.cos_cache, rope.sin_cache,
                                 qn, kn, heads, kv_heads, d, True, 1e-6)

    label = f"rope+kv write N={n} {heads}/{kv_heads}x{d}{' qk-norm' if qk_norm else ''}"
    _report(label, _interleaved({"paddle": composed, "cpp": fused}, iters))


QUANT_SHAPES = ((576, 576), (1536, 576), (576, 1536), (49152, 576))     # (out, in) = (rows, cols)


def bench_quant(kinds: list[str], rows_list: tuple[int, ...], iters: int, threads: int) -> None:
    from fdx.core import kernels
    from fdx.core.host import cpu_flags, cpu_model
    from fdx.ops import quant
    from fdx.ops.probes import random_quantized
    from fdx.plugins.backends.cpu import probe_kernels, quant_choices

    table = probe_kernels(threads)
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni") if f in cpu_flags()]
    print(f"cpu: {cpu_model()}, {threads} threads, flags {' '.join(isa)}, load average {os.getloadavg()[0]:.1f}")
    print(f"quant_matmul: {quant_choices(table)}; from {cpp.QUANT_BLAS_MIN_ROWS} rows (per kind with AVX-512 "
          "VNNI: cpp.quant_blas_min_rows) quant.matmul takes the dequantize + BLAS path")
    print(f"{'kind':<6} {'out x in':>10} {'M':>4} | {'int8 us':>9} {'GB/s':>6} | {'deq+BLAS us':>11} | "
          f"{'fp32 us':>9} {'GB/s':>6} | int8 vs fp32, deq+BLAS vs fp32")
    module = cpp._module_or_raise()
    rng = np.random.default_rng(0)
    with kernels.using(table):
        variant = next((v for v in cpp.QUANT_VARIANTS if table.usable(cpp.quant_kernel_name("q8_0", v))), "portable")
        for kind in kinds:
            for rows, cols in QUANT_SHAPES:
                if cols % quant.block_shape(kind)[0] if kind not in quant.WINT_KINDS else cols % 64:
                    print(f"{kind:<6} {f'{rows}x{cols}':>10}   : no whole blocks (a GGUF file holds another type here)")
                    continue
                w = random_quantized(kind, rows, cols, rng).prepare()
                data, scales = w.tensors()
                code = cpp.quant_code(w) if hasattr(cpp, "quant_code") else cpp.QUANT_KINDS.index(kind)
                args = (code, cpp._VARIANT_CODE[variant], rows, cols, w.group_size)
                dense = paddle.to_tensor(np.ascontiguousarray(w.dequantize().T))       # [in, out]
                for m in rows_list:
                    big = rows * cols * max(m, 8) > 4 << 20
                    n = max(5, iters // (10 if big else 1) // max(1, m // 64))
                    x = paddle.randn([m, cols])
                    times = _interleaved({
                        "int8": lambda: module.fdx_quant_matmul(x, data, scales, *args),
                        "deq": lambda: paddle.matmul(x, module.fdx_quant_dequantize(data, scales, *args),
                                                     transpose_y=True),
                        "fp32": lambda: paddle.matmul(x, dense)}, n)
                    tq, td, tf = (np.median(times[k]) for k in ("int8", "deq", "fp32"))
                    print(f"{kind:<6} {f'{rows}x{cols}':>10} {m:>4} | {tq:9.1f} {w.nbytes / tq / 1e3:6.1f} | "
                          f"{td:11.1f} | {tf:9.1f} {rows * cols * 4 / tf / 1e3:6.1f} | {tf / tq:5.2f}x {tf / td:5.2f}x")


def _new_and_old(kinds: list[str], threads: int, header: str, build: str | None = None,
                 old_flag: int = cpp._CODE_ROW_TILES):
    """Prints the CPU line and ``header``; yields, for each kind at 2048x2048 and
    8192x2048, random weights and the product's arguments now (args) and before
    (old: ``old_flag``, kCodeRowTiles: main's integer kernel), in instruction-set build ``build``
    (default: the widest the probed table passed)."""
    from fdx.core.host import cpu_flags, cpu_model
    from fdx.ops.probes import random_quantized
    from fdx.plugins.backends.cpu import probe_kernels

    table = probe_kernels(threads)
    isa = [f for f in ("avx2", "avx512f", "avx512bw", "avx512_vnni") if f in cpu_flags()]
    print(f"cpu: {cpu_model()}, {threads} threads, flags {' '.join(isa)}, load average "
          f"{' '.join(open('/proc/loadavg').read().split()[:3])}, build {build or 'the widest passed'}")
    print(header)
    module = cpp._module_or_raise()
    rng = np.random.default_rng(0)
    for kind in kinds:
        variant = build or next(v for v in cpp.QUANT_VARIANTS if table.usable(cpp.quant_kernel_name(kind, v)))
        for rows, cols in ((2048, 2048), (8192, 2048)):
            w = random_quantized(kind, rows, cols, rng).prepare()
            data, scales = w.tensors()
            args = (cpp.quant_code(w), cpp._VARIANT_CODE[variant], rows, cols, w.group_size)
            yield module, kind, rows, cols, data, scales, args, (cpp.quant_code(w) | old_flag,) + args[1:]


def bench_prefill(kinds: list[str], rows_list: tuple[int, ...], rounds: int, threads: int,
                  build: str | None = None, force_panel: bool = False) -> None:
    """Many activation rows (prefill): the compiled product as it runs now (on a CPU
    with AVX-512 VNNI the panel product, csrc/panel_gemm.inc, from its threshold), the
    integer kernels without it (kCodeNoPanel) and dequantize + BLAS, alternating call
    by call for ``rounds`` rounds; ratios of medians."""
    header = (f"{'kind':<6} {'out x in':>10} {'M':>4} | {'new ms':>8} {'old ms':>8} {'deq ms':>8} | "
              f"{'old/new':>7} {'deq/new':>7}")
    for module, kind, rows, cols, data, scales, args, old in _new_and_old(kinds, threads, header, build,
                                                                          cpp._CODE_NO_PANEL):
        if force_panel:                                  # --force-panel: "new" is the panel at every row count
            args = (args[0] | cpp._CODE_PANEL,) + args[1:]
        for m in rows_list:
            x = paddle.randn([m, cols])
            times = _interleaved({
                "new": lambda: module.fdx_quant_matmul(x, data, scales, *args),
                "old": lambda: module.fdx_quant_matmul(x, data, scales, *old),
                "deq": lambda: paddle.matmul(x, module.fdx_quant_dequantize(data, scales, *args),
                                             transpose_y=True)}, rounds)
            tn, to, td = (np.median(times[k]) / 1e3 for k in ("new", "old", "deq"))
            print(f"{kind:<6} {f'{rows}x{cols}':>10} {m:>4} | {tn:8.2f} {to:8.2f} {td:8.2f} | "
                  f"{to / tn:6.2f}x {td / tn:6.2f}x", flush=True)


def bench_decode(kinds: list[str], rows_list: tuple[int, ...], rounds: int, threads: int) -> None:
    """Few activation rows (decode): the compiled product as it runs now against the
    kernel before (kCodeRowTiles: the k-quants' 256-bit maddubs path, main's), with no
    third call between them (a dequantize + BLAS call evicts the weight, so the side
    after it would read it cold and the other warm). Each round runs the two once cold
    (caches flushed first: in a decode step a layer's weight streams from memory) and
    then once warm, in the order new/old on even rounds and old/new on odd ones;
    medians and their ratios."""
    header = (f"{'kind':<6} {'out x in':>10} {'M':>4} | {'cold new':>8} {'old ms':>8} {'old/new':>7} | "
              f"{'warm new':>8} {'old ms':>8} {'old/new':>7}")
    flush = np.empty(64 << 18, np.float32)              # 64 MiB: more than the L3
    for module, kind, rows, cols, data, scales, args, old in _new_and_old(kinds, threads, header):
        for m in rows_list:
            x = paddle.randn([m, cols])
            fns = {"new": lambda: module.fdx_quant_matmul(x, data, scales, *args),
                   "old": lambda: module.fdx_quant_matmul(x, data, scales, *old)}
            times = {(k, c): [] for k in fns for c in ("cold", "warm")}
            for fn in fns.values():
                fn()
            for i in range(rounds):
                for k in (("new", "old") if i % 2 == 0 else ("old", "new")):
                    for cond in ("cold", "warm"):
                        if cond == "cold":
                            flush.fill(i)
                        t0 = CLOCK()
                        fns[k]()
                        times[k, cond].append(CLOCK() - t0)
            med = {key: 1e3 * np.median(v) for key, v in times.items()}
            print(f"{kind:<6} {f'{rows}x{cols}':>10} {m:>4} | {med['new', 'cold']:8.3f} "
                  f"{med['old', 'cold']:8.3f} {med['old', 'cold'] / med['new', 'cold']:6.2f}x | "
                  f"{med['new', 'warm']:8.3f} {med['old', 'warm']:8.3f} "
                  f"{med['old', 'warm'] / med['new', 'warm']:6.2f}x", flush=True)


def bench_layer(kinds: list[str], seqs_list: tuple[int, ...], iters: int, threads: int, ctx: int = 128) -> None:
    from fdx.core import kernels
    from fdx.core.host import cpu_model
    from fdx.core.interfaces import AttentionContext
    from fdx.plugins.backends.probe_child import random_layer
    from fdx.plugins.backends.attention import CpuAttention
    from fdx.plugins.backends.cpu import probe_kernels

    table = probe_kernels(threads)
    print(f"cpu: {cpu_model()}, {threads} threads, load average {' '.join(open('/proc/loadavg').read().split()[:3])}")
    backend = CpuAttention()
    rng = np.random.default_rng(0)
    block, kvh = 16, 3
    with kernels.using(table):
        for kind in kinds:
            layer, cfg = random_layer(kind, rng, hidden=576, inter=1536, heads=9, kv_heads=kvh, head_dim=64,
                                      table=table, max_position=ctx + 1)
            for n in seqs_list:
                per_seq = -(-(ctx + 1) // block)
                num_slots = n * per_seq * block
                caches = tuple(paddle.randn([kvh * num_slots, 64]) for _ in range(2))
                tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
                meta = build_attention_metadata([1] * n, [ctx] * n, tables, block, kvh, num_slots, impl="cpp")
                x, res = paddle.randn([n, 576]), paddle.randn([n, 576])

                ctx_ = AttentionContext(backend, meta)
                composed = lambda: layer.composed(x, res, meta.positions, caches, ctx_)   # noqa: E731
                fused = lambda: layer(x, res, meta.positions, caches, ctx_)               # noqa: E731 (the port's)
                _report(f"decoder layer {kind} {n} seqs x {ctx} ctx",
                        _interleaved({"composed": composed, "fused": fused}, iters))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads, as the cpu backend sets them (default: the cores this process may use)")
    parser.add_argument("--quant", nargs="?", const="q8_0,q4_0,q4_1,q5_0,q5_1,q4_k,q5_k,q6_k,wint8,wint4",
                        help="time the quantized products instead (comma-separated kinds; default all)")
    parser.add_argument("--rows", default="1,8,64", help="with --quant: activation rows (comma-separated)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by this thread's CPU time, not wall time (with --threads 1 only: the time "
                             "other jobs on the cores take is then not counted)")
    parser.add_argument("--prefill", nargs="?", const="q4_k,q6_k,q8_0,q4_0,q4_1,q5_k",
                        help="many-row products (--rows, default 32,128,512): now (the panel product on "
                             "AVX-512 VNNI), the integer kernels without the panel, dequantize + BLAS")
    parser.add_argument("--force-panel", action="store_true",
                        help="with --prefill: 'new' is the panel product at every row count (kCodePanel), "
                             "to measure its threshold (QUANT_PANEL_MIN_ROWS_VNNI)")
    parser.add_argument("--variant", choices=cpp.QUANT_VARIANTS,
                        help="with --prefill: this instruction-set build (default: the widest the CPU runs), "
                             "e.g. avx2 on an AVX-512 CPU")
    parser.add_argument("--decode", nargs="?", const="q4_1,q4_k,q5_k,q6_k",
                        help="few-row products (--rows, default 1,2,4,8), cold and warm: now against the "
                             "kernel before (the 256-bit path of the k-quants and q4_1/q5_1)")
    parser.add_argument("--layer", nargs="?", const="q4_1,q8_0",
                        help="time one whole decoder layer, composed and fused (comma-separated kinds)")
    args = parser.parse_args()
    if args.cpu_time:
        if args.threads != 1:
            parser.error("--cpu-time counts the calling thread only: use it with --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    os.environ["OMP_NUM_THREADS"] = str(args.threads)      # as the cpu backend does, before the first kernel
    paddle.base.core.set_num_threads(args.threads)
    paddle.set_grad_enabled(False)
    if not cpp.available():
        raise SystemExit(f"compiled ops unavailable: {cpp.unavailable_reason()}")
    if args.prefill:
        rows = "32,128,512" if args.rows == "1,8,64" else args.rows
        bench_prefill(args.prefill.split(","), tuple(int(m) for m in rows.split(",")), args.iters, args.threads,
                      args.variant, args.force_panel)
        return
    if args.decode:
        rows = "1,2,4,8" if args.rows == "1,8,64" else args.rows
        bench_decode(args.decode.split(","), tuple(int(m) for m in rows.split(",")), args.iters, args.threads)
        return
    if args.layer:
        bench_layer(args.layer.split(","), (1, 8, 32), args.iters, args.threads)
        return
    if args.quant:
        bench_quant(args.quant.split(","), tuple(int(m) for m in args.rows.split(",")), args.iters, args.threads)
        return
    print(f"threads={args.threads}")
    for n in (1, 64, 512):
        bench_silu(n, 1536, args.iters)
    for n in (1, 64, 512):
        bench_add_rms_norm(n, 576, args.iters)
    for n in (1, 64, 512):
        bench_rope_write(n, 9, 3, 64, False, args.iters)
    bench_rope_write(64, 16, 8, 128, True, args.iters)


if __name__ == "__main__":
    main()
