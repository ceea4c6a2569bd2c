"""Helpers for the splitwise tests: greedy sampling parameters and stepping
in-process engines until their requests finish."""
from __future__ import annotations

import time

from fdx.core.sampling_params import SamplingParams


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, extra_args=extra or None)


def run(*engines, timeout: float = 30.0) -> dict:
    """Step ``engines`` until none has work; the finished requests by (id(engine), request id)."""
    done, deadline = {}, time.monotonic() + timeout
    while any(e.has_unfinished() for e in engines):
        assert time.monotonic() < deadline, "requests hang"
        for e in engines:
            if e.has_unfinished():
                for r in e.step():
                    if r.is_finished:
                        done[(id(e), r.request_id)] = r
        time.sleep(0.001)
    return done
