"""``fdx bench guided``: what guided decoding costs, per backend. Figures
are reported, never asserted.

1. Throughput: N concurrent JSON-schema requests (sampled, so outputs vary),
   then the same prompts unconstrained with each request's max_tokens set
   to the length its guided run produced (ignore_eos): the same batch
   shapes step by step, so the ratio isolates the matcher and mask cost.
   Alternating rounds of each, so drifting machine load hits both.
2. Compile time: distinct schemas compiled cold (median), then found in
   the cache.
3. Steps while grammars compile: a batch decodes; at one step K new
   constrained requests arrive. Once with grammars never seen (they
   compile in the thread pool while the batch goes on) and once with the
   same grammars cached; the longest step of each run is reported, and
   their ratio.
"""
from __future__ import annotations

import json
import statistics
import time

import numpy as np

from fdx.core.sampling_params import SamplingParams


def schema(i: int) -> dict:
    """A bounded schema; ``i`` makes it distinct (a new compile)."""
    return {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000 + i},
        "name": {"type": "string", "pattern": f"^[A-Z][a-z]{{1,{6 + i % 5}}}$"},
        "email": {"type": "string", "pattern": r"^[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)$"},
        "role": {"enum": ["admin", "user", "guest", f"r{i}"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                   "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"}},
        "required": ["id", "name", "email", "role", "scores", "address", "active"],
        "additionalProperties": False}


PROMPT = "Write one user record as JSON with id, name, email, role, scores, address and active:"


def _drive(eng, reqs) -> tuple[float, list]:
    for r in reqs:
        eng.add_request(r)
    steps = []
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        steps.append(eng.last_stats)
    return time.perf_counter() - t0, steps


def throughput(llm, num_requests: int, max_tokens: int, seed: int, rounds: int = 3) -> dict:
    """Guided and unguided runs alternate (``rounds`` of each, a new seed
    each round), so a machine whose load drifts affects both alike; the
    ratio is of the summed times."""
    eng = llm.engine
    ids = llm.tokenizer.encode(PROMPT)
    llm.generate([PROMPT], SamplingParams(guided_json=schema(0), max_tokens=8))   # warm-up, compiles schema(0)
    g_time = p_time = 0.0
    toks = valid = 0
    # time the guided service's share of a step (matchers and the mask fill): a figure the
    # machine's load cannot blur the way it blurs the throughput ratio
    service = eng.guided
    spent = [0.0]

    def timed_fill(rows, _fill=service.step_bitmask):
        t0 = time.perf_counter()
        try:
            return _fill(rows)
        finally:
            spent[0] += time.perf_counter() - t0
    service.step_bitmask = timed_fill
    for k in range(rounds):
        s0 = seed + 1000 * k
        guided = [eng.make_request(ids, SamplingParams(guided_json=schema(0), max_tokens=max_tokens,
                                                       temperature=1.0, seed=s0 + i)) for i in range(num_requests)]
        t, steps = _drive(eng, guided)
        g_time += t
        g_steps = steps if k == 0 else g_steps + steps
        lens = [r.num_output_tokens for r in guided]
        plain = [eng.make_request(ids, SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, seed=s0 + i))
                 for i, n in enumerate(lens)]
        t, _ = _drive(eng, plain)
        p_time += t
        toks += sum(lens)
        for r in guided:
            try:
                json.loads(llm.tokenizer.decode(r.output_token_ids))
                valid += r.status.value == "stop"
            except ValueError:
                pass
    del service.step_bitmask
    step_s = sum(st.step_time_s for st in g_steps)
    return {"num_requests": num_requests, "rounds": rounds, "output_tokens": toks, "valid_json_stopped": valid,
            "guided_tokens_per_s": toks / g_time, "unguided_tokens_per_s": toks / p_time,
            "ratio": p_time / g_time,
            "processor_ms_per_step": 1000 * spent[0] / max(len(g_steps), 1),
            "processor_share_of_step": spent[0] / step_s if step_s else 0.0}


def compile_times(llm, count: int, offset: int) -> dict:
    g = llm.engine.guided
    cold, warm = [], []
    for i in range(offset, offset + count):
        sp = SamplingParams(guided_json=schema(i))
        t0 = time.perf_counter()
        g.validate(sp)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        g.validate(sp)
        warm.append(time.perf_counter() - t0)
    return {"schemas": count, "cold_ms": 1000 * statistics.median(cold), "cold_max_ms": 1000 * max(cold),
            "cached_ms": 1000 * statistics.median(warm)}


