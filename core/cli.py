"""The ``fdx`` command line: generate, chat, plugins, bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from fdx.core.bench import serve as bench_serve
from fdx.core.serving import cli as serve_cli
from fdx.core.serving import router as router_cli
from fdx.core.bench import prefix as bench_prefix
from fdx.core.config import FLAT_KEYS, ConfigError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--config", "-c", default=None, help="YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, flat (block_size=32) or dotted (cache.block_size=32); repeatable")
    for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                "num_threads", "seed"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, dest=key)
    for key in ("resource_manager", "kv_cache", "backend"):
        p.add_argument(f"--{key.replace('_', '-')}", default=None, dest=key)
    p.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_const", const=False, default=None)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, dest="sampling_seed")
    p.add_argument("--stop", action="append", default=[])


def _overrides(args) -> dict:
    out = {}
    for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                "num_threads", "seed", "resource_manager", "kv_cache", "backend", "enable_chunked_prefill"):
        v = getattr(args, key, None)
        if v is not None:
            out[key] = v
    for item in args.set:
        if "=" not in item:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        import yaml
        out[k.strip()] = yaml.safe_load(v)
    return out


def _make_llm(args, progress=True):
    from fdx.core.llm import LLM
    return LLM(args.model, config=args.config, progress=progress, **_overrides(args))


def _sampling(args):
    from fdx.core.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop)


def cmd_generate(args) -> int:
    sp = _sampling(args)
    llm = _make_llm(args)
    out = llm.generate([args.prompt], sp)[0].outputs[0]
    print(args.prompt + out.text)
    print(f"[finish_reason={out.finish_reason}, tokens={len(out.token_ids)}]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    sp = _sampling(args)
    llm = _make_llm(args)
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.message})
    out = llm.chat(messages, sp)[0].outputs[0]
    print(out.text)
    print(f"[finish_reason={out.finish_reason}, tokens={len(out.token_ids)}]", file=sys.stderr)
    return 0


def cmd_plugins(args) -> int:
    from fdx.core.plugins import get_plugin_manager
    print(get_plugin_manager().report())
    return 0


def cmd_bench_throughput(args) -> int:
    from fdx.core.bench import throughput as bench
    llm = _make_llm(args, progress=False)
    result = bench.throughput(llm, args.num_requests, args.input_len, args.output_len, seed=args.bench_seed)
    print(json.dumps(result, indent=2) if args.json else bench.format_throughput(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fdx", description="fdx: plugin-based LLM inference")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="complete a prompt")
    g.add_argument("prompt")
    _add_engine_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="one chat turn through the model's chat template")
    c.add_argument("message")
    c.add_argument("--system", default=None)
    _add_engine_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    p = sub.add_parser("plugins", help="list registered plugins by hook")
    p.set_defaults(func=cmd_plugins)

    serve_cli.add_parser(sub)
    router_cli.add_parser(sub)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    t = bsub.add_parser("throughput", help="offline throughput through LLM")
    t.add_argument("--num-requests", type=int, default=64)
    t.add_argument("--input-len", type=int, default=128)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--bench-seed", type=int, default=0)
    t.add_argument("--json", action="store_true")
    _add_engine_args(t)
    t.set_defaults(func=cmd_bench_throughput)
    bench_prefix.add_parser(bsub)
    bench_serve.add_parser(bsub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"fdx: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
