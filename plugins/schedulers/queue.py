"""The waiting queue of the KV schedulers, ordered by ``scheduler.policy``.

- ``fcfs`` (default): arrival order.
- ``priority``: ``Request.priority``, lower value first; ties by arrival.
- ``lpm``: longest prefix match first: the request with the most prompt
  tokens already in the prefix cache goes first (SGLang found this raises
  hit rates when prompts share prefixes); ties by arrival. When more than
  ``LPM_MAX_QUEUE`` requests wait, the lookups cost more than they buy and
  the order falls back to fcfs.

Every policy keeps v1's rule for preemption: ``appendleft`` puts a request
back at the head of its class (for fcfs the head of the queue; for
priority, ahead of the waiting requests of the same priority; for lpm,
ahead of those with the same match length), the last one put back first.

The queue reads like a deque (``append``, ``appendleft``, ``popleft``,
``[0]``, ``remove``, ``clear``, ``extend``, iteration), so plugins written
against v1's former ``deque`` keep working.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Callable, Iterable, Iterator

from fdx.core.config import ConfigError
from fdx.core.request import Request

LPM_MAX_QUEUE = 128


class WaitingQueue:
    """Requests sorted by ``(class key, sequence number)``; the sequence
    number grows with each ``append`` and falls with each ``appendleft``."""

    policy = "fcfs"

    def __init__(self) -> None:
        self._entries: list[tuple[tuple, Request]] = []   # sorted by key
        self._keys: dict[str, tuple] = {}                  # request_id -> its key
        self._seq = itertools.count(1)

    def class_key(self, request: Request) -> tuple:
        """The leading part of the sort key; fcfs has none."""
        return ()

    def reorder(self) -> None:
        """Called once at the start of each ``schedule()``; policies whose
        keys change over time (lpm) re-sort here."""

    # -- deque-like API -----------------------------------------------------
    def append(self, request: Request) -> None:
        self._insert(request, next(self._seq))

    def appendleft(self, request: Request) -> None:
        self._insert(request, -next(self._seq))

    def extend(self, requests: Iterable[Request]) -> None:
        for r in requests:
            self.append(r)

    def popleft(self) -> Request:
        key, req = self._entries.pop(0)
        del self._keys[req.request_id]
        return req

    def remove(self, request: Request) -> None:
        key = self._keys.pop(request.request_id)
        i = bisect.bisect_left(self._entries, key, key=lambda e: e[0])
        assert self._entries[i][1] is request
        del self._entries[i]

    def clear(self) -> None:
        self._entries.clear()
        self._keys.clear()

    def __getitem__(self, i: int) -> Request:
        return self._entries[i][1]

    def __iter__(self) -> Iterator[Request]:
        return iter([r for _, r in self._entries])

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._keys

    # -- internals ------------------------------------------------------------
    def _insert(self, request: Request, seq: int) -> None:
        if request.request_id in self._keys:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        key = (*self.class_key(request), seq)
        self._keys[request.request_id] = key
        bisect.insort(self._entries, (key, request), key=lambda e: e[0])


class PriorityQueue(WaitingQueue):
    policy = "priority"

    def class_key(self, request: Request) -> tuple:
        return (request.priority,)


class LongestPrefixMatchQueue(WaitingQueue):
    policy = "lpm"

    def __init__(self, cached_prefix_len: Callable[[Request], int]):
        super().__init__()
        self.cached_prefix_len = cached_prefix_len

    def class_key(self, request: Request) -> tuple:
        return (0,)       # set by reorder()

    def reorder(self) -> None:
        if len(self._entries) > LPM_MAX_QUEUE:
            match = lambda r: 0        # fcfs: only the sequence numbers count
        else:
            match = lambda r: -self.cached_prefix_len(r)
        entries = [((match(r), key[-1]), r) for key, r in self._entries]
        entries.sort(key=lambda e: e[0])
        self._entries = entries
        self._keys = {r.request_id: key for key, r in entries}


POLICIES = ("fcfs", "priority", "lpm")


def make_waiting_queue(policy: str, kv_cache) -> WaitingQueue:
    """The queue for ``scheduler.policy``; ``kv_cache`` answers lpm's lookups."""
    if policy == "fcfs":
        return WaitingQueue()
    if policy == "priority":
        return PriorityQueue()
    if policy == "lpm":
        return LongestPrefixMatchQueue(kv_cache.cached_prefix_len)
    raise ConfigError(f"config key 'scheduler.policy': unknown policy {policy!r}; "
                      f"known: {', '.join(POLICIES)}")


def unservable_reason(request: Request, kv_cache, max_model_len: int) -> str | None:
    """Why a request can never run, or None. A request needs, at worst,
    blocks for its prompt plus its output tokens; a pool smaller than that
    would leave it waiting (or preempting itself) forever."""
    total = min(request.num_prompt_tokens + max(request.max_tokens, 0), max_model_len)
    need = -(-total // kv_cache.block_size)
    if need > kv_cache.num_blocks:
        return (f"needs {need} KV blocks for {total} tokens, but the pool has "
                f"{kv_cache.num_blocks} blocks of {kv_cache.block_size} tokens")
    return None