def stall(llm, batch: int, arrivals: int, offset: int, seed: int) -> dict:
    """Longest step after K constrained requests arrive mid-batch, with
    grammars new (compiling) and cached."""
    eng = llm.engine
    ids = llm.tokenizer.encode(PROMPT)
    rng = np.random.default_rng(seed)

    def run(schemas) -> tuple[float, float, int]:
        base = [eng.make_request(rng.integers(0, 1000, 16).tolist(),
                                 SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0))
                for _ in range(batch)]
        for r in base:
            eng.add_request(r)
        for _ in range(8):                       # prefill done, decoding
            eng.step()
        before = []
        for _ in range(8):
            eng.step()
            before.append(eng.last_stats.step_time_s)
        for s in schemas:                        # arrivals (make_request starts the compiles)
            eng.add_request(eng.make_request(ids, SamplingParams(guided_json=s, max_tokens=24, temperature=0.0)))
        after, waited = [], 0
        while eng.has_unfinished():
            eng.step()
            after.append(eng.last_stats.step_time_s)
            waited += eng.last_stats.num_waiting > 0
        return max(before), max(after[:24]), waited

    new = [schema(i) for i in range(offset, offset + arrivals)]
    b1, cold_max, waited = run(new)             # new grammars: they compile while the batch steps
    b2, warm_max, _ = run(new)                  # the same grammars: cached
    return {"batch": batch, "arrivals": arrivals, "steps_with_waiting_requests": waited,
            "longest_step_compiling_ms": 1000 * cold_max, "longest_step_cached_ms": 1000 * warm_max,
            "ratio": cold_max / warm_max, "decode_step_before_ms": 1000 * max(b1, b2)}


def run(args) -> dict:
    from fdx.entrypoints.engine_args import _make_llm
    out = {"backends": {}}
    for name in args.backends.split(","):
        args.set = [s for s in args.set if not s.startswith("guided_backend=")] + [f"guided_backend={name}"]
        if args.max_num_seqs is None:
            args.max_num_seqs = max(args.num_requests, args.stall_batch + args.stall_arrivals)
        if args.max_model_len is None:
            args.max_model_len = 512
        llm = _make_llm(args, progress=False)
        out["backend"] = llm.engine.backend.describe()
        llm.engine.guided.validate(SamplingParams(guided_regex="a"))       # the backend is built
        r = {"throughput": throughput(llm, args.num_requests, args.max_tokens, args.bench_seed, args.rounds),
             "compile": compile_times(llm, args.compile_schemas, 1000),
             "stall": stall(llm, args.stall_batch, args.stall_arrivals, 2000, args.bench_seed)}
        out["backends"][name] = r
        del llm
    return out


def format_result(r: dict) -> str:
    lines = [f"fdx bench guided ({r['backend']})"]
    for name, b in r["backends"].items():
        t, c, s = b["throughput"], b["compile"], b["stall"]
        lines += [
            f"  {name}:",
            f"    {t['num_requests']} concurrent JSON-schema requests x {t['rounds']} rounds, {t['output_tokens']} "
            f"output tokens ({t['valid_json_stopped']} valid JSON ending in stop): guided {t['guided_tokens_per_s']:.1f} tok/s, "
            f"unguided {t['unguided_tokens_per_s']:.1f} tok/s: ratio {t['ratio']:.3f}; the guided processor "
            f"{t['processor_ms_per_step']:.2f} ms a step ({100 * t['processor_share_of_step']:.1f}% of step time)",
            f"    compile: cold {c['cold_ms']:.2f} ms median (max {c['cold_max_ms']:.2f}) over {c['schemas']} "
            f"schemas, cached {c['cached_ms']:.3f} ms",
            f"    {s['arrivals']} new constrained requests into a batch of {s['batch']}: longest step "
            f"{s['longest_step_compiling_ms']:.1f} ms with grammars compiling, {s['longest_step_cached_ms']:.1f} ms "
            f"cached: ratio {s['ratio']:.2f} (decode step before: {s['decode_step_before_ms']:.1f} ms)",
        ]
    return "\n".join(lines)


def cmd(args) -> int:
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


def add_parser(bench_subparsers) -> None:
    """Add ``fdx bench guided`` to the ``fdx bench`` sub-commands."""
    from fdx.entrypoints.engine_args import _add_engine_args
    p = bench_subparsers.add_parser("guided", help="guided decoding: throughput ratio, compile time, steps "
                                                   "while grammars compile")
    p.add_argument("--backends", default="xgrammar,llguidance",
                   help="comma-separated guided backends, one engine each (default: xgrammar,llguidance)")
    p.add_argument("--num-requests", type=int, default=16,
                   help="throughput case: concurrent JSON-schema requests (default: 16)")
    p.add_argument("--max-tokens", type=int, default=160, help="throughput case: max_tokens of each (default: 160)")
    p.add_argument("--rounds", type=int, default=3,
                   help="throughput case: guided and unguided runs, alternating (default: 3)")
    p.add_argument("--compile-schemas", type=int, default=8,
                   help="compile case: distinct schemas compiled cold then cached (default: 8)")
    p.add_argument("--stall-batch", type=int, default=16,
                   help="stall case: requests decoding when the new ones arrive (default: 16)")
    p.add_argument("--stall-arrivals", type=int, default=8,
                   help="stall case: constrained requests that arrive with new grammars (default: 8)")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the sampled requests (default: 0)")
    p.add_argument("--json", action="store_true", help="print every figure as JSON (default: a summary)")
    _add_engine_args(p)
    p.set_defaults(func=cmd)
