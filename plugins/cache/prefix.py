"""Prefix caching (``kv_cache: prefix``): requests that share a prefix share
its KV blocks.

- Every full block of a request is keyed by a chained hash of (its
  parent's key, its token ids, extra keys: the request's ``cache_salt``),
  so a key names the whole prefix up to that block. Blocks are registered
  once computed (``on_tokens_computed``); partial blocks never are.
- ``get_computed_blocks`` walks a new request's keys, and a block is a hit
  only when its stored parent, tokens and salt equal the request's (a hash
  collision is a miss). Hit blocks are shared: their reference count is
  the number of requests holding them. A request whose whole prompt is
  cached still computes its last block, so the model sees its last token.
- A cached block no request holds stays in the pool as evictable, least
  recently used first; allocation takes never-cached free blocks first,
  then evicts. A request's blocks are released tail first, so a prefix's
  head outlives its tail.
- Second tier (``cache.swap_max_blocks``, ``cache.swap_dir``): an evicted
  block is copied to host memory or, with ``swap_dir``, to a file (see
  swap.py); a later hit there is copied back into a fresh block instead of
  recomputed. ``close()`` writes the blocks still in the pool to the file
  tier, so they survive a restart; it runs at exit and when the cache is
  collected (a killed process keeps only what was evicted before).
- ``stats()``: ``prefix_cache_queries`` and ``prefix_cache_hits`` (tokens of
  admitted requests, and of those the ones served from cache), tier-2 hits,
  evictions, cached blocks.
"""
from __future__ import annotations

import atexit
import logging
import weakref
from collections import OrderedDict

import numpy as np

from fdx.core.hookspecs import hookimpl
from fdx.core.request import Request
from fdx.plugins.cache.paged import BlockPool, PagedKVCache
from fdx.plugins.cache.swap import (ROOT_KEY, BlockMeta, FileTier, HostTier, MemoryTier, block_key,
                                    model_fingerprint)

log = logging.getLogger("fdx.cache.prefix")

DEFAULT_SWAP_BLOCKS = 1024      # tier-2 size when swap_dir is set and swap_max_blocks is not


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
            self.free_ids.append(block_id)


