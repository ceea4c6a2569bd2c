"""Two (or more) source trees of fdx, compared step by step in lockstep:
a speed A/B that survives a loaded machine.

Each tree runs in its own engine process (``nice -n 5``), built like
``fdx bench throughput``'s (SmolLM2 by default, fp32, ``--num-threads``),
with N requests of 32 random prompt tokens queued at once. The driver then
asks the processes for one engine step each in turn (A B, then B A, ...), so
neighbouring steps of the trees see the same load, and compares them step
by step: the ratio of each tree's step to the last tree's, over the decode
steps at the full batch, as quartiles; the step's wall time (the engine's
``step_time_s``) and the process's CPU time (``time.process_time``; with
one thread, that is the work itself, less disturbed by descheduling).

    python scripts/bench_lockstep.py N THREADS STEPS name=<tree's parent>[,VAR:value...] ...
    # e.g. the branch against a worktree of main, 64 sequences, one thread, 50 steps:
    python scripts/bench_lockstep.py 64 1 50 branch=/work/paths/perf19 main=/work/paths/base

``<tree's parent>`` is the PYTHONPATH under which ``import fdx`` is that
tree; ``VAR:value`` sets an environment variable in that tree's process.
``--output-len`` (default: STEPS + 8) is each request's length, so one
round of requests lasts the whole run. Figures are printed, never asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

INPUT_LEN = 32


def worker(n: int, threads: int, output_len: int) -> None:
    """One tree's engine: one step per line on stdin, its figures as a JSON line."""
    import numpy as np

    from fdx.entrypoints.engine_args import _make_llm
    from fdx.entrypoints.cli import build_parser
    from fdx.core.sampling_params import SamplingParams
    blocks = max(64, n * (INPUT_LEN + output_len) // 16 + 2 * n + 8)
    argv = ["bench", "throughput", "--max-model-len", str(INPUT_LEN + output_len + 16),
            "--num-kv-blocks", str(blocks)] + (["--num-threads", str(threads)] if threads else [])
    llm = _make_llm(build_parser().parse_args(argv), progress=False)
    eng = llm.engine
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True))   # warm-up

    def fill():
        for _ in range(n):
            eng.add_request(eng.make_request(rng.integers(0, eng.shape.vocab_size, INPUT_LEN).tolist(), sp))

    fill()
    print(json.dumps({"backend": eng.backend.describe(), "torch_loaded": "torch" in sys.modules}), flush=True)
    for _ in sys.stdin:
        if not eng.has_unfinished():
            fill()
        c0 = time.process_time()
        eng.step()
        s = eng.last_stats
        print(json.dumps({"step": s.step_time_s, "cpu": time.process_time() - c0,
                          "prefill": s.num_prefill_tokens, "decode": s.num_decode_tokens}), flush=True)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    v = sorted(values)
    return v[len(v) // 4], statistics.median(v), v[(3 * len(v)) // 4]


def drive(n: int, threads: int, steps: int, output_len: int, specs: list[str]) -> None:
    procs = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        path, *pairs = rest.split(",")
        env = dict(os.environ, PYTHONPATH=path)
        env.update(p.split(":", 1) for p in pairs)
        cmd = ["nice", "-n", "5", sys.executable, __file__, "--worker", str(n), str(threads), str(steps),
               "--output-len", str(output_len)]
        procs.append((name, subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=subprocess.DEVNULL, env=env, text=True)))
    for name, p in procs:
        print(f"{name}: {p.stdout.readline().strip()}", flush=True)
    got: dict[str, list[dict]] = {name: [] for name, _ in procs}
    for i in range(steps):
        for name, p in procs if i % 2 == 0 else procs[::-1]:
            p.stdin.write("step\n")
            p.stdin.flush()
            got[name].append(json.loads(p.stdout.readline()))
    for _, p in procs:
        p.stdin.close()
        p.wait()
    names = list(got)
    keep = [i for i in range(steps) if all(got[m][i]["prefill"] == 0 and got[m][i]["decode"] == n for m in names)]
    ref = names[-1]
    print(f"N={n}, threads={threads}: {len(keep)} decode steps at the full batch of {steps}; "
          f"load average now {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for m in names:
        wall = [got[m][i]["step"] for i in keep]
        cpu = [got[m][i]["cpu"] for i in keep]
        rw = quartiles([got[m][i]["step"] / got[ref][i]["step"] for i in keep])
        rc = quartiles([got[m][i]["cpu"] / got[ref][i]["cpu"] for i in keep])
        print(f"  {m:12s} step median {1000 * statistics.median(wall):7.1f} ms, cpu median "
              f"{1000 * statistics.median(cpu):7.1f} ms | / {ref}: step {rw[0]:.3f} [{rw[1]:.3f}] {rw[2]:.3f}, "
              f"cpu {rc[0]:.3f} [{rc[1]:.3f}] {rc[2]:.3f} (quartiles [median])")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", type=int)
    ap.add_argument("threads", type=int)
    ap.add_argument("steps", type=int)
    ap.add_argument("trees", nargs="*", help="name=<PYTHONPATH>[,VAR:value...]; the last is the reference")
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    output_len = a.output_len or a.steps + 8
    if a.worker:
        worker(a.n, a.threads, output_len)
    else:
        drive(a.n, a.threads, a.steps, output_len, a.trees)


if __name__ == "__main__":
    main()
