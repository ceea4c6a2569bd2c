"""CPU time of batch-1 decode steps on one thread: one request of 128 random
prompt tokens, 128 greedy tokens (ignore_eos), ``quantization auto``; the
median ``time.thread_time`` of the decode steps, so time spent waiting for
a core on a loaded machine is not counted. Run it on two trees alternately
to compare them:

    PYTHONPATH=<tree's parent> python scripts/bench_decode_cpu.py [model.gguf] [label]

(default model: the embedded SmolLM2-135M Q4_1).
"""
from __future__ import annotations

import sys
import time

import numpy as np

from fdx import LLM, SamplingParams


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "default" else None
    label = sys.argv[2] if len(sys.argv) > 2 else ""
    llm = LLM(model, quantization="auto", num_threads=1, progress=False)
    eng = llm.engine
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True))
    prompt = np.random.default_rng(0).integers(0, eng.shape.vocab_size, 128).tolist()
    eng.add_request(eng.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)))
    eng.step()                                  # the prefill
    cpu, wall = [], []
    while eng.has_unfinished():
        t, w = time.thread_time(), time.perf_counter()
        eng.step()
        cpu.append(time.thread_time() - t)
        wall.append(time.perf_counter() - w)
    print(f"{label} {model or 'default'}: decode step cpu median {1e3 * np.median(cpu):.2f} ms, "
          f"wall median {1e3 * np.median(wall):.2f} ms over {len(cpu)} steps")


if __name__ == "__main__":
    main()
