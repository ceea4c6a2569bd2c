"""``fdx bench soak``: hold a server under mixed streaming load for M minutes
and report whether it held: requests served, errors (a failed request, or a
finished one whose usage is not exactly what was asked), p50/p99 latency,
resident memory of the API and engine processes at the start and the end
(from fdx's /metrics), and whether the engine was idle with its KV pool
fully free afterwards.

Each request streams a random token-id prompt of 1..max-input-len tokens
with max_tokens 1..max-output-len and ignore_eos, so its usage is known in
advance; a fraction is cancelled (the client hangs up) after the first
text. Figures are reported, never asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

import numpy as np


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out.setdefault(key.split("{", 1)[0], float(value))
        except ValueError:
            continue
    return out


async def _metrics(client, base: str) -> dict[str, float]:
    try:
        r = await client.get(base + "/metrics")
        return parse_metrics(r.text) if r.status_code == 200 else {}
    except Exception:
        return {}


def _idle(m: dict[str, float]) -> bool:
    need = ("fdx:num_requests_running", "fdx:num_requests_waiting", "fdx:kv_cache_free_blocks",
            "fdx:kv_cache_total_blocks")
    return all(k in m for k in need) and m[need[0]] == 0 and m[need[1]] == 0 and m[need[2]] == m[need[3]]


async def _one(client, opts, rng: random.Random, stats: dict) -> None:
    prompt = [rng.randrange(opts.min_token_id, opts.max_token_id) for _ in range(rng.randint(1, opts.max_input_len))]
    max_tokens = rng.randint(1, opts.max_output_len)
    cancel = rng.random() < opts.cancel_fraction
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": opts.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if opts.model:
        body["model"] = opts.model
    t0 = time.perf_counter()
    usage, finish, got_text = None, None, False
    try:
        async with client.stream("POST", opts.base_url.rstrip("/") + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise RuntimeError(f"stream error: {ev['error'].get('message')}")
                usage = ev.get("usage") or usage
                for ch in ev.get("choices") or []:
                    got_text = got_text or bool(ch.get("text"))
                    finish = ch.get("finish_reason") or finish
                if cancel and got_text and finish is None:
                    stats["cancelled"] += 1
                    return                                        # hang up mid-stream
        if finish != "length" or not usage or usage.get("completion_tokens") != max_tokens \
                or usage.get("prompt_tokens") != len(prompt):
            raise RuntimeError(f"wrong result: finish_reason {finish!r}, usage {usage} for a prompt of "
                               f"{len(prompt)} tokens and max_tokens {max_tokens}")
        stats["served"] += 1
        stats["latencies"].append(time.perf_counter() - t0)
        stats["tokens"] += max_tokens
    except Exception as e:  # counted and reported, never fatal
        stats["errors"] += 1
        if len(stats["error_samples"]) < 5:
            stats["error_samples"].append(f"{type(e).__name__}: {e}")


async def run(opts) -> dict:
    import httpx
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    base = opts.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=opts.concurrency + 8, max_keepalive_connections=opts.concurrency)
    stats = {"served": 0, "cancelled": 0, "errors": 0, "tokens": 0, "latencies": [], "error_samples": []}
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(opts.timeout), limits=limits) as client:
        m0 = await _metrics(client, base)
        t0 = time.perf_counter()
        end = t0 + 60.0 * opts.minutes
        rng = random.Random(opts.seed)

        async def worker(i: int) -> None:
            wrng = random.Random(rng.random() + i)
            while time.perf_counter() < end:
                await _one(client, opts, wrng, stats)

        await asyncio.gather(*[worker(i) for i in range(opts.concurrency)])
        duration = time.perf_counter() - t0
        idle_deadline = time.perf_counter() + opts.idle_wait
        m1 = await _metrics(client, base)
        while m1 and not _idle(m1) and time.perf_counter() < idle_deadline:
            await asyncio.sleep(0.5)
            m1 = await _metrics(client, base)
    lat = np.asarray(stats["latencies"] or [0.0]) * 1000.0
    mib = 1.0 / (1 << 20)
    return {
        "base_url": opts.base_url, "minutes": opts.minutes, "concurrency": opts.concurrency,
        "duration_s": duration, "requests": stats["served"] + stats["cancelled"] + stats["errors"],
        "served": stats["served"], "cancelled": stats["cancelled"], "errors": stats["errors"],
        "error_samples": stats["error_samples"], "generated_tokens": stats["tokens"],
        "request_throughput": stats["served"] / duration if duration else 0.0,
        "p50_latency_ms": float(np.percentile(lat, 50)), "p99_latency_ms": float(np.percentile(lat, 99)),
        "api_rss_mib_start": m0.get("fdx:api_resident_memory_bytes", 0.0) * mib or None,
        "api_rss_mib_end": m1.get("fdx:api_resident_memory_bytes", 0.0) * mib or None,
        "engine_rss_mib_start": m0.get("fdx:engine_resident_memory_bytes", 0.0) * mib or None,
        "engine_rss_mib_end": m1.get("fdx:engine_resident_memory_bytes", 0.0) * mib or None,
        "idle_at_end": _idle(m1) if m1 else None,
        "kv_free_blocks_end": m1.get("fdx:kv_cache_free_blocks"),
        "kv_total_blocks": m1.get("fdx:kv_cache_total_blocks"),
    }


def format_report(r: dict) -> str:
    def mem(key):
        v = r[key]
        return "n/a" if v is None else f"{v:.1f} MiB"
    lines = [
        f"{' fdx bench soak ':=^60}",
        f"{'Server:':<40}{r['base_url']}",
        f"{'Duration (s) / concurrency:':<40}{r['duration_s']:.1f} / {r['concurrency']}",
        f"{'Requests sent:':<40}{r['requests']}",
        f"{'Served (exact usage):':<40}{r['served']}",
        f"{'Cancelled mid-stream:':<40}{r['cancelled']}",
        f"{'Errors:':<40}{r['errors']}",
        f"{'Request throughput (req/s):':<40}{r['request_throughput']:.2f}",
        f"{'p50 / p99 latency (ms):':<40}{r['p50_latency_ms']:.1f} / {r['p99_latency_ms']:.1f}",
        f"{'API process RSS start -> end:':<40}{mem('api_rss_mib_start')} -> {mem('api_rss_mib_end')}",
        f"{'Engine process RSS start -> end:':<40}{mem('engine_rss_mib_start')} -> {mem('engine_rss_mib_end')}",
        f"{'Idle, KV pool free at the end:':<40}{r['idle_at_end']} "
        f"({r['kv_free_blocks_end']}/{r['kv_total_blocks']} blocks free)",
        "=" * 60,
    ]
    lines += [f"error: {e}" for e in r["error_samples"]]
    return "\n".join(lines)


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("soak", help="hold a server under mixed streaming load for M minutes; report what held",
                        description="Keeps --concurrency streaming requests of mixed lengths in flight for "
                                    "--minutes, a fraction cancelled mid-stream, and reports requests served, "
                                    "errors, p50/p99 latency and the API and engine resident memory at the "
                                    "start and end (fdx's /metrics). See docs/reliability.md.")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    s.add_argument("--api-key", default=None, help="bearer key (default: $FDX_API_KEY or $OPENAI_API_KEY)")
    s.add_argument("--model", default=None, help="model id to send (default: none, the server's own)")
    s.add_argument("--minutes", type=float, default=10.0)
    s.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    s.add_argument("--cancel-fraction", type=float, default=0.25, help="share of requests cut off mid-stream")
    s.add_argument("--max-input-len", type=int, default=128, help="prompt length: 1 to this many tokens")
    s.add_argument("--max-output-len", type=int, default=64, help="max_tokens: 1 to this")
    s.add_argument("--min-token-id", type=int, default=1000)
    s.add_argument("--max-token-id", type=int, default=10000)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument("--idle-wait", type=float, default=30.0, help="seconds to wait for the server to be idle after")
    s.add_argument("--json", action="store_true", help="print the results as JSON")
    for action in s._actions:                    # every flag's help says its default
        if action.option_strings and action.dest != "help" and "default" not in (action.help or ""):
            action.help = f"{action.help or action.dest.replace('_', ' ')} (default: %(default)s)"
    s.set_defaults(func=cmd_bench_soak)
    return s


def cmd_bench_soak(args) -> int:
    if not args.minutes > 0 or args.concurrency < 1 or args.max_input_len < 1 or args.max_output_len < 1:
        raise ValueError("--minutes must be > 0; --concurrency, --max-input-len and --max-output-len >= 1")
    if not 0.0 <= args.cancel_fraction <= 1.0:
        raise ValueError("--cancel-fraction must be in [0, 1]")
    if not 0 <= args.min_token_id < args.max_token_id:
        raise ValueError("--min-token-id must be >= 0 and below --max-token-id")
    args.api_key = args.api_key or os.environ.get("FDX_API_KEY") or os.environ.get("OPENAI_API_KEY")
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0 if result["served"] and not result["errors"] else 1

