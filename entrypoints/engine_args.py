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
    "num_kv_blocks": "KV-cache blocks (default: max_num_seqs x max_model_len tokens, capped at "
                     "cache.memory_fraction of the host's memory)",
    "num_threads": "CPU threads (default: the cores this process may use)",
    "seed": "the engine's sampling seed for requests without one (default: 0)",
}
_ENGINE_STR_FLAGS = {
    "kv_scheduler": "KV scheduler (policy) plugin: what each step runs (default: v1; see fdx plugins)",
    "kv_cache": "KV-cache plugin: paged or prefix (default: paged)",
    "backend": "device backend plugin (default: auto, the best available)",
    "quantization": "weight format: auto, none, q8_0, q4_0, q4_1, q4_k, q6_k, wint8, wint4, or a plugin's "
                    "(default: auto, each GGUF tensor in its own type; float32 for a float checkpoint)",
}


# vLLM's and FastDeploy's engine flags under their own names (docs/migrating.md): flag -> (config key, help)
_ALIAS_FLAGS = {
    "--tensor-parallel-size": ("tensor_parallel_size", int,
                               "vLLM/FastDeploy: worker processes sharing each layer (parallel.tensor_parallel_size; "
                               "default: 1)"),
    "--gpu-memory-utilization": ("memory_fraction", float,
                                 "vLLM/FastDeploy: in fdx, the most the default KV cache may take, as a share of "
                                 "the host's total memory (CPU; of the memory free after the weights and one "
                                 "largest-batch forward on a GPU); it holds max_num_seqs x max_model_len tokens "
                                 "below that (cache.memory_fraction; default: 0.1)"),
    "--kv-cache-ratio": ("plugins.kv_scheduler.v0.kv_cache_ratio", float,
                         "FastDeploy: the v0 scheduler's share of KV blocks prompts may take "
                         "(plugins.kv_scheduler.v0.kv_cache_ratio; default: 0.75); v0 only: refused "
                         "under another --kv-scheduler"),
    "--kv-cache-memory-bytes": ("kv_cache_memory_bytes", int,
                                "vLLM: the KV cache's size in bytes, whatever the memory (cache.kv_cache_memory_bytes; "
                                "default: max_num_seqs x max_model_len tokens, capped at cache.memory_fraction of "
                                "the host's memory)"),
    "--kv-cache-dtype": ("kv_cache_dtype", str,
                         "vLLM: the KV cache's element type: auto (the model's dtype) or int8 (CPU backend: "
                         "8-bit rows with a float32 scale each, about a quarter of float32's bytes; q8_0, "
                         "llama.cpp's name, is taken for int8; "
                         "cache.kv_cache_dtype; default: auto)"),
    "--num-gpu-blocks-override": ("num_kv_blocks", int, "vLLM/FastDeploy: = --num-kv-blocks (default: sized by "
                                                         "cache.memory_fraction)"),
    "--splitwise-role": ("splitwise_role", str,
                         "FastDeploy: mixed, prefill or decode (= --set kv_connector=splitwise --set "
                         "plugins.connector.splitwise.role=ROLE; default: mixed; docs/deployment.md)"),
    "--chat-template": ("chat_template", str,
                        "vLLM: a Jinja chat template, as a file or the template text (model.chat_template; "
                        "default: the model's own)"),
    "--generation-config": ("generation_config", str,
                            "vLLM: sampling defaults from 'auto' (the model's), 'vllm' (none: fdx's own) or a "
                            "folder with a generation_config.json (model.generation_config; default: auto)"),
    "--data-parallel-size": ("data_parallel_size", int,
                             "vLLM/FastDeploy: fdx serve only: engine processes (each with its own KV cache) "
                             "behind one API server, requests balanced by load and prompt prefix; the CPU threads "
                             "split between them (parallel.data_parallel_size; default: 1; docs/serving.md)"),
    "--task": ("task", str, "generate or embed (a pooling runner for /v1/embeddings; model.task; default: generate)"),
}
_DTYPES = {"auto": "auto", "float32": "float32", "float": "float32", "fp32": "float32", "float16": "float16",
           "half": "float16", "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_GUIDED = {"xgrammar": "xgrammar", "llguidance": "llguidance", "guidance": "llguidance"}

# vLLM / FastDeploy flags with no fdx setting: flag -> (values that ask for what fdx does anyway, what to use)
FOREIGN_FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "--pipeline-parallel-size": (("1",), "fdx has no pipeline parallelism; use --tensor-parallel-size (one host) "
                                         "or several servers behind fdx router (docs/deployment.md)"),
    "--enforce-eager": (("",), "fdx always runs eagerly unless backend.model_runner is cuda-graph"),
    "--disable-log-requests": (("",), "fdx logs no request contents"),
    "--disable-log-stats": (("",), "fdx logs no periodic stats; they are at /metrics"),
    "--load-format": (("auto",), "fdx reads safetensors folders and GGUF files as they are"),
    "--swap-space": ((), "fdx's second KV tier is counted in blocks: --set kv_connector=swap "
                              "--set plugins.connector.swap.max_blocks=N (docs/configuration.md)"),
    "--cpu-offload-gb": ((), "fdx keeps the weights on the device it runs on; use --quantization to shrink them"),
    "--tokenizer": ((), "fdx reads the tokenizer from the model folder or GGUF file"),
    "--revision": ((), "fdx loads local files only and downloads nothing"),
    "--download-dir": ((), "fdx loads local files only and downloads nothing"),
    "--max-num-partial-prefills": ((), "fdx has no partial-prefill limit; --max-num-batched-tokens bounds the "
                                       "prompt tokens of one step"),
    "--engine-worker-queue-port": ((), "fdx's engine talks to its API process over private ipc:// sockets"),
    "--cache-queue-port": ((), "fdx's engine talks to its API process over private ipc:// sockets"),
    "--metrics-port": ((), "fdx serves /metrics on --port"),
    "--enable-mm": ((), "fdx serves text models only"),
    "--max-logprobs": (("20",), "fdx bounds logprobs and prompt_logprobs at 20 per token, fixed"),
    "--enable-log-requests": (("",), "fdx logs no request contents; each request's id, status and timings are "
                                     "in its trace (observability.observers: [otel], docs/observability.md)"),
    "--response-role": (("assistant",), "fdx answers chat completions with the role 'assistant', fixed"),
    "--allowed-origins": ((), "fdx sends no CORS headers; put the page's origin and fdx behind one reverse proxy"),
    "--ssl-keyfile": ((), "fdx serves plain HTTP (on 127.0.0.1 by default); terminate TLS in a reverse proxy "
                          "in front of it (docs/deployment.md)"),
    "--ssl-certfile": ((), "fdx serves plain HTTP (on 127.0.0.1 by default); terminate TLS in a reverse proxy "
                           "in front of it (docs/deployment.md)"),
    "--root-path": ((), "fdx serves its routes at /; a reverse proxy that serves it under a prefix strips the "
                        "prefix before passing requests on"),
    "--enable-request-id-headers": (("",), "fdx always answers with the request's X-Request-Id header"),
    "--return-tokens-as-token-ids": ((), "fdx returns token text; ask for token ids with the completion's "
                                         "logprobs (each entry names its token id in /v1/completions' tokens)"),
    "--enable-logprob": (("",), "fdx always computes logprobs when a request asks for them"),
    "--max-waiting-time": ((), "fdx bounds the wait for a first token with server.max_queue (a 429 past it) and "
                               "the global scheduler's queue timeout (docs/deployment.md)"),
}


