"""Data parallel serving (``--data-parallel-size``, entrypoints/serving/data_parallel.py),
for real: one ``fdx serve`` with two engine processes on a tiny random Llama.

64 concurrent greedy requests answer as the in-process LLM does (both
batch-invariant, so the batch a request shares does not move its bits) and
leave every KV block of both ranks free; requests sharing a long prompt
prefix meet on one rank (its prefix cache serves them); a rank killed with
SIGKILL fails its own requests only (an error event in a stream, a 503 with
OpenAI's error body otherwise), the other rank's complete, and the rank is
started again and serves.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import numpy as np
import pytest

from fdx import LLM, SamplingParams
from fdx.core.config import ConfigError, FdxConfig
from serve_utils import API_KEY, ServerProcess

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
SETTINGS = dict(max_model_len=2048, quantization="none", block_size=16, num_kv_blocks=400, batch_invariant=True,
                kv_cache="prefix")


def test_flag_and_key_and_llm_refusal(tmp_path):
    """--data-parallel-size is parallel.data_parallel_size; the in-process
    engine refuses it, naming the key and saying it is a server feature."""
    from fdx.entrypoints.engine_args import _add_engine_args, _overrides
    import argparse
    p = argparse.ArgumentParser()
    _add_engine_args(p)
    assert FdxConfig.build(**_overrides(p.parse_args(["--data-parallel-size", "2"]))).parallel.data_parallel_size == 2
    assert FdxConfig.build(**_overrides(p.parse_args(["-dp", "3"]))).parallel.data_parallel_size == 3
    with pytest.raises(ConfigError, match=r"parallel.data_parallel_size.*server feature.*fdx serve"):
        LLM(data_parallel_size=2, progress=False)
    from fdx.entrypoints.serving.data_parallel import check_config, rank_config
    cfg = FdxConfig.build(data_parallel_size=2, num_threads=5)
    assert [rank_config(cfg, r).backend.num_threads for r in range(2)] == [2, 2]
    assert rank_config(FdxConfig.build(data_parallel_size=4, num_threads=2), 3).backend.num_threads == 1
    one = rank_config(FdxConfig.build(data_parallel_size=2, kv_cache_memory_bytes=1 << 30, num_kv_blocks=64), 1)
    assert (one.cache.kv_cache_memory_bytes, one.cache.memory_fraction, one.cache.num_kv_blocks) == (1 << 29, 0.05, 64)
    assert one.parallel.data_parallel_size == 1
    with pytest.raises(ConfigError, match="kv_connector"):
        check_config(FdxConfig.build(data_parallel_size=2, kv_connector="swap"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import TinyLlama
    return str(TinyLlama(vocab=64, hidden=32, intermediate=64, heads=2, kv_heads=1, max_len=2048)
               .hf_dir(tmp_path_factory.mktemp("dp") / "tiny"))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    s = SETTINGS
    srv = ServerProcess(tmp_path_factory.mktemp("dp-serve"),
                        model={"model": tiny_model, "max_model_len": s["max_model_len"], "quantization": "none"},
                        cache={"block_size": s["block_size"], "num_kv_blocks": s["num_kv_blocks"],
                               "kv_cache": "prefix"},
                        backend={"batch_invariant": True}, parallel={"data_parallel_size": 2})
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_model):
    llm = LLM(tiny_model, progress=False, **SETTINGS)
    yield llm
    llm.close()


def ranks(srv) -> list[dict]:
    return httpx.get(srv.base_url + "/load", headers=HEADERS, timeout=10).json()["data_parallel"]


def words(rng, n: int) -> str:
    return " ".join(f"w{i}" for i in rng.integers(3, 64, n))


async def complete(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
    r = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                 "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def settle(srv, check, timeout: float = 30.0):
    """Poll /load until ``check(ranks)`` holds (the ranks' stats arrive a step after their last token)."""
    deadline = time.monotonic() + timeout
    while True:
        now = ranks(srv)
        if check(now) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


@pytest.mark.slow
def test_64_concurrent_equal_the_llm_and_free_every_block(server, reference):
    rng = np.random.default_rng(0)
    prompts = [words(rng, int(rng.integers(3, 14))) for _ in range(64)]
    before = ranks(server)

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=120) as http:
            return await asyncio.gather(*(complete(http, p, 6) for p in prompts))
    got = asyncio.run(run())
    want = [o.outputs[0].text for o in
            reference.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))]
    assert got == want
    after = settle(server, lambda rs: all(r["kv_free_blocks"] == r["kv_total_blocks"] for r in rs))
    assert [r["kv_free_blocks"] for r in after] == [r["kv_total_blocks"] for r in after] == [400, 400]
    routed = [a["routed"] - b["routed"] for a, b in zip(after, before)]
    assert sum(routed) == 64 and min(routed) >= 16, routed      # both ranks served, by load
    assert all(r["in_flight"] == 0 for r in after)
    with open(f"/proc/{server.proc.pid}/maps") as f:        # the API process still holds no Paddle
        assert "libpaddle" not in f.read()
    metrics = server.metrics()
    assert metrics['fdx:kv_cache_free_blocks{model_name="tiny"}'] == 800          # the ranks summed
    assert metrics['fdx:dp_rank_kv_cache_free_blocks{dp_rank="1",model_name="tiny"}'] == 400