class PrefixKVCache(PagedKVCache):
    def __init__(self, num_blocks: int, block_size: int, config=None):
        super().__init__(num_blocks, block_size, config)
        self.pool = CachingBlockPool(num_blocks, self._evict)
        self.by_key: dict[bytes, int] = {}        # key -> block, for cached blocks
        self.meta: dict[int, BlockMeta] = {}      # block -> what it holds
        self.req_keys: dict[str, list[bytes]] = {}   # request -> keys of its full blocks so far
        self.num_registered: dict[str, int] = {}  # request -> leading table blocks already cached
        self.pending_stats: dict[str, tuple[int, int]] = {}  # request -> (queried, hit) until it runs
        self.tier2: HostTier | None = None
        self.kv_caches: list | None = None
        self.counters = {"prefix_cache_queries": 0, "prefix_cache_hits": 0,
                         "prefix_cache_tier2_hits": 0, "prefix_cache_evictions": 0}

    # -- tier 2 set-up ----------------------------------------------------------
    def attach_kv_tensors(self, kv_caches: list, num_kv_heads: int, model_id: str = "") -> None:
        self.kv_caches = kv_caches
        self.num_kv_heads = num_kv_heads
        rows, self.head_dim = kv_caches[0][0].shape
        self.num_slots = rows // num_kv_heads
        cc = self.config.cache if self.config is not None else None
        if cc is None:
            return
        size = cc.swap_max_blocks
        if size is None:
            size = DEFAULT_SWAP_BLOCKS if cc.swap_dir else 0
        if size == 0:
            return
        if cc.swap_dir:
            fingerprint = {**model_fingerprint(model_id), "num_layers": len(kv_caches),
                           "num_kv_heads": num_kv_heads, "head_dim": int(self.head_dim),
                           "block_size": self.block_size, "dtype": "float32",
                           "layout": "head-major rows h*num_slots+slot"}
            self.tier2 = FileTier(cc.swap_dir, size, fingerprint)
            ref = weakref.ref(self)
            atexit.register(lambda: (c := ref()) is not None and c.close())
        else:
            self.tier2 = MemoryTier(size)

    def _rows(self, block_id: int):
        import paddle
        base = block_id * self.block_size
        idx = [h * self.num_slots + base + o for h in range(self.num_kv_heads) for o in range(self.block_size)]
        return paddle.to_tensor(np.asarray(idx, dtype=np.int64))

    def read_block(self, block_id: int) -> np.ndarray:
        """The block's KV: [num_layers, 2, num_kv_heads, block_size, head_dim]."""
        import paddle
        idx = self._rows(block_id)
        parts = [paddle.gather(t, idx) for kv in self.kv_caches for t in kv]
        shape = [len(self.kv_caches), 2, self.num_kv_heads, self.block_size, self.head_dim]
        return paddle.stack(parts).numpy().reshape(shape)

    def write_block(self, block_id: int, data: np.ndarray) -> None:
        import paddle
        idx = self._rows(block_id)
        flat = data.reshape(len(self.kv_caches), 2, self.num_kv_heads * self.block_size, self.head_dim)
        for layer, kv in enumerate(self.kv_caches):
            for j, t in enumerate(kv):
                t.scatter_(idx, paddle.to_tensor(np.ascontiguousarray(flat[layer, j])), overwrite=True)

    def flush(self) -> int:
        """Write the blocks still in the pool to the file tier (oldest
        first), so that they outlive this engine; returns how many were
        written."""
        if not isinstance(self.tier2, FileTier) or self.kv_caches is None:
            return 0
        order = list(self.pool.evictable) + [b for b in self.meta if b not in self.pool.evictable]
        n = 0
        for b in order:
            meta = self.meta[b]
            if meta.key not in self.tier2:
                self.tier2.put(meta, self.read_block(b))
                n += 1
        return n

    def close(self) -> None:
        """Flush, then let go of the KV tensors: blocks are no longer read
        from them (the engine may reuse them). Runs at exit and when the
        cache is collected."""
        if self.kv_caches is None:
            return
        try:
            self.flush()
        finally:
            self.kv_caches = None

    def __del__(self):
        try:
            self.close()
        except Exception as e:      # best effort: never raise from a finalizer
            log.warning("prefix cache: flush at shutdown failed: %s", e)

    # -- keys ---------------------------------------------------------------------
    @staticmethod
    def extra_keys(request: Request) -> tuple[str, ...]:
        return () if request.cache_salt is None else ("salt:" + request.cache_salt,)

    def _keys(self, request: Request, num_blocks: int) -> list[bytes]:
        keys = self.req_keys.setdefault(request.request_id, [])
        if len(keys) < num_blocks:
            tokens, bs, extra = request.all_token_ids, self.block_size, self.extra_keys(request)
            for i in range(len(keys), num_blocks):
                keys.append(block_key(keys[i - 1] if i else ROOT_KEY, tokens[i * bs:(i + 1) * bs], extra))
        return keys[:num_blocks]

    def _metas(self, request: Request, stop: int, start: int = 0):
        """BlockMeta of the request's full blocks start..stop-1."""
        keys, tokens, bs = self._keys(request, stop), request.all_token_ids, self.block_size
        extra = self.extra_keys(request)
        for i in range(start, stop):
            yield i, BlockMeta(keys[i], keys[i - 1] if i else ROOT_KEY, tuple(tokens[i * bs:(i + 1) * bs]), extra)

    def _max_hit_blocks(self, request: Request) -> int:
        return (request.num_tokens - 1) // self.block_size     # the last token is always computed

    # -- the KVCacheManager contract ----------------------------------------------
    def get_computed_blocks(self, request: Request) -> int:
        rid = request.request_id
        assert not self.tables.get(rid), f"{rid} already holds blocks"
        table: list[int] = []
        for _, meta in self._metas(request, self._max_hit_blocks(request)):
            b = self.by_key.get(meta.key)
            if b is not None:
                if self.meta[b] != meta:
                    break                          # a hash collision: not this prefix
                self.pool.ref(b)
                table.append(b)
                continue
            b = self._load_from_tier2(meta)
            if b is None:
                break
            table.append(b)
        self.tables[rid] = table
        self.num_registered[rid] = len(table)
        self.pending_stats[rid] = (request.num_tokens, len(table) * self.block_size)
        return len(table) * self.block_size

    def _load_from_tier2(self, meta: BlockMeta) -> int | None:
        if (self.tier2 is None or self.kv_caches is None or self.pool.num_free == 0
                or meta.key not in self.tier2):
            return None
        data = self.tier2.get(meta)            # read before allocating: allocation may evict into tier 2
        if data is None:
            return None
        b = self.pool.allocate(1)[0]
        self.write_block(b, data)
        self._register(b, meta)
        self.counters["prefix_cache_tier2_hits"] += 1
        return b

    def _register(self, block_id: int, meta: BlockMeta) -> None:
        self.by_key[meta.key] = block_id
        self.meta[block_id] = meta
        self.pool.cached[block_id] = True

    def _evict(self, block_id: int) -> None:
        meta = self.meta.pop(block_id)
        del self.by_key[meta.key]
        self.pool.cached[block_id] = False
        self.counters["prefix_cache_evictions"] += 1
        if self.tier2 is not None and self.kv_caches is not None:
            self.tier2.put(meta, self.read_block(block_id))

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

    def cached_prefix_len(self, request: Request) -> int:
        n = 0
        for _, meta in self._metas(request, self._max_hit_blocks(request)):
            b = self.by_key.get(meta.key)
            if b is not None and self.meta[b] != meta:
                break
            if b is None and (self.tier2 is None or meta.key not in self.tier2):
                break
            n += self.block_size
        return n

    def stats(self) -> dict[str, float]:
        return {**self.counters, "prefix_cache_blocks": len(self.meta),
                "prefix_cache_idle_blocks": len(self.pool.evictable),    # cached and free (reusable)
                "prefix_cache_tier2_blocks": len(self.tier2) if self.tier2 is not None else 0}


@hookimpl
def fdx_register_kv_caches(register):
    register("prefix", PrefixKVCache)
