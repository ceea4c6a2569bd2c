"""Decode at a long context over the 8-bit KV cache (cache.kv_cache_dtype int8) against the
float one, in one process: one engine a side, the same B random prompts of I tokens each
prefilled, then rounds of S decode steps a side, the sides' order swapped every round, so
both see the same machine load and, round by round, the same context lengths. Reported a
side: the median over rounds of the CPU time (time.process_time: this process's threads;
on a shared machine the time waiting for a core is not counted, so run it with
``--threads 1`` where a spinning OpenMP thread would count) and of the wall time of a decode
step; the int8 / float ratio of each round; the KV bytes per token. ``--composed`` adds an
int8 side with the fused decoder layers off (FDX_FUSED_LAYERS=0 around its steps).

    PYTHONPATH=<tree's parent> python scripts/bench_kv8.py [--model M] [--input-len 2048]
        [--batch 1] [--steps 32] [--rounds 4] [--threads 1] [--composed]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from fdx import LLM, SamplingParams
from fdx.ops.layer_port import FUSED_LAYERS_ENV


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--composed", action="store_true")
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    sides = {"float": ("auto", True), "int8": ("int8", True)}
    if args.composed:
        sides["int8-composed"] = ("int8", False)
    max_len = args.input_len + args.steps * args.rounds + 16
    block = 16
    blocks = args.batch * -(-max_len // block) + 8
    rng = np.random.default_rng(0)
    engines, kv_bytes = {}, {}
    for name, (dtype, _) in sides.items():
        llm = LLM(args.model, quantization=args.quantization, num_threads=args.threads, progress=False,
                  kv_cache_dtype=dtype, max_model_len=max_len, num_kv_blocks=blocks, block_size=block,
                  max_num_seqs=args.batch)
        eng = llm.engine
        spec = eng.kv_spec
        kv_bytes[name] = spec.bytes_per_block // spec.block_size
        engines[name] = llm
    vocab = next(iter(engines.values())).engine.shape.vocab_size
    prompts = [rng.integers(0, vocab, args.input_len).tolist() for _ in range(args.batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.steps * args.rounds + 2, ignore_eos=True)
    for name, llm in engines.items():
        eng = llm.engine
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True))
        for p in prompts:
            eng.add_request(eng.make_request(p, sp))
        os.environ[FUSED_LAYERS_ENV] = "1" if sides[name][1] else "0"
        while True:                                   # prefill (chunked) until every request decodes
            eng.step()
            if eng.last_stats.num_prefill_tokens == 0:
                break
    cpu = {n: [] for n in sides}
    wall = {n: [] for n in sides}
    order = list(sides)
    for r in range(args.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            eng = engines[name].engine
            os.environ[FUSED_LAYERS_ENV] = "1" if sides[name][1] else "0"
            eng.step()                                # the switch's one-time costs (the stack table) not counted
            c, w = time.process_time(), time.perf_counter()
            for _ in range(args.steps - 1):
                eng.step()
            cpu[name].append((time.process_time() - c) / (args.steps - 1))
            wall[name].append((time.perf_counter() - w) / (args.steps - 1))
    os.environ.pop(FUSED_LAYERS_ENV, None)
    result = {"model": args.model or "embedded SmolLM2-135M Q4_1", "input_len": args.input_len,
              "batch": args.batch, "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
              "kv_bytes_per_token": kv_bytes, "decode_step_cpu_ms": {}, "decode_step_wall_ms": {},
              "decode_tok_s_by_cpu": {}, "ratio_cpu_vs_float": {}, "ratio_wall_vs_float": {}}
    for name in sides:
        result["decode_step_cpu_ms"][name] = 1e3 * float(np.median(cpu[name]))
        result["decode_step_wall_ms"][name] = 1e3 * float(np.median(wall[name]))
        result["decode_tok_s_by_cpu"][name] = args.batch / float(np.median(cpu[name]))
        if name != "float":   # float time / this side's: above 1 is faster than the float cache
            result["ratio_cpu_vs_float"][name] = [round(f / x, 3) for f, x in zip(cpu["float"], cpu[name])]
            result["ratio_wall_vs_float"][name] = [round(f / x, 3) for f, x in zip(wall["float"], wall[name])]
    for llm in engines.values():
        llm.close()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
