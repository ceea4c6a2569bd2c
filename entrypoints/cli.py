"""The ``fdx`` command line: generate, chat, plugins, env, serve, router, bench."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from fdx.entrypoints.bench import serve as bench_serve
from fdx.entrypoints.serving import cli as serve_cli
from fdx.entrypoints.bench import guided as bench_guided
from fdx.entrypoints.serving import router as router_cli
from fdx.entrypoints.bench import prefix as bench_prefix
from fdx.entrypoints.bench import soak as bench_soak
from fdx.entrypoints.bench import defaults as bench_defaults
from fdx.entrypoints.bench import perplexity as bench_perplexity
from fdx.core.config import FLAT_KEYS, ConfigError
from fdx.entrypoints.engine_args import (_ENGINE_INT_FLAGS, _ENGINE_STR_FLAGS, _add_engine_args,  # noqa: F401
                                  _add_output_args, _make_llm, _overrides, _show_progress)


# where neither a flag nor the model's generation_config sets a field
GENERATE_FALLBACK = {"temperature": 0.0, "max_tokens": 128}


def _add_sampling_args(p: argparse.ArgumentParser, chat: bool) -> None:
    from fdx.core.generation import CHAT_DEFAULTS, EMBEDDED_CHAT_DEFAULTS
    d = {**(CHAT_DEFAULTS if chat else GENERATE_FALLBACK)}

    def default(name: str, plain: str) -> str:
        if chat and name in EMBEDDED_CHAT_DEFAULTS:
            return (f"(default: the model's generation_config, else {EMBEDDED_CHAT_DEFAULTS[name]} for the "
                    f"embedded SmolLM2 and {d.get(name, plain)} for other models)")
        return f"(default: the model's generation_config, else {d.get(name, plain)})"

    p.add_argument("--max-tokens", type=int, default=None, help=f"tokens to generate at most {default('max_tokens', '')}")
    p.add_argument("--temperature", type=float, default=None, help=f"0 is greedy {default('temperature', '')}")
    p.add_argument("--top-p", type=float, default=None, help=f"nucleus probability mass, in (0, 1] {default('top_p', 1.0)}")
    p.add_argument("--top-k", type=int, default=None, help=f"keep the k likeliest tokens; -1 keeps all {default('top_k', -1)}")
    p.add_argument("--min-p", type=float, default=None,
                   help=f"drop tokens below min_p x the top probability {default('min_p', 0.0)}")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"above 1 discourages repeating prompt or output tokens {default('repetition_penalty', 1.0)}")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help=f"subtracted from the logit of every token already generated {default('presence_penalty', 0.0)}")
    p.add_argument("--frequency-penalty", type=float, default=None,
                   help=f"subtracted once for each time a token was generated {default('frequency_penalty', 0.0)}")
    p.add_argument("--sampling-seed", type=int, default=None, dest="sampling_seed",
                   help="this request's seed (default: none: the engine's --seed stream)")
    p.add_argument("--stop", action="append", default=[], help="stop string; repeatable (default: none)")


_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")


def _sampling(args, llm, chat: bool):
    """Flags set on the command line, then the model's generation defaults,
    then fdx's chat defaults (chat) or GENERATE_FALLBACK (generate)."""
    from fdx.core.generation import defaults_for
    from fdx.core.sampling_params import SamplingParams
    kw = {**(GENERATE_FALLBACK if not chat else {}),
          **defaults_for(llm.engine.generation_config, chat, llm.engine.chat_defaults)}
    kw.update({k: getattr(args, k) for k in _SAMPLING_FLAGS if getattr(args, k) is not None})
    return SamplingParams(**kw, seed=args.sampling_seed, stop=args.stop)


def _check_sampling_flags(args) -> None:
    """A bad sampling flag fails before the model loads (ValueError naming it)."""
    from fdx.core.sampling_params import SamplingParams
    SamplingParams(**{k: getattr(args, k) for k in _SAMPLING_FLAGS if getattr(args, k) is not None},
                   seed=args.sampling_seed, stop=args.stop)


