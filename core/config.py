"""One config object with sections, from YAML, CLI flags and keyword overrides.

Every key is checked: an unknown key or a bad value fails with a
``ConfigError`` that names it (``cache.block_size``), never deep inside the
engine.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

log = logging.getLogger("fdx.config")


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    model: str | None = None                   # HF dir or .gguf; None: embedded SmolLM2
    max_model_len: int | None = Field(None, gt=0)   # None: the model's, capped at 8192
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"   # auto: the backend's first;
                                               # one the backend does not compute in is a config error
    quantization: str = "auto"                 # weight format plugin: auto (each GGUF tensor in its own type;
                                               # float32 for float checkpoints), none (fp32), q8_0, q4_0, q4_1,
                                               # q4_k, q6_k, wint8, wint4 (docs/configuration.md)
    moe_router: str | None = None              # a MoE model's expert choice (fdx_register_moe_routers); None:
                                               # the architecture's own top-k
    chat_template: str | None = None           # a Jinja file or the template text; None: the model's own
    generation_config: str = "auto"            # sampling defaults: auto (the model's), vllm / none (none:
                                               # fdx's), or a folder holding a generation_config.json
    task: Literal["generate", "embed"] = "generate"   # embed: a pooling runner (/v1/embeddings, LLM.embed)
    pooling_type: Literal["last", "mean"] = "last"    # task embed: the last prompt token's hidden state,
                                               # or the mean over the prompt's
    normalize: bool = True                     # task embed: L2-normalize each embedding


class CacheConfig(_Section):
    kv_cache: str = "paged"                    # KV-cache plugin name
    block_size: int = Field(16, gt=0, le=1024)
    num_kv_blocks: int | None = Field(None, gt=0)   # None: kv_cache_memory_bytes, else sized from the settings
    # the KV cache's bytes (vLLM's name; all ranks of this host together): num_kv_blocks from it
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    # the default KV cache holds max_num_seqs x max_model_len tokens, capped at this share of the host's
    # TOTAL memory (CPU; the same on every start) or of the device memory free after the weights and
    # one largest-batch forward (GPU backends without a total_memory_bytes)
    memory_fraction: float = Field(0.1, gt=0, le=0.95)
    kv_connector: str | None = None            # KV connector plugin name; None: none
    # the KV cache's element type: auto (the model's dtype) or int8 (CPU backend: per (token, kv head) row
    # head_dim int8 values + one float32 scale, about 3.8x less than float32 at head_dim 64; docs/backends.md);
    # q8_0 (llama.cpp's -ctk/-ctv name) is taken for int8: the same bytes at head_dim 64, one scale a row
    kv_cache_dtype: Literal["auto", "int8", "q8_0"] = "auto"

    @field_validator("kv_cache_dtype")
    @classmethod
    def _q8_0_is_int8(cls, value: str) -> str:
        return "int8" if value == "q8_0" else value


class SchedulerConfig(_Section):
    kv_scheduler: str = "v1"                   # KV scheduler (policy) plugin name: what each step runs
    policy: str = "fcfs"                       # waiting-queue order (queue policy plugin name)
    admission: list[str] = []                  # admission rule plugin names, all must agree
    preemption: str = "newest"                 # preemption victim policy plugin name
    max_num_seqs: int = Field(64, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)  # None: 2048, or max_model_len unchunked
    enable_chunked_prefill: bool = True
    request_scheduler: str = "local"           # request-level scheduler plugin: local (this engine) or
                                               # global (a Redis queue shared by instances, docs/deployment.md)

    def token_budget(self, max_model_len: int) -> int:
        """``max_num_batched_tokens``, its default resolved (the one place
        the rule is written: a fresh config works wherever a step is built)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max_model_len


