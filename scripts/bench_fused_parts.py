"""A fused q/k/v of mixed GGML kinds multiplied part by part (main's RowStack: a
call, an activation quantization and an op dispatch a part, then a concat)
against one fdx_parts_matmul call (fdx.ops.parts: same-kind neighbours one
part, each row quantized once): CPU time of the calling thread, one thread,
the two sides alternating round by round, median of the rounds. Checks the
two give the same bits first. Shapes: hidden 2048, q 2048 rows, k and v 512
(SmolLM2-1.7B-like GQA); kinds as llama.cpp's Q4_K_M writes them (Q4_K q/k
and Q6_K v; Q5_0 q/k and Q8_0 v where a row is not whole 256-blocks).

    PYTHONPATH=<tree's parent> python scripts/bench_fused_parts.py [rounds] [rows,rows,...]
"""
from __future__ import annotations

import sys
import time

import numpy as np


def main() -> None:
    import paddle
    paddle.base.core.set_num_threads(1)
    from fdx.core import kernels
    from fdx.core.interfaces import RowStack
    from fdx.ops import cpp
    from fdx.ops.probes import random_quantized
    from fdx.plugins.backends.cpu import probe_kernels
    from fdx.plugins.models.weight_formats import BlockWeight, stack

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    rows = [int(r) for r in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 4, 16, 64, 127, 512]
    cpp.prepare()
    table = probe_kernels(1)
    rng = np.random.default_rng(0)
    for kinds in (("q4_k", "q4_k", "q6_k"), ("q5_0", "q5_0", "q8_0")):
        hidden = 2048
        parts = [BlockWeight(random_quantized(k, r, hidden, rng)) for k, r in zip(kinds, (2048, 512, 512))]
        old, new = RowStack(parts), stack(parts)
        for w in parts + list(new.parts):
            w.q.prepare()
        with kernels.using(table):
            for m in rows:
                x = paddle.to_tensor(rng.standard_normal((m, hidden)).astype(np.float32))
                assert np.array_equal(old.matmul(x).numpy(), new.matmul(x).numpy()), "not the same bits"
                iters = max(1, 64 // m)
                times: dict[str, list[float]] = {"old": [], "new": []}
                for r in range(rounds):
                    for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                        w = old if side == "old" else new
                        c0 = time.thread_time()
                        for _ in range(iters):
                            w.matmul(x)
                        times[side].append((time.thread_time() - c0) / iters)
                a, b = float(np.median(times["old"])), float(np.median(times["new"]))
                print(f"{'+'.join(kinds):16s} M={m:4d}  part by part {a * 1e3:8.3f} ms  one call {b * 1e3:8.3f} ms"
                      f"  {a / b:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
