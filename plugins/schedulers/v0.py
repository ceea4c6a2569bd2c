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
- ``plugins.kv_scheduler.v0.kv_cache_ratio`` (``V0Settings``) bounds the share of the pool that the prompts of
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

from pydantic import BaseModel, ConfigDict, Field

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import KVScheduler
from fdx.core.request import Request


class V0Settings(BaseModel):
    """``plugins.kv_scheduler.v0``."""
    model_config = ConfigDict(extra="forbid")
    kv_cache_ratio: float = Field(0.75, gt=0, le=1)   # share of the blocks running prompts may take


class V0Policy(KVScheduler):
    """FastDeploy v0's step, on the engine's scheduling core."""
    Settings = V0Settings

    def __init__(self, settings: V0Settings | None = None, context=None):
        super().__init__(settings if settings is not None else V0Settings(), context)

    # -- block accounting ---------------------------------------------------
    @staticmethod
    def _blocks(core, num_tokens: int) -> int:
        return -(-num_tokens // core.kv_cache.block_size)

    def reserve(self, core, req: Request, have: int | None = None) -> int:
        """Blocks the request may still allocate before it finishes."""
        if have is None:
            have = len(core.kv_cache.block_table(req.request_id))
        worst = self._blocks(core, min(req.num_prompt_tokens + req.max_tokens, core.max_model_len))
        return max(0, worst - have)

    # -- one step ---------------------------------------------------------------
    def schedule(self, core) -> None:
        self._admit_waiting(core)
        prefilling = [r for r in core.running if r.num_computed_tokens < r.num_prompt_tokens]
        if prefilling:
            grants = self._split_budget(core, prefilling)
            batch = [(r, grants[r.request_id]) for r in prefilling if grants[r.request_id] > 0]
        else:
            batch = [(r, 1) for r in core.running[:core.max_num_batched_tokens]]
            # when the budget is below the running count, the rest go first next step
            core.rotate_running(len(batch))
        for req, n in batch:
            if not core.kv_cache.allocate_slots(req, n):
                raise RuntimeError(f"v0: the decode reserve of {req.request_id} did not hold "
                                   f"({core.kv_cache.num_free_blocks} blocks free)")
            core.schedule_request(req, n)

    def _admit_waiting(self, core) -> None:
        """The core's admission loop, with v0's test of each request: the
        prompt share (``kv_cache_ratio``), the whole prompt within the budget
        unless chunked, and the decode reserve of everyone running."""
        kv = core.kv_cache
        max_prompt_blocks = self.settings.kv_cache_ratio * kv.num_blocks
        # requests whose KV a connector is still loading (core.loading) hold blocks and will run:
        # their reserve counts as a running one's (a decode found no block when it did not)
        admitted = [*core.running, *core.loading]
        acc = dict(reserved=sum(self.reserve(core, r) for r in admitted),
                   prompt_blocks=sum(self._blocks(core, r.num_prompt_tokens) for r in admitted),
                   pending=sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in admitted))

        def grant(req, hit, external):
            own_prompt_blocks = self._blocks(core, req.num_prompt_tokens)
            if (core.running or core.loading) and acc["prompt_blocks"] + own_prompt_blocks > max_prompt_blocks:
                return None
            num_new = req.num_prompt_tokens - hit.num_tokens - external
            fits_budget = core.chunked_prefill or acc["pending"] + num_new <= core.max_num_batched_tokens
            # the hit's evictable blocks leave the free count when it is committed
            free_after_hit = kv.num_free_blocks - hit.num_evictable
            if not fits_budget or acc["reserved"] + self.reserve(core, req, len(hit.block_ids)) > free_after_hit:
                return None
            # counted before the admission: if it fails the loop stops and the counts are not read again
            acc["reserved"] += self.reserve(core, req, self._blocks(core, hit.num_tokens + external + num_new))
            acc["prompt_blocks"] += own_prompt_blocks
            acc["pending"] += num_new
            return num_new

        core.admit_waiting(grant, schedule=False)

    def _split_budget(self, core, prefilling: list[Request]) -> dict[str, int]:
        budget = core.max_num_batched_tokens
        left_of = {r.request_id: r.num_prompt_tokens - r.num_computed_tokens for r in prefilling}
        if not core.chunked_prefill:
            return left_of                       # admission kept the sum within the budget
        bs = core.kv_cache.block_size
        share = budget // len(prefilling) // bs * bs
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
def fdx_register_kv_schedulers(register):
    register("v0", V0Policy)
