"""Where an offline engine's resident memory is, stage by stage (docs/benchmarks.md,
"Resident memory"): after importing fdx and Paddle, after loading the model, after
a prefill of --input-len tokens, and after a second prompt of that length decoded
to --input-len + --output-len tokens (the same KV blocks, written further). Each
stage: VmRSS, its anonymous and file-backed parts (/proc/self/status: the
file-backed part is mostly Paddle's shared libraries), and the high-water mark
(VmHWM, what ``/usr/bin/time -v`` reports), in MiB.

    python scripts/bench_memory.py --model FILE.gguf --max-model-len 1024 [--kv-cache-dtype int8]
"""
from __future__ import annotations

import argparse
import os
import sys


def status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {k: int(fields[k].split()[0]) >> 10 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file or checkpoint directory (default: the embedded model)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=512)
    args = ap.parse_args()
    stages = [("start", status())]
    import fdx  # noqa: F401  (first, as every fdx process: Paddle then imports without torch)
    import paddle  # noqa: F401
    from fdx import LLM, SamplingParams
    stages.append(("import", status()))
    llm = LLM(args.model, max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype, progress=False)
    stages.append(("loaded", status()))
    n = args.input_len
    llm.generate([{"prompt_token_ids": list(range(100, 100 + n))}],
                 SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    stages.append((f"prefill {n}", status()))
    llm.generate([{"prompt_token_ids": list(range(1000, 1000 + n))}],
                 SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True))
    stages.append((f"{n} + {args.output_len}", status()))
    size = os.path.getsize(args.model) >> 20 if args.model and os.path.isfile(args.model) else None
    print(f"model {args.model or 'embedded'}" + (f" ({size} MiB)" if size else "") + f", KV {args.kv_cache_dtype}")
    print(f"{'stage':>12} {'VmRSS':>7} {'anon':>7} {'file':>7} {'VmHWM':>7}  (MiB)")
    for name, s in stages:
        print(f"{name:>12} {s['VmRSS']:7d} {s['RssAnon']:7d} {s['RssFile']:7d} {s['VmHWM']:7d}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
