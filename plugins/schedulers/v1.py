"""The v1 KV scheduler: no prefill or decode phase, a token budget per step.

Each request has ``num_computed_tokens``; every step gives tokens to
running requests first (decodes and unfinished prefill chunks), then admits
waiting requests while the budget, ``max_num_seqs`` and free blocks allow.
When blocks run out a running request is preempted (``scheduler.preemption``:
newest first by default): its blocks are freed and it goes back to the head
of the queue, to be recomputed. Waiting requests are ordered by
``scheduler.policy`` and filtered by ``scheduler.admission``; a request
refused by an admission rule is skipped for this step. The bookkeeping
(queues, blocks, the plain-data step) is ``fdx.core.scheduling``'s.
"""
from __future__ import annotations

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import ModelRunnerOutput, ResourceManager, SchedulerOutput
from fdx.core.request import Request
from fdx.core.scheduling import SchedulingCore


class V1ResourceManager(ResourceManager):
    def __init__(self, config, kv_cache, token_processor, max_model_len, settings=None, extensions=None):
        super().__init__(config, kv_cache, token_processor, max_model_len, settings, extensions)
        self.core = SchedulingCore(config, kv_cache, max_model_len, extensions)

    # -- the contract's bookkeeping, delegated ---------------------------------------
    def add_request(self, request: Request) -> None:
        self.core.add(request)

    def abort_request(self, request_id: str) -> Request | None:
        return self.core.abort(request_id)

    def requests(self) -> list[Request]:
        return self.core.requests()

    def pop_finished(self) -> list[Request]:
        return self.core.pop_rejected()

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        return self.core.update(scheduler_output, runner_output, self.token_processor)

    @property
    def running(self) -> list[Request]:
        return self.core.running

    @property
    def waiting(self):
        return self.core.waiting

    @property
    def num_running(self) -> int:
        return len(self.core.running)

    @property
    def num_waiting(self) -> int:
        return len(self.core.waiting)

    def has_unfinished(self) -> bool:
        # finished requests whose blocks a connector still holds keep the engine stepping
        return bool(self.core.running or self.core.waiting or self.core.held or self.core.recving)

    # -- one step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        core, kv = self.core, self.kv_cache
        out = core.begin_step()
        budget = core.max_num_batched_tokens

        # 1. running requests, oldest first; preempt when blocks run out
        i = 0
        while i < len(core.running) and budget > 0:
            req = core.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not kv.allocate_slots(req, num_new):
                victim = core.choose_victim(core.running[i:])   # not one already in this step
                core.preempt(victim)
                if victim is req:
                    break
            else:
                core.schedule_request(out, req, num_new)
                budget -= num_new
                i += 1

        # 2. waiting requests, in order, unless this step had to preempt
        if not core.preempted_ids:
            skipped = 0
            while (skipped < len(core.waiting) and budget > 0
                   and len(core.running) < core.max_num_seqs):
                req = core.waiting[skipped]
                if not core.may_admit(req):
                    skipped += 1
                    continue
                hit, external = core.lookup(req)
                num_new = req.num_tokens - hit.num_tokens - external
                if num_new > budget and not core.chunked_prefill:
                    break
                num_new = min(num_new, budget)
                if not core.admit(req, hit, external, num_new):
                    break
                core.schedule_request(out, req, num_new)
                budget -= num_new
        return core.end_step(out)


@hookimpl
def fdx_register_resource_managers(register):
    register("v1", V1ResourceManager)