@pytest.mark.slow
def test_shared_prefix_lands_on_one_rank(server, reference):
    rng = np.random.default_rng(1)
    prefix = words(rng, 48)                       # three full blocks
    prompts = [f"{prefix} {words(rng, 3)}" for _ in range(3)]
    before = ranks(server)
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60) as http:
        texts = []
        for p in prompts:                         # one at a time: by load alone they would take turns
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 4,
                                                   "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
    assert texts == [o.outputs[0].text for o in reference.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))]
    after = settle(server, lambda rs: all(r["in_flight"] == 0 for r in rs))
    routed = [a["routed"] - b["routed"] for a, b in zip(after, before)]
    by_prefix = [a["routed_by_prefix"] - b["routed_by_prefix"] for a, b in zip(after, before)]
    hits = [(a["prefix_cache_hits"] or 0) - (b["prefix_cache_hits"] or 0) for a, b in zip(after, before)]
    home = routed.index(3)                        # all three on one rank
    assert by_prefix[home] == 2 and by_prefix[1 - home] == 0
    assert hits[home] >= 2 * 48 and hits[1 - home] == 0
    metrics = server.metrics()
    assert metrics[f'fdx:dp_rank_requests_routed_by_prefix_total{{dp_rank="{home}",model_name="tiny"}}'] \
        >= by_prefix[home]


@pytest.mark.slow
def test_killed_rank_fails_its_own_requests_then_restarts(server, reference):
    rng = np.random.default_rng(2)
    prompts = [words(rng, 4) for _ in range(6)]   # no full block: placed by load, three per rank
    outcome: dict[int, str] = {}

    async def stream(http, i, first):
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 600, "temperature": 0, "ignore_eos": True}
        if i >= 4:                                # two of them not streamed
            first.set()                           # (in flight once /load counts six)
            r = await http.post("/v1/completions", json=body)
            if r.status_code == 200:
                outcome[i] = "done" if r.json()["choices"][0]["finish_reason"] == "length" else "short"
            else:
                assert r.status_code == 503, r.text
                assert r.json()["error"]["type"] == "service_unavailable"
                outcome[i] = "error"
            return
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            finish = None
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    assert chunk["error"]["type"] == "service_unavailable"
                    outcome[i] = "error"
                    return
                first.set()
                finish = chunk["choices"][0]["finish_reason"] or finish
            outcome[i] = "done" if finish == "length" else "short"

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=120) as http:
            firsts = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(stream(http, i, firsts[i])) for i in range(len(prompts))]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
            for _ in range(300):
                placed = (await http.get("/load")).json()["data_parallel"]
                if sum(r["in_flight"] for r in placed) == len(prompts):
                    break
                await asyncio.sleep(0.05)
            victim = placed[0]
            os.kill(victim["pid"], signal.SIGKILL)
            # the other rank serves meanwhile
            text = await complete(http, prompts[0], 3)
            await asyncio.gather(*tasks)
            return placed, text
    placed, text = asyncio.run(run())
    assert [r["in_flight"] for r in placed] == [3, 3], placed
    assert sorted(outcome.values()) == ["done"] * 3 + ["error"] * 3, outcome
    want = reference.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert text == want[0].outputs[0].text
    back = settle(server, lambda rs: rs[0]["up"] and rs[0]["restarts"] == 1, timeout=180)
    assert back[0]["up"] and back[0]["restarts"] == 1 and back[0]["pid"] != placed[0]["pid"], back
    assert back[0]["failed"] == 3 and back[1]["failed"] == 0
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200

    async def again():
        async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=120) as http:
            return await asyncio.gather(*(complete(http, p, 5) for p in prompts[:4]))
    got = asyncio.run(again())
    assert got == [o.outputs[0].text for o in reference.generate(
        prompts[:4], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))]
    final = settle(server, lambda rs: all(r["kv_free_blocks"] == r["kv_total_blocks"] for r in rs))
    assert final[0]["routed"] - back[0]["routed"] >= 1             # the restarted rank serves again
    assert [r["kv_free_blocks"] for r in final] == [400, 400]
    assert "Traceback" not in server.log_path.read_text()