def cmd_generate(args) -> int:
    _check_sampling_flags(args)
    llm = _make_llm(args)
    sp = _sampling(args, llm, chat=False)
    out = llm.generate([args.prompt], sp)[0].outputs[0]
    print(args.prompt + out.text)
    if not args.quiet:
        print(f"[finish_reason={out.finish_reason}, tokens={len(out.token_ids)}]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    _check_sampling_flags(args)
    llm = _make_llm(args)
    sp = _sampling(args, llm, chat=True)
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.message})
    out = llm.chat(messages, sp)[0].outputs[0]
    print(out.text)
    if not args.quiet:
        print(f"[finish_reason={out.finish_reason}, tokens={len(out.token_ids)}]", file=sys.stderr)
    return 0


def cmd_plugins(args) -> int:
    from fdx.core.plugins import get_plugin_manager
    print(get_plugin_manager().report())
    return 0


# The CPU flags that decide which kernels can run (the rest of /proc/cpuinfo's list is noise here).
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def env_report(backend_name: str = "auto", num_threads: int | None = None) -> str:
    """What ``fdx env`` prints: versions, the CPU and its flags, MKL and thread
    settings, and the backend's probed kernel table (set up as the engine does)."""
    import platform
    import fdx
    from fdx.core import host
    from fdx.core.config import FdxConfig
    from fdx.core.engine import select_backend
    from fdx.core.plugins import get_plugin_manager
    config = FdxConfig.build(backend=backend_name, num_threads=num_threads)
    backend = select_backend(config, get_plugin_manager())
    backend.setup(config)                    # probes (or reads the cache) as an engine start does
    import paddle
    flags = set(host.cpu_flags())
    has = [f for f in ISA_FLAGS if f in flags]
    lacks = [f for f in ISA_FLAGS if f not in flags and f in ("avx2", "fma", "avx512f")]
    table = backend.kernels
    lines = [
        f"fdx {fdx.__version__}, Python {platform.python_version()}, Paddle {paddle.__version__} "
        f"(commit {getattr(paddle.version, 'commit', '?')[:12]}, cuda={paddle.version.cuda()})",
        f"cpu: {host.cpu_model()}, {host.available_cores()} cores for this process",
        f"cpu flags: {' '.join(has) or '(unknown)'}" + (f"; no {', '.join(lacks)}" if lacks else ""),
        f"MKL_DEBUG_CPU_TYPE={os.environ.get('MKL_DEBUG_CPU_TYPE', '(unset)')}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}, "
        f"{host.PORTABLE_ENV}={'1' if host.portable_kernels() else '(unset)'}, "
        f"FDX_DISABLE_CPP_OPS={os.environ.get('FDX_DISABLE_CPP_OPS') or '(unset)'}",
        f"backend: {backend.describe()}",
        f"kernel table ({table.source}{f', {table.location}' if table.location else ''}):",
        *(f"  {name:<44} {'ok' if why is None else why}" for name, why in table.findings.items()),
        "what runs:",
        *(f"  {op:<14} {what}" for op, what in backend.kernel_choices().items()),
    ]
    return "\n".join(lines)


def cmd_env(args) -> int:
    print(env_report(args.backend, args.num_threads))
    return 0


