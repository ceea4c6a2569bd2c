"""``fdx serve``: its flags, wired into entrypoints/cli.py by ``add_parser``."""
from __future__ import annotations

import argparse
import os

SERVER_FLAGS = {  # flag dest -> config key
    "host": "server.host", "port": "server.port", "api_key": "server.api_key",
    "served_model_name": "server.served_model_name", "max_concurrency": "server.max_concurrency",
    "max_queue": "server.max_queue", "max_request_body_bytes": "server.max_request_body_bytes",
    "max_connections": "server.max_connections",
    "uvicorn_log_level": "server.log_level",
    "tool_call_parser": "server.tool_call_parser", "enable_auto_tool_choice": "server.enable_auto_tool_choice",
    "reasoning_parser": "server.reasoning_parser",
}


def add_parser(sub) -> argparse.ArgumentParser:
    from fdx.entrypoints.engine_args import _add_engine_args
    s = sub.add_parser("serve", help="the OpenAI-compatible server (default: SmolLM2 on 127.0.0.1:8000)",
                       description="Serve a model over an OpenAI-compatible HTTP API. See docs/serving.md.")
    s.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="a local Hugging Face folder or .gguf file, as in 'vllm serve MODEL' (= --model; "
                        "default: the embedded SmolLM2-135M-Instruct)")
    _add_engine_args(s)
    s.add_argument("--host", default=None, help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=None, help="port (default 8000; 0 picks a free one)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $FDX_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None, help="the model id clients send and /v1/models lists (default: the model file or folder name)")
    s.add_argument("--max-concurrency", type=int, default=None, help="HTTP generation requests in flight; past it 429 (default: no limit)")
    s.add_argument("--max-queue", type=int, default=None, help="sequences waiting for a first token; past it 429 (default: no limit)")
    s.add_argument("--max-request-body-bytes", type=int, default=None, help="larger request bodies get 413 (default: 4194304)")
    s.add_argument("--max-connections", type=int, default=None,
                   help="open client connections; past it 503 at once (default: what the descriptor limit leaves)")
    s.add_argument("--uvicorn-log-level", default=None, choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's own log level (default: info; warning with --quiet)")
    s.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="tool-call parser for tool_choice 'auto' (built-ins: hermes, llama3_json, ernie-4.5; default: none)")
    s.add_argument("--enable-auto-tool-choice", action="store_const", const=True, default=None,
                   help="allow tool_choice 'auto' (needs --tool-call-parser; default: off, 'auto' is a 400)")
    s.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split reasoning_content out of the output (built-ins: qwen3, deepseek_r1, ernie-4.5; default: none)")
    s.set_defaults(func=cmd_serve)
    return s


def server_config(args):
    from fdx.entrypoints.engine_args import _overrides
    from fdx.core.config import ConfigError, FdxConfig
    overrides = _overrides(args)
    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise ConfigError(f"two models: {args.model_arg!r} (positional) and --model {args.model!r}; give one")
        args.model = args.model_arg
    if args.model is not None:
        overrides["model"] = args.model
    if args.api_key is None and os.environ.get("FDX_API_KEY"):
        args.api_key = os.environ["FDX_API_KEY"]
    if getattr(args, "quiet", False) and args.uvicorn_log_level is None:
        args.uvicorn_log_level = "warning"
    for dest, key in SERVER_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[key] = value
    return FdxConfig.build(args.config, **overrides)


def cmd_serve(args) -> int:
    config = server_config(args)              # a bad key fails here, before any process starts
    from fdx.model_io.loader import check_model_path
    # a bad model path too: fdx.entrypoints.cli.main words it and exits 2, as for fdx generate
    check_model_path(config.model.model)
    from fdx.entrypoints.serving.app import run_server
    return run_server(config)
