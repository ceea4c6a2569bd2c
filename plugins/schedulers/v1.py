"""The v1 KV scheduler: no prefill or decode phase, a token budget per step.

Each request has ``num_computed_tokens``; every step gives tokens to
running requests first (decodes and unfinished prefill chunks), then admits
waiting requests while the budget, ``max_num_seqs`` and free blocks allow.
When blocks run out a running request is preempted (``scheduler.preemption``:
newest first by default): its blocks are freed and it goes back to the head
of the queue, to be recomputed. Waiting requests are ordered by
``scheduler.policy`` and filtered by ``scheduler.admission``; a request
refused by an admission rule is skipped for this step. Both loops are the
scheduling core's (``fdx.core.scheduling``); v1 is the policy of using them
in this order.
"""
from __future__ import annotations

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import KVScheduler


class V1Policy(KVScheduler):
    def schedule(self, core) -> None:
        core.schedule_running()     # 1. running requests, oldest first; preempt when blocks run out
        core.admit_waiting()        # 2. waiting requests, in order, unless this step had to preempt


@hookimpl
def fdx_register_kv_schedulers(register):
    register("v1", V1Policy)
