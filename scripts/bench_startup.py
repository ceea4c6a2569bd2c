"""Start-up time of LLM() with a cold and a warm kernel-probe cache.

    python scripts/bench_startup.py [--model PATH] [--repeats 3]

Each run is a fresh process that builds ``LLM(model)`` (the compiled
kernels stay cached: only the kernel table's file is removed for a cold
run) and reports the whole construction and the kernel table's part of
it. The runs use a cache folder of their own ($FDX_CACHE_DIR set to a
temporary folder; the first, untimed run builds the compiled kernels
there), so no other fdx process on the machine probes or reads for them. Cold and warm runs alternate, so a load that drifts hits both alike.
The CPU line is printed beside the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from fdx import LLM
llm = LLM(sys.argv[1] or None, max_model_len=512, num_kv_blocks=64, progress=False)
total = time.perf_counter() - t0
t = llm.engine.backend.kernels
print(json.dumps({"total_s": total, "table_s": t.seconds, "source": t.source, "location": t.location}))
"""


def run(model: str, cache: str) -> dict:
    env = dict(os.environ, FDX_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a model path (default: the embedded SmolLM2)")
    parser.add_argument("--repeats", type=int, default=3, help="cold and warm runs each (default: 3)")
    args = parser.parse_args()
    from pathlib import Path
    from fdx.core.host import cpu_model, available_cores
    cache = tempfile.mkdtemp(prefix="fdx-bench-startup-")
    location = run(args.model, cache)["location"]   # builds the compiled kernels and finds the table's file
    results = {"cold": [], "warm": []}
    for _ in range(args.repeats):
        Path(location).unlink(missing_ok=True)
        results["cold"].append(run(args.model, cache))
        results["warm"].append(run(args.model, cache))
    shutil.rmtree(cache, ignore_errors=True)
    print(f"cpu: {cpu_model()}, {available_cores()} cores")
    for kind, runs in results.items():
        assert all(r["source"] == ("probed" if kind == "cold" else "cache") for r in runs), runs
        total = statistics.median(r["total_s"] for r in runs)
        table = statistics.median(r["table_s"] for r in runs)
        each = ", ".join(f"{r['total_s']:.2f}" for r in runs)
        print(f"{kind}: LLM() {total:.2f} s (median of {len(runs)}; each: {each}), kernel table {table * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
