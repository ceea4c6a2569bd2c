"""The web page of ``fdx serve`` and the engine stats it reads.

    GET /                   the page: a chat playground and a live view of the engine
    GET /ui/<file>          its script and style sheet (static, public: they hold no data)
    GET /v1/engine/stats    JSON: the engine now and per second over the last minutes

The page needs no build step and loads nothing from elsewhere; it chats
through the server's own /v1/chat/completions (streamed) and polls
/v1/engine/stats, both with the API key typed into the page when the
server has one. ``server.ui: false`` turns all three off.
"""
from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

STATIC = Path(__file__).parent / "static"
HISTORY_S = 300                                 # seconds of per-second history kept


class EngineView:
    """The engine's per-step stats, folded into one bucket per second."""

    def __init__(self, history_s: int = HISTORY_S):
        self.buckets: deque[dict[str, Any]] = deque(maxlen=history_s)
        self.last = None                        # the latest EngineStats
        self.steps = 0
        self.preemptions = 0

    def observe(self, stats, now: float | None = None) -> None:
        self.last = stats
        if not stats.step_time_s:               # aborts only: no step ran
            return
        self.steps += 1
        self.preemptions += stats.num_preempted
        second = int(now if now is not None else time.time())
        if not self.buckets or self.buckets[-1]["t"] != second:
            self.buckets.append({"t": second, "steps": 0, "step_time_ms_sum": 0.0, "step_time_ms_max": 0.0,
                                 "prefill_tokens": 0, "decode_tokens": 0, "running_max": 0, "waiting_max": 0})
        b = self.buckets[-1]
        ms = 1e3 * stats.step_time_s
        b["steps"] += 1
        b["step_time_ms_sum"] += ms
        b["step_time_ms_max"] = max(b["step_time_ms_max"], ms)
        b["prefill_tokens"] += stats.num_prefill_tokens
        b["decode_tokens"] += stats.num_decode_tokens
        b["running_max"] = max(b["running_max"], stats.num_running)
        b["waiting_max"] = max(b["waiting_max"], stats.num_waiting)

    def snapshot(self, server, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        s = self.last
        ready = server.engine.ready
        total = int(s.num_blocks) if s else (int(ready.num_blocks) if ready else 0)
        free = int(s.num_free_blocks) if s else total
        cs = dict(s.cache_stats) if s else {}
        cached = int(cs.get("prefix_cache_idle_blocks", 0))
        queries, hits = cs.get("prefix_cache_queries"), cs.get("prefix_cache_hits")
        recent = [b for b in self.buckets if b["t"] >= int(now) - 10]
        span = max(1, min(10, int(now) - recent[0]["t"] + 1)) if recent else 1
        history = [{"t": b["t"], "steps": b["steps"],
                    "step_time_ms": b["step_time_ms_sum"] / b["steps"], "step_time_ms_max": b["step_time_ms_max"],
                    "prefill_tokens": b["prefill_tokens"], "decode_tokens": b["decode_tokens"],
                    "running": b["running_max"], "waiting": b["waiting_max"]}
                   for b in self.buckets if b["t"] >= int(now) - HISTORY_S]
        return {
            "model": server.model_name,
            "max_model_len": server.max_model_len,
            "kernels": ready.kernels if ready else "",
            "weights": {"bytes": sum(ready.weight_bytes.values()) if ready else 0,   # held, by kind
                        "by_kind": dict(ready.weight_bytes) if ready else {},
                        "engine_resident_bytes_at_ready": ready.resident_bytes if ready else 0},
            "time": now,
            "num_running": int(s.num_running) if s else 0,
            "num_waiting": int(s.num_waiting) if s else 0,
            "kv": {"total": total, "used": total - free, "cached": min(cached, free), "free": free - min(cached, free),
                   "block_size": ready.block_size if ready else 0},
            "prefix_cache": None if queries is None else {
                "queries": queries, "hits": hits, "hit_rate": (hits / queries) if queries else 0.0},
            "steps": self.steps,
            "preemptions": self.preemptions,
            "tokens_per_s": {  # over the last 10 seconds
                "prefill": sum(b["prefill_tokens"] for b in recent) / span,
                "decode": sum(b["decode_tokens"] for b in recent) / span},
            "history_s": HISTORY_S,
            "history": history,
        }


def install(app, server) -> None:
    """Add the page and the stats endpoint to the app (unless server.ui is false)."""
    if not server.sc.ui:
        return
    from fastapi.responses import FileResponse, JSONResponse
    from fastapi.staticfiles import StaticFiles

    view = EngineView()
    feed = server.engine.on_stats

    def on_stats(stats) -> None:
        if feed is not None:
            feed(stats)
        view.observe(stats)
    server.engine.on_stats = on_stats
    server.engine_view = view

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/engine/stats")
    async def engine_stats():
        return JSONResponse(view.snapshot(server), headers={"Cache-Control": "no-store"})

    app.mount("/ui", StaticFiles(directory=STATIC), name="ui")
