"""Built-in scheduling extensions: waiting-queue orders and preemption
victims (contracts: ``QueuePolicy``, ``PreemptionPolicy`` in core/interfaces.py).

Queue orders (``scheduler.policy``); preempted requests go first whatever
the order (the core queue keeps that rule):
- ``fcfs`` (default): arrival order.
- ``priority``: ``Request.priority``, lower value first; ties by arrival.
- ``lpm``: longest prefix match first: the request with the most prompt
  tokens already in the prefix cache goes first (SGLang found this raises
  hit rates when prompts share prefixes). When more than ``LPM_MAX_QUEUE``
  requests wait, the lookups cost more than they buy and the order falls
  back to fcfs.

Preemption victims (``scheduler.preemption``):
- ``newest`` (default): the request that started last (vLLM's rule).
- ``least-computed``: the request with the fewest computed tokens, so the
  least work is thrown away (vLLM's victim-policy RFC measured this
  recovering about half the recompute lost to preemption).
"""
from __future__ import annotations

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import PreemptionPolicy, QueuePolicy

LPM_MAX_QUEUE = 128


class Fcfs(QueuePolicy):
    def key(self, request) -> tuple:
        return ()


class Priority(QueuePolicy):
    def key(self, request) -> tuple:
        return (request.priority,)


class LongestPrefixMatch(QueuePolicy):
    dynamic = True
    max_dynamic_queue = LPM_MAX_QUEUE

    def key(self, request) -> tuple:
        return (-self.kv_cache.lookup_prefix(request).num_tokens,)


class Newest(PreemptionPolicy):
    def choose_victim(self, running, state):
        return running[-1]


class LeastComputed(PreemptionPolicy):
    def choose_victim(self, running, state):
        # ties: the newest of them (the last in run order)
        return min(reversed(running), key=lambda r: r.num_computed_tokens)


POLICIES = ("fcfs", "priority", "lpm")


@hookimpl
def fdx_register_queue_policies(register):
    register("fcfs", Fcfs)
    register("priority", Priority)
    register("lpm", LongestPrefixMatch)


@hookimpl
def fdx_register_preemption_policies(register):
    register("newest", Newest)
    register("least-computed", LeastComputed)
