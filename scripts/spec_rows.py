"""CPU time of a batch-1 decode step by the rows it scores (1 + drafts): the
cost a speculated step pays, against a plain one, on this machine.

A proposer that always drafts r - 1 tokens (rejected: a step still gives one
token) decodes one 160-token prompt with the cost gate off, one thread; per
step: (CPU time of 80 tokens - of 16) / 64, best of ``--reps``, row counts
alternated; a rep where a draft was kept (the model emitted the drafted token:
fewer steps than tokens) is not counted. The engine thread's CPU time, so
other jobs on the cores do not count.

    python scripts/spec_rows.py [--rows 1,2,3,4,5,6,7,8,9] [--reps 2]
"""
from __future__ import annotations

import argparse
import time
import types

from fdx import LLM, SamplingParams
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Proposer
from fdx.core.plugins import PluginManager


class Fixed(Proposer):
    drafts = 0

    def propose(self, request_id, token_ids, k, hidden_states=None):
        return [7] * min(k, Fixed.drafts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,9")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    pm = PluginManager(load_entry_points=False)
    pm.add_plugin(types.SimpleNamespace(fdx_register_proposers=hookimpl(lambda register: register("fixed", Fixed))),
                  name="fixed")
    llm = LLM(args.model, plugins=pm, max_model_len=1024, num_kv_blocks=256, progress=False,
              backend={"num_threads": 1},
              speculative_config={"method": "fixed", "num_speculative_tokens": 10, "cost_gate": False})
    prompt = {"prompt_token_ids": list(range(100, 260))}
    long, short = (SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (80, 16))
    rows = [int(r) for r in args.rows.split(",")]
    best = {r: float("inf") for r in rows}
    for _ in range(args.reps):
        for r in rows:
            Fixed.drafts = r - 1
            llm.generate([prompt], short)                # the prompt's KV in the prefix cache
            kept = llm.engine.speculation.counters.num_accepted_tokens
            t = time.thread_time()
            llm.generate([prompt], long)
            mid = time.thread_time()
            llm.generate([prompt], short)
            if llm.engine.speculation.counters.num_accepted_tokens == kept:   # else fewer steps than tokens
                best[r] = min(best[r], ((mid - t) - (time.thread_time() - mid)) / 64)
    print(" ".join(f"{r}: {best[r] * 1e3:.2f} ms ({best[r] / best[rows[0]]:.2f})" for r in rows))
    llm.close()


if __name__ == "__main__":
    main()
