"""The ``ngram`` proposer: prompt lookup (vLLM's ngram_proposer, llama.cpp's
lookup). The last n tokens of the request (n from ``prompt_lookup_max``
down to ``prompt_lookup_min``) are looked for earlier in its prompt and
output; the tokens that followed their latest earlier occurrence are the
draft. Input-grounded work (editing code, quoting a passage, echoing JSON)
repeats long runs of its input, which this finds at no model cost."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Proposer


def lookup(tokens: Sequence[int], lo: int, hi: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the
    longest suffix of ``tokens`` of length ``lo .. hi`` that occurred before."""
    t = np.asarray(tokens, dtype=np.int64)
    n_tok = len(t)
    for n in range(min(hi, n_tok - 1), lo - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(t[:n_tok - 1], n)   # starts 0 .. n_tok - 1 - n
        hits = np.flatnonzero((windows == t[n_tok - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return t[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        self.lo, self.hi = self.config.speculative.lookup_bounds

    def propose(self, request_id, token_ids, k, hidden_states=None):
        return lookup(token_ids, self.lo, self.hi, k)


@hookimpl
def fdx_register_proposers(register):
    register("ngram", NgramProposer)