class BackendConfig(_Section):
    name: str = "auto"                         # device backend plugin name, or auto
    num_threads: int | None = Field(None, gt=0)   # CPU threads; None: cores available
    model_runner: str | None = None            # model runner plugin name; None: the backend's choice
    batch_invariant: bool = False              # a row's bits independent of the rest of the step
                                               # (compiled kernels; docs/backends.md "Batch invariance")
    release_library_pages: bool = True         # before and after the model load, hand back the shared libraries'
                                               # pages only start-up touched (Linux; docs/backends.md "Resident memory")


class ParallelConfig(_Section):
    tensor_parallel_size: int = Field(1, gt=0, le=64)   # worker processes sharing each layer's heads and
                                               # MLP columns (the runner below); 1: in-process
    runner: str = "tp"                         # the executor under tensor_parallel_size > 1 (core Executor)
    data_parallel_size: int = Field(1, gt=0, le=64)   # fdx serve: engine processes (each with its own KV
                                               # cache and TP group) behind one API server; the threads
                                               # split between them (entrypoints/serving/data_parallel.py)
    # -- expert parallel (issue 39 item 3; docs/architecture.md "Mixture-of-experts layers")
    expert_parallel_size: int = Field(1, gt=0, le=64)   # MoE models: the tensor_parallel_size ranks in this
                                               # many groups, each holding num_experts / N whole experts
                                               # (their columns split over the group's ranks); must
                                               # divide tensor_parallel_size and num_experts
    enable_expert_parallel: bool = False       # vLLM/FastDeploy: expert_parallel_size = tensor_parallel_size


class DecodingConfig(_Section):
    token_processor: str = "default"
    logits_processors: list[str] = []          # logits processor plugins added to the built-ins
    guided_backend: str | None = "auto"        # guided decoding backend: auto (llguidance, else xgrammar,
                                               # whichever is installed first), a plugin's name, or
                                               # none / null (off)
    capture_logits: bool = False               # research tap: raw logits in each StepContext
    capture_hidden_states: bool = False        # research tap: final hidden states in each StepContext


