"""``fdx bench serve``: drive any OpenAI-compatible server with streaming
requests and report what vLLM's serving benchmark reports.

It speaks only the OpenAI HTTP API (SSE streaming, ``stream_options.
include_usage``), so the same run works against fdx, vLLM or llama.cpp's
llama-server. Figures are reported, never asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

# plain words that most BPE vocabularies hold as one token each (with a leading space)
_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which "
          "but have an they you were her she there one all we their been has when who will more no if "
          "out so said what up its about into than them can only other new some could time these two "
          "may then do first any my now such like our over man me even most made after also did many "
          "before must through back years where much your way well down should because each just those "
          "people how too little state good very make world still own see men work long get here between "
          "both life being under never day same another know while last might us great old year off come "
          "since against go came right used take three").split()


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0                 # from the server's usage when it reports it, else the estimate
    output_len: int = 0                 # likewise (else the number of content chunks)
    ttft: float = 0.0                   # seconds to the first content
    itl: list[float] = field(default_factory=list)   # gaps between content chunks
    latency: float = 0.0                # seconds, whole request
    start: float = 0.0                  # seconds since the benchmark began
    error: str = ""


def make_prompts(num: int, input_len: int, seed: int, token_ids: bool, vocab: tuple[int, int]) -> list:
    rng = np.random.default_rng(seed)
    if token_ids:
        return [rng.integers(vocab[0], vocab[1], input_len).tolist() for _ in range(num)]
    # a distinct start per prompt, so a prefix cache cannot serve one from another
    return [f"{i}: " + " ".join(rng.choice(_WORDS, max(1, input_len - 3)).tolist()) for i in range(num)]


def _payload(opts, prompt, max_tokens: int) -> dict:
    body = {"model": opts.model, "max_tokens": max_tokens, "temperature": opts.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.chat:
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = prompt
    return body


async def send_request(client, opts, prompt, max_tokens: int, t0: float) -> RequestResult:
    res = RequestResult(prompt_len=len(prompt) if isinstance(prompt, list) else opts.input_len)
    start = time.perf_counter()
    res.start = start - t0
    last = start
    chunks = 0
    usage = None
    path = "/v1/chat/completions" if opts.chat else "/v1/completions"
    try:
        async with client.stream("POST", opts.base_url.rstrip("/") + path,
                                 json=_payload(opts, prompt, max_tokens)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"].get("message", msg["error"]))
                    return res
                if msg.get("usage"):
                    usage = msg["usage"]
                for choice in msg.get("choices") or []:
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if chunks == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
        res.latency = time.perf_counter() - start
        if usage:
            res.prompt_len = usage.get("prompt_tokens", res.prompt_len)
            res.output_len = usage.get("completion_tokens", chunks)
        else:
            res.output_len = chunks
        res.success = chunks > 0 or res.output_len > 0
        if not res.success:
            res.error = "no content was streamed"
    except Exception as e:  # a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _resolve_model(client, opts) -> str:
    resp = await client.get(opts.base_url.rstrip("/") + "/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def run(opts) -> dict:
    import httpx
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(opts.timeout), limits=limits) as client:
        if not opts.model:
            opts.model = await _resolve_model(client, opts)
        prompts = make_prompts(opts.num_requests, opts.input_len, opts.seed, opts.token_ids,
                               (opts.min_token_id, opts.max_token_id))
        for _ in range(opts.warmup_requests):
            w = await send_request(client, opts, prompts[0], min(4, opts.output_len), time.perf_counter())
            if not w.success:
                raise RuntimeError(f"the warm-up request failed: {w.error}")

        rng = np.random.default_rng(opts.seed + 1)
        sem = asyncio.Semaphore(opts.concurrency) if opts.concurrency else None
        bar = None
        if opts.progress:
            from tqdm import tqdm
            bar = tqdm(total=opts.num_requests, desc="requests", unit="req", file=sys.stderr)

        async def one(prompt) -> RequestResult:
            if sem is None:
                r = await send_request(client, opts, prompt, opts.output_len, t0)
            else:
                async with sem:
                    r = await send_request(client, opts, prompt, opts.output_len, t0)
            if bar:
                bar.update(1)
            return r

        t0 = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if opts.request_rate and opts.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / opts.request_rate))   # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if bar:
            bar.close()
    return summarize(results, duration, opts)


def _stats(name: str, values_s: list[float]) -> dict:
    ms = np.asarray(values_s, dtype=float) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p90_{name}_ms": float(np.percentile(ms, 90)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float, opts) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    out = {
        "base_url": opts.base_url, "model": opts.model, "endpoint": "chat" if opts.chat else "completions",
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "max_concurrency": opts.concurrency, "request_rate": opts.request_rate,
        "input_len": opts.input_len, "output_len": opts.output_len,
        "duration": duration, "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
    }
    out |= _stats("ttft", [r.ttft for r in ok])
    out |= _stats("tpot", tpots)
    out |= _stats("itl", [g for r in ok for g in r.itl])
    out |= _stats("e2el", [r.latency for r in ok])
    out["errors"] = [r.error for r in results if not r.success][:10]
    out["requests"] = [{"start_s": r.start, "ttft_s": r.ttft, "latency_s": r.latency, "prompt_len": r.prompt_len,
                        "output_len": r.output_len, "success": r.success} for r in results]
    return out


def format_report(r: dict) -> str:
    rate = "inf" if r["request_rate"] in (None, float("inf")) else f"{r['request_rate']:g}"
    lines = [
        f"{' fdx bench serve ':=^60}",
        f"{'Server:':<40}{r['base_url']}",
        f"{'Model / endpoint:':<40}{r['model']} / {r['endpoint']}",
        f"{'Max concurrency / request rate:':<40}{r['max_concurrency'] or 'unlimited'} / {rate} req/s",
        f"{'Successful requests:':<40}{r['completed']}",
        f"{'Failed requests:':<40}{r['failed']}",
        f"{'Benchmark duration (s):':<40}{r['duration']:.2f}",
        f"{'Total input tokens:':<40}{r['total_input_tokens']}",
        f"{'Total generated tokens:':<40}{r['total_output_tokens']}",
        f"{'Request throughput (req/s):':<40}{r['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{r['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<40}{r['total_token_throughput']:.2f}",
    ]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, title in titles.items():
        lines.append(f"{' ' + title + ' ':-^60}")
        for stat in ("mean", "median", "p99"):
            lines.append(f"{f'{stat.capitalize()} {key.upper()} (ms):':<40}{r[f'{stat}_{key}_ms']:.2f}")
    lines.append("=" * 60)
    for e in r["errors"][:3]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("fdx bench serve: --plot needs matplotlib: pip install 'fdx[plot]' "
                         "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    reqs = [q for q in r["requests"] if q["success"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    starts = [q["start_s"] for q in reqs]
    a.scatter(starts, [1000 * q["latency_s"] for q in reqs], s=10, label="end-to-end")
    a.scatter(starts, [1000 * q["ttft_s"] for q in reqs], s=10, label="time to first token")
    a.set_xlabel("request start (s)")
    a.set_ylabel("ms")
    a.legend()
    a.set_title("latency per request")
    if reqs:
        b.hist([1000 * q["ttft_s"] for q in reqs], bins=30, alpha=0.6, label="TTFT")
        b.hist([1000 * q["latency_s"] for q in reqs], bins=30, alpha=0.6, label="E2E")
    b.set_xlabel("ms")
    b.set_ylabel("requests")
    b.legend()
    b.set_title(f"{r['model']}: {r['completed']} ok, {r['failed']} failed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("serve", help="online serving benchmark against an OpenAI-compatible server",
                        description="Streams requests to any OpenAI-compatible server (fdx, vLLM, llama-server) "
                                    "and reports throughput and TTFT/TPOT/ITL/E2E latency.")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1 (default: http://127.0.0.1:8000)")
    s.add_argument("--model", default=None, help="model id (default: the first from /v1/models)")
    s.add_argument("--api-key", default=None, help="bearer key (default: $FDX_API_KEY or $OPENAI_API_KEY)")
    s.add_argument("--chat", action="store_true", help="use /v1/chat/completions (default: /v1/completions)")
    s.add_argument("--num-requests", type=int, default=100, help="requests to send (default: 100)")
    s.add_argument("--concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    s.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    s.add_argument("--input-len", type=int, default=128, help="prompt length in tokens, approximate for text (default: 128)")
    s.add_argument("--output-len", type=int, default=128, help="max_tokens of each request (default: 128)")
    s.add_argument("--token-ids", action="store_true",
                   help="send prompts as token ids: exact input length, completions only (default: text)")
    s.add_argument("--min-token-id", type=int, default=1000, help="random prompt token ids from here (default: 1000)")
    s.add_argument("--max-token-id", type=int, default=10000, help="... up to here (default: 10000)")
    s.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at eos (default: ignore_eos, so each makes output-len tokens)")
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of each request (default: 0.0)")
    s.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times (default: 0)")
    s.add_argument("--warmup-requests", type=int, default=1, help="requests sent first and not counted (default: 1)")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    s.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar (default: shown)")
    s.add_argument("--json", action="store_true", help="print the results as JSON (default: a table)")
    s.add_argument("--plot", default=None, metavar="OUT.png", help="save a latency plot, needs matplotlib (default: none)")
    s.set_defaults(func=cmd_bench_serve)
    return s


def cmd_bench_serve(args) -> int:
    if args.num_requests < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-requests, --input-len and --output-len must be >= 1")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    if args.token_ids and args.chat:
        raise ValueError("--token-ids works with completions only, not --chat")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("fdx bench serve: --plot needs matplotlib: pip install 'fdx[plot]' "
                             "(or pip install matplotlib)") from None
    args.api_key = args.api_key or os.environ.get("FDX_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if getattr(args, "quiet", False):         # --quiet: no progress bar either
        args.progress = False
    import httpx
    try:
        result = asyncio.run(run(args))
    except (RuntimeError, httpx.HTTPError, KeyError, IndexError) as e:
        print(f"fdx bench serve: cannot benchmark {args.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_report(result))
    return 0 if result["completed"] else 1

