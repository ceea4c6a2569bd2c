"""The hook specifications: the whole plugin surface of fdx.

Registration hooks are called once, when the plugin manager starts. Each
receives a ``register(name, obj)`` callback; config selects an
implementation by that name, never by call order. A name registered twice
is an error that names both plugins.

Observer hooks are called by the engine as things happen, on the engine
thread; they return nothing and must not block for long. An implementation
takes any subset of a hook's arguments (by name); one that raises is logged
and the others still run. A module that implements them observes every
engine in the process; an ``Observer`` class registered by
``fdx_register_observers`` runs only in the engines whose config selects it
(``observability.observers``), with its settings.
"""
from __future__ import annotations

from typing import Any, Callable

import pluggy

PROJECT = "fdx"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[str, Any], None]


# --- registration hooks -------------------------------------------------

@hookspec
def fdx_register_kv_schedulers(register: Register) -> None:
    """Register KV schedulers (``KVScheduler`` subclasses) by name: the
    policy of what each step runs, on the engine's scheduling core.

    Called once at start-up. ``config.scheduler.kv_scheduler`` picks one
    (built-ins: ``v1``, ``v0``); settings: ``plugins.kv_scheduler.<name>``."""


@hookspec
def fdx_register_queue_policies(register: Register) -> None:
    """Register waiting-queue orders (``QueuePolicy`` subclasses).

    ``config.scheduler.policy`` picks one (built-ins: ``fcfs``, ``priority``,
    ``lpm``). Preempted requests go first whatever the policy."""


@hookspec
def fdx_register_admission_rules(register: Register) -> None:
    """Register admission rules (``AdmissionRule`` subclasses): may a
    waiting request start now. ``config.scheduler.admission`` lists the
    ones in force (none by default)."""


@hookspec
def fdx_register_preemption_policies(register: Register) -> None:
    """Register preemption victim policies (``PreemptionPolicy`` subclasses).

    ``config.scheduler.preemption`` picks one (built-ins: ``newest``,
    ``least-computed``)."""


@hookspec
def fdx_register_request_schedulers(register: Register) -> None:
    """Register request-level schedulers (``RequestScheduler`` subclasses:
    where a server's requests run, e.g. a queue across engine instances).

    Called once at start-up. Built-ins: ``local`` and ``global`` (Redis),
    picked by ``scheduler.request_scheduler``; settings:
    ``plugins.request_scheduler.<name>``."""


@hookspec
def fdx_register_kv_caches(register: Register) -> None:
    """Register KV block managers (``KVCacheManager`` subclasses) by name.

    Called once at start-up. ``config.cache.kv_cache`` picks one (built-ins:
    ``paged``, ``prefix``)."""


@hookspec
def fdx_register_connectors(register: Register) -> None:
    """Register KV connectors (``KVConnector`` subclasses) that move KV
    blocks in and out of the pool: a host/file tier, another instance.
    ``config.cache.kv_connector`` picks one (built-ins: ``swap``, ``splitwise``)."""


@hookspec
def fdx_register_token_processors(register: Register) -> None:
    """Register token processors (``TokenProcessor`` subclasses): sampled
    token ids -> request state on the engine side (eos, stop token ids,
    lengths; logprob ids and values). Text is the output processor's
    (core/output.py), not theirs."""


@hookspec
def fdx_register_backends(register: Register) -> None:
    """Register device backends (``Backend`` subclasses) by name.

    ``config.backend.name`` picks one; ``auto`` takes the first available
    in order of ``Backend.priority`` (highest first)."""


@hookspec
def fdx_register_attention_backends(register: Register) -> None:
    """Register attention backends (``AttentionBackend`` subclasses) by
    name; a ``Backend`` names the one its device uses (built-ins:
    ``paddle``, the device-agnostic reference, and ``cpu``, the compiled
    CPU kernel with the reference as fallback)."""


@hookspec
def fdx_register_samplers(register: Register) -> None:
    """Register samplers (``Sampler`` subclasses); a ``Backend`` names the
    one its device uses (built-in: ``host``, numpy)."""


@hookspec
def fdx_register_model_runners(register: Register) -> None:
    """Register model runners (``ModelRunner`` subclasses); a ``Backend``
    names the one its device uses (built-in: ``default``)."""


@hookspec
def fdx_register_guided_backends(register: Register) -> None:
    """Register guided-decoding backends (grammar -> token bitmask),
    selected by ``config.decoding.guided_backend``."""


@hookspec
def fdx_register_models(register: Register) -> None:
    """Register model classes by Hugging Face architecture name
    (``config.json``'s ``architectures[0]``)."""


@hookspec
def fdx_register_weight_formats(register: Register) -> None:
    """Register weight formats (``WeightFormat`` subclasses): how a model
    holds and multiplies its linear layers. ``config.model.quantization``
    picks one (built-ins: ``none``, ``auto``, ``q8_0``, ``q4_0``,
    ``q4_1``, ``q4_k``, ``q6_k``, ``wint8``, ``wint4``)."""


