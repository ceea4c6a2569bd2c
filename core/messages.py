"""The wire format between the API process and the engine process (and
any other process fed an engine's work): msgspec structs encoded as
msgpack, never pickle. Each message is tagged, so a decoder typed with a
union rejects anything that is not one of them."""
from __future__ import annotations

import msgspec

from fdx.core.sampling_params import SamplingParams

class EngineDeadError(RuntimeError):
    """The engine process is gone (or hung, and was stopped): what a
    request-level scheduler or the API's client raises or hands a waiting
    request (entrypoints/serving/engine_client.py, plugins/schedulers/)."""


# -- messages --------------------------------------------------------------------

class EngineAdd(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams                   # as the caller made it: one form on both sides
    trace: dict[str, str] = {}               # x-request-id, W3C traceparent / tracestate (Request.trace_headers)
    lora: str | None = None                  # the LoRA adapter it runs with (the request's model field), by name


class EngineAbort(msgspec.Struct, tag="abort"):
    """End requests early (the client went away, the server stops). Stop
    strings end requests in the engine (its token processor), never here."""
    request_ids: list[str]


class EngineShutdown(msgspec.Struct, tag="shutdown"):
    pass


class EngineLoRA(msgspec.Struct, tag="lora"):
    """Load (``path`` set) or unload a LoRA adapter (/v1/load_lora_adapter,
    /v1/unload_lora_adapter): answered with ``EngineLoRADone``, or
    ``EngineRejected`` (400: a bad adapter, with the reason; 404: unknown)
    under the same ``call_id``."""
    call_id: str
    name: str
    path: str | None = None


class EngineLoRADone(msgspec.Struct, tag="lora_done"):
    call_id: str


class SeqDelta(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]                     # new tokens since the last delta
    finish_reason: str | None = None         # "stop", "length", "abort" once finished
    stop_reason: int | str | None = None     # the stop token id or stop string that ended it
    logprobs: list[list[list[float]]] | None = None  # per new token: [[token_id, logprob, rank], ...]
    num_cached_tokens: int = 0
    queue_time_s: float | None = None        # arrival to first scheduled, on the first delta
    embedding: bytes | None = None           # a pooling request's (model.task embed): float32 [hidden], with
                                             # its finishing delta
    prefill_time_s: float | None = None      # first scheduled to first token, on the first delta with tokens
    decode_time_s: float | None = None       # first token to finished, on the last delta
    activations: list[tuple[str, list[int], int, bytes]] | None = None   # SamplingParams.activations
                                             # captures, with the finishing delta: ("point.layer",
                                             # positions, hidden, float32 [positions, hidden] bytes)
    prompt_logprobs: list[list[list[float]] | None] | None = None   # with prompt_logprobs=N, on the first
                                             # delta with tokens: per prompt token [[token_id, logprob, rank],
                                             # ...] by rank (the prompt's own token among them), None first


class EngineStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_blocks: int
    cache_stats: dict[str, float] = {}      # kv_cache.stats(): prefix-cache counters, if any
    num_preempted: int = 0                   # preemptions in this step
    num_computed_tokens: int = 0             # since the engine started
    num_recomputed_tokens: int = 0           # of those, computed again after a preemption
    step_time_s: float = 0.0                 # this step's wall time (0: no step ran, e.g. only aborts)
    num_prefill_tokens: int = 0              # prompt tokens computed in this step
    num_decode_tokens: int = 0               # decode tokens computed in this step


class EngineOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[SeqDelta]
    stats: EngineStats


class EngineRejected(msgspec.Struct, tag="rejected"):
    request_id: str
    message: str
    status: int = 400          # the HTTP status to answer (408: a guided compile timed out, 429: busy)


class EngineReady(msgspec.Struct, tag="ready"):
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    model_path: str
    backend: str
    kernels: str = ""                        # what fdx.ops.cpp.prepare() did: built, loaded, or unavailable
    generation_config: dict[str, int | float] = {}   # the model's sampling defaults (core/generation.py)
    weight_bytes: dict[str, int] = {}        # weights held, by kind ("q4_1", "f32", ...; model.weight_bytes())
    resident_bytes: int = 0                  # the engine process's resident set when it became ready
    hidden_size: int = 0                     # the model's hidden size: an embedding's length (model.task embed)


class EngineFailed(msgspec.Struct, tag="failed"):
    message: str
    expected: bool = False                   # a bad model or config (the message says what), not a bug


class EngineHeartbeat(msgspec.Struct, tag="beat"):
    """Sent every ``server.engine_heartbeat_interval_s`` by a thread of the
    engine process, from its start (loading included) to its end: silence
    means the process is frozen or gone, not that a step is long (``step_s``
    says that: the API process compares it with engine_step_timeout_s)."""
    loading: bool                            # still loading (no EngineReady yet)
    loop_idle_s: float                       # seconds since the step loop last went round
    resident_bytes: int                      # the engine process's resident memory
    step_s: float = 0.0                      # how long the step now running has run (0: none running)


ToEngine = EngineAdd | EngineAbort | EngineShutdown | EngineLoRA
FromEngine = EngineOutputs | EngineRejected | EngineReady | EngineFailed | EngineHeartbeat | EngineLoRADone

_encoder = msgspec.msgpack.Encoder()



encoder = msgspec.msgpack.Encoder()
