"""Property test of every KV scheduler x KV cache x queue policy x victim
policy, through the conformance kit (fdx.core.testing), plus an audit of
the built-in pools' reference counts after every step.

The kit's fake model is deterministic (the next token is a hash of the
sequence so far), so every finished request must say exactly what it says
alone; its fake runner sees only the plain-data step (round-tripped
through msgspec) and checks the KV each request attends to.
"""
from __future__ import annotations

import collections
import itertools

import pytest

from fdx.core.request import RequestStatus
from fdx.core.testing import check_scheduler, run_workload
from fdx.plugins.cache.prefix import PrefixKVCache

POLICIES = ("fcfs", "priority", "lpm")
# pairwise over (scheduler, cache, policy, victim): every pair of values appears together
_QUICK = [("v1", "paged", "fcfs", "newest"), ("v1", "prefix", "priority", "least-computed"),
          ("v0", "prefix", "fcfs", "newest")]
_FULL = [("v1", "prefix", "lpm", "newest"), ("v1", "paged", "lpm", "least-computed"),
         ("v1", "paged", "priority", "newest"), ("v1", "prefix", "fcfs", "least-computed"),
         ("v0", "paged", "priority", "newest"), ("v0", "prefix", "lpm", "newest")]
COMBOS = _QUICK + [pytest.param(*c, marks=pytest.mark.slow) for c in _FULL]   # the quick subset keeps three


def audit_pool(rm, kv) -> None:
    pool, n = kv.pool, kv.num_blocks
    holders = collections.Counter(b for table in kv.tables.values() for b in table)
    for b in range(n):
        assert pool.ref_counts[b] == holders[b], f"block {b}: ref count {pool.ref_counts[b]}, holders {holders[b]}"
    free = list(pool.free_ids)
    assert len(set(free)) == len(free), "a block twice in the free list"
    evictable = set(getattr(pool, "evictable", ()))
    held = set(holders)
    assert not (set(free) & held) and not (evictable & held) and not (set(free) & evictable)
    assert len(free) + len(evictable) + len(held) == n, "a block leaked"
    assert kv.num_free_blocks == len(free) + len(evictable)
    if isinstance(kv, PrefixKVCache):
        assert {m.key: b for b, m in kv.meta.items()} == kv.by_key
        assert all(pool.cached[b] == (b in kv.meta) for b in range(n))
        assert all(pool.cached[b] for b in evictable) and not any(pool.cached[b] for b in free)
    running = {r.request_id for r in rm.requests() if r.status is RequestStatus.RUNNING}
    held = set(rm.held)                     # kept for a connector transfer
    holding = {rid for rid, table in kv.tables.items() if table}
    assert holding <= running | held, f"not running but holding blocks: {holding - running - held}"


def check_v0(rm, kv) -> None:
    """v0 never preempts."""
    assert not any(r.status is RequestStatus.PREEMPTED for r in rm.requests()), "v0 preempted"


@pytest.mark.parametrize("kind,cache,policy,victim", COMBOS)
def test_kv_scheduling_properties(kind, cache, policy, victim):
    def audit(rm, kv):
        audit_pool(rm, kv)
        if kind == "v0":
            check_v0(rm, kv)
    check_scheduler(kind, cache, policy, preemption=victim, max_examples=40, audit=audit)


def test_shared_prefix_workload_hits_and_outputs_match():
    """A hand-picked case on every combination: shared prefixes, a tiny pool
    that forces eviction (and saves to the swap tier), and one abort."""
    prefix = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    other = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 1, 2]
    prompts = [prefix + [20], prefix + [21], other + [22], other[:8] + [23], prefix[:8] + [24], prefix + [25],
               other + [26]]
    w = dict(bs=4, max_model_len=24, num_blocks=8, chunked=True, budget=10, max_num_seqs=2, swap=8,
             requests=[dict(arrival=3 * a, prompt=p, max_tokens=5, priority=a % 2, salt=None,
                            abort_after=(2 if a == 3 else None)) for a, p in enumerate(prompts)])
    for kind, cache, policy in itertools.product(("v0", "v1"), ("paged", "prefix"), POLICIES):
        reqs, kv, rm = run_workload(kind, cache, policy, w, audit=audit_pool)
        assert [r.status for r in reqs.values()].count(RequestStatus.FINISHED_ABORTED) <= 1
        if cache == "prefix":
            stats = kv.stats()
            assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_evictions"] > 0
