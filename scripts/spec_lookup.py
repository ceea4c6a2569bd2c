"""llama.cpp's n-gram lookup (``llama-lookup``) on the prompts of an fdx
bench workload, against its own plain decode, beside
``fdx bench throughput --workload W --speculative-config ...``
(docs/benchmarks.md, speculative decoding):

    python scripts/spec_lookup.py LLAMA_LOOKUP MODEL.gguf [--workload grounded] [--draft 8] [--rounds 2]

Each prompt goes through the model's chat template (fdx's tokenizer, as the
bench does), as text, with ``-t 1 --temp 0`` and up to ``--output-len``
tokens (llama-lookup stops at eos, as the bench does). Per prompt and round
three runs, alternated: ``-n 1`` (loading and the prompt), plain
(``--spec-draft-n-max 0``: a one-row step a token) and lookup
(``--spec-draft-n-max D``); the decode's CPU time is a run's process CPU
time less the ``-n 1`` run's, so a loaded machine's other jobs are not
counted. Prints llama-lookup's own n_drafted / n_accept totals, the
decoded tokens and the ratio of decode tokens a CPU second, lookup / plain.
Needs llama.cpp built with its ``llama-lookup`` target
(``cmake --build <build dir> --target llama-lookup``).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile


def run(binary: str, model: str, prompt_file: str, n: int, draft: int) -> tuple[float, dict]:
    """(process CPU seconds, llama-lookup's printed counts) of one run."""
    before = os.times()
    proc = subprocess.run([binary, "-m", model, "-f", prompt_file, "-n", str(n), "-t", "1", "-tb", "1",
                           "--temp", "0", "-c", "1024", "--spec-draft-n-max", str(draft)],
                          capture_output=True, text=True)
    after = os.times()
    if proc.returncode != 0:
        raise RuntimeError(f"{binary} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    log = proc.stdout + proc.stderr
    counts = {key: int(m.group(1)) for key in ("n_predict", "n_drafted", "n_accept")
              if (m := re.search(rf"{key}\s*=\s*(\d+)", log))}
    return (after.children_user + after.children_system) - (before.children_user + before.children_system), counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("binary", help="the llama-lookup executable")
    ap.add_argument("model", help="the GGUF (the embedded model's, for fdx's figures)")
    ap.add_argument("--workload", default="grounded")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--draft", type=int, default=8, help="llama-lookup's --spec-draft-n-max (default: 8)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from fdx import LLM
    from fdx.entrypoints.bench.throughput import workload_prompts
    llm = LLM(args.model, progress=False)
    prompts = [llm.tokenizer.decode(p) for p in workload_prompts(llm, args.workload)]
    del llm
    total = {"plain": [0.0, 0], "lookup": [0.0, 0]}
    drafted = accepted = 0
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            cpu_r = {"plain": [0.0, 0], "lookup": [0.0, 0]}
            for i, text in enumerate(prompts):
                path = os.path.join(tmp, f"p{i}.txt")
                with open(path, "w") as f:
                    f.write(text)
                base, _ = run(args.binary, args.model, path, 1, 0)
                sides = ("plain", "lookup") if (rnd + i) % 2 == 0 else ("lookup", "plain")
                for side in sides:
                    cpu, counts = run(args.binary, args.model, path, args.output_len, 0 if side == "plain" else args.draft)
                    cpu_r[side][0] += max(cpu - base, 1e-6)
                    cpu_r[side][1] += counts.get("n_predict", 0)
                    if side == "lookup" and rnd == 0:
                        drafted += counts.get("n_drafted", 0)
                        accepted += counts.get("n_accept", 0)
            for side in cpu_r:
                total[side][0] += cpu_r[side][0]
                total[side][1] += cpu_r[side][1]
            rate = {s: v[1] / v[0] for s, v in cpu_r.items()}
            ratios.append(rate["lookup"] / rate["plain"])
            print(f"round {rnd + 1}: plain {rate['plain']:.1f} tok/CPU-s, lookup {rate['lookup']:.1f} tok/CPU-s: "
                  f"{ratios[-1]:.2f}x", flush=True)
    print(f"llama-lookup --spec-draft-n-max {args.draft} on {len(prompts)} prompts of {args.workload}: "
          f"n_drafted {drafted}, n_accept {accepted} ({100 * accepted / max(drafted, 1):.1f}%), "
          f"decoded {total['lookup'][1] // args.rounds} tokens a round; lookup / plain by decode CPU time: "
          f"{', '.join(f'{r:.2f}' for r in ratios)} (median {sorted(ratios)[len(ratios) // 2]:.2f}x)")


if __name__ == "__main__":
    main()
