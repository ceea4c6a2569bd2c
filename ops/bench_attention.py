"""Per-layer paged attention timings, Paddle path vs compiled kernel.

    python -m fdx.ops.bench_attention

Not a test: prints min and median wall milliseconds per call, and the
process CPU time per call (robust to other load on the machine when run
with OMP_NUM_THREADS=1; with more threads it counts OpenMP spin-waits too). Default case: 64 sequences
decoding with 256 cached tokens each, 9 query / 3 kv heads, head_dim 64.
"""
import argparse
import os
import time

import numpy as np
import paddle

from fdx.ops import cpp
from fdx.ops.attention import build_attention_metadata, paged_attention, write_kv


def _time_ms(fn, clock=time.perf_counter) -> float:
    t0 = clock()
    fn()
    return 1e3 * (clock() - t0)


def bench_case(label, query_lens, context_lens, heads=9, kv_heads=3, d=64, block_size=16, iters=30, impls=None):
    """Times each impl on the same pool, interleaved so that both see the same
    machine load; prints min and median wall milliseconds per call."""
    rng = np.random.default_rng(0)
    need = [-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens)]
    num_blocks = sum(need) + 8
    ids = rng.permutation(num_blocks).tolist()
    tables = [[ids.pop() for _ in range(nb)] for nb in need]
    num_slots = num_blocks * block_size
    k_cache = paddle.to_tensor(rng.standard_normal((kv_heads * num_slots, d)).astype(np.float32))
    v_cache = paddle.to_tensor(rng.standard_normal((kv_heads * num_slots, d)).astype(np.float32))
    n = sum(query_lens)
    q = paddle.to_tensor(rng.standard_normal((n, heads, d)).astype(np.float32))
    k = paddle.to_tensor(rng.standard_normal((n, kv_heads, d)).astype(np.float32))
    args = (query_lens, context_lens, tables, block_size, kv_heads, num_slots)
    runs = {}
    for impl, max_q in impls or [("paddle", None), ("cpp", None)]:
        name = impl if max_q is None else f"{impl}<={max_q}"
        if impl == "cpp" and not cpp.available():
            print(f"{label:<40} {name:<8} unavailable: {cpp.unavailable_reason()}")
            continue
        kw = {"impl": impl, "cpp_max_query_len": max_q, "num_heads": heads}
        meta = build_attention_metadata(*args, **kw)
        runs[name] = {"kw": kw, "meta": meta, "attn": [], "cpu": [], "write": [], "build": []}
    for it in range(iters):
        for r in runs.values():
            meta = r["meta"]
            r["attn"].append(_time_ms(lambda: paged_attention(q, k_cache, v_cache, meta, d**-0.5)))
            r["cpu"].append(_time_ms(lambda: paged_attention(q, k_cache, v_cache, meta, d**-0.5), time.process_time))
            r["write"].append(_time_ms(lambda: write_kv(k_cache, v_cache, k, k, meta)))
            if it < max(3, iters // 3):
                r["build"].append(_time_ms(lambda: build_attention_metadata(*args, **r["kw"])))
    ref = None
    for name, r in runs.items():
        out = paged_attention(q, k_cache, v_cache, r["meta"], d**-0.5).numpy()
        diff = 0.0 if ref is None else float(np.abs(out - ref).max())
        ref = out if ref is None else ref
        attn, cpu_ms, write, build = (np.asarray(r[key][1:]) for key in ("attn", "cpu", "write", "build"))
        print(
            f"{label:<40} {name:<8} attention min {attn.min():7.3f} med {np.median(attn):7.3f} ms "
            f"(process cpu med {np.median(cpu_ms):7.3f}) | "
            f"write_kv med {np.median(write):6.3f} | metadata/step med {np.median(build):6.3f} | "
            f"max|diff| {diff:.0e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--all", action="store_true", help="also mixed and prefill cases")
    args = parser.parse_args()
    paddle.set_grad_enabled(False)
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    bench_case("decode 64 seqs x 256 ctx, 9/3 heads, d64", [1] * 64, [256] * 64, iters=args.iters)
    if args.all:
        all3 = [("paddle", None), ("cpp", None), ("cpp", 1)]
        lens = np.random.default_rng(1).integers(16, 512, 64).tolist()
        bench_case("decode 64 seqs x 16..512 ctx", [1] * 64, lens, iters=args.iters)
        bench_case("decode 1 seq x 256 ctx", [1], [256], iters=args.iters)
        bench_case("63 decodes x 256 + a 64-token chunk", [1] * 63 + [64], [256] * 63 + [128], iters=args.iters,
                   impls=all3)
        bench_case("prefill 512 tokens", [512], [0], iters=max(5, args.iters // 3), impls=all3[:2])
        bench_case("prefill chunk 64 after 448 ctx", [64], [448], iters=args.iters, impls=all3[:2])
        bench_case("prefill chunk 16 after 256 ctx", [16], [256], iters=args.iters, impls=all3[:2])

if __name__ == "__main__":
    main()
