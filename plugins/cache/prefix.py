"""Prefix caching (``kv_cache: prefix``): requests that share a prefix share
its KV blocks.

- Every full block of a request is keyed by a chained hash of (its
  parent's key, its token ids, extra keys: the request's ``cache_salt``),
  so a key names the whole prefix up to that block. Blocks are registered
  once computed (``on_tokens_computed``); partial blocks never are.
- ``lookup_prefix`` walks a request's keys with no side effect; a block is
  a hit only when its stored parent, tokens and salt equal the request's (a
  hash collision is a miss). ``allocate_slots(..., prefix=hit)`` commits
  the hit with the new blocks. Hit blocks are shared: their reference count
  is the number of requests holding them. A request whose whole prompt is
  cached still computes its last block, so the model sees its last token.
- A cached block no request holds stays in the pool as evictable, least
  recently used first; allocation takes never-cached free blocks first,
  then evicts. A request's blocks are released tail first, so a prefix's
  head outlives its tail.
- A second tier (host memory or files) is a KV connector, ``swap``
  (plugins/cache/swap.py), selected by ``cache.kv_connector: swap``, set by
  ``plugins.connector.swap.dir`` / ``.max_blocks``.
- ``stats()``: ``prefix_cache_queries`` and ``prefix_cache_hits`` (tokens of
  admitted requests, and of those the ones served from cache), evictions,
  cached blocks.
"""
from __future__ import annotations

from collections import OrderedDict

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import PrefixHit
from fdx.core.request import Request
from fdx.plugins.cache.blocks import BlockMeta, block_metas
from fdx.plugins.cache.paged import BlockPool, PagedKVCache


class CachingBlockPool(BlockPool):
    """A BlockPool in which a cached block that nobody holds waits in an LRU
    (still counted free) instead of the free list, until allocation needs
    it and ``on_evict(block_id)`` lets it go."""

    def __init__(self, num_blocks: int, on_evict):
        super().__init__(num_blocks)
        self.evictable: OrderedDict[int, None] = OrderedDict()   # oldest first
        self.cached = [False] * num_blocks
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_free} free")
        ids = []
        for _ in range(n):
            if self.free_ids:
                b = self.free_ids.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                self.on_evict(b)
            self.ref_counts[b] = 1
            ids.append(b)
        return ids

    def ref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.evictable[block_id]       # KeyError here means a free, uncached block
        self.ref_counts[block_id] += 1

    def _became_free(self, block_id: int) -> None:
        if self.cached[block_id]:
            self.evictable[block_id] = None
        else:
            self.free_ids.appendleft(block_id)     # reused first, as BlockPool's (paged.py)


class PrefixKVCache(PagedKVCache):
    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        self.pool = CachingBlockPool(self.num_blocks, self._evict)
        self.by_key: dict[bytes, int] = {}        # key -> block, for cached blocks
        self.meta: dict[int, BlockMeta] = {}      # block -> what it holds
        self.req_keys: dict[str, list[bytes]] = {}   # request -> keys of its full blocks so far (a memo)
        self.num_registered: dict[str, int] = {}  # request -> leading table blocks already cached
        self.pending_stats: dict[str, tuple[int, int]] = {}  # request -> (queried, hit) until it runs
        self.counters = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_evictions": 0}

    def _metas(self, request: Request, stop: int, start: int = 0):
        return block_metas(request, self.block_size, stop, start, self.req_keys.setdefault(request.request_id, []))

    def _max_hit_blocks(self, request: Request) -> int:
        return (request.num_tokens - 1) // self.block_size     # the last token is always computed

    # -- the KVCacheManager contract ----------------------------------------------
    def lookup_prefix(self, request: Request) -> PrefixHit:
        blocks, evictable = [], 0
        for _, meta in self._metas(request, self._max_hit_blocks(request)):
            b = self.by_key.get(meta.key)
            if b is None or self.meta[b] != meta:     # a miss, or a hash collision: not this prefix
                break
            blocks.append(b)
            evictable += self.pool.ref_counts[b] == 0
        return PrefixHit(tuple(blocks), len(blocks) * self.block_size, evictable)

    def allocate_slots(self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None) -> bool:
        rid = request.request_id
        first = not self.tables.get(rid)
        if not super().allocate_slots(request, num_new_tokens, prefix):
            return False
        if first:                                  # admission: the hit (if any) is committed now
            hit = prefix.num_tokens if prefix is not None else 0
            self.num_registered[rid] = hit // self.block_size
            self.pending_stats[rid] = (request.num_tokens, hit)
        return True

    def _register(self, block_id: int, meta: BlockMeta) -> None:
        self.by_key[meta.key] = block_id
        self.meta[block_id] = meta
        self.pool.cached[block_id] = True

    def _evict(self, block_id: int) -> None:
        meta = self.meta.pop(block_id)
        del self.by_key[meta.key]
        self.pool.cached[block_id] = False
        self.counters["prefix_cache_evictions"] += 1

    def on_tokens_computed(self, request: Request) -> None:
        rid = request.request_id
        queried, hit = self.pending_stats.pop(rid, (0, 0))
        self.counters["prefix_cache_queries"] += queried
        self.counters["prefix_cache_hits"] += hit
        full = request.num_computed_tokens // self.block_size
        start = self.num_registered.get(rid, 0)
        if full <= start:
            return
        table = self.tables[rid]
        for i, meta in self._metas(request, full, start):
            if meta.key not in self.by_key:
                self._register(table[i], meta)
        self.num_registered[rid] = full

    def free(self, request: Request) -> None:
        super().free(request)                  # releases tail first
        rid = request.request_id
        self.req_keys.pop(rid, None)
        self.num_registered.pop(rid, None)
        self.pending_stats.pop(rid, None)

    def stats(self) -> dict[str, float]:
        return {**self.counters, "prefix_cache_blocks": len(self.meta),
                "prefix_cache_idle_blocks": len(self.pool.evictable)}    # cached and free (reusable)


@hookimpl
def fdx_register_kv_caches(register):
    register("prefix", PrefixKVCache)
