"""The paged block pool: a free list, reference counts, a block table per
request. No reuse across requests; the prefix cache builds on this."""
from __future__ import annotations

from collections import deque

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import KVCacheManager, PrefixHit
from fdx.core.request import Request


class BlockPool:
    """Physical blocks with reference counts. Block ids are 0..num_blocks-1."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise MemoryError(f"asked for {n} KV blocks, {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def ref(self, block_id: int) -> None:
        self.ref_counts[block_id] += 1

    def release(self, block_id: int) -> bool:
        """Drop one reference; returns True when the block became free."""
        rc = self.ref_counts[block_id]
        if rc <= 0:
            raise AssertionError(f"KV block {block_id} freed twice")
        self.ref_counts[block_id] = rc - 1
        if rc > 1:
            return False
        self._became_free(block_id)
        return True

    def _became_free(self, block_id: int) -> None:
        # reused first (last in, first out): the host KV cache's pages become resident when a block is
        # first written (core/memory.py), so reusing written blocks keeps the process at its high-water mark
        self.free_ids.appendleft(block_id)


class PagedKVCache(KVCacheManager):
    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        self.pool = BlockPool(self.num_blocks)
        self.tables: dict[str, list[int]] = {}

    def allocate_slots(self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None) -> bool:
        rid = request.request_id
        table = self.tables.get(rid, [])
        if prefix is not None and prefix.num_tokens:
            if table:
                raise ValueError(f"{rid} already holds blocks: a prefix hit is committed only at admission")
            base, have, free = prefix.num_tokens, len(prefix.block_ids), self.pool.num_free - prefix.num_evictable
        else:
            base, have, free = request.num_computed_tokens, len(table), self.pool.num_free
        need = max(0, -(-(base + num_new_tokens) // self.block_size) - have)
        if need > free:
            return False
        table = self.tables.setdefault(rid, table)
        if prefix is not None and prefix.num_tokens:
            for b in prefix.block_ids:          # taken first: allocation must not evict them
                self.pool.ref(b)
            table.extend(prefix.block_ids)
        if need:
            table.extend(self.pool.allocate(need))
        return True

    def free(self, request: Request) -> None:
        for b in reversed(self.tables.pop(request.request_id, [])):
            self.pool.release(b)

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free


@hookimpl
def fdx_register_kv_caches(register):
    register("paged", PagedKVCache)
