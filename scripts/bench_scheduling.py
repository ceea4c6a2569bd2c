"""The scheduling cost of one step, no model: ``schedule()`` + ``update()``
of N decoding requests on the engine's scheduling core (the default token
processor detokenizing with a stub tokenizer), best of 5 runs of 400 steps.
Run it on two trees alternately to compare them:

    PYTHONPATH=<tree's parent> python scripts/bench_scheduling.py 64
"""
from __future__ import annotations

import sys
import time

from fdx.core.assembly import Assembly
from fdx.core.config import FdxConfig
from fdx.core.interfaces import ModelRunnerOutput
from fdx.core.plugins import PluginManager
from fdx.core.request import Request
from fdx.core.sampling_params import SamplingParams


def main(num_seqs: int, steps: int = 400, repeats: int = 5) -> float:
    cfg = FdxConfig.build(max_num_seqs=max(num_seqs, 1), block_size=16, max_num_batched_tokens=2048)
    assembly = Assembly(cfg, PluginManager(load_entry_points=False))
    tp = assembly.token_processor()
    best = float("inf")
    for _ in range(repeats):
        rm = assembly.scheduler_side(4096, tp, 2048)["scheduling"]
        for i in range(num_seqs):
            r = Request(f"r{i}", list(range(1, 33)), SamplingParams(temperature=0, max_tokens=steps + 10,
                                                                    ignore_eos=True), max_model_len=2048)
            tp.start(r)
            rm.add_request(r)
        t0 = time.perf_counter()
        for _ in range(steps):
            sched = rm.schedule()
            by_id = {r.request_id: r for r in rm.requests()}
            rm.update(sched, ModelRunnerOutput(sampled={
                rid: 5 for rid, n in sched.num_scheduled_tokens.items()
                if by_id[rid].num_computed_tokens + n == by_id[rid].num_tokens}))
        best = min(best, (time.perf_counter() - t0) / steps)
    return best


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    print(f"{n} sequences: {main(n) * 1e6:.1f} us per step (schedule + update)")
