"""What expert parallel's exchange costs over gloo on CPU (docs/architecture.md,
"Mixture-of-experts layers"): Paddle's all_reduce, all_gather and all_to_all
between N processes on [rows, hidden] float32, at a decode step's and a
prefill's row counts, one thread a rank as the tp executor gives a 2-core
machine. Each iteration runs every collective once (order alternating),
each after a barrier; the median and the 10th percentile per collective.

    python scripts/bench_gloo_collectives.py --world 2 --hidden 2048 --rows 1,8,32,256

A collective Paddle's gloo group does not implement is reported as such
(all_to_all: 'ProcessGroupGLOO does not support all_to_all')."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def _rank(args) -> None:
    import numpy as np
    import paddle
    import paddle.distributed as dist
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = ["all_reduce", "all_gather", "all_to_all"]
    missing = {}
    try:
        probe = paddle.ones([1, 4])
        dist.alltoall([paddle.empty_like(probe) for _ in range(world)], [probe] * world)
    except Exception as e:                   # gloo: NotImplementedError, synchronous or not
        missing["all_to_all"] = str(e).splitlines()[0][:90]
        ops.remove("all_to_all")
    times: dict = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        x = paddle.to_tensor(np.random.default_rng(rank).standard_normal((rows, args.hidden)).astype(np.float32))

        def run(op):
            if op == "all_reduce":
                dist.all_reduce(x)
            elif op == "all_gather":
                dist.all_gather([], x)
            else:
                dist.alltoall([paddle.empty_like(x) for _ in range(world)], [x] * world)
        for op in ops:
            for _ in range(5):
                run(op)
        for i in range(args.iters):
            for op in ops if i % 2 == 0 else ops[::-1]:
                dist.barrier()
                t0 = time.perf_counter()
                run(op)
                times.setdefault((rows, op), []).append(time.perf_counter() - t0)
    if rank == 0:
        for (rows, op), ts in times.items():
            us = np.array(ts) * 1e6
            print(f"{op:10s} rows {rows:4d} x {args.hidden} float32 ({rows * args.hidden * 4:8d} bytes a rank): "
                  f"median {np.median(us):7.0f} us, p10 {np.percentile(us, 10):7.0f} us")
        for op, why in missing.items():
            print(f"{op:10s} not run: {why}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)         # Qwen3-30B-A3B's
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        _rank(args)
        return 0
    socks = [socket.socket() for _ in range(args.world)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    endpoints = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = []
    for r in range(args.world):
        env = {**os.environ, "PADDLE_TRAINER_ID": str(r), "PADDLE_TRAINERS_NUM": str(args.world),
               "PADDLE_TRAINER_ENDPOINTS": endpoints, "PADDLE_CURRENT_ENDPOINT": f"127.0.0.1:{ports[r]}",
               "PADDLE_DISTRI_BACKEND": "gloo", "OMP_NUM_THREADS": "1", "GLOG_minloglevel": "2"}
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(r)], env=env,
                                      stderr=subprocess.DEVNULL))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
