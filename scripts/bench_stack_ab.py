"""The one call for all layers (fdx.ops.layer_port.decoder_stack) on and off
every other batch-1 decode step, in one process: CPU time of the calling
thread a step, as scripts/bench_decode_cpu.py measures it (one thread by
default; with more, the wall time too), ``quantization auto``.
Off, the same step runs one compiled layer call a layer (``decoder_layer``),
so the pair isolates what the single call saves. Alternating step by step,
both halves see the same machine load.

    PYTHONPATH=<tree's parent> python scripts/bench_stack_ab.py [model.gguf] [steps] [threads]
"""
from __future__ import annotations

import sys
import time

import numpy as np

from fdx import LLM, SamplingParams
from fdx.ops import layer_port


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "default" else None
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    on = [True]
    real = layer_port.decoder_stack
    taken = {True: 0, False: 0}

    def switched(*args, **kw):
        got = real(*args, **kw) if on[0] else None
        taken[on[0]] += got is not None
        return got
    layer_port.decoder_stack = switched
    llm = LLM(model, quantization="auto", num_threads=threads, progress=False)
    eng = llm.engine
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True))
    prompt = np.random.default_rng(0).integers(0, eng.shape.vocab_size, 128).tolist()
    eng.add_request(eng.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)))
    eng.step()                                  # the prefill
    cpu = {True: [], False: []}
    wall = {True: [], False: []}
    i = 0
    while eng.has_unfinished():
        on[0] = i % 2 == 0
        t, w = time.thread_time(), time.perf_counter()
        eng.step()
        cpu[on[0]].append(time.thread_time() - t)
        wall[on[0]].append(time.perf_counter() - w)
        i += 1
    for name, times in (("cpu", cpu), ("wall", wall)):
        a, b = np.median(times[True]), np.median(times[False])
        print(f"{model or 'default'}, {threads} thread(s): decode step {name} median, one call for all layers "
              f"{1e3 * a:.2f} ms, a call a layer {1e3 * b:.2f} ms, ratio {b / a:.3f}x over "
              f"{len(times[True])}+{len(times[False])} steps (stack taken on {taken[True]} steps)")


if __name__ == "__main__":
    main()
