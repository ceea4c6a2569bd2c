"""`fdx bench serve` against a real `fdx serve`; then SIGTERM on that server."""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time

import httpx
import pytest
from serve_utils import API_KEY, ServerProcess, pid_alive

from fdx.entrypoints.bench.serve import RequestResult, format_report, summarize


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("bench_serve"), scheduler={"max_num_seqs": 8},
                        cache={"kv_cache": "prefix"})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def bench(server, *args) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "fdx.entrypoints.cli", "bench", "serve", "--base-url", server.base_url,
         "--api-key", API_KEY, "--json", "--warmup-requests", "0", *args],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def check_consistent(r: dict, num: int, output_len: int) -> None:
    assert r["completed"] + r["failed"] == r["num_requests"] == num
    assert r["failed"] == 0, r["errors"]
    assert r["total_output_tokens"] == num * output_len                 # ignore_eos: every token made
    assert r["total_input_tokens"] == sum(q["prompt_len"] for q in r["requests"]) > 0
    assert r["request_throughput"] == pytest.approx(r["completed"] / r["duration"])
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
    assert r["total_token_throughput"] == pytest.approx(
        (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"])
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{m}_ms"] <= r[f"p90_{m}_ms"] <= r[f"p99_{m}_ms"], m
        assert r[f"mean_{m}_ms"] <= r[f"p99_{m}_ms"] or r[f"std_{m}_ms"] > 0
    assert r["p99_ttft_ms"] <= r["p99_e2el_ms"] and r["mean_ttft_ms"] < r["mean_e2el_ms"]
    assert r["p99_e2el_ms"] <= 1000 * r["duration"]


def test_bench_serve_completions_poisson(server, tmp_path):
    png = tmp_path / "latency.png"
    r = bench(server, "--num-requests", "5", "--concurrency", "3", "--request-rate", "20",
              "--input-len", "16", "--output-len", "6", "--token-ids", "--plot", str(png))
    check_consistent(r, 5, 6)
    assert r["total_input_tokens"] == 5 * 16                            # token-id prompts are exact
    assert png.stat().st_size > 1000


def test_bench_serve_chat_text_report(server):
    out = subprocess.run(
        [sys.executable, "-m", "fdx.entrypoints.cli", "bench", "serve", "--base-url", server.base_url, "--chat",
         "--api-key", API_KEY, "--warmup-requests", "1", "--num-requests", "3", "--input-len", "12",
         "--output-len", "4", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for line in ("Successful requests:", "Failed requests:", "Request throughput (req/s):",
                 "Output token throughput (tok/s):", "Median TTFT (ms):", "P99 ITL (ms):", "Mean E2EL (ms):"):
        assert line in out.stdout
    assert "Successful requests:                    3" in out.stdout
    # the chat template's system prompt is a shared prefix: the prefix cache reports hits
    m = server.metrics()
    assert m["fdx:prefix_cache_hits_total"] > 0
    assert 0 < m["fdx:prefix_cache_hit_rate"] == m["fdx:prefix_cache_hits_total"] / m["fdx:prefix_cache_queries_total"]


def test_bench_counts_failures():
    class Opts:
        base_url, model, chat, concurrency, request_rate, input_len, output_len = "u", "m", False, 2, 1.0, 4, 3
    ok = RequestResult(True, 4, 3, 0.1, [0.05, 0.05], 0.2)
    bad = RequestResult(error="HTTP 429: busy")
    r = summarize([ok, bad, ok], 1.0, Opts)
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (2, 1, 6)
    assert r["errors"] == ["HTTP 429: busy"] and "Failed requests:" in format_report(r)


def test_sigterm_ends_streams_and_leaves_no_child(server):
    """Last in the module: it stops the server."""
    engine = server.engine_pid()
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=30) as http, contextlib.ExitStack() as stack:
        resp = stack.enter_context(http.stream("POST", "/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}))
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        rest = list(lines)                                            # ends, does not hang
        assert time.monotonic() - t0 < 60                                # no hang (a minute)
        assert any("shutting down" in line for line in rest)
    assert server.proc.wait(30) == 0
    assert not pid_alive(engine)
