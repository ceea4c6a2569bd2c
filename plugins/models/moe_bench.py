"""A micro-benchmark of one MoE layer's routed experts: the grouped call
(fdx.ops.moe.experts, one compiled call a layer) against the per-expert
loop (``SparseMoe._expert_loop``: one format product per chosen expert,
main's path before the grouped kernel), on random experts of a real A3B
model's shapes (Qwen3-30B-A3B: hidden 2048, 128 experts of 768, top-8),
in one process, alternating the two, best of several rounds of CPU time
per call::

    python -m fdx.plugins.models.moe_bench --kind q8_0 --rows 1,32 --layers 4

``--layers`` distinct layers are cycled (a decode step streams each layer's
experts from memory, not from cache). The routing is uniform random, so
the expert load is balanced; it is printed per call.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def _layer(kind: str, experts: int, hidden: int, inter: int, top_k: int, rng):
    from fdx.ops import moe
    from fdx.ops.probes import random_quantized
    from fdx.plugins.models.moe_layers import SparseMoe, stack_experts
    from fdx.plugins.models.weight_formats import BlockWeight, DenseWeight
    import paddle

    def weight(rows: int, cols: int):
        if kind == "f32":
            return DenseWeight(paddle.to_tensor((0.05 * rng.standard_normal((cols, rows))).astype(np.float32)))
        return BlockWeight(random_quantized(kind, rows, cols, rng))

    block = SparseMoe.__new__(SparseMoe)
    block.num_experts, block.top_k, block.intermediate_size = experts, top_k, inter
    block.w_gate_up = [weight(2 * inter, hidden) for _ in range(experts)]
    block.w_down = [weight(hidden, inter) for _ in range(experts)]
    stacks = (stack_experts(block.w_gate_up), stack_experts(block.w_down))
    assert all(isinstance(s, moe.ExpertStack) for s in stacks)
    return block, stacks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="q8_0")
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import paddle
    from fdx.core import kernels
    from fdx.core.host import cpu_model
    from fdx.ops import cpp, moe
    from fdx.plugins.backends.cpu import probe_kernels
    paddle.set_device("cpu")
    paddle.base.core.set_num_threads(args.threads)
    table = probe_kernels(args.threads)
    print(f"cpu: {cpu_model()}, threads {args.threads}, grouped build {moe.build(table)}, kind {args.kind}, "
          f"{args.layers} layers of {args.experts} experts [{2 * args.inter}x{args.hidden}, "
          f"{args.hidden}x{args.inter}] top-{args.top_k}")
    rng = np.random.default_rng(0)
    layers = [_layer(args.kind, args.experts, args.hidden, args.inter, args.top_k, rng) for _ in range(args.layers)]
    with kernels.using(table):
        for rows in [int(r) for r in args.rows.split(",")]:
            x = paddle.to_tensor(rng.standard_normal((rows, args.hidden)).astype(np.float32))
            ids = np.stack([rng.permutation(args.experts)[:args.top_k] for _ in range(rows)]).astype(np.int64)
            w = rng.random((rows, args.top_k)).astype(np.float32)
            counts = np.bincount(ids.reshape(-1), minlength=args.experts)
            sides = {"grouped": lambda b, s: moe.experts(x, ids, w, *s),
                     "loop": lambda b, s: b._expert_loop(x, ids, w, counts)}
            best = {name: float("inf") for name in sides}
            for _ in range(args.rounds):
                for name, fn in sides.items():            # alternating sides each round
                    t0 = time.process_time()
                    for block, stacks in layers:
                        fn(block, stacks)
                    best[name] = min(best[name], (time.process_time() - t0) / len(layers))
            a, b = (np.asarray(sides[n](*layers[0]).numpy()) for n in ("grouped", "loop"))
            diff = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
            print(f"rows {rows}: experts used {int((counts > 0).sum())}, load max/mean "
                  f"{counts.max() / max(counts[counts > 0].mean(), 1):.2f}; grouped {best['grouped'] * 1e3:.2f} ms, "
                  f"loop {best['loop'] * 1e3:.2f} ms CPU a layer: loop/grouped {best['loop'] / best['grouped']:.2f}x "
                  f"(max relative difference {diff:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