def cmd_bench_throughput(args) -> int:
    from fdx.entrypoints.bench import throughput as bench
    llm = _make_llm(args, progress=False)
    try:
        run = lambda speculation: bench.throughput(llm, args.num_requests, args.input_len, args.output_len,
                                                   seed=args.bench_seed, profile=args.profile,
                                                   workload=args.workload, speculation=speculation,
                                                   ignore_eos=True if args.ignore_eos else None)
        ratios, cpu_ratios, decode_ratios = [], [], []    # speculation on / off, per round (the sides alternate)
        for _ in range(max(1, args.rounds) if llm.engine.speculation is not None else 1):
            baseline = run(False) if llm.engine.speculation is not None else None
            result = run(True)
            if baseline is not None:
                ratios.append(result["output_tokens_per_s"] / baseline["output_tokens_per_s"])
                # output tokens a CPU second (stopping at eos, the two sides' outputs may differ in length
                # where they differ: without --batch-invariant a near tie can go the other way)
                per_cpu = lambda r, n, t: r[n] / max(r[t], 1e-9)
                cpu_ratios.append(per_cpu(result, "output_tokens", "cpu_time_s")
                                  / per_cpu(baseline, "output_tokens", "cpu_time_s"))
                decode_ratios.append(per_cpu(result, "decode_output_tokens", "decode_cpu_time_s")
                                     / per_cpu(baseline, "decode_output_tokens", "decode_cpu_time_s"))
    except ValueError as e:
        print(f"fdx: error: {e}", file=sys.stderr)
        return 2
    if baseline is not None:       # speculation off, the same engine and prompts, first: the ratio's base
        result["baseline"] = {k: baseline[k] for k in ("output_tokens_per_s", "decode_tokens_per_s", "total_time_s")}
        result["outputs_equal"] = baseline["outputs_sha1"] == result["outputs_sha1"]
        result["batch_invariant"] = bool(llm.engine.config.backend.batch_invariant)
        result["row_invariant_rows"] = bench.row_invariant_rows(llm.engine)
        result["ratios"], result["cpu_ratios"], result["decode_cpu_ratios"] = ratios, cpu_ratios, decode_ratios
    print(json.dumps(result, indent=2) if args.json else bench.format_throughput(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fdx", description="fdx: plugin-based LLM inference")
    parser.add_argument("--log-level", dest="global_log_level", default=None, type=str.lower,
                        choices=["debug", "info", "warning", "error"],
                        help="fdx's log level (default: $FDX_LOG_LEVEL, else info)")
    parser.add_argument("--quiet", "-q", dest="global_quiet", action="store_true",
                        help="no progress bars and only warnings and errors from fdx (default: off)")
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="complete a prompt")
    g.add_argument("prompt", help="the text to continue")
    _add_engine_args(g)
    _add_sampling_args(g, chat=False)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="one chat turn through the model's chat template")
    c.add_argument("message", help="the user's message")
    c.add_argument("--system", default=None, help="a system message before it (default: none)")
    _add_engine_args(c)
    _add_sampling_args(c, chat=True)
    c.set_defaults(func=cmd_chat)

    p = sub.add_parser("plugins", help="list registered plugins by hook")
    p.set_defaults(func=cmd_plugins)

    e = sub.add_parser("env", help="the CPU, its flags, MKL and thread settings, and which kernels run here "
                                   "(probed once per machine, then cached)")
    e.add_argument("--backend", default="auto", help="device backend plugin (default: auto, the best available)")
    e.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: the cores we may use)")
    e.set_defaults(func=cmd_env)

    serve_cli.add_parser(sub)
    router_cli.add_parser(sub)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    t = bsub.add_parser("throughput", help="offline throughput through LLM")
    t.add_argument("--num-requests", type=int, default=64, help="requests, all queued at once (default: 64)")
    t.add_argument("--input-len", type=int, default=128, help="random prompt tokens per request (default: 128)")
    t.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default: 128)")
    t.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    t.add_argument("--workload", default=None, metavar="FILE",
                   help="prompts from a JSON-lines file ({\"messages\": [...]} or {\"prompt\": ...}), cycled to "
                        "--num-requests, or 'grounded' (shipped: code to copy with one change, passages to quote, "
                        "JSON to echo with edits) or 'chat' (shipped: free-form questions); with --speculative-config the run is made without speculation "
                        "first and the ratio printed (default: random prompts of --input-len)")
    t.add_argument("--ignore-eos", action="store_true",
                   help="with --workload: generate --output-len tokens past eos (default: each answer stops at its "
                        "eos, --output-len at most; random prompts always ignore eos)")
    t.add_argument("--rounds", type=int, default=1,
                   help="with --speculative-config: rounds of (without, with) speculation, alternating; the "
                        "ratio of each round is printed (default: 1)")
    t.add_argument("--json", action="store_true", help="print every figure as JSON (default: a table)")
    t.add_argument("--profile", action="store_true",
                   help="profile each step and break the full-batch decode steps down into GEMMs, attention "
                        "and the rest, by op and by phase (default: off)")
    _add_engine_args(t)
    t.set_defaults(func=cmd_bench_throughput)
    bench_prefix.add_parser(bsub)
    bench_guided.add_parser(bsub)
    bench_serve.add_parser(bsub)
    bench_soak.add_parser(bsub)
    bsub.add_parser("peers", add_help=False, help="fdx side by side with llama.cpp and ik_llama.cpp on this "
                    "machine (a developer tool in scripts/bench_peers/; builds them once)"
                    ).set_defaults(func=lambda args: _bench_peers([]))
    bench_defaults.add_parser(bsub)
    bench_perplexity.add_parser(bsub)
    for sp in _leaf_parsers(parser):          # every command takes --quiet and --log-level (README)
        have = {o for a in sp._actions for o in a.option_strings}
        if "--log-level" not in have:
            _add_output_args(sp)
        elif "--quiet" not in have:           # fdx router: its --log-level is uvicorn's and its own
            sp.add_argument("--quiet", "-q", action="store_true",
                            help="only warnings and errors from fdx (default: off)")
    return parser


