"""The scheduling core the engine owns: the waiting queue, admission,
preemption, freeing, building the plain-data step, and the two loops every
KV scheduler (policy) shares.

The engine holds one ``SchedulingCore`` (``engine.scheduling``) and
asks it for each step; the scheduler plugin (``scheduler.kv_scheduler``,
a ``KVScheduler`` from core/interfaces.py) only decides which requests
run and how many tokens each gets, through the helpers here. The core keeps
the correctness-critical rules whatever the policy does:

- preempted requests wait ahead of every request that never ran (last
  preempted first), whatever the queue policy says about the rest;
- a waiting request holds no blocks: a prefix hit is looked up with no side
  effect and committed only by ``admit``, with the new blocks, all or nothing;
- a request that the whole pool could never hold is rejected when it arrives
  (it would otherwise wait forever);
- a finished, aborted or preempted request gives its blocks back (after the
  KV connector's transfer, if it holds them) and its id reaches the runner in
  the next step's ``finished_req_ids``;
- ``update`` counts recompute: tokens computed again after a preemption.

A step, as ``schedule()`` runs it::

    begin_step()              # a fresh SchedulerOutput, budget = max_num_batched_tokens
    policy.schedule(view)     # schedule_running(), admit_waiting(grant), schedule_request(...)
    end_step()                # ids that left the runner, the connector's metadata

The policy is handed a ``SchedulingView`` of the core, not the core: the
documented surface (docs/plugins.md), so a policy cannot come to depend on
the bookkeeping behind it.
"""
from __future__ import annotations

import bisect
import itertools
import time
from typing import Callable, Iterator

from fdx.core import activations
from fdx.core.interfaces import (CachedRequestData, KVCacheManager, KVScheduler, ModelRunnerOutput,
                                 NewRequestData, PrefixHit, QueuePolicy, SchedulerOutput, SchedulerState,
                                 SchedulingExtensions)
from fdx.core.request import Request, RequestStatus


class WaitingQueue:
    """Preempted requests first (last preempted first), then the others in
    the policy's order (its key, then arrival). Reads like a deque:
    ``append``, ``appendleft`` (= ``push_preempted``), ``popleft``, ``[i]``,
    ``remove``, iteration, ``len``."""

    def __init__(self, policy: QueuePolicy):
        self.policy = policy
        self.preempted: list[Request] = []               # a stack: the last pushed is first
        self._entries: list[tuple[tuple, Request]] = []  # sorted by ((policy key), arrival seq)
        self._keys: dict[str, tuple] = {}
        self._seq = itertools.count()

    def append(self, request: Request) -> None:
        if request.request_id in self._keys or request in self.preempted:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        # a dynamic policy's keys are computed by reorder(), at the start of each step
        key = (() if self.policy.dynamic else tuple(self.policy.key(request)), next(self._seq))
        self._keys[request.request_id] = key
        bisect.insort(self._entries, (key, request), key=lambda e: e[0])

    def push_preempted(self, request: Request) -> None:
        self.preempted.append(request)

    appendleft = push_preempted

    def reorder(self) -> None:
        """Called at the start of each schedule(): re-sort when the policy's
        keys change over time (lpm)."""
        if self.policy.dynamic and len(self._entries) > 1:
            limit = self.policy.max_dynamic_queue
            if limit is not None and len(self._entries) > limit:
                key_of = lambda r: ()          # arrival order: only the sequence numbers count
            else:
                key_of = self.policy.key
            entries = [((tuple(key_of(r)), key[-1]), r) for key, r in self._entries]
            entries.sort(key=lambda e: e[0])
            self._entries = entries
            self._keys = {r.request_id: key for key, r in entries}

    def popleft(self) -> Request:
        if self.preempted:
            return self.preempted.pop()
        _, req = self._entries.pop(0)
        del self._keys[req.request_id]
        return req

    def remove(self, request: Request) -> None:
        if request in self.preempted:
            self.preempted.remove(request)
            return
        key = self._keys.pop(request.request_id)
        i = bisect.bisect_left(self._entries, key, key=lambda e: e[0])
        assert self._entries[i][1] is request
        del self._entries[i]

    def __getitem__(self, i: int) -> Request:
        n = len(self.preempted)
        return self.preempted[n - 1 - i] if i < n else self._entries[i - n][1]

    def __iter__(self) -> Iterator[Request]:
        return iter([*reversed(self.preempted), *(r for _, r in self._entries)])

    def __len__(self) -> int:
        return len(self.preempted) + len(self._entries)

    def __bool__(self) -> bool:
        return bool(self.preempted or self._entries)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._keys or request in self.preempted


