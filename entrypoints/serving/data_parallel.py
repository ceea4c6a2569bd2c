"""Data parallel serving (``--data-parallel-size N``, ``parallel.data_parallel_size``).

    API process                                         N engine processes
    Server --> DataParallelClient --> EngineClient[0] --> engine_proc (rank 0: its KV cache, its TP group)
                                  --> EngineClient[1] --> engine_proc (rank 1)
                                  ...

One API server tokenizes, detokenizes and streams for every rank; each rank is
an ordinary engine process (entrypoints/serving/engine_proc.py, started by its own
``EngineClient``), so everything a single engine does (heartbeats, hang
detection, TP workers, LoRA) each rank does the same way. The
``DataParallelClient`` keeps the ``EngineClient`` interface as the server
uses it, so the server, the UI's stats and a request scheduler plugin wrap
it as they wrap one client.

Routing (``route``): a request goes to the rank that last served the
longest run of its prompt's full KV blocks (a chained hash per block, as a
prefix cache keys them; the adapter name is part of the hash), when that
rank is no busier than the least loaded one plus ``affinity_slack``
sequences; otherwise to the least loaded rank (sequences in flight there),
ties taken in turn. Every block of the prompt is then remembered as that
rank's (an LRU of ``MAX_ROUTES`` entries), so requests sharing a long
prefix meet in one rank's prefix cache.

Threads: ``backend.num_threads`` (default: the cores this process may use)
is the machine's budget; each rank gets an equal share (at least one), and
a rank's TP workers split its share again (plugins/backends/tp.py).

A rank that dies (killed, crashed, hung past the heartbeat timeout) fails
its own requests in flight only: their streams get an error event and a
non-streamed request a 503 (a server fault, as vLLM answers an engine's
death with a 5xx; the body is OpenAI's error shape, type
``service_unavailable``). The other ranks keep serving, and the rank is
started again (its LoRA adapters loaded again); only when no rank is left
(a restart failed) does the server stop, as it does when its one engine dies.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from fdx.core.config import ConfigError, FdxConfig
from fdx.core.messages import EngineHeartbeat, EngineReady, EngineRejected, EngineStats, SeqDelta
from fdx.core.procs import death_message
from fdx.entrypoints.serving.engine_client import EngineClient, EngineDeadError

log = logging.getLogger("fdx.data_parallel")

MAX_ROUTES = 1 << 16          # prompt-block hashes remembered (rank that served each), least recent dropped


def rank_config(config: FdxConfig, rank: int) -> FdxConfig:
    """The config of rank ``rank``'s engine process: one engine
    (``data_parallel_size`` 1) with its share of the threads and of the
    host's KV memory (``cache.kv_cache_memory_bytes`` and
    ``cache.memory_fraction`` are the host's; ``cache.num_kv_blocks`` is
    each rank's)."""
    from fdx.core.host import available_cores
    size = config.parallel.data_parallel_size
    data = config.model_dump()
    data["parallel"]["data_parallel_size"] = 1
    total = config.backend.num_threads or available_cores()
    data["backend"]["num_threads"] = max(1, total // size)
    cache = data["cache"]
    if cache["kv_cache_memory_bytes"] is not None:
        cache["kv_cache_memory_bytes"] = max(1, cache["kv_cache_memory_bytes"] // size)
    cache["memory_fraction"] = cache["memory_fraction"] / size
    return FdxConfig.model_validate(data)


def check_config(config: FdxConfig) -> None:
    """What data parallel runs with; a ConfigError naming the key otherwise."""
    size = config.parallel.data_parallel_size
    if config.cache.kv_connector is not None:
        raise ConfigError(f"config key 'parallel.data_parallel_size' ({size}): data parallel runs without a KV "
                          f"connector (cache.kv_connector is {config.cache.kv_connector!r}): each rank would "
                          "bind the same connector; run one server per replica instead")


def block_hashes(token_ids: list[int], block_size: int, salt: str | None) -> list[int]:
    """A chained hash per full block of ``token_ids``: entry i names the
    prompt's first i+1 blocks (and the adapter ``salt``)."""
    out, h = [], hash(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start:start + block_size])))
        out.append(h)
    return out


@dataclass(eq=False)
class Rank:
    index: int
    config: FdxConfig
    client: EngineClient | None = None
    up: bool = False
    restarting: asyncio.Task | None = None
    gone: bool = False                        # a restart failed: the rank stays down
    stats: EngineStats | None = None          # its last step's
    in_flight: set = field(default_factory=set)   # engine request ids routed here, not finished
    routed: int = 0                           # requests sent here, since the server started
    affinity: int = 0                         # of those, sent here for their prompt prefix
    failed: int = 0                           # requests in flight when it died
    restarts: int = 0


