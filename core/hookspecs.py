"""The hook specifications: the whole plugin surface of fdx.

Registration hooks are called once, when the plugin manager starts. Each
receives a ``register(name, obj)`` callback; config selects an
implementation by that name, never by call order. A name registered twice
is an error that names both plugins.

Observer hooks are called by the engine as things happen; they return
nothing and must not block for long.
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
def fdx_register_resource_managers(register: Register) -> None:
    """Register KV schedulers (``SchedulerPolicy`` subclasses) by name.

    Called once at start-up. ``config.scheduler.resource_manager`` picks one
    (built-ins: ``v1``, ``v0``)."""


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
def fdx_register_schedulers(register: Register) -> None:
    """Register request-level schedulers (queues across engine instances).

    Called once at start-up. Built-ins: ``local`` and ``global`` (Redis),
    picked by ``scheduler.request_scheduler``; the contract is in
    core/serving/request_scheduler.py."""


@hookspec
def fdx_register_kv_caches(register: Register) -> None:
    """Register KV block managers (``KVCacheManager`` subclasses) by name.

    Called once at start-up. ``config.cache.kv_cache`` picks one (built-ins:
    ``paged``, ``prefix``)."""


@hookspec
def fdx_register_connectors(register: Register) -> None:
    """Register KV connectors (``KVConnector`` subclasses) that move KV
    blocks in and out of the pool: a host/file tier, another instance.
    ``config.cache.kv_connector`` picks one (built-in: ``swap``)."""


@hookspec
def fdx_register_token_processors(register: Register) -> None:
    """Register token processors (``TokenProcessor`` subclasses): sampled
    token ids -> request outputs (stop checks, detokenizing, logprobs)."""


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
def fdx_register_logits_processors(register: Register) -> None:
    """Register logits processors (``LogitsProcessor`` subclasses) by
    name. The built-ins always run; ``config.decoding.logits_processors``
    adds others."""


# --- observer hooks -------------------------------------------------------

@hookspec
def fdx_engine_started(engine: Any) -> None:
    """The engine has loaded its model and allocated its KV cache."""


@hookspec
def fdx_request_added(request: Any) -> None:
    """A request was validated and queued in the engine."""


@hookspec
def fdx_step_finished(scheduler_output: Any, step_stats: Any, context: Any) -> None:
    """One engine step ran: what was scheduled (``SchedulerOutput``), its
    ``StepStats``, and a ``StepContext`` taken before ``update()``. An
    implementation may take any subset of these arguments."""


@hookspec
def fdx_request_finished(request: Any, output: Any) -> None:
    """A request finished (stopped, hit its length, or was aborted)."""