def _leaf_parsers(parser: argparse.ArgumentParser):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
        return
    for sp in dict.fromkeys(subs[0].choices.values()):
        yield from _leaf_parsers(sp)


def log_level(args) -> str:
    """--log-level, else $FDX_LOG_LEVEL, else info (warning with --quiet)."""
    quiet = getattr(args, "quiet", False) or args.global_quiet
    args.quiet = quiet
    level = getattr(args, "log_level", None) or args.global_log_level or os.environ.get("FDX_LOG_LEVEL")
    return (level or ("warning" if quiet else "info")).upper()


def _bench_peers(argv: list[str]) -> int:
    """``fdx bench peers``: the tool in scripts/bench_peers/ parses its own arguments."""
    from fdx.entrypoints.bench import PeersToolMissing, load_peers
    try:
        tool = load_peers()
    except PeersToolMissing as e:
        print(f"fdx bench peers: error: {e}", file=sys.stderr)
        return 2
    return tool.main(argv)


def _peers_argv(argv: list[str]) -> list[str] | None:
    """The tool's arguments when the command is ``fdx [-q] [--log-level L] bench peers ...``, else None."""
    for i in range(len(argv) - 1):
        if argv[i:i + 2] == ["bench", "peers"]:
            lead = argv[:i]
            if all(a.startswith("-") or (j and lead[j - 1] == "--log-level") for j, a in enumerate(lead)):
                return lead + argv[i + 2:]
            return None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if (peers_argv := _peers_argv(argv)) is not None:
        return _bench_peers(peers_argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    level = log_level(args)
    from fdx.core.logs import configure
    try:
        configure(level)
    except ValueError:
        print(f"fdx: error: FDX_LOG_LEVEL={level.lower()!r} is not a log level (debug, info, warning, error)",
              file=sys.stderr)
        return 2
    os.environ["FDX_LOG_LEVEL"] = level            # the engine process of fdx serve logs at the same level
    # Paddle warns at import when OMP_NUM_THREADS > 1; the CPU backend sets the
    # thread count from config (backend.num_threads) or the cores, not from it
    os.environ.pop("OMP_NUM_THREADS", None)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError, KeyError) as e:
        from fdx.entrypoints.serving.engine_proc import user_message
        print(f"fdx: error: {user_message(e)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name != "paddle":
            raise
        print("fdx: error: PaddlePaddle is not installed; install fdx with its extra: "
              "pip install 'fdx[cpu]' (or 'fdx[gpu]', see docs/backends.md)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
