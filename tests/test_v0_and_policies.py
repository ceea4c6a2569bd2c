"""v0's rules (budget split, prefill first, reserve, kv_cache_ratio),
rejection, and the waiting-queue policies, step by step."""
from __future__ import annotations

import pytest

from fdx.core.config import ConfigError, FdxConfig
from fdx.core.interfaces import BuildContext, KVConnector, ModelRunnerOutput
from fdx.core.request import Request, RequestStatus
from fdx.core.sampling_params import SamplingParams
from fdx.core.scheduling import WaitingQueue
from fdx.core.assembly import Assembly
from fdx.core.plugins import get_plugin_manager
from fdx.plugins.decoding.token_processor import DefaultTokenProcessor
from fdx.plugins.schedulers.policies import Fcfs, LongestPrefixMatch, Priority

MAX_LEN = 256


def make_rm(kind="v0", cache="paged", num_blocks=64, bs=8, **cfg):
    """The engine's scheduling core running ``kind``'s policy, built by the engine's assembly."""
    config = FdxConfig.build(resource_manager=kind, kv_cache=cache, block_size=bs, **cfg)
    if config.scheduler.max_num_batched_tokens is None:
        config.scheduler.max_num_batched_tokens = 64
    parts = Assembly(config, get_plugin_manager()).scheduler_side(
        num_blocks, DefaultTokenProcessor(), MAX_LEN)
    return parts["scheduling"]


def req(rid, n, max_tokens=4, priority=0, first=1):
    r = Request(rid, list(range(first, first + n)), SamplingParams(temperature=0, max_tokens=max_tokens),
                priority=priority, max_model_len=MAX_LEN)
    return r


def step(rm, token=5):
    """One step with a model that always says ``token``: which requests ran, how many tokens each."""
    sched = rm.schedule()
    by_id = {r.request_id: r for r in rm.requests()}
    sampled = {rid: token for rid, n in sched.num_scheduled_tokens.items()
               if by_id[rid].num_computed_tokens + n == by_id[rid].num_tokens}
    rm.update(sched, ModelRunnerOutput(sampled=sampled))
    return dict(sched.num_scheduled_tokens), sched


def test_v0_splits_the_budget_in_whole_blocks_leftover_to_the_shortest():
    rm = make_rm(max_num_batched_tokens=64)
    for rid, n in (("a", 40), ("b", 100), ("c", 10)):
        rm.add_request(req(rid, n))
    grants, _ = step(rm)
    # share = 64 // 3 = 21 -> 16; c takes its 10, then a takes the leftover 22
    assert grants == {"a": 38, "b": 16, "c": 10}


def test_v0_prefills_before_decoding_and_never_mixes():
    rm = make_rm(max_num_batched_tokens=64)
    rm.add_request(req("a", 8))
    assert step(rm)[0] == {"a": 8}
    assert step(rm)[0] == {"a": 1}                          # decode
    rm.add_request(req("b", 100))
    assert step(rm)[0] == {"b": 64}                         # a waits while b prefills
    assert step(rm)[0] == {"b": 36}
    assert step(rm)[0] == {"a": 1, "b": 1}


def test_v0_reserves_blocks_for_every_admitted_request_to_finish():
    # 10 blocks of 8: a needs 2 prompt blocks + up to 40 output tokens -> 7 blocks in the worst case
    rm = make_rm(num_blocks=10, max_num_batched_tokens=64, kv_cache_ratio=1.0)
    rm.add_request(req("a", 16, max_tokens=40))
    rm.add_request(req("b", 16, max_tokens=8))              # worst case 3 blocks: 7 + 3 = 10 fit
    rm.add_request(req("c", 8, max_tokens=1))               # 2 more blocks: must wait
    grants, _ = step(rm)
    assert set(grants) == {"a", "b"} and rm.num_waiting == 1
    finished = set()
    while rm.has_unfinished() or len(finished) < 3:
        grants, sched = step(rm)
        assert not sched.preempted_req_ids
        finished |= set(sched.finished_req_ids)           # those that finished before this step
        if "c" in grants:
            assert "b" in finished                          # c ran only once b gave its blocks back
    assert finished == {"a", "b", "c"}