_SWITCHES = {"--enforce-eager", "--disable-log-requests", "--disable-log-stats", "--enable-mm",
             "--enable-log-requests", "--enable-request-id-headers", "--return-tokens-as-token-ids",
             "--enable-logprob"}


class _Foreign(argparse.Action):
    """A vLLM / FastDeploy flag: remembered, then checked by _overrides."""
    def __call__(self, parser, namespace, values, option_string=None):
        value = None if values == [] else values
        namespace.foreign_flags = [*getattr(namespace, "foreign_flags", []), (option_string, value)]


def check_foreign_flags(args) -> None:
    """A flag fdx has no setting for is an error that says so and what to use,
    unless its value asks for what fdx does anyway (a no-op, logged)."""
    import logging
    for flag, value in getattr(args, "foreign_flags", []):
        same, instead = FOREIGN_FLAGS[flag]
        if (value if value is not None else "") in same:
            logging.getLogger("fdx").info("%s%s: accepted, it changes nothing in fdx (%s)", flag,
                                          f" {value}" if value else "", instead)
            continue
        raise ConfigError(f"{flag}{f' {value}' if value is not None else ''}: not an fdx setting; {instead}")


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
    p.add_argument("--resource-manager", default=None, dest="resource_manager",
                   help="deprecated: = --kv-scheduler (scheduler.kv_scheduler; logs a warning; default: unset)")
    p.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_const", const=False,
                   default=None, help="run each prompt in one step (default: chunked prefill on)")
    p.add_argument("--batch-invariant", dest="batch_invariant", action="store_const", const=True, default=None,
                   help="a request's logits bitwise the same whatever shares its steps, at a measured cost "
                        "(backend.batch_invariant; docs/backends.md; default: off)")
    # vLLM's and FastDeploy's names for the same settings (docs/migrating.md)
    p.add_argument("--enable-chunked-prefill", dest="enable_chunked_prefill", action="store_const", const=True,
                   help="vLLM/FastDeploy: chunked prefill on (default: on)")
    p.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_const",
                   const=False, help="vLLM: = --no-chunked-prefill (default: chunked prefill on)")
    p.add_argument("--enable-prefix-caching", dest="kv_cache", action="store_const", const="prefix",
                   help="vLLM/FastDeploy: = --kv-cache prefix (default: paged, no prefix reuse)")
    p.add_argument("--no-enable-prefix-caching", dest="kv_cache", action="store_const", const="paged",
                   help="vLLM: = --kv-cache paged (default: paged)")
    for flag, (key, kind, text) in _ALIAS_FLAGS.items():
        names = [flag, {"--tensor-parallel-size": "-tp", "--data-parallel-size": "-dp"}[flag]] \
            if flag in ("--tensor-parallel-size", "--data-parallel-size") else [flag]
        p.add_argument(*names, dest=key, type=kind, default=None, help=text,
                       metavar=flag[2:].replace("-", "_").upper() if "." in key else None)
    p.add_argument("--dtype", default=None, type=str.lower, choices=sorted(_DTYPES), metavar="DTYPE",
                   help="vLLM: the dtype weights and activations compute in: auto, float32, float16, bfloat16 "
                        "(and vLLM's half, float); one the backend cannot compute in is an error saying so "
                        "(cpu: float32 only; model.dtype; default: auto)")
    p.add_argument("--guided-decoding-backend", default=None, metavar="NAME",
                   help="vLLM/FastDeploy: xgrammar, llguidance (vLLM's 'guidance'), auto (llguidance, else "
                        "xgrammar: the first installed) or none (off) (decoding.guided_backend; default: auto)")
    p.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help="vLLM: '{\"backend\": NAME}' with NAME as --guided-decoding-backend takes it "
                        "(decoding.guided_backend; default: auto)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM/FastDeploy: speculative decoding, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (methods: ngram, suffix, "
                        "draft_model with \"model\", or a plugin's; the speculative section, docs/speculative.md; "
                        "default: off)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="vLLM: trace each request to this OTLP/HTTP collector (= observability.observers: [otel] "
                        "and plugins.observer.otel.endpoint: URL; needs fdx[otel]; default: no tracing)")
    p.add_argument("--enable-lora", dest="enable_lora", action="store_const", const=True, default=None,
                   help="vLLM: requests may name LoRA adapters (lora.enable_lora; default: off; docs/lora.md)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="vLLM: LoRA adapters loaded at start, as name=path or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ...}' (lora.lora_modules; needs --enable-lora; default: none)")
    p.add_argument("--max-loras", type=int, default=None, dest="max_loras",
                   help="vLLM: LoRA adapters loaded at once (lora.max_loras; default: 1)")
    p.add_argument("--max-lora-rank", type=int, default=None, dest="max_lora_rank",
                   help="vLLM: the highest adapter rank accepted (lora.max_lora_rank; default: 16)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="vLLM/FastDeploy: accepted and ignored: fdx runs no code from a model's folder "
                        "(default: off, and on changes nothing)")
    p.add_argument("--enable-expert-parallel", dest="enable_expert_parallel", action="store_const", const=True,
                   default=None, help="vLLM/FastDeploy: a mixture-of-experts model's experts split whole over the "
                                      "--tensor-parallel-size ranks (parallel.expert_parallel_size = "
                                      "tensor_parallel_size; a divisor of it with --set expert_parallel_size=N; "
                                      "default: off, each expert's columns split instead)")
    p.add_argument("--use-cudagraph", dest="model_runner", action="store_const", const="cuda-graph",
                   help="FastDeploy: = --set model_runner=cuda-graph (cuda backend only; default: off)")
    for flag in FOREIGN_FLAGS:         # listed in docs/migrating.md, not in --help
        p.add_argument(flag, action=_Foreign, nargs=0 if flag in _SWITCHES else None, metavar="VALUE",
                       help=argparse.SUPPRESS)
    _add_output_args(p)


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars and only warnings and errors from fdx (default: off)")
    p.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"], type=str.lower,
                   help="fdx's log level (default: $FDX_LOG_LEVEL, else info; warning with --quiet)")



