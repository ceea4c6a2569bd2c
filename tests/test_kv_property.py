"""Property test of every KV scheduler x KV cache x queue policy, with a fake
model runner, the real token processor and tiny block pools.

The fake model is deterministic (the next token is a hash of the sequence
so far), so every finished request must say exactly what it says alone.
The fake runner also writes each token's KV as a value that encodes
(token, position, layer, k/v, head) and, before each step, checks that the
context it attends to holds exactly those values: a prefix hit or a
second-tier copy that maps the wrong block, or a write into a shared block,
shows up here. After every step the block pool is audited.
"""
from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fdx.core.config import FdxConfig
from fdx.core.interfaces import ModelRunnerOutput, SchedulerOutput
from fdx.core.request import Request, RequestStatus
from fdx.core.sampling_params import SamplingParams
from fdx.plugins.cache.paged import PagedKVCache
from fdx.plugins.cache.prefix import PrefixKVCache
from fdx.plugins.decoding.token_processor import DefaultTokenProcessor
from fdx.plugins.schedulers.v0 import V0ResourceManager
from fdx.plugins.schedulers.v1 import V1ResourceManager

VOCAB, EOS = 40, 0
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 2
RESOURCE_MANAGERS = {"v0": V0ResourceManager, "v1": V1ResourceManager}
KV_CACHES = {"paged": PagedKVCache, "prefix": PrefixKVCache}
POLICIES = ("fcfs", "priority", "lpm")
COMBOS = list(itertools.product(RESOURCE_MANAGERS, KV_CACHES, POLICIES))


class StubTokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def next_token(tokens: list[int]) -> int:
    """The fake model: a hash of the last tokens and the length."""
    h = (tokens[-1] * 2654435761 + (tokens[-2] if len(tokens) > 1 else 7) * 40503 + len(tokens) * 97) % 1000003
    return h % VOCAB


def reference_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    toks, out = list(prompt), []
    limit = min(max_tokens, max_model_len - len(prompt))
    while True:
        t = next_token(toks)
        toks.append(t)
        out.append(t)
        if t == EOS or len(out) >= limit or len(toks) >= max_model_len:
            return out


def kv_value(tokens: np.ndarray, positions: np.ndarray, layer: int, j: int, head: int) -> np.ndarray:
    """[n, HEAD_DIM] float32 values that identify (token, position, layer, k/v, head)."""
    a = tokens * 1000.0 + positions
    b = np.full_like(a, layer * 100 + j * 10 + head)
    return np.stack([a, b], axis=1).astype(np.float32)


