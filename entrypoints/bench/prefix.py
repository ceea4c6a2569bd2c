"""``fdx bench prefix``: what prefix caching buys. Figures are reported,
never asserted.

1. Time to first token of a request whose long prefix (1,000 tokens by
   default) is already cached, as a ratio to the same request cold.
2. Throughput of a shared-system-prompt workload (every request = one
   system prompt + its own question), with and without the prefix cache.

Both run in one process on one loaded model: each measurement gets a fresh
KV cache and scheduler (``use_scheduling``) over the same KV tensors.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np

from fdx.core.config import FdxConfig
from fdx.core.sampling_params import SamplingParams


@contextlib.contextmanager
def use_scheduling(engine, num_kv_blocks: int | None = None, **overrides):
    """Run ``engine`` with a fresh KV-cache plugin and resource manager built
    from its config plus ``overrides`` (config keys: ``kv_cache``,
    ``kv_scheduler``, ``policy``, ``kv_connector``, ``plugins``, ...),
    over the KV tensors it already has; ``num_kv_blocks`` may shrink the
    pool; ``kv_connector=False``: none. Restores the old ones on exit. The
    engine must be idle."""
    assert not engine.has_unfinished(), "the engine is busy"
    no_connector = overrides.get("kv_connector") is False
    overrides = {k: v for k, v in overrides.items() if not (k == "kv_connector" and v is False)}
    cfg = engine.config.overlay(FdxConfig.build(**overrides))
    if no_connector:
        cfg.cache.kv_connector = None
    num_blocks = num_kv_blocks or engine.kv_cache.num_blocks
    if num_blocks > engine.config.cache.num_kv_blocks:
        raise ValueError(f"num_kv_blocks={num_blocks} exceeds the engine's {engine.config.cache.num_kv_blocks}")
    cfg.cache.num_kv_blocks = num_blocks
    parts = engine.build_parts(cfg, num_blocks)
    engine.executor.reconfigure(parts["assembly"], parts["connector"])   # the runner side: its connector
    saved = engine._install(parts)
    try:
        yield engine
    finally:
        for req in engine.scheduling.requests():
            engine.abort_request(req.request_id)
        while engine.has_unfinished():      # let a connector finish its transfers
            engine.step()
        if engine.connector is not None:
            engine.connector.close()         # before the tensors are reused
        engine.kv_cache.close()
        engine._install(saved)
        engine.executor.reconfigure(saved["assembly"], saved["connector"])


def _run(engine, prompts: list[list[int]], sp: SamplingParams) -> tuple[list, float]:
    reqs = [engine.make_request(p, sp) for p in prompts]
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
        r.arrival_time = time.monotonic()
    while engine.has_unfinished():
        engine.step()
    return reqs, time.perf_counter() - t0


def _ttft(req) -> float:
    return req.first_token_time - req.arrival_time


def ttft(llm, prefix_len: int = 1000, suffix_len: int = 16, repeats: int = 3, seed: int = 0) -> dict:
    """Cold and warm time to first token of prefix + suffix, each repeat on
    a fresh cache and a fresh random prefix."""
    eng = llm.engine
    rng = np.random.default_rng(seed)
    vocab = eng.shape.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    cold, warm, same = [], [], True
    with use_scheduling(eng, kv_cache="paged"):           # warm-up: one-time costs
        _run(eng, [rng.integers(0, vocab, prefix_len + suffix_len).tolist()], sp)
    for _ in range(repeats):
        prefix = rng.integers(0, vocab, prefix_len).tolist()
        suffix_a, suffix_b = (rng.integers(0, vocab, suffix_len).tolist() for _ in range(2))
        with use_scheduling(eng, kv_cache="prefix", kv_connector=False):
            (c,), _ = _run(eng, [prefix + suffix_a], sp)          # cold: nothing cached
            _run(eng, [prefix + suffix_b], sp)                    # caches the prefix
            (w,), _ = _run(eng, [prefix + suffix_a], sp)          # warm
            hit = w.num_cached_tokens
        cold.append(_ttft(c))
        warm.append(_ttft(w))
        same &= c.output_token_ids == w.output_token_ids
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    return {"prefix_len": prefix_len, "suffix_len": suffix_len, "repeats": repeats,
            "cold_ttft_ms": 1000 * cold_s, "warm_ttft_ms": 1000 * warm_s, "ratio": warm_s / cold_s,
            "cached_tokens": hit, "same_first_token": same}


def shared_prompt_throughput(llm, num_requests: int = 32, system_len: int = 512, question_len: int = 32,
                             output_len: int = 32, seed: int = 0) -> dict:
    """Every request is the same system prompt plus its own question; all
    are queued at once, with the paged cache and then the prefix cache.
    Before each run one request with the system prompt alone has run (a
    server's steady state: the system prompt was seen before)."""
    eng = llm.engine
    rng = np.random.default_rng(seed)
    vocab = eng.shape.vocab_size
    system = rng.integers(0, vocab, system_len).tolist()
    prompts = [system + rng.integers(0, vocab, question_len).tolist() for _ in range(num_requests)]
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    out = {"num_requests": num_requests, "system_len": system_len, "question_len": question_len,
           "output_len": output_len, "kv_scheduler": eng.config.scheduler.kv_scheduler,
           "max_num_seqs": eng.config.scheduler.max_num_seqs,
           "max_num_batched_tokens": eng.config.scheduler.max_num_batched_tokens}
    outputs = {}
    for cache in ("paged", "prefix"):
        with use_scheduling(eng, kv_cache=cache, kv_connector=False):
            _run(eng, [system + [1]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            reqs, total = _run(eng, prompts, sp)
            stats = eng.kv_cache.stats()
        toks = sum(r.num_output_tokens for r in reqs)
        outputs[cache] = [r.output_token_ids for r in reqs]
        out[cache] = {"total_s": total, "output_tokens_per_s": toks / total,
                      "requests_per_s": num_requests / total,
                      "mean_ttft_ms": 1000 * statistics.mean(_ttft(r) for r in reqs),
                      "cached_tokens": stats.get("prefix_cache_hits", 0)}
    out["speedup"] = out["paged"]["total_s"] / out["prefix"]["total_s"]
    out["same_outputs"] = outputs["paged"] == outputs["prefix"]
    return out


def format_result(r: dict) -> str:
    t, s = r["ttft"], r["throughput"]
    return "\n".join([
        f"fdx bench prefix ({r['backend']})",
        f"  TTFT, {t['prefix_len']}-token prefix + {t['suffix_len']} tokens (median of {t['repeats']}):",
        f"    cold {t['cold_ttft_ms']:.1f} ms, prefix cached {t['warm_ttft_ms']:.1f} ms "
        f"({t['cached_tokens']} tokens hit): ratio {t['ratio']:.3f}",
        f"  shared system prompt: {s['num_requests']} requests x ({s['system_len']} shared + "
        f"{s['question_len']} own prompt, {s['output_len']} output) tokens, {s['kv_scheduler']}, "
        f"max_num_seqs {s['max_num_seqs']}",
        f"    paged  {s['paged']['total_s']:.2f} s, {s['paged']['output_tokens_per_s']:.1f} output tok/s, "
        f"mean TTFT {s['paged']['mean_ttft_ms']:.0f} ms",
        f"    prefix {s['prefix']['total_s']:.2f} s, {s['prefix']['output_tokens_per_s']:.1f} output tok/s, "
        f"mean TTFT {s['prefix']['mean_ttft_ms']:.0f} ms, {s['prefix']['cached_tokens']} prompt tokens from cache",
        f"    speed-up {s['speedup']:.2f}x; same outputs: {s['same_outputs']}",
    ])


def run(args) -> dict:
    from fdx.entrypoints.engine_args import _make_llm
    need = max(args.prefix_len + args.suffix_len, args.system_len + args.question_len + args.output_len) + 1
    if args.max_model_len is None:
        args.max_model_len = max(1024, 1 << (need - 1).bit_length())
    llm = _make_llm(args, progress=False)
    return {"backend": llm.engine.backend.describe(),
            "ttft": ttft(llm, args.prefix_len, args.suffix_len, args.repeats, args.bench_seed),
            "throughput": shared_prompt_throughput(llm, args.num_requests, args.system_len, args.question_len,
                                                   args.output_len, args.bench_seed)}


def cmd(args) -> int:
    import json
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


def add_parser(bench_subparsers) -> None:
    """Add ``fdx bench prefix`` to the ``fdx bench`` sub-commands."""
    from fdx.entrypoints.engine_args import _add_engine_args
    p = bench_subparsers.add_parser("prefix", help="what prefix caching buys: TTFT and shared-prompt throughput")
    p.add_argument("--prefix-len", type=int, default=1000, help="TTFT case: shared prefix tokens (default: 1000)")
    p.add_argument("--suffix-len", type=int, default=16, help="TTFT case: tokens after the prefix (default: 16)")
    p.add_argument("--repeats", type=int, default=3, help="TTFT case: runs, the median is reported (default: 3)")
    p.add_argument("--num-requests", type=int, default=32, help="shared-prompt case: requests (default: 32)")
    p.add_argument("--system-len", type=int, default=512, help="shared-prompt case: system prompt tokens (default: 512)")
    p.add_argument("--question-len", type=int, default=32, help="shared-prompt case: tokens of each question (default: 32)")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default: 32)")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    p.add_argument("--json", action="store_true", help="print every figure as JSON (default: a table)")
    _add_engine_args(p)
    p.set_defaults(func=cmd)
