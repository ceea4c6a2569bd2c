"""Under backend.batch_invariant: the panel product in TileM1Vnni's float order
(csrc/panel_gemm.inc's PanelTileM1; kCodePanel: at every row count) against
TileM1Vnni (kCodeNoPanel), the kinds that take it (q4_0, q4_1, q5_1, wint4), on
one thread by CPU time (``time.thread_time``), the two alternated call by call;
medians and old/new. The figures behind ``fdx.ops.cpp.QUANT_PANEL_M1_MIN_ROWS``.

    PYTHONPATH=<tree's parent> python scripts/bench_invariant_panel.py [--kinds q4_1] [--rows 16,32,512]

``--default``: the same order against the panel's default order (both forced, not
under the switch): whether it could serve the default mode too.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ["OMP_NUM_THREADS"] = "1"                 # before the first kernel, as the cpu backend does

import numpy as np
import paddle


def main() -> None:
    from fdx.ops import cpp
    from fdx.ops.probes import random_quantized
    from fdx.plugins.backends.cpu import probe_kernels

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(cpp.QUANT_PANEL_M1_MIN_ROWS))
    ap.add_argument("--shapes", default="576x576,1536x576,576x1536,2048x8192,8192x2048",
                    help="out x in: the embedded model's q/o, gate/up, down; a 1.7B layer's down, gate/up")
    ap.add_argument("--rows", default="16,24,32,48,64,128,512")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--default", action="store_true")
    a = ap.parse_args()
    paddle.base.core.set_num_threads(1)
    paddle.set_grad_enabled(False)
    probe_kernels(1)
    mod = cpp._module_or_raise()
    print(f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}, 1 thread, CPU time", flush=True)
    rng = np.random.default_rng(0)
    for kind in a.kinds.split(","):
        for shape in a.shapes.split(","):
            rows, cols = map(int, shape.split("x"))
            w = random_quantized(kind, rows, cols, rng).prepare()     # the layout the probe picks
            data, scales = w.tensors()
            rest = (cpp._VARIANT_CODE["avx512"], rows, cols, w.group_size)
            if a.default:
                new = (cpp.quant_code(w, True) | cpp._CODE_PANEL,) + rest
                old = (cpp.quant_code(w) | cpp._CODE_PANEL,) + rest
            else:
                new = (cpp.quant_code(w, True) | cpp._CODE_PANEL,) + rest
                old = (cpp.quant_code(w, True) | cpp._CODE_NO_PANEL,) + rest
            for m in map(int, a.rows.split(",")):
                x = paddle.randn([m, cols])
                fns = {"new": lambda: mod.fdx_quant_matmul(x, data, scales, *new),
                       "old": lambda: mod.fdx_quant_matmul(x, data, scales, *old)}
                times = {k: [] for k in fns}
                for fn in fns.values():
                    fn()
                for i in range(a.iters):
                    for k in (("new", "old") if i % 2 == 0 else ("old", "new")):
                        t0 = time.thread_time()
                        fns[k]()
                        times[k].append(time.thread_time() - t0)
                tn, to = (1e3 * np.median(times[k]) for k in ("new", "old"))
                layout = "interleaved" if w.interleaved else "plain"
                print(f"{kind:<6} {shape:>10} {layout:<11} M={m:<4} new {tn:8.3f} ms  old {to:8.3f} ms  "
                      f"old/new {to / tn:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
