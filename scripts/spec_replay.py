"""What suffix speculation can give at batch 1 on a workload, given what a
decode step costs by rows scored: the embedded model's greedy answers
(batch 1, stopping at eos) replayed through the suffix proposer's trie
(plugins/spec/suffix.py; the request's own and the finished requests'),
each step costed by the table. Decode steps only (prefill is not
speculated). Three policies:

- ``all``: every draft verified whole (k, the trie's min_prob and factor);
- ``record``: each draft cut to the length that maximizes expected tokens
  a unit of cost, from kept-rates learned per draft class and position so
  far (what core/spec.py's DraftRecord does, with the table);
- ``oracle``: each draft cut to exactly the tokens that will be kept (no
  policy of draft length can do better with this proposer's drafts).

    python scripts/spec_replay.py [--workload grounded] [--costs 1,1.375,1.55,1.825,2.025,2.225,2.475,2.95,3.1]
        [--k 8] [--row-scale 0.8,0.6]

``--costs``: a step's CPU time with 1, 2, ... rows against 1 (measure it
with scripts/spec_rows.py). ``--k``: the longest draft (2: what a gate that
fixes k' = 2 for every draft leaves). ``--row-scale``: the same with every
draft row's cost scaled (what cheaper verification rows would give).
"""
from __future__ import annotations

import argparse

import numpy as np

from fdx.plugins.spec.suffix import SuffixTrie


def replay(items, costs, policy: str, k: int = 8, factor: float = 1.0, min_prob: float = 0.1):
    """(speed-up, acceptance, mean accepted length, proposals a step)."""
    shared, kept_rates = SuffixTrie(24), {}
    plain = spec = 0.0
    steps = drafts = proposed = accepted = 0
    for prompt, out in items:
        trie, active, toks = SuffixTrie(24), [], list(prompt)
        for t in toks:
            active = trie.extend(active, t)
        i = 0
        while i < len(out):
            own, score, m = trie.draft(toks, k, factor, min_prob, active)
            other, other_score, other_m = shared.draft(toks, k, factor, min_prob)
            if other_score > score:
                own, score, m = other, other_score, other_m
            own = own[:max(0, min(len(own), len(out) - i - 1, len(costs) - 1))]
            right = 0
            while right < len(own) and own[right] == out[i + right]:
                right += 1
            cls = (min(m, 8), bool(own) and score >= 0.9 * len(own))
            if policy == "oracle":
                own = own[:right]
            elif policy == "record" and own:
                reached, kept = kept_rates.get(cls, (np.zeros(k), np.zeros(k)))
                chance = np.cumprod((kept[:len(own)] + 3) / (reached[:len(own)] + 4))
                value = [1 / costs[0]] + [(1 + chance[:n].sum()) / costs[n] for n in range(1, len(own) + 1)]
                own = own[:int(np.argmax(value))]
            a = min(right, len(own))
            reached, kept = kept_rates.setdefault(cls, (np.zeros(k), np.zeros(k)))
            reached[:min(a + 1, len(own))] += 1
            kept[:a] += 1
            steps += 1
            drafts += bool(own)
            proposed += len(own)
            accepted += a
            spec += costs[len(own)]
            for t in out[i:i + a + 1]:
                active = trie.extend(active, t)
                toks.append(t)
            i += a + 1
        plain += len(out)
        shared.add(out)
    return plain / spec, accepted / max(proposed, 1), 1 + accepted / max(drafts, 1), drafts / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="grounded")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--costs", default="1,1.375,1.55,1.825,2.025,2.225,2.475,2.95,3.1",
                    help="a step's cost with 1, 2, ... rows against 1 (default: the Zen 5's, docs/speculative.md)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--row-scale", default="", help="comma-separated factors on a draft row's cost")
    args = ap.parse_args()
    costs = [float(c) for c in args.costs.split(",")]
    from fdx import LLM, SamplingParams
    from fdx.entrypoints.bench.throughput import workload_prompts
    with LLM(max_model_len=1024, max_num_seqs=1, num_threads=1, progress=False) as llm:
        prompts = workload_prompts(llm, args.workload)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=args.output_len))
    items = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    print(f"{args.workload}: {len(items)} answers, {sum(len(o) for _, o in items)} tokens; costs {costs}")
    for policy in ("all", "record", "oracle"):
        speed, rate, mal, per_step = replay(items, costs, policy, k=args.k)
        print(f"  {policy:<7} {speed:.2f}x decode, acceptance {100 * rate:.0f}%, mean accepted length {mal:.2f}, "
              f"{per_step:.2f} proposals a step")
    for scale in [float(x) for x in args.row_scale.split(",") if x]:
        scaled = [1 + scale * (c - 1) for c in costs]
        got = [replay(items, scaled, policy, k=args.k)[0] for policy in ("all", "record", "oracle")]
        print(f"  draft rows x{scale:g}: all {got[0]:.2f}x, record {got[1]:.2f}x, oracle {got[2]:.2f}x decode")


if __name__ == "__main__":
    main()