def _guided_backend(name: str) -> str:
    if name in ("auto", "none"):
        return name
    if name not in _GUIDED:
        raise ConfigError(f"--guided-decoding-backend {name}: fdx has auto, none, xgrammar and llguidance "
                          "(vLLM's 'guidance'), or a plugin's name with --set guided_backend=NAME")
    return _GUIDED[name]


def _structured_outputs_backend(text: str) -> str:
    """vLLM's --structured-outputs-config JSON: its ``backend`` (the only key fdx has)."""
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--structured-outputs-config: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError("--structured-outputs-config: a JSON object, e.g. '{\"backend\": \"xgrammar\"}'")
    unknown = sorted(set(value) - {"backend"})
    if unknown:
        raise ConfigError(f"--structured-outputs-config: key {unknown[0]!r} is not an fdx setting; fdx takes "
                          "'backend' only (docs/guided.md)")
    backend = value.get("backend", "auto")
    if not isinstance(backend, str):
        raise ConfigError("--structured-outputs-config: 'backend' must be a string")
    return _guided_backend(backend)


def _lora_modules(items: list[str]) -> dict[str, str]:
    """vLLM's --lora-modules entries, ``name=path`` or a JSON object with
    ``name`` and ``path`` (``base_model_name`` accepted): {name: path}."""
    import json
    out: dict[str, str] = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                value = json.loads(item)
            except ValueError as e:
                raise ConfigError(f"--lora-modules {item}: not JSON ({e})") from None
            unknown = sorted(set(value) - {"name", "path", "base_model_name"}) if isinstance(value, dict) else []
            if not isinstance(value, dict) or unknown or not isinstance(value.get("name"), str) \
                    or not isinstance(value.get("path"), str):
                raise ConfigError(f"--lora-modules {item}: a JSON entry is an object with 'name' and 'path' "
                                  f"(and 'base_model_name'){f'; {unknown[0]!r} is not one' if unknown else ''}")
            name, path = value["name"], value["path"]
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules {item}: expected name=path or a JSON object")
        if name in out:
            raise ConfigError(f"--lora-modules: {name!r} is given twice")
        out[name] = path
    return out


