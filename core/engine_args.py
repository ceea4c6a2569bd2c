"""The engine flags every command shares (`fdx generate | chat | serve | bench ...`)
and the LLM they build; the entry points import this, never each other."""
from __future__ import annotations

import argparse
import sys

from fdx.core.config import ConfigError


_ENGINE_INT_FLAGS = {  # flag -> help
    "max_model_len": "context length in tokens (default: the model's, capped at 8192)",
    "max_num_seqs": "sequences in one engine step (default: 64)",
    "max_num_batched_tokens": "tokens in one engine step (default: 2048 with chunked prefill)",
    "block_size": "tokens per KV-cache block (default: 16)",
    "num_kv_blocks": "KV-cache blocks (default: sized by cache.memory_fraction of free memory)",
    "num_threads": "CPU threads (default: the cores this process may use)",
    "seed": "the engine's sampling seed for requests without one (default: 0)",
}
_ENGINE_STR_FLAGS = {
    "resource_manager": "KV scheduler plugin (default: v1; see fdx plugins)",
    "kv_cache": "KV-cache plugin: paged or prefix (default: paged)",
    "backend": "device backend plugin (default: auto, the best available)",
    "quantization": "weight format: none, auto, q8_0, q4_0, q4_1, q4_k, q6_k, wint8, wint4, or a plugin's "
                    "(default: none, float32)",
}


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="a local Hugging Face folder or .gguf file; fdx downloads nothing "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--config", "-c", default=None, help="YAML config file (default: none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, flat (block_size=32) or dotted (cache.block_size=32); repeatable "
                        "(default: none; keys in docs/configuration.md)")
    for key, text in _ENGINE_INT_FLAGS.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, dest=key, help=text)
    for key, text in _ENGINE_STR_FLAGS.items():
        p.add_argument(f"--{key.replace('_', '-')}", default=None, dest=key, help=text)
    p.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_const", const=False,
                   default=None, help="run each prompt in one step (default: chunked prefill on)")
    _add_output_args(p)


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars and only warnings and errors from fdx (default: off)")
    p.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"], type=str.lower,
                   help="fdx's log level (default: $FDX_LOG_LEVEL, else info; warning with --quiet)")



def _overrides(args) -> dict:
    out = {}
    for key in (*_ENGINE_INT_FLAGS, *_ENGINE_STR_FLAGS, "enable_chunked_prefill"):
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


def _show_progress(args) -> bool:
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


def _make_llm(args, progress=None):
    from fdx.core.llm import LLM
    progress = _show_progress(args) if progress is None else progress
    return LLM(args.model, config=args.config, progress=progress, **_overrides(args))