def unservable_reason(request: Request, kv_cache: KVCacheManager, max_model_len: int) -> str | None:
    """Why a request can never run, or None. A request needs, at worst,
    blocks for its prompt plus its output tokens; a pool smaller than that
    would leave it waiting (or preempting itself) forever."""
    total = min(request.num_prompt_tokens + max(request.max_tokens, 0), max_model_len)
    need = -(-total // kv_cache.block_size)
    if need > kv_cache.num_blocks:
        return (f"needs {need} KV blocks for {total} tokens, but the pool has "
                f"{kv_cache.num_blocks} blocks of {kv_cache.block_size} tokens")
    return None


class SchedulingView:
    """What a KV scheduler (``KVScheduler.schedule(core)``) works
    through: the scheduling core's documented surface, and nothing else (an
    attribute not listed here is an AttributeError naming this list).

    Read (snapshots: a tuple is a copy taken when read):
    ``running`` (run order, oldest first), ``waiting`` (queue order,
    preempted requests first), ``loading`` (admitted requests whose KV a
    connector is still loading: they hold blocks and will run), ``budget``
    (tokens left this step), ``step``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``max_model_len``, ``chunked_prefill``,
    ``preempted_ids`` (this step's preemptions), ``kv_cache`` (the
    ``KVCacheManager``: ``block_size``, ``num_blocks``, ``num_free_blocks``,
    ``block_table``, ``allocate_slots``).

    Do: ``schedule_running()``, ``admit_waiting(grant=None, schedule=True)``,
    ``schedule_request(request, n)``, ``rotate_running(n)`` (the first
    ``n`` running requests go to the end of the run order),
    ``preempt(request)`` (a running request gives its blocks back and waits
    first in the queue: a policy that picks its own victims), and the steps of
    ``admit_waiting`` for a policy that writes its own admission loop:
    ``may_admit(request)``, ``lookup(request) -> (hit, num_external)``,
    ``default_grant(request, hit, num_external)``,
    ``admit(request, hit, num_external, n)``."""

    __slots__ = ("_core",)

    def __init__(self, core: "SchedulingCore"):
        self._core = core

    def __getattr__(self, name: str):
        raise AttributeError(f"a KV scheduler's view of the scheduling core has no {name!r}; what it has: "
                             "fdx.core.scheduling.SchedulingView (docs/plugins.md, 'A KV scheduler')")

    # -- read --------------------------------------------------------------------------
    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._core.running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._core.waiting)

    @property
    def loading(self) -> tuple[Request, ...]:
        return tuple(self._core.recving.values())

    @property
    def budget(self) -> int:
        return self._core.budget

    @property
    def step(self) -> int:
        return self._core.step

    @property
    def max_num_seqs(self) -> int:
        return self._core.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self._core.max_num_batched_tokens

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def chunked_prefill(self) -> bool:
        return self._core.chunked_prefill

    @property
    def preempted_ids(self) -> tuple[str, ...]:
        return tuple(self._core.preempted_ids)

    @property
    def kv_cache(self) -> KVCacheManager:
        return self._core.kv_cache

    # -- do ----------------------------------------------------------------------------
    def schedule_running(self) -> None:
        self._core.schedule_running()

    def admit_waiting(self, grant: Callable[[Request, PrefixHit, int], int | None] | None = None, *,
                      schedule: bool = True) -> list[Request]:
        return self._core.admit_waiting(grant, schedule=schedule)

    def schedule_request(self, request: Request, num_new_tokens: int) -> None:
        self._core.schedule_request(request, num_new_tokens)

    def preempt(self, request: Request) -> None:
        self._core.preempt(request)

    def rotate_running(self, n: int) -> None:
        running = self._core.running
        n = max(0, min(n, len(running)))
        running[:] = running[n:] + running[:n]

    def may_admit(self, request: Request) -> bool:
        return self._core.may_admit(request)

    def lookup(self, request: Request) -> tuple[PrefixHit, int]:
        return self._core.lookup(request)

    def default_grant(self, request: Request, hit: PrefixHit, num_external: int) -> int | None:
        return self._core.default_grant(request, hit, num_external)

    def admit(self, request: Request, hit: PrefixHit, num_external: int, num_new_tokens: int) -> bool:
        return self._core.admit(request, hit, num_external, num_new_tokens)


