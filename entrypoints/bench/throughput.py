"""Benchmarks. Figures are reported, never asserted."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from fdx.entrypoints.bench.profile import StepProfiler, format_profile
from fdx.core.sampling_params import SamplingParams


WORKLOADS = {"grounded": Path(__file__).with_name("grounded.jsonl"),   # shipped workload files by name
             "chat": Path(__file__).with_name("chat.jsonl")}


def workload_prompts(llm, workload: str) -> list[list[int]]:
    """The prompts of a workload file (JSON lines: ``{"messages": [...]}``,
    through the model's chat template, or ``{"prompt": "..."}``), or of a
    shipped one by name (``grounded``: input-grounded prompts, code to copy
    with one change, a passage to quote, JSON to echo with edits)."""
    path = WORKLOADS.get(workload, Path(workload))
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise ValueError(f"--workload {workload}: cannot read it as JSON lines ({e})") from None
    tok, out = llm.tokenizer, []
    for i, row in enumerate(lines):
        if "messages" in row:
            text = tok.apply_chat_template(row["messages"], add_generation_prompt=True)
            out.append(tok.encode(text, add_special_tokens=False))
        elif "prompt" in row:
            out.append(tok.encode(row["prompt"]))
        else:
            raise ValueError(f"--workload {workload}: line {i + 1} has neither 'messages' nor 'prompt'")
    if not out:
        raise ValueError(f"--workload {workload}: no prompts")
    return out


def throughput(llm, num_requests: int, input_len: int, output_len: int, seed: int = 0,
               profile: bool = False, workload: str | None = None, speculation: bool = True,
               ignore_eos: bool | None = None) -> dict:
    """N requests of I random prompt tokens and O generated tokens (ignore_eos),
    all queued at once, driven step by step through the LLM's engine.
    ``workload``: the prompts of a workload file instead (cycled to N; see
    ``workload_prompts``), each answered up to its eos (O at most: an
    answer, not the model chatting past its end) unless ``ignore_eos``. ``speculation`` False: an engine built with a
    speculative config runs this without it (the baseline of the same run).
    ``profile``: run each step under cProfile and add a breakdown of the
    decode-only steps at the full batch (``fdx.entrypoints.bench.profile``); the
    profiler slows Python-heavy parts, so time figures of such a run read
    a little low."""
    eng = llm.engine
    rng = np.random.default_rng(seed)
    vocab = eng.shape.vocab_size
    if ignore_eos is None:
        ignore_eos = workload is None
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos)
    # warm-up: one short request, so one-time costs are not counted
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True))
    if workload is not None:
        pool = workload_prompts(llm, workload)
        prompts = [pool[i % len(pool)] for i in range(num_requests)]
    else:
        prompts = [rng.integers(0, vocab, input_len).tolist() for _ in range(num_requests)]
    spec = eng.speculation
    if spec is not None and not speculation:
        eng.scheduling.speculation = None
    elif spec is not None:
        spec.forget()           # each round drafts from its own requests, not an earlier round's same outputs
    reqs = [eng.make_request(p, sp) for p in prompts]
    for r in reqs:
        eng.add_request(r)
    steps = []
    computed0, recomputed0 = eng.num_computed_tokens, eng.num_recomputed_tokens
    profiler = StepProfiler(min(num_requests, eng.config.scheduler.max_num_seqs)) if profile else None
    read_before = memory_read_rate(eng)
    t0, cpu0 = time.perf_counter(), time.process_time()
    # the decode-only steps' process CPU time and output tokens (prefill is not speculated)
    decode_cpu, decode_out = 0.0, 0
    while eng.has_unfinished():
        c, n = time.process_time(), sum(r.num_output_tokens for r in reqs)
        if profiler is not None:
            profiler.step(eng)
        else:
            eng.step()
        steps.append(st := eng.last_stats)
        if st.num_prefill_tokens == 0 and st.num_decode_tokens > 0:
            decode_cpu += time.process_time() - c
            decode_out += sum(r.num_output_tokens for r in reqs) - n
    total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    read_after = memory_read_rate(eng)
    eng.scheduling.speculation = spec
    prefill_steps = [s for s in steps if s.num_prefill_tokens > 0]
    decode_steps = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    prefill_time = sum(s.step_time_s for s in prefill_steps)
    decode_time = sum(s.step_time_s for s in decode_steps)
    prompt_tokens = sum(len(p) for p in prompts)
    out_tokens = sum(r.num_output_tokens for r in reqs)
    result = {
        "num_requests": num_requests, "input_len": input_len, "output_len": output_len,
        "backend": eng.backend.describe(), "kv_scheduler": eng.config.scheduler.kv_scheduler,
        "max_num_seqs": eng.config.scheduler.max_num_seqs,
        "max_num_batched_tokens": eng.config.scheduler.max_num_batched_tokens,
        "total_time_s": total, "cpu_time_s": cpu, "decode_cpu_time_s": decode_cpu,
        "decode_output_tokens": decode_out, "steps": len(steps),
        "mean_step_time_ms": 1000 * total / max(len(steps), 1),
        "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "prompt_tokens_per_s": sum(s.num_prefill_tokens for s in prefill_steps) / prefill_time if prefill_time else 0.0,
        "decode_tokens_per_s": sum(s.num_decode_tokens for s in decode_steps) / decode_time if decode_time else 0.0,
        "mean_decode_step_ms": 1000 * decode_time / max(len(decode_steps), 1),
        "overall_tokens_per_s": (prompt_tokens + out_tokens) / total,
        "output_tokens_per_s": out_tokens / total,
        "preemptions": sum(s.num_preempted for s in steps),
        # the product threads' memory read rate (GB/s) just before and after the run, or None:
        # batch-1 decode follows it, and on a VM it can change between runs (docs/backends.md)
        "memory_read_gbps": [read_before, read_after] if read_before and read_after else None,
        "preemption_policy": eng.config.scheduler.preemption,
        # recomputed tokens / all computed tokens in this run: what preemption cost
        "recompute_tax": ((eng.num_recomputed_tokens - recomputed0) / (eng.num_computed_tokens - computed0)
                          if eng.num_computed_tokens > computed0 else 0.0),
    }
    import hashlib
    result["outputs_sha1"] = hashlib.sha1(json.dumps([r.output_token_ids for r in reqs]).encode()).hexdigest()
    if workload is not None:
        result["workload"] = workload
        result["ignore_eos"] = ignore_eos
    if spec is not None and speculation:       # vLLM's spec_decode figures, for this run's steps
        drafts = sum(st.spec_num_drafts for st in steps)
        proposed = sum(st.spec_num_draft_tokens for st in steps)
        accepted = sum(st.spec_num_accepted_tokens for st in steps)
        result["speculative"] = {
            "method": spec.name, "num_speculative_tokens": spec.k, "num_drafts": drafts,
            "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            "proposals_per_step": drafts / max(len(steps), 1),
            "gated_steps": sum(st.spec_gated for st in steps)}
    loads = [st.expert_load for st in steps if st.expert_load]
    if loads:                                  # a MoE model: tokens per expert per layer over the run
        per_layer = np.sum(np.asarray(loads, dtype=np.int64), axis=0)
        ratios = per_layer.max(axis=1) / np.maximum(per_layer.mean(axis=1), 1e-9)
        result["expert_load"] = {"moe_layers": int(per_layer.shape[0]), "experts": int(per_layer.shape[1]),
                                 "max_over_mean": float(ratios.max()), "mean_max_over_mean": float(ratios.mean()),
                                 "idle_experts": int((per_layer == 0).sum())}
    from fdx.core.memory import rss_bytes
    result["quantization"] = eng.config.model.quantization
    result["weight_bytes"] = eng.executor.weight_bytes()      # by kind ("q4_1", "f32", ...)
    result["resident_bytes"] = rss_bytes()                     # this process, after the run
    if profiler is not None:
        result["profile"] = profiler.summary().as_dict()
    return result


def row_invariant_rows(eng) -> int | None:
    """The largest one-sequence step (rows) in which the backend's kernels give each
    row its one-row bits in the default mode, for this model's weights
    (``Backend.row_invariant_rows``; the CPU backend's: fdx.ops.cpp.step_row_invariant_rows):
    at batch 1 a speculative step of k + 1 rows within it keeps decoding's greedy
    tokens. None where the backend does not say."""
    return eng.backend.row_invariant_rows(eng.executor.weight_bytes(), eng.kv_spec.head_dim)


def outputs_differ_why(r: dict) -> str:
    """Why speculation's outputs differ from the baseline's in run ``r``, or ""
    where they must not (docs/speculative.md, "What verification guarantees")."""
    if r["outputs_equal"] or r.get("batch_invariant", True):
        return ""
    near_tie = "a near tie can take the other token; docs/speculative.md"
    rows, k = r.get("row_invariant_rows"), r.get("speculative", {}).get("num_speculative_tokens")
    if r.get("max_num_seqs") != 1 or rows is None or k is None:
        return (" (expected without --batch-invariant at more than one sequence a step: the rows a step "
                f"scores move a quantized product's last bits, and {near_tie})")
    if k + 1 > rows:
        return (f" (expected at k={k}: this model's products keep a row's bits in steps of up to {rows} rows, "
                f"k up to {rows - 1}; past that {near_tie})")
    return (f" (not expected: at batch 1 with k={k} every verified row should have its decode row's bits; "
            "please report it)")


def memory_read_rate(eng) -> float | None:
    """GB/s at which the CPU backend's threads read memory together now
    (fdx.ops.cpp.read_bandwidth), None on another backend or without the
    compiled kernels. From a process of its own: its 128 MiB buffer is not on
    this process's peak resident memory, which a run under ``/usr/bin/time``
    measures (docs/benchmarks.md, "Resident memory")."""
    threads = getattr(eng.backend, "num_threads", None)
    if not threads:
        return None
    from fdx.ops import cpp
    return cpp.read_bandwidth(threads, own_process=True) if cpp.loaded() else None


def format_throughput(r: dict) -> str:
    lines = [
        f"fdx bench throughput: {r['num_requests']} requests x ({r['input_len']} prompt + {r['output_len']} output) tokens"
        if "workload" not in r else f"fdx bench throughput: {r['num_requests']} requests of workload {r['workload']} "
        f"({r['prompt_tokens']} prompt tokens) x {r['output_len'] if r['ignore_eos'] else 'up to eos, at most ' + str(r['output_len'])}"
        f" output tokens ({r['output_tokens']} in all)",
        f"  backend {r['backend']}, KV scheduler {r['kv_scheduler']}, "
        f"max_num_seqs {r['max_num_seqs']}, max_num_batched_tokens {r['max_num_batched_tokens']}",
        f"  total            {r['total_time_s']:.2f} s over {r['steps']} steps (mean step {r['mean_step_time_ms']:.1f} ms)",
        f"  prompt           {r['prompt_tokens_per_s']:.1f} tok/s (steps with prefill)",
        f"  decode           {r['decode_tokens_per_s']:.1f} tok/s (decode-only steps, mean {r['mean_decode_step_ms']:.1f} ms)",
        f"  output           {r['output_tokens_per_s']:.1f} tok/s overall, {r['overall_tokens_per_s']:.1f} tok/s prompt+output",
        f"  preemptions      {r['preemptions']} (victims: {r['preemption_policy']}), "
        f"recompute tax {100 * r['recompute_tax']:.1f}% of computed tokens",
    ]
    if r.get("memory_read_gbps"):
        before, after = r["memory_read_gbps"]
        lines.append(f"  memory read      {before:.1f} GB/s before, {after:.1f} after (the backend's threads "
                     "together: batch-1 decode follows it)")
    if r.get("expert_load"):
        el = r["expert_load"]
        lines.append(f"  expert load      busiest expert {el['max_over_mean']:.2f}x the mean (layer average "
                     f"{el['mean_max_over_mean']:.2f}x; 1.00: even) over {el['moe_layers']} MoE layers of "
                     f"{el['experts']} experts, {el['idle_experts']} (layer, expert) pairs idle")
    if r.get("weight_bytes"):
        from fdx.model_io.model import format_bytes
        lines.append(f"  weights          {format_bytes(r['weight_bytes'])}, model.quantization "
                     f"{r['quantization']}; process resident {r['resident_bytes'] / 1e6:.1f} MB")
    if "speculative" in r:
        sp = r["speculative"]
        lines.append(f"  speculative      {sp['method']} k={sp['num_speculative_tokens']}: acceptance rate "
                     f"{100 * sp['acceptance_rate']:.1f}%, mean accepted length {sp['mean_accepted_length']:.2f}, "
                     f"{sp['proposals_per_step']:.2f} proposals a step, {sp['gated_steps']} steps gated off")
    if "baseline" in r:
        b = r["baseline"]
        lines.append(f"  without speculation (same run): output {b['output_tokens_per_s']:.1f} tok/s; "
                     f"speculation {r['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x, outputs "
                     f"{'equal' if r['outputs_equal'] else 'DIFFERENT'}" + outputs_differ_why(r))
        if len(r.get("ratios", ())) > 1:
            q = sorted(r["ratios"])
            lines.append(f"  rounds           {len(q)} (off, on) alternating: speculation median "
                         f"{float(np.median(q)):.2f}x, {q[0]:.2f}x .. {q[-1]:.2f}x "
                         f"({', '.join(f'{x:.2f}' for x in r['ratios'])})")
            # by this process's CPU time (all its threads): what a shared machine's other jobs take is not
            # counted (with backend.num_threads=1 nearly exactly; with more, a thread that waits spinning is)
            for key, what in (("cpu_ratios", "by CPU time     "), ("decode_cpu_ratios", "decode steps CPU")):
                q = sorted(r[key])
                lines.append(f"  {what} speculation median {float(np.median(q)):.2f}x, {q[0]:.2f}x .. "
                             f"{q[-1]:.2f}x ({', '.join(f'{x:.2f}' for x in r[key])})")
    if "profile" in r:
        lines.append(format_profile(r["profile"]))
    return "\n".join(lines)
