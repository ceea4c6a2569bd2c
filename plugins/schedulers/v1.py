"""The v1 KV scheduler: no prefill or decode phase, a token budget per step.

Each request has ``num_computed_tokens``; every step gives tokens to
running requests first (decodes and unfinished prefill chunks), then admits
waiting requests while the budget, ``max_num_seqs`` and free blocks allow.
When blocks run out the newest running request is preempted: its blocks
are freed and it goes back to the head of the queue, to be recomputed.
The waiting queue is ordered by ``scheduler.policy`` (see queue.py). A
waiting request never holds blocks: a prefix hit attached for an admission
that then fails is released again. A request that the whole pool could not
hold is rejected when it arrives.
"""
from __future__ import annotations

import time

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import (ModelRunnerOutput, ResourceManager, ScheduledRequest,
                                 SchedulerOutput)
from fdx.core.request import Request, RequestStatus
from fdx.plugins.schedulers.queue import make_waiting_queue, unservable_reason


class V1ResourceManager(ResourceManager):
    def __init__(self, config, kv_cache, token_processor, max_model_len):
        super().__init__(config, kv_cache, token_processor, max_model_len)
        sc = config.scheduler
        self.max_num_seqs = sc.max_num_seqs
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.chunked_prefill = sc.enable_chunked_prefill
        self.waiting = make_waiting_queue(sc.policy, kv_cache)
        self.running: list[Request] = []
        self.aborted: list[Request] = []

    # -- queue ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        reason = unservable_reason(request, self.kv_cache, self.max_model_len)
        if reason is not None:
            request.status = RequestStatus.FINISHED_REJECTED
            request.stop_reason = f"rejected: {reason}"
            request.finished_time = time.monotonic()
            self.aborted.append(request)      # reported by the next schedule()
            return
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self.kv_cache.free(req)
                    req.status = RequestStatus.FINISHED_ABORTED
                    req.finished_time = time.monotonic()
                    self.aborted.append(req)
                    return req
        return None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_aborted=self.aborted)
        self.aborted = []
        budget = self.max_num_batched_tokens
        now = time.monotonic()
        self.waiting.reorder()

        # 1. running requests, oldest first; preempt from the tail
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new, self.kv_cache.block_table(req.request_id)))
                budget -= num_new
                i += 1

        # 2. waiting requests, in order, unless this step had to preempt
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            req.num_computed_tokens = self.kv_cache.get_computed_blocks(req)
            num_new = req.num_tokens - req.num_computed_tokens
            if (num_new > budget and not self.chunked_prefill) or \
                    not self.kv_cache.allocate_slots(req, min(num_new, budget)):
                self._release_hit(req)
                break
            num_new = min(num_new, budget)
            self._admit(req, now)
            out.scheduled.append(ScheduledRequest(req, num_new, self.kv_cache.block_table(req.request_id)))
            budget -= num_new

        out.num_scheduled_tokens = self.max_num_batched_tokens - budget
        return out

    def _release_hit(self, req: Request) -> None:
        """Undo get_computed_blocks for a request that stays waiting."""
        self.kv_cache.free(req)
        req.num_computed_tokens = 0

    def _admit(self, req: Request, now: float) -> None:
        """Move the head of the waiting queue, whose blocks are allocated, to running."""
        self.waiting.popleft()
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
            req.num_cached_tokens = req.num_computed_tokens
        self.running.append(req)

    def _preempt(self, req: Request) -> None:
        self.kv_cache.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, scheduler_output: SchedulerOutput,
               runner_output: ModelRunnerOutput) -> list[Request]:
        changed = []
        for sr in scheduler_output.scheduled:
            req = sr.request
            if req.is_finished:          # aborted while the step ran
                continue
            req.num_computed_tokens += sr.num_new_tokens
            self.kv_cache.on_tokens_computed(req)
            token = runner_output.sampled.get(req.request_id)
            if token is None:
                continue                  # a prefill chunk that did not reach the end
            done = self.token_processor.process(req, token, runner_output.logprobs.get(req.request_id))
            changed.append(req)
            if done:
                self.running.remove(req)
                self.kv_cache.free(req)
        return changed


@hookimpl
def fdx_register_resource_managers(register):
    register("v1", V1ResourceManager)