class DataParallelClient:
    """N ``EngineClient``s behind the one interface the server drives (see
    the module docstring). ``on_stats`` receives the ranks' stats summed
    (a rank's step at a time); ``on_death`` is called once no rank is left."""

    def __init__(self, config: FdxConfig, on_stats: Callable[[EngineStats], None] | None = None,
                 on_death: Callable[[int], None] | None = None):
        check_config(config)
        self.config = config
        self.size = config.parallel.data_parallel_size
        self.on_stats = on_stats
        self.on_death = on_death
        self.block_size = config.cache.block_size
        self.affinity_slack = max(1, config.scheduler.max_num_seqs // 4)
        self.ranks = [Rank(r, rank_config(config, r)) for r in range(self.size)]
        self.routes: OrderedDict[int, int] = OrderedDict()    # block hash -> rank index
        self.owner: dict[str, Rank] = {}
        self.loras: dict[str, str] = dict(config.lora.lora_modules)   # adapters every rank holds
        self.ready: EngineReady | None = None
        self.stopping = False
        self._next = 0                            # where the least-loaded search starts (turns on ties)

    # -- the EngineClient interface -------------------------------------------------------
    def _client(self, rank: Rank) -> EngineClient:
        return EngineClient(rank.config, on_stats=lambda s, rank=rank: self._stats(rank, s),
                            on_death=lambda code, rank=rank: self._death(rank, code))

    async def start(self) -> EngineReady:
        for rank in self.ranks:
            rank.client = self._client(rank)
        starts = [asyncio.ensure_future(rank.client.start()) for rank in self.ranks]
        try:
            readies = await asyncio.gather(*starts)
        except BaseException:
            for s in starts:
                s.cancel()
            await asyncio.gather(*(rank.client.shutdown() for rank in self.ranks), return_exceptions=True)
            raise
        for rank in self.ranks:
            rank.up = True
        first = readies[0]
        self.ready = msgspec.structs.replace(first, num_blocks=sum(r.num_blocks for r in readies),
                                             resident_bytes=sum(r.resident_bytes for r in readies))
        log.info("data parallel: %d ranks, %s threads each, engine pids %s", self.size,
                 self.ranks[0].config.backend.num_threads, ", ".join(str(p) for p in self.pids))
        return self.ready

    @property
    def dead(self) -> bool:
        return not any(r.up for r in self.ranks)

    @property
    def hung(self) -> bool:
        return all(r.client is not None and r.client.hung for r in self.ranks)

    @property
    def pid(self) -> int | None:
        return self.ranks[0].client.pid if self.ranks[0].client else None

    @property
    def pids(self) -> list[int | None]:
        return [r.client.pid if r.client else None for r in self.ranks]

    @property
    def long_step_s(self) -> float | None:
        """A long step that holds every stream: one on every live rank (a
        rank in a long step holds its own streams only; the others serve)."""
        steps = [r.client.long_step_s for r in self.ranks if r.up]
        if not steps or any(s is None for s in steps):
            return None
        return min(steps)

    @property
    def num_long_steps(self) -> int:
        return sum(r.client.num_long_steps for r in self.ranks if r.client)

    @property
    def last_beat(self) -> EngineHeartbeat | None:
        beats = [r.client.last_beat for r in self.ranks if r.up and r.client.last_beat is not None]
        if not beats:
            return None
        return EngineHeartbeat(False, min(b.loop_idle_s for b in beats), sum(b.resident_bytes for b in beats),
                               max(b.step_s for b in beats))

    def route(self, prompt_token_ids: list[int], lora: str | None = None) -> tuple[Rank, bool]:
        """The rank for a prompt, and whether its prefix chose it."""
        live = [r for r in self.ranks if r.up and not r.client.dead]
        if not live:
            raise EngineDeadError("no data-parallel rank is running (a rank that died is being restarted)")
        least = min(len(r.in_flight) for r in live)
        hashes = block_hashes(prompt_token_ids, self.block_size, lora)
        chosen, by_prefix = None, False
        for h in reversed(hashes):                # the longest prefix a rank served
            idx = self.routes.get(h)
            if idx is not None:
                rank = self.ranks[idx]
                if rank in live and len(rank.in_flight) <= least + self.affinity_slack:
                    chosen, by_prefix = rank, True
                break
        if chosen is None:                        # the least loaded, ties in turn
            order = self.ranks[self._next:] + self.ranks[:self._next]
            chosen = min((r for r in order if r in live), key=lambda r: len(r.in_flight))
            self._next = (chosen.index + 1) % self.size
        for h in hashes:
            self.routes[h] = chosen.index
            self.routes.move_to_end(h)
        while len(self.routes) > MAX_ROUTES:
            self.routes.popitem(last=False)
        return chosen, by_prefix

    def add(self, request_id: str, prompt_token_ids: list[int], params, callback: Callable[[Any], None],
            trace: dict[str, str] | None = None, lora: str | None = None) -> None:
        if self.stopping:
            raise EngineDeadError("the engine is not running")
        rank, by_prefix = self.route(prompt_token_ids, lora)

        def on_msg(msg, rank=rank):
            if isinstance(msg, EngineDeadError):
                rank.failed += 1                  # its rank died with it in flight
            if (isinstance(msg, (EngineRejected, BaseException))
                    or (isinstance(msg, SeqDelta) and msg.finish_reason is not None)):
                self._forget(request_id)
            callback(msg)
        extra = {} if lora is None else {"lora": lora}
        rank.client.add(request_id, prompt_token_ids, params, on_msg, trace=trace, **extra)
        rank.in_flight.add(request_id)
        self.owner[request_id] = rank
        rank.routed += 1
        rank.affinity += by_prefix

    def _forget(self, request_id: str) -> Rank | None:
        rank = self.owner.pop(request_id, None)
        if rank is not None:
            rank.in_flight.discard(request_id)
        return rank

    def abort(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self._forget(rid)
            if rank is not None:
                by_rank.setdefault(rank.index, []).append(rid)
        for idx, ids in by_rank.items():
            self.ranks[idx].client.abort(ids)

    def finished(self, request_id: str) -> None:
        rank = self._forget(request_id)
        if rank is not None:
            rank.client.finished(request_id)

    async def lora(self, name: str, path: str | None) -> EngineRejected | None:
        """Load or unload an adapter on every live rank (a rank restarted
        later loads the same set); a refusal undoes the ranks done so far."""
        done = []
        for rank in [r for r in self.ranks if r.up]:
            refused = await rank.client.lora(name, path)
            if refused is not None:
                if path is not None:
                    for r in done:
                        if r.up:
                            await r.client.lora(name, None)
                return refused
            done.append(rank)
        if path is None:
            self.loras.pop(name, None)
        else:
            self.loras[name] = path
        return None

    # -- stats and deaths ---------------------------------------------------------------------
    def _stats(self, rank: Rank, stats: EngineStats) -> None:
        rank.stats = stats
        if self.on_stats is None:
            return
        seen = [r.stats for r in self.ranks if r.up and r.stats is not None]
        cache: dict[str, float] = {}
        for s in seen:
            for k, v in s.cache_stats.items():
                cache[k] = cache.get(k, 0.0) + v
        free, total = sum(s.num_free_blocks for s in seen), sum(s.num_blocks for s in seen)
        self.on_stats(EngineStats(
            sum(s.num_running for s in seen), sum(s.num_waiting for s in seen),
            1.0 - free / total if total else 0.0, free, total, cache, stats.num_preempted,
            num_computed_tokens=sum(s.num_computed_tokens for s in seen),
            num_recomputed_tokens=sum(s.num_recomputed_tokens for s in seen),
            step_time_s=stats.step_time_s, num_prefill_tokens=stats.num_prefill_tokens,
            num_decode_tokens=stats.num_decode_tokens))

    def _death(self, rank: Rank, code: int) -> None:
        """Rank ``rank``'s process died (its client failed its requests in flight)."""
        rank.up = False
        rank.stats = None
        for rid in list(rank.in_flight):          # its client failed them already
            self.owner.pop(rid, None)
        rank.in_flight.clear()
        if self.stopping:
            return
        log.error("%s; its requests in flight failed; restarting it",
                  death_message(f"data-parallel rank {rank.index}", code))
        rank.restarting = asyncio.get_running_loop().create_task(self._restart(rank, code))

    async def _restart(self, rank: Rank, code: int) -> None:
        old = rank.client
        await old.shutdown()                      # its sockets' folder; the process is gone already
        client = self._client(rank)
        try:
            await client.start()
            modules = self.config.lora.lora_modules       # loaded by the engine from its config
            for name in modules:
                if name not in self.loras:
                    await client.lora(name, None)
            for name, path in self.loras.items():
                if name not in modules:
                    refused = await client.lora(name, path)
                    if refused is not None:
                        log.error("rank %d: LoRA adapter %s: %s", rank.index, name, refused.message)
        except asyncio.CancelledError:
            await client.shutdown()
            raise
        except Exception as e:
            await client.shutdown()
            rank.gone = True
            log.error("data-parallel rank %d could not be restarted: %s", rank.index, e)
            if self.dead and not any(r.restarting and not r.restarting.done() and r is not rank
                                     for r in self.ranks) and self.on_death:
                self.on_death(code)
            return
        finally:
            rank.restarting = None
        if self.stopping:
            await client.shutdown()
            return
        rank.client, rank.up = client, True
        rank.restarts += 1
        log.warning("data-parallel rank %d restarted (engine pid %s)", rank.index, client.pid)

    def describe(self) -> list[dict]:
        """Each rank now: what /load shows and the metrics export."""
        out = []
        for r in self.ranks:
            s = r.stats
            out.append({"rank": r.index, "up": r.up, "pid": r.client.pid if r.client else None,
                        "in_flight": len(r.in_flight), "routed": r.routed, "routed_by_prefix": r.affinity,
                        "failed": r.failed, "restarts": r.restarts,
                        "num_running": s.num_running if s else 0, "num_waiting": s.num_waiting if s else 0,
                        "kv_free_blocks": s.num_free_blocks if s else None,
                        "kv_total_blocks": s.num_blocks if s else None,
                        "prefix_cache_hits": s.cache_stats.get("prefix_cache_hits") if s else None})
        return out

    # -- stopping ---------------------------------------------------------------------------
    def stop(self) -> None:
        self.stopping = True
        for r in self.ranks:
            if r.client is not None:
                r.client.stop()

    async def shutdown(self, timeout: float = 5.0) -> None:
        self.stopping = True
        for r in self.ranks:
            if r.restarting is not None:
                r.restarting.cancel()
        await asyncio.gather(*(r.restarting for r in self.ranks if r.restarting), return_exceptions=True)
        await asyncio.gather(*(r.client.shutdown(timeout) for r in self.ranks if r.client), return_exceptions=True)


class DataParallelCollector:
    """Per-rank series of /metrics, labelled ``dp_rank`` (the server's own
    series sum the ranks)."""

    GAUGES = {"up": "1 while the rank's engine process runs.",
              "requests_in_flight": "Sequences routed to the rank and not finished.",
              "requests_running": "Sequences running in the rank's engine.",
              "requests_waiting": "Sequences waiting in the rank's engine.",
              "kv_cache_free_blocks": "The rank's free KV-cache blocks.",
              "kv_cache_total_blocks": "The rank's KV-cache blocks.",
              "prefix_cache_hits": "Prompt tokens the rank's prefix cache served, since the rank started."}
    COUNTERS = {"requests_routed": "Sequences routed to the rank.",
                "requests_routed_by_prefix": "Sequences routed to the rank because it served their prompt prefix.",
                "requests_failed": "Sequences in flight on the rank when its engine process died.",
                "restarts": "Times the rank's engine process was started again after dying."}

    def __init__(self, labels: dict, dp: DataParallelClient):
        self.labels, self.dp = labels, dp

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        names = [*self.labels, "dp_rank"]
        ranks = self.dp.describe()
        values = {"up": lambda r: float(r["up"]), "requests_in_flight": lambda r: r["in_flight"],
                  "requests_running": lambda r: r["num_running"], "requests_waiting": lambda r: r["num_waiting"],
                  "kv_cache_free_blocks": lambda r: r["kv_free_blocks"] or 0,
                  "kv_cache_total_blocks": lambda r: r["kv_total_blocks"] or 0,
                  "prefix_cache_hits": lambda r: r["prefix_cache_hits"] or 0,
                  "requests_routed": lambda r: r["routed"], "requests_routed_by_prefix": lambda r: r["routed_by_prefix"],
                  "requests_failed": lambda r: r["failed"], "restarts": lambda r: r["restarts"]}
        for kind, table in ((GaugeMetricFamily, self.GAUGES), (CounterMetricFamily, self.COUNTERS)):
            for key, doc in table.items():
                m = kind(f"fdx:dp_rank_{key}", doc, labels=names)
                for r in ranks:
                    m.add_metric([*self.labels.values(), str(r["rank"])], float(values[key](r)))
                yield m