class ServerConfig(_Section):
    host: str = "127.0.0.1"                    # loopback only unless told otherwise
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None                 # required as "Authorization: Bearer ..." on /v1
    served_model_name: str | None = None       # None: the model file or folder name
    max_concurrency: int | None = Field(None, gt=0)  # HTTP generation requests in flight; past it 429
    max_queue: int | None = Field(None, gt=0)  # sequences sent with no token yet; past it 429
    max_request_body_bytes: int = Field(4 * 1024 * 1024, gt=0)  # larger bodies get 413
    max_connections: int | None = Field(None, gt=0)  # open client connections; past it 503 at once.
                                               # None: what the descriptor limit leaves (never more)
    engine_death_grace_s: float = Field(2.0, ge=0)  # answer 503 this long after the engine died, then exit 1
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"  # uvicorn's
    access_log: bool = False
    # -- first-run UX (issue 12)
    ui: bool = True                            # the web page at / and GET /v1/engine/stats (entrypoints/serving/ui.py)

    # -- reliability and security (issue 13)
    engine_heartbeat_interval_s: float = Field(1.0, gt=0)   # the engine process says it is alive this often
    engine_heartbeat_timeout_s: float = Field(30.0, gt=0)   # silent this long: hung; killed, 503, exit 1
    engine_step_timeout_s: float = Field(60.0, gt=0)   # one step running longer: /health 503 until it ends
    stream_send_timeout_s: float = Field(60.0, gt=0)  # a client that takes no stream data this long is cut off
                                               # (counted from when its TCP stopped taking data)
    socket_send_buffer_bytes: int | None = Field(256 * 1024, gt=0)  # each client socket's kernel send
                                               # buffer (SO_SNDBUF); None: the kernel's (grows to MBs)
    header_timeout_s: float | None = Field(10.0, gt=0)  # a request head not complete this long after
                                               # the connection (or its first byte): 408, closed
    max_tokens_per_request: int | None = Field(None, gt=0)  # tokens one request may ask to generate, all
                                                            # completions together; past it 400
    health_access: Literal["open", "key", "off"] = "open"   # /health: no key needed, the API key, or 404
    metrics_access: Literal["open", "key", "off"] = "open"  # /metrics likewise
    # -- what one request may carry (issue 21; checked at the edge, serve and router: entrypoints/serving/edge.py)
    max_stop_strings: int = Field(16, gt=0)          # stop strings per request
    max_stop_string_chars: int = Field(1024, gt=0)   # characters in each stop string
    max_bad_words: int = Field(256, ge=0)            # bad_words entries (each is tokenized)
    max_bad_words_bytes: int = Field(64 * 1024, ge=0)  # UTF-8 bytes of all bad_words together
    max_logit_bias: int = Field(1024, ge=0)          # logit_bias entries
    max_allowed_token_ids: int = Field(262144, gt=0)  # allowed_token_ids entries
    max_guided_bytes: int = Field(64 * 1024, gt=0)   # a guided schema / regex / grammar / tag (as JSON)
    max_guided_choices: int = Field(1024, gt=0)      # guided_choice entries
    guided_compile_timeout_s: float = Field(30.0, gt=0)  # a compile not done by then: the request gets 408
    max_guided_compiles: int = Field(8, gt=0)        # large (> 4 KiB) constraints compiling or queued; past 429
    max_extra_args_bytes: int = Field(64 * 1024, gt=0)  # extra_args (vllm_xargs) as JSON
    max_messages: int = Field(4096, gt=0)            # chat messages per request (issue 35: checked before
    max_tools: int = Field(256, gt=0)                # tools per request             the schema validates)
    body_timeout_s: float | None = Field(30.0, gt=0)  # a request body not complete this long after its
                                               # head: 408, closed (per connection; None: no limit)
    refused_bytes_per_s: float | None = Field(1024 * 1024, gt=0)  # per client (address + key): refused
                                               # bodies' bytes refill this fast; an empty budget: 429
    refused_bytes_burst: int = Field(32 * 1024 * 1024, gt=0)  # ... up to this many (docs/security.md)
    content_special_tokens: Literal["parse", "text"] = "parse"  # special-token text in chat message
                                               # content: real special tokens, or encoded as plain text
    # -- chat output parsers (issue 20; plugins: fdx_register_tool_parsers / _reasoning_parsers)
    tool_call_parser: str | None = None        # finds calls in the output of tool_choice "auto" (hermes,
                                               # llama3_json, ernie-4.5); None: "auto" is refused
    enable_auto_tool_choice: bool = False      # tool_choice "auto" (the default with tools) is allowed
    reasoning_parser: str | None = None        # splits out reasoning_content (qwen3, deepseek_r1, ernie-4.5)

    @model_validator(mode="after")
    def _key_for_closed_endpoints(self):
        closed = [n for n in ("health_access", "metrics_access") if getattr(self, n) == "key"]
        if closed and not self.api_key:
            raise ValueError(f"{', '.join(closed)}='key' needs server.api_key to be set")
        return self


