"""Interleaved (repacked at load) against plain weights of the kinds whose layout
is chosen per machine (fdx.ops.quant.PROBED_REPACK_KINDS: q4_0, wint4,
q2_k, q3_k), through
fdx.ops.quant.matmul in one build (the table lists only that build): CPU time
of the process (all its threads), the two sides alternating round by round,
median of the rounds; the ratio is plain time / interleaved time (above 1: the
interleaved layout is faster). Checks first that both give the float64 numpy
product within 1e-4. Shapes out x in: 2048x2048 and 8192x2048.

    PYTHONPATH=<tree's parent> python scripts/bench_repack.py [--build avx512] [--threads 1]
        [--rounds 9] [--rows 1,8,32,512] [--kinds q4_0,wint4]
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--build", default="avx512")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--rows", default="1,8,32,512")
    p.add_argument("--kinds", default="q4_0,wint4")
    args = p.parse_args()
    import paddle
    paddle.base.core.set_num_threads(args.threads)
    from fdx.core import kernels
    from fdx.ops import cpp, quant
    from fdx.ops.probes import act_block, int8_blocks, random_blocks

    cpp.prepare()
    kinds = args.kinds.split(",")
    table = kernels.KernelTable({cpp.quant_kernel_name(k, args.build): None for k in kinds})
    rng = np.random.default_rng(0)
    for kind in kinds:
        for rows, cols in ((2048, 2048), (8192, 2048)):
            if kind == "wint4":
                plain = quant.QuantizedTensor(kind, (rows, cols), rng.integers(0, 256, (rows, cols // 2), np.uint8),
                                              rng.uniform(0.01, 0.02, (rows, cols // 128)).astype(np.float32), 128)
            else:
                plain = quant.QuantizedTensor(kind, (rows, cols), random_blocks(kind, rows, cols, rng))
            inter = quant.QuantizedTensor(kind, plain.shape, plain.data.copy(), plain.scales, plain.group_size)
            values = plain.dequantize().astype(np.float64)
            plain.prepare(interleave=False)
            inter.prepare(interleave=True)
            assert inter.interleaved and not plain.interleaved
            with kernels.using(table):
                for m in (int(r) for r in args.rows.split(",")):
                    x = rng.standard_normal((m, cols)).astype(np.float32)
                    xt = paddle.to_tensor(x)
                    want = int8_blocks(x, act_block(kind)).astype(np.float64) @ values.T
                    blas = cpp.quant_blas_min_rows(kind, args.build)
                    if blas is not None and m >= blas:
                        want = x.astype(np.float64) @ values.T
                    for w in (plain, inter):
                        err = np.abs(quant.matmul(xt, w).numpy() - want).max() / np.abs(want).max()
                        assert err < 1e-4, (kind, rows, m, w.interleaved, err)
                    iters = max(1, 64 // m)
                    times: dict[bool, list[float]] = {False: [], True: []}
                    for r in range(args.rounds):
                        for side in ((False, True) if r % 2 == 0 else (True, False)):
                            w = inter if side else plain
                            c0 = time.process_time()
                            for _ in range(iters):
                                quant.matmul(xt, w)
                            times[side].append((time.process_time() - c0) / iters)
                    a, b = float(np.median(times[False])), float(np.median(times[True]))
                    print(f"{kind:5s} {args.build:8s} {rows}x{cols} M={m:4d}  plain {a * 1e3:8.3f} ms  "
                          f"interleaved {b * 1e3:8.3f} ms  {a / b:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