class FakeRunner:
    def __init__(self, kv_caches, kv, block_size: int, num_slots: int):
        self.kv_caches, self.kv, self.bs, self.num_slots = kv_caches, kv, block_size, num_slots

    def _rows(self, table, positions, head):
        table = np.asarray(table, dtype=np.int64)
        return head * self.num_slots + table[positions // self.bs] * self.bs + positions % self.bs

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        import paddle
        snapshot = [(k.numpy(), v.numpy()) for k, v in self.kv_caches]
        writes = collections.defaultdict(list)    # (layer, j) -> [(rows, values)]
        out = ModelRunnerOutput()
        for sr in sched.scheduled:
            req, ctx, n, table = sr.request, sr.context_len, sr.num_new_tokens, sr.block_table
            tokens = np.asarray(req.all_token_ids[:ctx + n], dtype=np.int64)
            assert len(table) * self.bs >= ctx + n, "block table too short"
            assert len(set(table)) == len(table), "a block twice in one table"
            ctx_pos, new_pos = np.arange(ctx), np.arange(ctx, ctx + n)
            for b in {table[p // self.bs] for p in new_pos}:
                assert self.kv.pool.ref_counts[b] == 1, f"{req.request_id} writes into shared block {b}"
            for layer, j, h in itertools.product(range(NUM_LAYERS), range(2), range(NUM_KV_HEADS)):
                got = snapshot[layer][j][self._rows(table, ctx_pos, h)]
                want = kv_value(tokens[:ctx], ctx_pos, layer, j, h)
                assert np.array_equal(got, want), f"{req.request_id}: wrong KV in its context"
                writes[layer, j].append((self._rows(table, new_pos, h), kv_value(tokens[ctx:], new_pos, layer, j, h)))
            if sr.samples:
                out.sampled[req.request_id] = next_token(req.all_token_ids)
        for (layer, j), parts in writes.items():
            rows = np.concatenate([r for r, _ in parts])
            vals = np.concatenate([v for _, v in parts])
            self.kv_caches[layer][j].scatter_(paddle.to_tensor(rows), paddle.to_tensor(vals), overwrite=True)
        return out


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
    running = {r.request_id for r in rm.running}
    holding = {rid for rid, table in kv.tables.items() if table}
    assert holding <= running, f"not running but holding blocks: {holding - running}"


def check_schedule(sched, rm, kind: str, cfg) -> None:
    sc = cfg.scheduler
    assert sched.num_scheduled_tokens == sum(sr.num_new_tokens for sr in sched.scheduled)
    assert sched.num_scheduled_tokens <= sc.max_num_batched_tokens
    assert len(sched.scheduled) <= sc.max_num_seqs and rm.num_running <= sc.max_num_seqs
    assert len({sr.request.request_id for sr in sched.scheduled}) == len(sched.scheduled)
    for sr in sched.scheduled:
        assert sr.num_new_tokens >= 1
        assert sr.context_len + sr.num_new_tokens <= sr.request.num_tokens
        assert sr.request.status is RequestStatus.RUNNING
        if not sc.enable_chunked_prefill:
            assert sr.context_len + sr.num_new_tokens == sr.request.num_tokens, "a chunk without chunking"
    if kind == "v0":
        assert not sched.preempted, "v0 preempted"
        phases = {sr.context_len < sr.request.num_prompt_tokens for sr in sched.scheduled}
        assert len(phases) <= 1, "v0 mixed prefill and decode in one step"


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([2, 4]))
    max_model_len = draw(st.sampled_from([12, 16, 24]))
    need = -(-max_model_len // bs)
    num_blocks = draw(st.integers(max(2, need // 2), need + 8))
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 2 * max_model_len) if chunked else st.integers(max_model_len, 2 * max_model_len))
    max_num_seqs = draw(st.integers(1, 5))
    swap = draw(st.sampled_from([0, 3, 12]))
    prefixes = draw(st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=max_model_len, max_size=max_model_len),
                             min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        length = draw(st.integers(1, max_model_len - 1))
        shared = draw(st.one_of(st.just(length), st.integers(0, length)))   # often all shared
        prompt = draw(st.sampled_from(prefixes))[:shared] + draw(
            st.lists(st.integers(1, VOCAB - 1), min_size=length - shared, max_size=length - shared))
        requests.append(dict(
            arrival=draw(st.integers(0, 30)), prompt=prompt, max_tokens=draw(st.integers(1, 10)),
            priority=draw(st.integers(0, 3)), salt=draw(st.sampled_from([None, None, "s"])),
            abort_after=draw(st.one_of(st.none(), st.integers(0, 15)))))
    return dict(bs=bs, max_model_len=max_model_len, num_blocks=num_blocks, chunked=chunked, budget=budget,
                max_num_seqs=max_num_seqs, swap=swap, requests=requests)


def run_workload(kind: str, cache: str, policy: str, w: dict):
    import paddle
    cfg = FdxConfig.build(resource_manager=kind, kv_cache=cache, policy=policy, block_size=w["bs"],
                          max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["budget"],
                          enable_chunked_prefill=w["chunked"], swap_max_blocks=w["swap"])
    kv = KV_CACHES[cache](w["num_blocks"], w["bs"], cfg)
    num_slots = w["num_blocks"] * w["bs"]
    kv_caches = [(paddle.zeros([NUM_KV_HEADS * num_slots, HEAD_DIM]), paddle.zeros([NUM_KV_HEADS * num_slots, HEAD_DIM]))
                 for _ in range(NUM_LAYERS)]
    kv.attach_kv_tensors(kv_caches, NUM_KV_HEADS, "fake-model")
    tp = DefaultTokenProcessor(StubTokenizer())
    rm = RESOURCE_MANAGERS[kind](cfg, kv, tp, w["max_model_len"])
    runner = FakeRunner(kv_caches, kv, w["bs"], num_slots)

    reqs: dict[str, Request] = {}
    events = collections.defaultdict(list)       # step -> [("add", spec) | ("abort", rid)]
    for i, spec in enumerate(w["requests"]):
        events[spec["arrival"]].append(("add", i, spec))
        if spec["abort_after"] is not None:
            events[spec["arrival"] + spec["abort_after"]].append(("abort", i, spec))
    last_event = max(events)
    total = sum(len(s["prompt"]) + s["max_tokens"] for s in w["requests"])
    bound = last_event + 10 * total + 20
    step = 0
    while step <= last_event or rm.has_unfinished():
        assert step < bound, f"no progress after {step} steps: {rm.num_running} running, {rm.num_waiting} waiting"
        for what, i, spec in events.get(step, ()):
            if what == "add":
                req = Request(f"r{i}", list(spec["prompt"]), SamplingParams(temperature=0, max_tokens=spec["max_tokens"]),
                              priority=spec["priority"], cache_salt=spec["salt"],
                              eos_token_ids=frozenset({EOS}), max_model_len=w["max_model_len"])
                tp.start(req)
                rm.add_request(req)
                reqs[req.request_id] = req
            else:
                aborted = rm.abort_request(f"r{i}")
                assert aborted is None or aborted.status is RequestStatus.FINISHED_ABORTED
        sched = rm.schedule()
        check_schedule(sched, rm, kind, cfg)
        if not sched.is_empty:
            rm.update(sched, runner.execute(sched))
        audit_pool(rm, kv)
        step += 1

    assert kv.num_free_blocks == w["num_blocks"] and not any(kv.tables.values())
    assert all(rc == 0 for rc in kv.pool.ref_counts)
    for spec_i, spec in enumerate(w["requests"]):
        req = reqs[f"r{spec_i}"]
        assert req.is_finished, f"{req.request_id} never finished"
        want = reference_output(spec["prompt"], spec["max_tokens"], w["max_model_len"])
        if req.status is RequestStatus.FINISHED_REJECTED:
            assert isinstance(req.stop_reason, str) and req.stop_reason.startswith("rejected")
            assert -(-min(len(spec["prompt"]) + spec["max_tokens"], w["max_model_len"]) // w["bs"]) > w["num_blocks"]
        elif req.status is RequestStatus.FINISHED_ABORTED:
            assert req.output_token_ids == want[:len(req.output_token_ids)]
        else:
            assert req.output_token_ids == want, f"{req.request_id}: output differs from the solo run"
    if cache == "prefix":
        stats = kv.stats()
        assert 0 <= stats["prefix_cache_hits"] <= stats["prefix_cache_queries"]
    return reqs, kv


@pytest.mark.parametrize("kind,cache,policy", COMBOS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads())
def test_kv_scheduling_properties(kind, cache, policy, w):
    run_workload(kind, cache, policy, w)


def test_shared_prefix_workload_hits_and_outputs_match():
    """A hand-picked case on every combination: shared prefixes, a tiny pool
    that forces eviction into the second tier, and one abort."""
    prefix = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    other = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 1, 2]
    prompts = [prefix + [20], prefix + [21], other + [22], other[:8] + [23], prefix[:8] + [24], prefix + [25],
               other + [26]]
    w = dict(bs=4, max_model_len=24, num_blocks=8, chunked=True, budget=10, max_num_seqs=2, swap=8,
             requests=[dict(arrival=3 * a, prompt=p, max_tokens=5, priority=a % 2, salt=None,
                            abort_after=(2 if a == 3 else None)) for a, p in enumerate(prompts)])
    for kind, cache, policy in COMBOS:
        reqs, kv = run_workload(kind, cache, policy, w)
        assert [r.status for r in reqs.values()].count(RequestStatus.FINISHED_ABORTED) <= 1
        if cache == "prefix":
            stats = kv.stats()
            assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_evictions"] > 0
            if policy == "fcfs":
                assert stats["prefix_cache_tier2_hits"] > 0, (kind, policy, stats)
