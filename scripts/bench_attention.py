"""The batch-invariant paged attention against the default one, same data, same process.

    FDX_CACHE_DIR=... PYTHONPATH=... python scripts/bench_attention.py [--heads 9 --kv-heads 3 --head-dim 64]
        [--threads 1] [--rounds 7] [--case S,ctx,tq ...]

For each case (S sequences of tq query tokens after ctx cached ones, each sequence's blocks
contiguous; a one-sequence step of <= 16 tokens gets a one-key second sequence on the default
side, see make_args) it times ``cpp.paged_attention`` with invariant False and True in alternating
rounds and prints the best CPU time (process time: every thread's; --wall: wall-clock) of each side and the
median of the per-round ratios invariant / default. Run it with another PYTHONPATH to measure
another tree's kernels (the ratios of two trees are comparable only from the same run or
the same load). Where the CPU runs the invariant kernel's AVX-512 primitives and head_dim is
a multiple of 32, the default mode takes that kernel at every step (InvariantStep): there
``--default-kernels native`` times the same kernel on both sides (ratios about 1.0), and
``avx2`` (the default) or ``portable`` times the default mode's own kernels, which AVX2-only
CPUs run (cpp.paged_attention's test-only ``default_kernels``).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import paddle

from fdx.ops import cpp

CASES = [(1, 256, 1), (1, 1024, 1), (1, 1024, 9), (32, 256, 1), (4, 512, 9), (1, 512, 512), (1, 0, 512)]


def make_args(S, ctx, tq, heads, kv_heads, dim, block_size=16, seed=0, pad=False):
    """paged_attention's arguments; pad: one more sequence of one token and one key (in its own
    block), which costs next to nothing and keeps a one-sequence step of <= 16 tokens off the
    invariant kernel that the default mode gives it (paged_attention_kernel.h InvariantStep)."""
    rng = np.random.default_rng(seed)
    blocks_per = (ctx + tq + block_size - 1) // block_size
    nblk = S * blocks_per
    k = rng.random((kv_heads, nblk * block_size, dim), np.float32) - 0.5
    v = rng.random((kv_heads, nblk * block_size, dim), np.float32) - 0.5
    q = rng.random((S * tq, heads, dim), np.float32) - 0.5
    info = [[s * tq, tq, ctx, s * tq] for s in range(S)]
    tables = np.arange(nblk, dtype=np.int32).reshape(S, blocks_per)
    if pad:  # block nblk of every head, the extra sequence's one key
        k, v = (np.concatenate([c, np.zeros((kv_heads, block_size, dim), np.float32)], axis=1) for c in (k, v))
        q = np.concatenate([q, np.zeros((1, heads, dim), np.float32)])
        info.append([S * tq, 1, 0, S * tq])
        tables = np.concatenate([tables, np.full((1, blocks_per), nblk, np.int32)])
    k, v, q = (paddle.to_tensor(np.ascontiguousarray(x.reshape(-1, x.shape[-1]) if x is not q else x)) for x in (k, v, q))
    return (q, k, v, paddle.to_tensor(np.array(info, np.int32)), paddle.to_tensor(tables), dim ** -0.5, kv_heads,
            block_size, len(q))


def timed(args, invariant, reps, clock=time.process_time, **kw):
    t = clock()
    for _ in range(reps):
        cpp.paged_attention(*args, invariant=invariant, **kw)
    return (clock() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wall", action="store_true", help="wall-clock time in place of CPU time")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--target-ms", type=float, default=40.0, help="CPU time a side spends per round")
    ap.add_argument("--no-pad", action="store_true",
                    help="with --default-kernels native: time a one-sequence step of <= 16 tokens as it is (the "
                         "default mode runs the invariant kernel there), not with the extra one-key sequence that "
                         "sends it to the default kernels where the CPU has no AVX-512")
    ap.add_argument("--case", action="append", default=None, help="S,ctx,tq (repeatable)")
    ap.add_argument("--default-kernels", choices=("avx2", "portable", "native"), default="avx2",
                    help="the default side: the AVX2 build's kernels (AttendSplit, AttendOne, AttendPrefill), the "
                         "portable build's AttendTile, or what the default mode runs on this CPU (native)")
    opt = ap.parse_args()
    cpp.prepare()
    paddle.base.core.set_num_threads(opt.threads)
    clock = time.perf_counter if opt.wall else time.process_time
    cases = [tuple(int(x) for x in c.split(",")) for c in opt.case] if opt.case else CASES
    print(f"heads {opt.heads} / kv heads {opt.kv_heads}, head_dim {opt.head_dim}, {opt.threads} thread(s), "
          f"{'wall-clock' if opt.wall else 'CPU'} time, best of {opt.rounds} rounds; ratio: median of the rounds' invariant / default")
    for S, ctx, tq in cases:
        args = make_args(S, ctx, tq, opt.heads, opt.kv_heads, opt.head_dim)
        native = opt.default_kernels == "native"
        kw = {} if native else {"default_kernels": opt.default_kernels}
        pad = native and S == 1 and tq <= 16 and not opt.no_pad
        dargs = make_args(S, ctx, tq, opt.heads, opt.kv_heads, opt.head_dim, pad=True) if pad else args
        a = cpp.paged_attention(*dargs, invariant=False, **kw).numpy()[:S * tq]
        b = cpp.paged_attention(*args, invariant=True).numpy()
        reps = max(1, int(opt.target_ms / max(timed(args, True, 3), 1e-3)))
        ds, vs, ratios = [], [], []
        for _ in range(opt.rounds):
            d = timed(dargs, False, reps, clock, **kw)
            i = timed(args, True, reps, clock)
            ds.append(d), vs.append(i), ratios.append(i / d)
        print(f"S={S:3d} ctx={ctx:5d} tq={tq:4d}: default {min(ds):8.4f} ms  invariant {min(vs):8.4f} ms  "
              f"ratio {statistics.median(ratios):.3f}  (max |diff| {np.abs(a - b).max():.1e})", flush=True)


if __name__ == "__main__":
    main()
