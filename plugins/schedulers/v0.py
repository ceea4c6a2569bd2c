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

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import SchedulerOutput
from fdx.core.request import Request
from fdx.plugins.schedulers.v1 import V1ResourceManager


class V0ResourceManager(V1ResourceManager):
    """v1's bookkeeping (fdx.core.scheduling) with FastDeploy v0's ``schedule()``."""

    def __init__(self, config, kv_cache, token_processor, max_model_len, settings=None, extensions=None):
        super().__init__(config, kv_cache, token_processor, max_model_len, settings, extensions)
        self.block_size = kv_cache.block_size
        self.max_prompt_blocks = config.cache.kv_cache_ratio * kv_cache.num_blocks

    # -- block accounting ---------------------------------------------------
    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _worst_case_blocks(self, req: Request) -> int:
        return self._blocks(min(req.num_prompt_tokens + req.max_tokens, self.max_model_len))

    def reserve(self, req: Request, have: int | None = None) -> int:
        """Blocks the request may still allocate before it finishes."""
        if have is None:
            have = len(self.kv_cache.block_table(req.request_id))
        return max(0, self._worst_case_blocks(req) - have)

    # -- one step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        core = self.core
        out = core.begin_step()
        self._admit_waiting()
        prefilling = [r for r in core.running if r.num_computed_tokens < r.num_prompt_tokens]
        if prefilling:
            grants = self._split_budget(prefilling)
            batch = [(r, grants[r.request_id]) for r in prefilling if grants[r.request_id] > 0]
        else:
            batch = [(r, 1) for r in core.running[:core.max_num_batched_tokens]]
            # when the budget is below the running count, the rest go first next step
            core.running[:] = core.running[len(batch):] + core.running[:len(batch)]
        for req, n in batch:
            if not self.kv_cache.allocate_slots(req, n):
                raise RuntimeError(f"v0: the decode reserve of {req.request_id} did not hold "
                                   f"({self.kv_cache.num_free_blocks} blocks free)")
            core.schedule_request(out, req, n)
        return core.end_step(out)

    def _admit_waiting(self) -> None:
        core = self.core
        reserved = sum(self.reserve(r) for r in core.running)
        prompt_blocks = sum(self._blocks(r.num_prompt_tokens) for r in core.running)
        pending = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in core.running)
        skipped = 0
        while skipped < len(core.waiting) and len(core.running) < core.max_num_seqs:
            req = core.waiting[skipped]
            if not core.may_admit(req):
                skipped += 1
                continue
            own_prompt_blocks = self._blocks(req.num_prompt_tokens)
            if core.running and prompt_blocks + own_prompt_blocks > self.max_prompt_blocks:
                break
            hit, external = core.lookup(req)
            num_new = req.num_prompt_tokens - hit.num_tokens - external
            fits_budget = core.chunked_prefill or pending + num_new <= core.max_num_batched_tokens
            # the hit's evictable blocks leave the free count when it is committed
            free_after_hit = self.kv_cache.num_free_blocks - hit.num_evictable
            if (not fits_budget or reserved + self.reserve(req, len(hit.block_ids)) > free_after_hit
                    or not core.admit(req, hit, external, num_new)):
                break
            reserved += self.reserve(req)
            prompt_blocks += own_prompt_blocks
            pending += num_new
    def _split_budget(self, prefilling: list[Request]) -> dict[str, int]:
        budget = self.core.max_num_batched_tokens
        left_of = {r.request_id: r.num_prompt_tokens - r.num_computed_tokens for r in prefilling}
        if not self.core.chunked_prefill:
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
