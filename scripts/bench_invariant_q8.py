"""q8_0 / wint8 products under backend.batch_invariant: TileM1VnniQ8 at every row count
(what kCodeInvariant runs now on a CPU with AVX-512 VNNI) against the 256-bit TileMatmul
(what it ran before: kCodeInvariant | kCodeRowTiles still takes it), same process,
alternating call by call, CPU time of 1 thread. Not a test.

    FDX_CACHE_DIR=... PYTHONPATH=... python scripts/bench_invariant_q8.py [--kinds q8_0,wint8]
        [--rows 1,2,5,9,12,16,32,64,128,512] [--rounds 7] [--layout interleaved|plain]

Prints per kind, shape and row count the median ms of each side and old/new.
"""
import argparse
import os
import time

import numpy as np

SHAPES = ((49152, 576), (576, 576), (1536, 576), (2048, 8192))   # the embedded LM head, q/o, gate/up; a big one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="q8_0,wint8")
    parser.add_argument("--rows", default="1,2,5,9,12,16,32,64,128,512")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layout", choices=("interleaved", "plain"), default="interleaved")
    parser.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in SHAPES))
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    import paddle
    from fdx.ops import cpp
    from fdx.ops.probes import random_quantized

    paddle.base.core.set_num_threads(1)
    paddle.set_grad_enabled(False)
    module = cpp._module_or_raise()
    rng = np.random.default_rng(0)
    print(f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}, 1 thread, CPU time, "
          f"{args.layout}, median of {args.rounds} alternated rounds")
    print(f"{'kind':<6} {'rows x cols':>11} {'M':>4} | {'M1VnniQ8 ms':>11} {'TileMatmul ms':>13} | old/new")
    for kind in args.kinds.split(","):
        for shape in args.shapes.split(","):
            rows, cols = (int(v) for v in shape.split("x"))
            w = random_quantized(kind, rows, cols, rng).prepare(interleave=args.layout == "interleaved")
            data, scales = w.tensors()
            code = cpp.quant_code(w, invariant=True)
            new = (code, cpp._VARIANT_CODE["avx512"], rows, cols, w.group_size)
            old = (code | cpp._CODE_ROW_TILES,) + new[1:]
            for m in (int(v) for v in args.rows.split(",")):
                x = paddle.randn([m, cols])
                fns = {"new": lambda: module.fdx_quant_matmul(x, data, scales, *new),
                       "old": lambda: module.fdx_quant_matmul(x, data, scales, *old)}
                times = {k: [] for k in fns}
                for fn in fns.values():
                    fn()
                n = max(3, args.rounds // max(1, rows * cols * m // (1 << 30)))
                for i in range(n):
                    for k in (("new", "old") if i % 2 == 0 else ("old", "new")):
                        t0 = time.thread_time()
                        fns[k]()
                        times[k].append(time.thread_time() - t0)
                tn, to = (1e3 * np.median(times[k]) for k in ("new", "old"))
                print(f"{kind:<6} {shape:>11} {m:>4} | {tn:11.3f} {to:13.3f} | {to / tn:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