class SpeculativeConfig(_Section):
    """Speculative decoding (docs/speculative.md): a proposer drafts tokens,
    one forward of the model verifies them; the output never changes. Keys
    are vLLM's ``--speculative-config`` names; FastDeploy's ``max_ngram_size``
    / ``min_ngram_size`` are taken for prompt_lookup_max / _min."""
    method: str | None = None                  # a proposer (fdx_register_proposers: ngram, suffix, draft_model, or a
                                               # plugin's); None: off
    num_speculative_tokens: int = Field(4, ge=1, le=64)   # k: tokens proposed per request and step, at most
    prompt_lookup_min: int | None = Field(None, ge=1)     # ngram: shortest / longest n-gram of the tokens'
    prompt_lookup_max: int | None = Field(None, ge=1)     # end looked up earlier (vLLM's: 5 and 5; one set: both)
    suffix_decoding_max_tree_depth: int = Field(24, ge=1)   # suffix: longest match and draft kept
    suffix_decoding_max_cached_requests: int = Field(1000, ge=0)  # suffix: finished requests' outputs kept
                                               # for later requests (0: the request's own tokens only)
    suffix_decoding_max_spec_factor: float = Field(1.0, gt=0)  # suffix: draft at most factor x match length
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1)  # suffix: stop a draft where the next
                                               # token's share of the continuations falls below this
    model: str | None = None                   # draft_model: the draft's HF folder or .gguf (the target's
                                               # tokenizer; vLLM's key); "self": the target's own path
    disable_by_batch_size: int | None = Field(None, ge=1)   # vLLM's: no speculation on a step with at least
                                               # this many decoding requests
    cost_gate: bool = True                     # measure a forward of 1 against k+1 rows per request and
                                               # lower k (or skip) at batch sizes where it cannot pay

    @model_validator(mode="after")
    def _lookup_bounds(self):
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
        return self

    @model_validator(mode="after")
    def _draft_model_by_default(self):
        if self.method is None and self.model is not None:      # vLLM's: a model alone is a draft model
            self.method = "draft_model"
        return self

    @property
    def lookup_bounds(self) -> tuple[int, int]:
        """(min, max) n of the n-gram lookup, filled in as vLLM does: both 5
        when neither is set, else the one set for the other."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            return 5, 5
        return (lo or hi), (hi or lo)


class LoRAConfig(_Section):
    enable_lora: bool = False                  # requests may name LoRA adapters (docs/lora.md)
    max_loras: int = Field(1, gt=0)            # adapters loaded at once; one more evicts the least recently
                                               # used idle one (all in use: the request is refused)
    max_lora_rank: int = Field(16, gt=0)       # an adapter of a higher rank is refused at load
    lora_modules: dict[str, str] = {}          # name -> adapter path, loaded at start (--lora-modules)
    lora_loader: str = "peft"                  # adapter file format (fdx_register_lora_loaders)


class ObservabilityConfig(_Section):
    observers: list[str] = []                  # observer plugins each engine builds (fdx_register_observers;
                                               # built-in: otel, settings plugins.observer.otel)


class FdxConfig(_Section):
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    backend: BackendConfig = BackendConfig()
    decoding: DecodingConfig = DecodingConfig()
    parallel: ParallelConfig = ParallelConfig()
    server: ServerConfig = ServerConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    lora: LoRAConfig = LoRAConfig()
    seed: int | None = 0
    # plugin settings: {kind: {name: {key: value}}}, validated by the plugin's Settings schema (when it
    # declares one) and handed to its constructor (core/assembly.py)
    plugins: dict[str, dict[str, dict[str, Any]]] = {}

    @model_validator(mode="after")
    def _expert_parallel(self):
        """On the whole config (a section's own assignment, e.g. a draft model's
        tensor_parallel_size = 1, does not re-run it)."""
        p = self.parallel
        tp, ep = p.tensor_parallel_size, p.expert_parallel_size
        if p.enable_expert_parallel and ep == 1:
            if tp == 1:
                raise ValueError("config key 'parallel.enable_expert_parallel': expert parallel spreads the "
                                 "experts over the tensor-parallel ranks; set parallel.tensor_parallel_size "
                                 "(--tensor-parallel-size) to 2 or more")
            p.expert_parallel_size = ep = tp
        if tp % ep:
            raise ValueError(f"config key 'parallel.expert_parallel_size': {ep} does not divide "
                             f"parallel.tensor_parallel_size ({tp}): the experts are split over the "
                             "tensor-parallel ranks, in expert_parallel_size groups of equal size")
        return self

    @classmethod
    def build(cls, yaml_path: str | None = None, /, **overrides: Any) -> "FdxConfig":
        """YAML file first, then overrides: flat keys (``block_size``),
        dotted keys (``cache.block_size``) or whole sections (``cache={...}``)."""
        data: dict[str, Any] = {}
        if yaml_path:
            try:
                with open(yaml_path) as f:
                    loaded = yaml.safe_load(f) or {}
            except OSError as e:
                raise ConfigError(f"cannot read config file {yaml_path}: {e.strerror}") from None
            except yaml.YAMLError as e:
                raise ConfigError(f"config file {yaml_path} is not valid YAML: {e}") from None
            if not isinstance(loaded, dict):
                raise ConfigError(f"config file {yaml_path} must hold a mapping")
            for key, value in loaded.items():
                _merge(data, key, value)
        for key, value in overrides.items():
            if value is not None or key in ("seed",):
                _merge(data, key, value)
        for _, key, name in sorted(data.pop("__implied__", [])):   # an old key's plugin choice
            section, field = key.split(".")
            data.setdefault(section, {}).setdefault(field, name)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(_describe(e)) from None

    def overlay(self, other: "FdxConfig") -> "FdxConfig":
        """This config with the keys ``other`` sets explicitly (a fresh
        ``FdxConfig.build(policy=...)`` sets only ``scheduler.policy``) put
        over it; plugin settings merge by kind and name."""
        data = self.model_dump()
        for name in other.model_fields_set:
            value = getattr(other, name)
            if isinstance(value, _Section):
                data[name].update({f: getattr(value, f) for f in value.model_fields_set})
            elif name == "plugins":
                for kind, by_name in value.items():
                    data["plugins"].setdefault(kind, {}).update(by_name)
            else:
                data[name] = value
        try:
            return type(self).model_validate(data)
        except ValidationError as e:
            raise ConfigError(_describe(e)) from None

    def dotted(self) -> dict[str, Any]:
        """Every key as ``section.field`` (plugin settings as
        ``plugins.<kind>.<name>``) with its value."""
        out: dict[str, Any] = {"seed": self.seed}
        for s in SECTIONS:
            section = getattr(self, s)
            out.update({f"{s}.{f}": getattr(section, f) for f in type(section).model_fields})
        for kind, by_name in self.plugins.items():
            out.update({f"plugins.{kind}.{name}": value for name, value in by_name.items()})
        return out

    def flat(self) -> dict[str, Any]:
        return {k: getattr(getattr(self, s), f) if s else getattr(self, f)
                for k, (s, f) in FLAT_KEYS.items()}


SPECULATIVE_ALIASES = {"max_ngram_size": "prompt_lookup_max", "min_ngram_size": "prompt_lookup_min"}

SECTIONS = ("model", "cache", "scheduler", "backend", "decoding", "parallel", "server", "observability",
            "speculative", "lora")

# flat key -> (section, field); section "" means top level
FLAT_KEYS: dict[str, tuple[str, str]] = {"seed": ("", "seed")}
for _s in SECTIONS:
    for _f in FdxConfig.model_fields[_s].annotation.model_fields:
        FLAT_KEYS.setdefault(_f, (_s, _f))
FLAT_KEYS["backend"] = ("backend", "name")
FLAT_KEYS["model"] = ("model", "model")
FLAT_KEYS.pop("name", None)

# Deprecated keys (kept for one release, docs/configuration.md "Deprecated keys"): the old key, flat
# or dotted, -> the new one. Each use logs one warning naming both. Some old keys also chose a plugin;
# _implied says which selector a value sets, unless the config sets that selector itself.
DEPRECATED: dict[str, str] = {
    "splitwise.role": "plugins.connector.splitwise.role",
    "splitwise.connector_host": "plugins.connector.splitwise.host",
    "splitwise.connector_port": "plugins.connector.splitwise.port",
    "splitwise.connector_secret": "plugins.connector.splitwise.secret",
    "splitwise.transfer_timeout_s": "plugins.connector.splitwise.transfer_timeout_s",
    "splitwise.debug_transfer_delay_s": "plugins.connector.splitwise.debug_transfer_delay_s",
    "cache.kv_cache_ratio": "plugins.kv_scheduler.v0.kv_cache_ratio",
    "cache.swap_dir": "plugins.connector.swap.dir",
    "cache.swap_max_blocks": "plugins.connector.swap.max_blocks",
    "backend.cuda_graph": "backend.model_runner",
    "backend.cuda_graph_batch_sizes": "plugins.model_runner.cuda-graph.batch_sizes",
    "scheduler.resource_manager": "scheduler.kv_scheduler",
}
DEPRECATED_FLAT = {"splitwise_role": "splitwise.role", **{
    k.split(".", 1)[1]: k for k in DEPRECATED if k.split(".", 1)[1] not in FLAT_KEYS and k != "splitwise.role"}}
DEPRECATED_SECTIONS = ("splitwise",)
_warned: set[str] = set()
# Plugin kinds renamed (issue 36: one name each for the KV scheduler and the request-level scheduler): the old
# kind under ``plugins.`` is an alias of the new one (settings move, one warning), and the plugin manager finds
# the old kind name too (core/plugins.py). docs/configuration.md "Deprecated keys".
KIND_ALIASES: dict[str, str] = {"resource_manager": "kv_scheduler", "scheduler": "request_scheduler"}


def _implied(old: str, value: Any) -> tuple[str, Any] | None | bool:
    """What an old key's value means now: (selector key, plugin name) it also sets, None when it
    only moves, False when the value is the old default that selected nothing (dropped)."""
    if old == "backend.cuda_graph":
        return ("backend.model_runner", "cuda-graph") if value else False
    if old == "splitwise.role":
        return ("cache.kv_connector", "splitwise") if value in ("prefill", "decode") else (
            False if value == "mixed" else None)
    if old in ("cache.swap_dir", "cache.swap_max_blocks"):
        return ("cache.kv_connector", "swap") if value else None
    return None


def plugin_settings(kind: str, name: str, cls: Any, raw: dict | None) -> Any:
    """The ``plugins.<kind>.<name>`` mapping ``raw`` as the plugin class
    declares it: validated into ``cls.Settings`` (a pydantic model or a
    dataclass; an unknown key or a bad value is a ConfigError naming
    ``plugins.<kind>.<name>.<key>``), or, for a class without one, the dict
    itself (the plugin checks it)."""
    raw = dict(raw or {})
    schema = getattr(cls, "Settings", None)
    if schema is None:
        return raw
    key = f"plugins.{kind}.{name}"
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        known = set(schema.model_fields)
    elif dataclasses.is_dataclass(schema):
        known = {f.name for f in dataclasses.fields(schema)}
    else:
        raise TypeError(f"{cls.__qualname__}.Settings must be a pydantic model or a dataclass")
    for k in raw:
        if k not in known:
            raise ConfigError(f"unknown config key '{key}.{k}'; {name} has: {', '.join(sorted(known)) or 'none'}")
    try:
        return TypeAdapter(schema).validate_python(raw)
    except ValidationError as e:
        raise ConfigError(_describe(e, key)) from None


def _deep_update(node: dict[str, Any], value: dict[str, Any]) -> None:
    """``node.update(value)``, but a mapping met in both is merged, not replaced."""
    for k, v in value.items():
        if isinstance(v, dict) and isinstance(node.get(k), dict):
            _deep_update(node[k], v)
        else:
            node[k] = v


def _merge(data: dict[str, Any], key: str, value: Any) -> None:
    if key == "plugins" or key.startswith("plugins."):
        path = key.split(".")[1:]
        if not path:
            if not isinstance(value, dict):
                raise ConfigError(f"config key 'plugins' must be a mapping {{kind: {{name: {{...}}}}}}, got {value!r}")
            for kind, names in value.items():
                _merge(data, f"plugins.{kind}", names)
            return
        if len(path) < 2 and not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        if path[0] in KIND_ALIASES:
            old, path[0] = path[0], KIND_ALIASES[path[0]]
            if f"plugins.{old}" not in _warned:
                _warned.add(f"plugins.{old}")
                log.warning("config key 'plugins.%s' is deprecated: use 'plugins.%s' (docs/configuration.md)",
                            old, path[0])
            key = ".".join(["plugins", *path])
        node = data.setdefault("plugins", {})
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key '{key}': '{part}' is not a mapping")
        if isinstance(value, dict) and isinstance(node.get(path[-1]), dict):
            _deep_update(node[path[-1]], value)      # what an old key (an alias) put there stays
        else:
            node[path[-1]] = value
        return
    if key == "speculative_config":        # vLLM's name (LLM(speculative_config=...), --speculative-config)
        value = _speculative_mapping(value)
        if value is None:
            return
        key = "speculative"
    if key in DEPRECATED_FLAT:
        key = DEPRECATED_FLAT[key]
    if key in DEPRECATED:
        new = DEPRECATED[key]
        if key not in _warned:
            _warned.add(key)
            log.warning("config key '%s' is deprecated: use '%s' (docs/configuration.md)", key, new)
        implied = _implied(key, value)
        if implied is False:
            return
        if implied is not None:
            data.setdefault("__implied__", []).append((list(DEPRECATED).index(key), *implied))
            if implied[0] == new:
                return
        _merge(data, new, value)
        return
    if (key in SECTIONS or key in DEPRECATED_SECTIONS) and isinstance(value, dict):
        if key == "speculative":           # FastDeploy's names for two of its keys
            value = {SPECULATIVE_ALIASES.get(k, k): v for k, v in value.items()}
        for k, v in value.items():
            _merge(data, f"{key}.{k}", v)
        return
    if "." in key:
        section, field = key.split(".", 1)
        if section in DEPRECATED_SECTIONS:
            raise ConfigError(f"unknown config key '{key}'; section '{section}' is deprecated and has: "
                              f"{', '.join(k.split('.', 1)[1] for k in DEPRECATED if k.startswith(section + '.'))}")
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section '{section}' in key '{key}' "
                              f"(sections: {', '.join(SECTIONS)})")
    elif key in FLAT_KEYS:
        section, field = FLAT_KEYS[key]
    else:
        raise ConfigError(f"unknown config key '{key}'; known keys: {', '.join(sorted(FLAT_KEYS))}")
    if not section:
        data[field] = value
        return
    known = FdxConfig.model_fields[section].annotation.model_fields
    if field not in known:
        raise ConfigError(f"unknown config key '{section}.{field}'; "
                          f"section '{section}' has: {', '.join(known)}")
    data.setdefault(section, {})[field] = value


_SECRET_NAMES = ("secret", "password", "api_key")     # values never echoed in an error


def _redacted(value, name: str = ""):
    """``value`` as an error may show it: settings named like a secret as ``***``."""
    if value and any(s in name for s in _SECRET_NAMES):
        return "***"
    if isinstance(value, dict):
        return {k: _redacted(v, str(k)) for k, v in value.items()}
    return value


def _describe(e: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in e.errors():
        loc = ".".join([prefix] * bool(prefix) + [str(p) for p in err["loc"]])
        if not loc and err["msg"].startswith("Value error, config key '"):   # a whole-config check names its key
            parts.append(err["msg"][len("Value error, "):])
            continue
        shown = _redacted(err.get("input"), str(err["loc"][-1]) if err["loc"] else "")
        parts.append(f"config key '{loc}': {err['msg']} (got {shown!r})")
    return "; ".join(parts)


def _speculative_mapping(value: Any) -> dict | None:
    """vLLM's ``speculative_config``: a mapping or its JSON text (None or {}: off)."""
    if isinstance(value, str):
        import json
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"config key 'speculative_config': not JSON ({e})") from None
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError("config key 'speculative_config' must be a mapping, e.g. "
                          "{\"method\": \"ngram\", \"num_speculative_tokens\": 4}")
    return value