def _overrides(args) -> dict:
    check_foreign_flags(args)
    out = {}
    keys = (*_ENGINE_INT_FLAGS, *_ENGINE_STR_FLAGS, "resource_manager", "enable_chunked_prefill", "batch_invariant",
            "model_runner", "enable_lora", "max_loras", "max_lora_rank", "enable_expert_parallel",
            *(key for key, _, _ in _ALIAS_FLAGS.values()))
    for key in keys:
        v = getattr(args, key, None)
        if v is not None:
            out[key] = v
    if getattr(args, "dtype", None) is not None:
        out["dtype"] = _DTYPES[args.dtype]
    if getattr(args, "guided_decoding_backend", None) is not None:
        out["guided_backend"] = _guided_backend(args.guided_decoding_backend)
    if getattr(args, "structured_outputs_config", None) is not None:
        out["guided_backend"] = _structured_outputs_backend(args.structured_outputs_config)
    if getattr(args, "speculative_config", None) is not None:
        out["speculative_config"] = args.speculative_config     # JSON text: checked by FdxConfig.build
    if getattr(args, "lora_modules", None):
        out["lora.lora_modules"] = _lora_modules(args.lora_modules)
    if getattr(args, "otlp_traces_endpoint", None) is not None:
        out["observability.observers"] = ["otel"]
        out["plugins.observer.otel.endpoint"] = args.otlp_traces_endpoint
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
