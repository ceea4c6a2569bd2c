"""CPU time of the steps issue 18's Q8_0 targets depend on, on one thread
(``time.thread_time``, so time spent waiting for a core on a loaded machine
is not counted): a 128-token prefill of one sequence (``prefill``), a
decode step of 64 sequences (``decode64``), and a prefill chunk of 64
sequences x 32 tokens (``prefill64``), ``quantization auto``. The median of
``--repeat`` runs. Run it on two trees alternately to compare them:

    PYTHONPATH=<tree's parent> python scripts/bench_quant_cpu.py MODEL.gguf [--what prefill,decode64]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from fdx import LLM, SamplingParams


def _timed_step(eng) -> float:
    t = time.thread_time()
    eng.step()
    return time.thread_time() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--what", default="prefill,decode64,prefill64")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    llm = LLM(args.model, quantization=args.quantization, num_threads=1, progress=False)
    eng = llm.engine
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True))
    rng = np.random.default_rng(0)
    vocab = eng.shape.vocab_size
    out = []
    for what in args.what.split(","):
        times = []
        if what == "prefill":
            for _ in range(args.repeat):
                prompt = rng.integers(0, vocab, 128).tolist()
                eng.add_request(eng.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
                times.append(_timed_step(eng))
                while eng.has_unfinished():
                    eng.step()
        elif what in ("decode64", "prefill64"):
            for _ in range(args.repeat if what == "prefill64" else 1):
                for _ in range(64):
                    prompt = rng.integers(0, vocab, 32).tolist()
                    eng.add_request(eng.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=2 * args.repeat + 2,
                                                                            ignore_eos=True)))
                t = _timed_step(eng)           # all 64 prompts: 2048 tokens, one chunk
                if what == "prefill64":
                    times.append(t)
                while eng.has_unfinished():
                    t = _timed_step(eng)
                    if what == "decode64":
                        times.append(t)
        else:
            raise SystemExit(f"unknown --what {what}")
        out.append(f"{what} {1e3 * np.median(times):.1f} ms")
    print(args.label, "cpu median:", ", ".join(out))


if __name__ == "__main__":
    main()