class LoadsInTheBackground(KVConnector):
    """Offers the whole prompt but its last token for the requests named
    ``remote*``, loaded in the background (a decode-side splitwise peer)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return request.num_prompt_tokens - 1 - num_computed_tokens if request.request_id.startswith("remote") else 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def load_async(self, request):
        return True

    def build_connector_meta(self):
        return None

    def start_load_kv(self, metadata):
        pass


def test_v0_counts_the_reserve_of_a_request_whose_kv_is_still_loading():
    """A request admitted with its KV loading in the background holds
    blocks and will run: its decode reserve counts, so a request after it
    waits when both could not finish (it was admitted, and a decode later
    found no block: "the decode reserve ... did not hold")."""
    rm = make_rm(num_blocks=8, max_num_batched_tokens=64, kv_cache_ratio=1.0)
    rm.connector = LoadsInTheBackground(None, BuildContext(FdxConfig.build(), block_size=8))
    rm.add_request(req("remote", 9, max_tokens=30))         # 2 blocks now, 5 at worst
    assert step(rm)[0] == {} and "remote" in rm.recving
    rm.add_request(req("local", 9, max_tokens=30))          # 5 at worst: 3 + 5 > the 6 free
    assert step(rm)[0] == {} and rm.num_waiting == 1
    sched = rm.schedule()                                    # the load ends with this step
    rm.update(sched, ModelRunnerOutput(finished_recving=["remote"]))
    finished = set()
    while rm.has_unfinished() or len(finished) < 2:
        grants, sched = step(rm)
        assert not sched.preempted_req_ids
        finished |= set(sched.finished_req_ids)
        if "local" in grants:
            assert "remote" in finished                     # it waited for the reserve to come back
    assert finished == {"remote", "local"}


def test_v0_kv_cache_ratio_bounds_prompt_blocks_but_not_a_lone_request():
    rm = make_rm(num_blocks=20, kv_cache_ratio=0.5, max_num_batched_tokens=256)
    rm.add_request(req("long", 120, max_tokens=1))          # 15 prompt blocks > 10, but alone
    rm.add_request(req("short", 8, max_tokens=1))           # would exceed the ratio beside it
    grants, _ = step(rm)
    assert grants == {"long": 120}
    step(rm)                                                # long finished (max_tokens=1)
    assert step(rm)[0] == {"short": 8} or rm.num_running == 0


def test_v0_without_chunking_admits_only_whole_prompts_within_the_budget():
    rm = make_rm(max_num_batched_tokens=MAX_LEN, enable_chunked_prefill=False)
    rm.add_request(req("a", 200))
    rm.add_request(req("b", 100))
    assert step(rm)[0] == {"a": 200}
    assert step(rm)[0] == {"b": 100}


@pytest.mark.parametrize("kind", ["v0", "v1"])
def test_a_request_the_pool_cannot_hold_is_rejected_with_a_reason(kind):
    rm = make_rm(kind, num_blocks=4, bs=8)                  # 32 tokens in all
    r = req("big", 30, max_tokens=10)
    rm.add_request(r)
    assert r.status is RequestStatus.FINISHED_REJECTED and "needs 5 KV blocks" in r.stop_reason
    assert rm.pop_finished() == [r] and not rm.has_unfinished()
    assert rm.schedule().is_empty


def test_v1_waiting_requests_hold_no_blocks():
    rm = make_rm("v1", cache="prefix", num_blocks=6, bs=4, max_num_batched_tokens=64)
    rm.add_request(req("a", 9, max_tokens=2))
    step(rm)                                                # a holds 3 blocks, 2 of them cached
    rm.add_request(req("b", 21, max_tokens=2))              # shares a's 2 cached blocks, needs 4 more: 3 free
    step(rm)
    assert rm.kv_cache.block_table("b") == [] and rm.num_waiting == 1
    while rm.has_unfinished():
        step(rm)
    assert rm.kv_cache.num_free_blocks == 6


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="scheduler.policy.*nope.*available: ") as e:
        make_rm(policy="nope")
    # the built-ins, among what plugins (and the docs' examples a test ran) registered
    assert {"fcfs", "lpm", "priority"} <= set(str(e.value).split("available: ", 1)[1].split(", "))


def test_priority_lower_first_ties_in_arrival_order_preempted_before_all():
    q = WaitingQueue(Priority(None))
    rs = [req(f"r{i}", 4, priority=p) for i, p in enumerate([2, 0, 1, 0, 2])]
    for r in rs:
        q.append(r)
    assert [r.request_id for r in q] == ["r1", "r3", "r2", "r0", "r4"]
    back, again = req("back", 4, priority=2), req("again", 4, priority=3)
    q.push_preempted(back)
    q.push_preempted(again)                                 # the last preempted resumes first
    assert [r.request_id for r in q] == ["again", "back", "r1", "r3", "r2", "r0", "r4"]
    q.remove(rs[2])
    assert q.popleft() is again and q.popleft() is back and q.popleft() is rs[1] and len(q) == 3


def test_fcfs_queue_reads_like_a_deque():
    q = WaitingQueue(Fcfs(None))
    a, b, c = req("a", 1), req("b", 1), req("c", 1)
    q.append(a)
    q.append(b)
    q.appendleft(c)
    assert list(q) == [c, a, b] and q[0] is c and q[1] is a and c in q
    with pytest.raises(ValueError, match="already waiting"):
        q.append(a)


def test_lpm_orders_by_cached_prefix_and_falls_back_to_fcfs_when_long(monkeypatch):
    rm = make_rm("v1", cache="prefix", policy="lpm", num_blocks=32, bs=4, max_num_seqs=1)
    rm.add_request(req("seed", 16, max_tokens=1))
    while rm.has_unfinished():
        step(rm)                                            # tokens 1..16 cached (3 blocks hit at most)
    rm.add_request(req("first", 16, max_tokens=1, first=100))
    rm.add_request(req("half", 16, max_tokens=1, first=1)) # same tokens as seed
    rm.waiting.reorder()
    assert [r.request_id for r in rm.waiting] == ["half", "first"]
    monkeypatch.setattr(LongestPrefixMatch, "max_dynamic_queue", 1)
    rm.waiting.reorder()
    assert [r.request_id for r in rm.waiting] == ["first", "half"]