class SchedulingCore:
    """The bookkeeping (queues, blocks, the runner's view, recompute) and
    the step's helpers; ``policy`` decides what each step runs."""

    def __init__(self, config, kv_cache: KVCacheManager, max_model_len: int, extensions: SchedulingExtensions,
                 policy: KVScheduler, token_processor=None):
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.ext = extensions
        self.policy = policy
        self.token_processor = token_processor
        self.connector = extensions.connector
        sc = config.scheduler
        self.max_num_seqs = sc.max_num_seqs
        self.max_num_batched_tokens = sc.token_budget(max_model_len)
        self.chunked_prefill = sc.enable_chunked_prefill
        self.waiting = WaitingQueue(extensions.queue_policy)
        self.running: list[Request] = []
        self.rejected: list[Request] = []
        self.held: dict[str, Request] = {}          # finished, blocks kept for a connector transfer
        self.recving: dict[str, Request] = {}       # admitted, blocks held, KV loading in the background
        self.in_runner: dict[str, int] = {}         # request id -> blocks of its table the runner has
        self.left_runner: list[str] = []            # ids for the next finished_req_ids
        self.preempted_ids: list[str] = []
        self.out: SchedulerOutput | None = None     # the step being built (inside schedule())
        self.budget = 0                             # tokens left in this step's budget
        self.step = 0
        self.num_computed_total = 0
        self.num_recomputed_total = 0
        self.speculation = None                     # core.spec.Speculation when speculative.method is set
        self.view = SchedulingView(self)            # what the policy is handed each step

    # -- what the engine asks ---------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        # finished requests whose blocks a connector still holds keep the engine stepping
        return bool(self.running or self.waiting or self.held or self.recving)

    def schedule(self) -> SchedulerOutput:
        """This step's batch: the policy fills it through the helpers."""
        self.out = self.begin_step()
        try:
            self.policy.schedule(self.view)
            out = self.out
        finally:
            self.out = None
        return self.end_step(out)

    # -- arrivals and aborts ------------------------------------------------------
    def add_request(self, request: Request) -> None:
        reason = unservable_reason(request, self.kv_cache, self.max_model_len)
        if reason is not None:
            request.status = RequestStatus.FINISHED_REJECTED
            request.stop_reason = f"rejected: {reason}"
            request.finished_time = time.monotonic()
            self.rejected.append(request)
            return
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        if self.connector is not None:
            self.connector.request_added(request)

    def abort_request(self, request_id: str) -> Request | None:
        for req in self.running:
            if req.request_id == request_id:
                self.running.remove(req)
                break
        else:
            req = self.recving.pop(request_id, None)
            if req is None:
                req = next((r for r in self.waiting if r.request_id == request_id), None)
                if req is None:
                    return None
                self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        req.finished_time = time.monotonic()
        self.release(req)
        return req

    def pop_finished(self) -> list[Request]:
        """Requests ended without running a step (rejected on arrival,
        external KV that never came), for the engine to report."""
        out, self.rejected = self.rejected, []
        return out

    def requests(self) -> list[Request]:
        return [*self.running, *self.recving.values(), *self.waiting]

    def holds_id(self, request_id: str) -> bool:
        """Whether ``request_id`` names a request here: queued, running, loading its
        KV, or finished with its blocks still held for a connector's transfer (its
        id keys that transfer's blocks until the connector reports it done)."""
        return request_id in self.held or any(r.request_id == request_id for r in self.requests())

    def fail_external(self) -> None:
        """End the requests whose external KV will never come (the connector's
        ``take_failed``): aborted with the reason, blocks freed, reported
        with the rejected ones."""
        if self.connector is None:
            return
        for rid, reason in self.connector.take_failed().items():
            req = self.abort_request(rid)
            if req is not None:
                req.stop_reason = reason
                self.rejected.append(req)

    # -- a step -----------------------------------------------------------------
    def begin_step(self) -> SchedulerOutput:
        """A new, empty SchedulerOutput; ``preempted_ids`` now lists only
        this step's preemptions."""
        self.step += 1
        self.fail_external()
        self.waiting.reorder()
        self.budget = self.max_num_batched_tokens
        return SchedulerOutput(step=self.step)

    def end_step(self, out: SchedulerOutput) -> SchedulerOutput:
        """Hand the runner every id that left it since the last step (this
        step's preemptions included: the runner drops those before it adds
        the step's new requests) and the connector's metadata."""
        out.finished_req_ids, self.left_runner = self.left_runner, []
        out.preempted_req_ids, self.preempted_ids = self.preempted_ids, []
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta()
        return out

    def state(self) -> SchedulerState:
        kv = self.kv_cache
        return SchedulerState(self.step, self.running, len(self.waiting), kv.num_free_blocks, kv.num_blocks,
                              self.max_num_seqs)

    def may_admit(self, request: Request) -> bool:
        """The admission rules' verdict (preempted requests are not asked)."""
        if request.num_preemptions and request in self.waiting.preempted:
            return True
        if self.connector is not None and self.connector.defer_request(request):
            return False
        if self.recving and len(self.running) + len(self.recving) >= self.max_num_seqs:
            return False                       # loading requests will run: they count
        if not self.ext.admission_rules:
            return True
        state = self.state()
        return all(rule.admit(request, state) for rule in self.ext.admission_rules)

    def lookup(self, request: Request) -> tuple[PrefixHit, int]:
        """(the local prefix hit, tokens the connector can load after it): no
        side effects. A request that wants prompt logprobs computes its whole
        prompt, so it takes no hit; so does a pooling request (its embedding
        pools every prompt token's hidden state), nor one with activation hooks
        (its positions are captured or steered: docs/research.md)."""
        if (request.sampling_params.prompt_logprobs is not None or request.pooling
                or request.sampling_params.activations is not None):
            return PrefixHit(), 0
        hit = self.kv_cache.lookup_prefix(request)
        external = 0
        if self.connector is not None:
            external = self.connector.get_num_new_matched_tokens(request, hit.num_tokens)
        return hit, external

    def admit(self, request: Request, hit: PrefixHit, external: int, num_new_tokens: int) -> bool:
        """Commit a lookup and allocate blocks for ``num_new_tokens`` computed
        tokens after it; False (nothing changed) when they do not fit. On
        success the request is running, with ``num_computed_tokens`` = hit +
        loaded tokens."""
        if not self.kv_cache.allocate_slots(request, external + num_new_tokens, prefix=hit):
            return False
        self.waiting.remove(request)
        request.num_computed_tokens = hit.num_tokens
        if external and self.connector is not None:
            self.connector.update_state_after_alloc(request, self.kv_cache.block_table(request.request_id),
                                                    external)
        request.num_computed_tokens = hit.num_tokens + external
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = request.num_computed_tokens
        if external and self.connector is not None and self.connector.load_async(request):
            self.recving[request.request_id] = request    # schedule_request skips it until loaded
            return True
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def choose_victim(self, candidates: list[Request] | None = None) -> Request:
        """The preemption policy's pick among ``candidates`` (default: all
        running requests); newest first without a policy. The policy is
        asked even when one candidate is left (it must return that one)."""
        candidates = self.running if candidates is None else candidates
        policy = self.ext.preemption_policy
        if policy is None:
            return candidates[-1]
        victim = policy.choose_victim(candidates, self.state())
        if not any(victim is c for c in candidates):
            raise RuntimeError(f"preemption policy {type(policy).__name__} chose a request that is not a candidate")
        return victim

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the head of the queue."""
        self.running.remove(request)
        self.kv_cache.free(request)
        if request.request_id in self.in_runner:
            del self.in_runner[request.request_id]
            self.left_runner.append(request.request_id)
            self.preempted_ids.append(request.request_id)
        request.status = RequestStatus.PREEMPTED
        if self.speculation is not None:
            self.speculation.preempted(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.push_preempted(request)

    def release(self, request: Request) -> None:
        """A request finished or was aborted: give its blocks back, unless
        the connector keeps them for a transfer (freed when it reports)."""
        if request.request_id in self.in_runner:
            del self.in_runner[request.request_id]
            self.left_runner.append(request.request_id)
        if self.connector is not None and self.kv_cache.block_table(request.request_id):
            if self.connector.request_finished(request, list(self.kv_cache.block_table(request.request_id))):
                self.held[request.request_id] = request
                return
        self.kv_cache.free(request)

    def schedule_request(self, request: Request, num_new_tokens: int) -> None:
        """Add a running request whose blocks cover its new tokens to the step
        and take them from the budget (a request whose KV is still loading in
        the background is skipped)."""
        rid, out = request.request_id, self.out
        if rid in self.recving:
            return
        table = self.kv_cache.block_table(rid)
        sent = self.in_runner.get(rid)
        if sent is None:
            out.new_requests.append(NewRequestData(
                rid, list(request.prompt_token_ids), list(request.output_token_ids), request.sampling_params,
                list(table), request.num_computed_tokens, request.lora_name))
        else:
            out.cached_requests.append(CachedRequestData(rid, list(table[sent:]), request.num_computed_tokens))
        self.in_runner[rid] = len(table)
        out.num_scheduled_tokens[rid] = num_new_tokens
        out.total_num_scheduled_tokens += num_new_tokens
        self.budget -= num_new_tokens

    # -- the two loops every policy shares -----------------------------------------------
    def schedule_running(self) -> None:
        """Running requests, oldest first, each its remaining tokens (a
        decode: one; a prefill: what is left, cut to the budget) while the
        budget lasts. When blocks run out, the victim policy picks among the
        running requests not yet scheduled this step (the one asking
        included) and that one is preempted; a request that is itself the
        victim is not scheduled. With speculative decoding, a decoding
        request's step also holds its drafts (``spec_token_ids``), budget
        and blocks allowing; blocks run short, the drafts go first."""
        i = 0
        while i < len(self.running) and self.budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, self.budget)
            drafts = self.drafts(req, num_new)
            while not self.kv_cache.allocate_slots(req, num_new + len(drafts)):
                if drafts:
                    drafts = []
                    continue
                victim = self.choose_victim(self.running[i:])   # not one already in this step
                self.preempt(victim)
                if victim is req:
                    break
            else:
                self.schedule_request(req, num_new + len(drafts))
                if drafts:
                    self.out.spec_token_ids[req.request_id] = drafts
                    probs = self.speculation.draft_probs.get(req.request_id)
                    if probs is not None:
                        self.out.spec_draft_probs[req.request_id] = probs.tobytes()
                i += 1

    def drafts(self, request: Request, num_new: int) -> list[int]:
        """The speculative drafts for a request that decodes (one new token),
        within the step's budget, max_model_len and its max_tokens."""
        if self.speculation is None or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        room = min(self.budget - 1, self.max_model_len - request.num_tokens,
                   request.max_tokens - request.num_output_tokens - 1)
        return self.speculation.drafts(request, room) if room > 0 else []

    def admit_waiting(self, grant: Callable[[Request, PrefixHit, int], int | None] | None = None, *,
                      schedule: bool = True) -> list[Request]:
        """The admission loop, written once. Waiting requests in queue order
        (preempted ones first), while the budget has tokens, fewer than
        ``max_num_seqs`` run and this step preempted nothing. A request an
        admission rule (or the connector) refuses is skipped for this step;
        the first one that does not fit stops the loop, so nothing behind it
        starts before it (the kit's bounded-wait property).

        ``grant(request, hit, num_external)`` says how many tokens the
        request computes now, or None to stop here; the default is all it
        has left after its prefix hit and external tokens, cut to the budget
        when chunked prefill is on, and None when it is off and the rest
        does not fit. ``schedule=False`` only admits (blocks for the granted
        tokens, the request running): the policy schedules the step itself,
        as v0 does. Returns the admitted requests."""
        admitted: list[Request] = []
        if self.preempted_ids:
            return admitted
        skipped = 0
        while skipped < len(self.waiting) and self.budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[skipped]
            if not self.may_admit(req):
                skipped += 1
                continue
            hit, external = self.lookup(req)
            num_new = (grant or self.default_grant)(req, hit, external)
            if num_new is None or not self.admit(req, hit, external, num_new):
                break
            admitted.append(req)
            if schedule:
                self.schedule_request(req, num_new)
        return admitted

    def default_grant(self, request: Request, hit: PrefixHit, num_external: int) -> int | None:
        num_new = request.num_tokens - hit.num_tokens - num_external
        if num_new > self.budget and not self.chunked_prefill:
            return None                     # a whole prompt must fit the step unless chunked
        return min(num_new, self.budget)

    # -- after the forward ------------------------------------------------------------
    def update(self, out: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Account for a step that ran: append the sampled tokens through the
        token processor, free what finished; the requests that produced a
        token (finished or not)."""
        token_processor = self.token_processor
        for rid in runner_output.finished_sending:
            req = self.held.pop(rid, None)
            if req is not None:
                self.kv_cache.free(req)
        for rid in runner_output.finished_recving:
            req = self.recving.pop(rid, None)
            if req is not None:                           # loaded: it joins the batch next step
                req.status = RequestStatus.RUNNING
                self.running.append(req)
        by_id = {r.request_id: r for r in self.running}
        changed, recomputed = [], 0
        for rid, n in out.num_scheduled_tokens.items():
            req = by_id.get(rid)
            if req is None or req.is_finished:          # aborted while the step ran
                continue
            start = req.num_computed_tokens
            if rid in runner_output.accepted:             # speculated: _update_speculated counts
                n -= len(out.spec_token_ids.get(rid, ()))
            recomputed += max(0, min(req.max_num_computed_tokens, start + n) - start)
            req.num_computed_tokens = start + n
            req.max_num_computed_tokens = max(req.max_num_computed_tokens, start + n)
            self.kv_cache.on_tokens_computed(req)
            if rid in runner_output.prompt_logprobs:
                token_processor.add_prompt_logprobs(req, start, runner_output.prompt_logprobs[rid])
            if rid in runner_output.activations:      # one row per position: a recomputed one replaces it
                req.activations = activations.keep(req.activations, runner_output.activations[rid])
            if rid in runner_output.accepted:
                self._update_speculated(req, start, n, out.spec_token_ids.get(rid, []), runner_output, changed)
                continue
            token = runner_output.sampled.get(rid)
            if token is None:
                continue                                  # a prefill chunk short of the end
            done = token_processor.process(req, token, runner_output.logprobs.get(rid))
            changed.append(req)
            if done:
                self.running.remove(req)
                self.release(req)
        self.num_computed_total += out.total_num_scheduled_tokens
        self.num_recomputed_total += recomputed
        runner_output.num_recomputed_tokens = recomputed
        return changed

    def _update_speculated(self, req: Request, start: int, n: int, drafts: list[int],
                           runner_output: ModelRunnerOutput, changed: list[Request]) -> None:
        """A request that verified drafts: its accepted tokens go through the
        token processor one at a time, up to the first that finishes it; its
        computed count covers only the pending token and the drafts kept
        (the rejected positions' KV is past it: overwritten later, never
        registered in the prefix cache)."""
        tokens = runner_output.accepted[req.request_id]
        lps = runner_output.accepted_logprobs.get(req.request_id)
        done, kept = False, 0
        for j, token in enumerate(tokens):
            kept += 1
            done = self.token_processor.process(req, token, lps[j] if lps else None)
            if done:
                break
        req.num_computed_tokens = start + n + min(len(tokens) - 1, kept - 1)   # n: without the drafts
        req.max_num_computed_tokens = max(req.max_num_computed_tokens, req.num_computed_tokens)
        self.kv_cache.on_tokens_computed(req)
        if self.speculation is not None:
            self.speculation.on_accepted(req, len(drafts), len(tokens) - 1)
        changed.append(req)
        if done:
            self.running.remove(req)
            self.release(req)