@hookspec
def fdx_register_lora_loaders(register: Register) -> None:
    """Register LoRA adapter loaders (``LoRALoader`` subclasses) by name:
    a file format for adapters. ``config.lora.lora_loader`` picks one
    (built-in: ``peft``, a PEFT safetensors folder); it runs on every rank
    where the model runs, and what it returns is checked against the model
    by the engine (docs/lora.md)."""


@hookspec
def fdx_register_moe_routers(register: Register) -> None:
    """Register mixture-of-experts routers: classes constructed once per
    model as ``cls(settings, context)`` (``context.moe``, the model's
    ``MoeConfig``: ``num_experts``, ``top_k``, ...; the
    ``plugins.moe_router.<name>`` settings), whose instances are called in every MoE layer as
    ``router(logits, bias) -> (ids, weights)``: the router's float32 logits
    (numpy ``[rows, num_experts]``) and the checkpoint's expert-choice bias
    (float32 ``[num_experts]``, or None) in; each row's expert ids (int64
    ``[rows, k]``) and weights (float32 ``[rows, k]``) out.
    ``config.model.moe_router`` picks one in place of the architecture's own
    top-k (none built in)."""


@hookspec
def fdx_register_observers(register: Register) -> None:
    """Register observers (``Observer`` subclasses: classes whose methods
    are the observer hooks below) by name. ``config.observability.observers``
    lists the ones each engine builds, with ``plugins.observer.<name>`` as
    their settings (built-in: ``otel``, OpenTelemetry spans per request)."""


@hookspec
def fdx_register_logits_processors(register: Register) -> None:
    """Register logits processors (``LogitsProcessor`` subclasses) by
    name. The built-ins always run; ``config.decoding.logits_processors``
    adds others."""


@hookspec
def fdx_register_proposers(register: Register) -> None:
    """Register speculative-decoding proposers (``Proposer`` subclasses) by
    name. ``speculative.method`` picks one (built-ins: ``ngram``,
    ``suffix``); the engine verifies what it proposes in one forward and
    keeps only what the target model would have produced itself."""


@hookspec
def fdx_register_activation_functions(register: Register) -> None:
    """Register activation functions by name: ``fn(layer, positions, hidden,
    args) -> Tensor``, called in the forward for the rows of one request
    whose ``SamplingParams.activations`` add names it (``{"function":
    name, "args": {...}}``): ``layer`` the decoder layer, ``positions``
    the rows' token positions, ``hidden`` their activations at the hook's
    point ([rows, hidden], the full residual under tensor parallel, on
    every rank), ``args`` the request's. Returns the new activations, same
    shape (docs/research.md)."""


@hookspec
def fdx_register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers (``ToolParser`` subclasses) by name;
    ``server.tool_call_parser`` picks one (built-ins: ``hermes``,
    ``llama3_json``, ``ernie-4.5``). They run in the API process of
    ``fdx serve``: a module that registers one must not import Paddle."""


@hookspec
def fdx_register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers (``ReasoningParser`` subclasses) by name;
    ``server.reasoning_parser`` picks one (built-ins: ``qwen3``,
    ``deepseek_r1``, ``ernie-4.5``). API process only, as tool parsers."""


# --- observer hooks -------------------------------------------------------

@hookspec
def fdx_engine_started(engine: Any) -> None:
    """The engine (an ``EngineCore``) has loaded its model and allocated its
    KV cache; called once, at the end of its construction (before the
    server's warm-up request)."""


@hookspec
def fdx_request_added(request: Any) -> None:
    """A request (a ``Request``: ``request_id``, ``prompt_token_ids``,
    ``sampling_params``, ``arrival_time``, and ``trace_headers``, the
    W3C ``traceparent`` / ``tracestate`` and ``x-request-id`` it came with
    over HTTP, or None) was validated and queued in the engine, from
    ``EngineCore.add_request``."""


@hookspec
def fdx_step_finished(scheduler_output: Any, step_stats: Any, context: Any) -> None:
    """One engine step ran: what was scheduled (``SchedulerOutput``), its
    ``StepStats``, and a ``StepContext`` taken before ``update()``. An
    implementation may take any subset of these arguments."""


@hookspec
def fdx_request_finished(request: Any, output: Any) -> None:
    """A request finished: stopped, hit its length, was aborted, or was
    rejected. ``request`` is the engine's ``Request`` in its final state
    (``status``, ``first_scheduled_time``, ``first_token_time``,
    ``finished_time``, ``num_preemptions``); ``output`` its
    ``RequestOutput`` (one ``CompletionOutput``: text, token ids, finish
    reason; ``metrics``: the request's times on the monotonic clock)."""


# --- deprecated names (kept one release; core/plugins.py DEPRECATED_HOOKS) ---------

@hookspec
def fdx_register_resource_managers(register: Register) -> None:
    """Deprecated name of ``fdx_register_kv_schedulers`` (what it registers
    is a KV scheduler; a warning names the plugin)."""


@hookspec
def fdx_register_schedulers(register: Register) -> None:
    """Deprecated name of ``fdx_register_request_schedulers`` (what it
    registers is a request-level scheduler; a warning names the plugin)."""
