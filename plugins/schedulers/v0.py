"""The v0 KV scheduler: FastDeploy's first one. Prefill before decode,
whole prompts admitted at once, never a preemption.

- Slots: at most ``max_num_seqs`` requests run at once.
- Admission, in queue order (``scheduler.policy``), stopping at the first
  request that does not fit. A request is admitted when the free blocks
  (a prefix hit counted as its own) cover its whole worst case -- its
  prompt plus ``max_tokens`` of output, bounded by ``max_model_len`` --
  on top of what every running request may still claim. That is the decode
  reserve: each running request keeps enough blocks in reserve to reach
  its own end, so a decode step always finds a block, nothing is ever
  preempted, and every admitted request finishes. The prompt's blocks are
  allocated at admission; output blocks one by one as decoding needs them.
- ``cache.kv_cache_ratio`` bounds the share of the pool that the prompts of
  running requests may take, leaving the rest to their outputs. A request
  admitted into an empty engine is exempt, so a long prompt always runs.
- A step either prefills or decodes: while any running request has prompt
  tokens left, the step prefills (all such requests, decodes wait); else it
  decodes every running request, one token each.
- Chunked prefill splits the step's token budget across the prefilling
  requests: the budget divided by their number, rounded down to whole
  blocks, with the leftover given to the request with the fewest tokens
  left (then the next fewest). Without it, a request is admitted only
  when its whole remaining prompt fits the step's budget with the others.

The reserve is exact for greedy lengths and conservative otherwise: a
request that stops early (eos, stop strings) gives its reserve back when it
finishes. A request whose worst case exceeds the whole pool is rejected.
"""
from __future__ import annotations

import time

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import ScheduledRequest, SchedulerOutput
from fdx.core.request import Request, RequestStatus
from fdx.plugins.schedulers.v1 import V1ResourceManager


class V0ResourceManager(V1ResourceManager):
    """v1's queue and bookkeeping with FastDeploy v0's ``schedule()``."""

    def __init__(self, config, kv_cache, token_processor, max_model_len):
        super().__init__(config, kv_cache, token_processor, max_model_len)
        self.block_size = kv_cache.block_size
        self.max_prompt_blocks = config.cache.kv_cache_ratio * kv_cache.num_blocks

    # -- block accounting ---------------------------------------------------
    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _worst_case_blocks(self, req: Request) -> int:
        return self._blocks(min(req.num_prompt_tokens + req.max_tokens, self.max_model_len))

    def reserve(self, req: Request) -> int:
        """Blocks the request may still allocate before it finishes."""
        have = len(self.kv_cache.block_table(req.request_id))
        return max(0, self._worst_case_blocks(req) - have)

    # -- one step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_aborted=self.aborted)
        self.aborted = []
        self.waiting.reorder()
        self._admit_waiting()
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        if prefilling:
            grants = self._split_budget(prefilling)
            batch = [(r, grants[r.request_id]) for r in prefilling if grants[r.request_id] > 0]
        else:
            batch = [(r, 1) for r in self.running[:self.max_num_batched_tokens]]
            # when the budget is below the running count, the rest go first next step
            self.running = self.running[len(batch):] + self.running[:len(batch)]
        for req, n in batch:
            if not self.kv_cache.allocate_slots(req, n):
                raise RuntimeError(f"v0: the decode reserve of {req.request_id} did not hold "
                                   f"({self.kv_cache.num_free_blocks} blocks free)")
            out.scheduled.append(ScheduledRequest(req, n, self.kv_cache.block_table(req.request_id)))
            out.num_scheduled_tokens += n
        return out

    def _admit_waiting(self) -> None:
        now = time.monotonic()
        reserved = sum(self.reserve(r) for r in self.running)
        prompt_blocks = sum(self._blocks(r.num_prompt_tokens) for r in self.running)
        pending = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.running)
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            own_prompt_blocks = self._blocks(req.num_prompt_tokens)
            if self.running and prompt_blocks + own_prompt_blocks > self.max_prompt_blocks:
                break
            req.num_computed_tokens = self.kv_cache.get_computed_blocks(req)
            num_new = req.num_prompt_tokens - req.num_computed_tokens
            fits_budget = self.chunked_prefill or pending + num_new <= self.max_num_batched_tokens
            if (not fits_budget or reserved + self.reserve(req) > self.kv_cache.num_free_blocks
                    or not self.kv_cache.allocate_slots(req, num_new)):
                self._release_hit(req)
                break
            self._admit(req, now)
            reserved += self.reserve(req)
            prompt_blocks += own_prompt_blocks
            pending += num_new

    def _split_budget(self, prefilling: list[Request]) -> dict[str, int]:
        budget = self.max_num_batched_tokens
        left_of = {r.request_id: r.num_prompt_tokens - r.num_computed_tokens for r in prefilling}
        if not self.chunked_prefill:
            return left_of                       # admission kept the sum within the budget
        share = budget // len(prefilling) // self.block_size * self.block_size
        grants = {rid: min(n, share) for rid, n in left_of.items()}
        leftover = budget - sum(grants.values())
        for r in sorted(prefilling, key=lambda r: left_of[r.request_id]):
            if leftover <= 0:
                break
            extra = min(leftover, left_of[r.request_id] - grants[r.request_id])
            grants[r.request_id] += extra
            leftover -= extra
        return grants


@hookimpl
def fdx_register_resource_managers(register):
    register("v0", V0ResourceManager)
