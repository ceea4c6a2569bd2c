"""A third-party fdx plugin package: one plugin per contract, each written
against ``fdx.core`` only (never ``fdx.plugins``), installed with pip and
found through the ``fdx`` entry-point group. fdx knows nothing about it.

- ``example-fifo`` KV scheduler: the engine's scheduling core's two
  loops, with a cap of its own on each new prompt's first chunk.
- ``shortest-first`` queue policy, ``tenant-cap`` admission rule (its
  settings declared as a ``Settings`` dataclass), ``most-output``
  preemption victim policy.
- ``example-blocks`` KV cache: a plain block pool, written from scratch.
- ``fakedev`` backend with its own ``example-naive`` attention backend
  (which also takes the optional fused ``rope_write_kv`` step).
- ``stop-after`` logits processor: a per-request argument
  (``extra_args={"stop_after": n}``) ends a request after n tokens.
- ``example-memory`` KV connector: a host-memory store of whole prompts;
  ``example-layer-recorder``: records the per-layer runner-side calls.
- ``example-int8`` weight format: every matrix (linear layers, embedding,
  LM head) as int8 with one float32 scale for the whole tensor.
- an observer of every step, through the ``StepContext``, and of every
  request added and finished (with its output), as module-level hooks.
- ``example-npz`` LoRA adapter loader (lora_loader.py): adapters as one
  numpy file, selected by ``lora.lora_loader``.
- ``example-recorder`` observer (an ``Observer`` class, selected by
  ``observability.observers``): writes each request it sees added and
  finished as a JSON line to the file its ``path`` setting names.
- ``example-lookback`` speculative-decoding proposer (proposer.py, its own
  entry point): a one-token lookup with a ``max_draft`` setting.

engine_parts.py has the token processor, sampler, model runner, request
scheduler and activation function; guided.py, model.py, parsers.py and
moe_router.py one kind each.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import Field

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import (AdmissionRule, AttentionBackend, Backend, KVCacheManager, KVConnector,
                                 KVScheduler, LinearWeight, LogitsProcessor, Observer, PreemptionPolicy,
                                 QueuePolicy, WeightFormat)
from fdx.core.kernels import KernelTable

# what the observer saw, for tests to read
STEPS: list[tuple[int, int]] = []        # (step, num_scheduled_tokens)
CONTEXTS: list[tuple[int, int, int, int]] = []   # (step, prefill tokens, decode tokens, kv blocks used)
STARTED: list[weakref.ref] = []         # each engine started, weakly: a plugin that kept the engines it saw
                                        # would keep every engine's model and KV cache alive with them
ROPE_CALLS: list[int] = []               # tokens per call of NaiveAttention.rope_write_kv
FINISHED: list[str] = []
ADDED: list[str] = []                    # request ids, from fdx_request_added
OUTPUTS: dict[str, tuple[list[int], str]] = {}   # request id -> (token ids, finish reason) of its output
LAYER_CALLS: list[tuple] = []            # the example-layer-recorder connector's runner-side calls


# --- a scheduler ---------------------------------------------------------------

class FifoScheduler(KVScheduler):
    """Running requests first, each its remaining tokens within the budget
    (the oldest first; the victim policy picks who gives way when blocks run
    out); then waiting ones in queue order, each new prompt's first chunk at
    most ``max_first_chunk`` tokens (a setting; chunked prefill only), so a
    long prompt arriving cannot take a whole step from the decodes."""

    # Deliberately in the older per-kind shape, ``(config, settings)``, calling its base's constructor
    # in that shape too: the one class here that keeps fdx's adapters for both tested (make_plugin calls it
    # so, and the base maps its call, each with a DeprecationWarning);
    # every other class in this package is written to ``(settings, context)``.
    def __init__(self, config, settings=None):
        super().__init__(config, settings)
        self.max_first_chunk = self.settings.get("max_first_chunk")
        if self.max_first_chunk is not None and (not isinstance(self.max_first_chunk, int)
                                                 or self.max_first_chunk < 1):
            raise ValueError(f"max_first_chunk must be a positive integer, got {self.max_first_chunk!r}")

    def schedule(self, core):
        core.schedule_running()

        def grant(request, hit, num_external):
            n = request.num_tokens - hit.num_tokens - num_external
            if not core.chunked_prefill:
                return n if n <= core.budget else None
            return min(n, core.budget, self.max_first_chunk or n)

        core.admit_waiting(grant)


# --- scheduling extensions ------------------------------------------------------

class ShortestFirst(QueuePolicy):
    """Shortest prompt first; ties by arrival."""

    def __init__(self, settings, context):
        super().__init__(settings, context)

    def key(self, request):
        return (request.num_prompt_tokens,)


@dataclass
class TenantCapSettings:
    """``plugins.admission_rule.tenant-cap``: the schema the engine validates
    (an unknown key or a bad value is a config error naming it)."""
    max_running: Annotated[int, Field(ge=1, strict=True)] = 1   # running requests per tenant


class TenantCap(AdmissionRule):
    """At most ``max_running`` running requests per tenant (``extra_args["tenant"]``)."""
    Settings = TenantCapSettings

    def __init__(self, settings: TenantCapSettings, context):
        super().__init__(settings, context)
        self.max_running = self.settings.max_running

    @staticmethod
    def tenant(request):
        return (request.sampling_params.extra_args or {}).get("tenant")

    def admit(self, request, state):
        tenant = self.tenant(request)
        if tenant is None:
            return True
        return sum(self.tenant(r) == tenant for r in state.running) < self.max_running


class MostOutput(PreemptionPolicy):
    """The request with the most generated tokens gives way (ties: the newest)."""

    def __init__(self, settings, context):
        super().__init__(settings, context)

    def choose_victim(self, running, state):
        return max(reversed(running), key=lambda r: r.num_output_tokens)


# --- a KV cache -------------------------------------------------------------------

class SimpleBlocks(KVCacheManager):
    """A free list and a block table per request; no sharing."""

    def __init__(self, settings, context):
        num_blocks = context.num_blocks
        super().__init__(settings, context)
        self.free_ids = list(range(num_blocks - 1, -1, -1))   # pops the lowest id first
        self.tables: dict[str, list[int]] = {}

    def allocate_slots(self, request, num_new_tokens, prefix=None):
        table = self.tables.get(request.request_id, [])
        need = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
        if need > len(self.free_ids):
            return False
        self.tables.setdefault(request.request_id, table).extend(self.free_ids.pop() for _ in range(max(0, need)))
        return True

    def free(self, request):
        self.free_ids.extend(reversed(self.tables.pop(request.request_id, [])))

    def block_table(self, request_id):
        return self.tables.get(request_id, [])

    @property
    def num_free_blocks(self):
        return len(self.free_ids)


# --- a device backend with its own attention ------------------------------------------

class NaiveMetadata:
    def __init__(self, positions, slots, seqs):
        self.positions = positions      # int64 [N]
        self.slots = slots              # int64 [N]: each new token's cache slot
        self.seqs = seqs                # per sequence: (first token row, query_len, all its slots [ctx + q])


class NaiveAttention(AttentionBackend):
    """Attention one sequence at a time, every KV head repeated: slow and
    plain, for a device that has no paged kernel."""
    name = "example-naive"

    def build_metadata(self, query_lens, context_lens, block_tables, spec, num_heads):
        import paddle
        positions, slots, seqs, row = [], [], [], 0
        for q, c, table in zip(query_lens, context_lens, block_tables):
            pos = np.arange(c + q)
            all_slots = np.asarray(table, dtype=np.int64)[pos // spec.block_size] * spec.block_size \
                + pos % spec.block_size
            positions.append(pos[c:])
            slots.append(all_slots[c:])
            seqs.append((row, q, paddle.to_tensor(all_slots)))
            row += q
        self.num_slots, self.num_kv_heads = spec.num_slots, spec.num_kv_heads
        return NaiveMetadata(paddle.to_tensor(np.concatenate(positions)), np.concatenate(slots), seqs)

    def _rows(self, slots):
        import paddle
        heads = np.arange(self.num_kv_heads)[None, :] * self.num_slots
        return paddle.to_tensor((np.asarray(slots)[:, None] + heads).reshape(-1))

    def write_kv(self, k_cache, v_cache, k, v, metadata):
        n, kvh, d = k.shape
        rows = self._rows(metadata.slots)
        k_cache.scatter_(rows, k.reshape([n * kvh, d]), overwrite=True)
        v_cache.scatter_(rows, v.reshape([n * kvh, d]), overwrite=True)

    def rope_write_kv(self, qkv, positions, k_cache, v_cache, metadata, *, num_heads, num_kv_heads, head_dim,
                      rope, q_norm=None, k_norm=None, eps=1e-6):
        """The optional fused step, done plainly (a real device would fuse
        it): split q/k/v, per-head RMS norm, rotary from ``rope``'s tables,
        then ``write_kv``."""
        import paddle
        n = qkv.shape[0]
        q, k, v = paddle.split(qkv, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                               axis=-1)
        q, k = q.reshape([n, num_heads, head_dim]), k.reshape([n, num_kv_heads, head_dim])
        v = v.reshape([n, num_kv_heads, head_dim])
        if q_norm is not None:
            q, k = _rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)
        cos = paddle.gather(rope.cos_cache, positions).unsqueeze(1)        # [N, 1, D]
        sin = paddle.gather(rope.sin_cache, positions).unsqueeze(1)
        rotary_dim = getattr(rope, "rotary_dim", head_dim)
        q, k = (_rotary(t, cos, sin, rope.is_neox_style, rotary_dim) for t in (q, k))
        self.write_kv(k_cache, v_cache, k, v, metadata)
        ROPE_CALLS.append(n)
        return q

    def forward(self, q, k_cache, v_cache, metadata, scale):
        import paddle
        import paddle.nn.functional as F
        _, h, d = q.shape
        kvh = self.num_kv_heads
        outs = []
        for row, ql, slots in metadata.seqs:
            total = slots.shape[0]
            rows = self._rows(slots.numpy())
            k = paddle.gather(k_cache, rows).reshape([total, kvh, d]).transpose([1, 0, 2])
            v = paddle.gather(v_cache, rows).reshape([total, kvh, d]).transpose([1, 0, 2])
            k = paddle.repeat_interleave(k, h // kvh, axis=0)
            v = paddle.repeat_interleave(v, h // kvh, axis=0)
            qs = q[row:row + ql].transpose([1, 0, 2])                     # [H, ql, D]
            scores = paddle.matmul(qs, k, transpose_y=True) * scale       # [H, ql, total]
            causal = np.arange(total)[None, :] <= (total - ql + np.arange(ql))[:, None]
            scores = scores + paddle.to_tensor(np.where(causal, 0.0, -1e30).astype("float32"))
            outs.append(paddle.matmul(F.softmax(scores, axis=-1), v).transpose([1, 0, 2]))
        return paddle.concat(outs, axis=0)


def _rms_norm(x, weight, eps):
    import paddle
    return x * paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + eps) * weight


def _rotary(x, cos, sin, neox, rotary_dim):
    """x * cos + rotate(x) * sin over the first rotary_dim dims: rotate the
    halves (neox) or the pairs (2i, 2i+1); the tables are 1 and 0 past it."""
    import paddle
    head = x[..., :rotary_dim]
    if neox:
        half = rotary_dim // 2
        rotated = paddle.concat([-head[..., half:], head[..., :half]], axis=-1)
    else:
        pairs = head.reshape(head.shape[:-1] + [rotary_dim // 2, 2])
        rotated = paddle.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(head.shape)
    if rotary_dim < x.shape[-1]:
        rotated = paddle.concat([rotated, paddle.zeros_like(x[..., rotary_dim:])], axis=-1)
    return x * cos + rotated * sin


class FakeDevice(Backend):
    """A "device" that is the host, with its own attention backend."""
    name = "fakedev"
    priority = -1                       # never picked by auto
    attention_backend = "example-naive"

    @classmethod
    def is_available(cls):
        return True

    def setup(self, config):
        import paddle
        paddle.set_device("cpu")
        self.kernels = KernelTable({"swiglu": probe_swiglu()}, source="in-process")

    def free_memory_bytes(self):
        return 1 << 30


def probe_swiglu() -> str | None:
    """Paddle's swiglu against silu(a) * b on this host: None when it
    matches, else why not (what a KernelTable finding says)."""
    import numpy as np
    import paddle
    import paddle.nn.functional as F
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((3, 16)).astype("float32"))
    try:
        got = F.swiglu(x).numpy()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    want = (F.silu(x[:, :8]) * x[:, 8:]).numpy()
    return None if np.allclose(got, want, atol=1e-5) else "wrong result"


# --- a stateful logits processor driven by a per-request argument -----------------------

class StopAfter(LogitsProcessor):
    """``extra_args={"stop_after": n}``: after n generated tokens, only eos
    may follow. Counts from the request's own outputs, so a request that
    comes back after a preemption resumes its count."""

    def __init__(self, settings, context):
        tokenizer = context.tokenizer
        super().__init__(settings, context)
        self.eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())[:1]
        self.limits: dict[str, tuple[int, object]] = {}    # request id -> (n, its live output list)
        self.rows: list[str] = []

    @classmethod
    def validate_params(cls, params):
        n = (params.extra_args or {}).get("stop_after")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"extra_args.stop_after must be a non-negative integer, got {n!r}")

    def update_state(self, update):
        for rid in update.removed:
            self.limits.pop(rid, None)
        for row in update.added:
            n = (row.params.extra_args or {}).get("stop_after")
            if n is not None:
                self.limits[row.request_id] = (n, row.output_token_ids)
        self.rows = update.rows

    def apply(self, logits):
        if self.limits and self.eos:
            for i, rid in enumerate(self.rows):
                limit = self.limits.get(rid)
                if limit is not None and len(limit[1]) >= limit[0]:
                    eos_logit = logits[i, self.eos[0]]
                    logits[i] = -np.inf
                    logits[i, self.eos[0]] = eos_logit if np.isfinite(eos_logit) else 0.0
        return logits


# --- a KV connector ---------------------------------------------------------------------

class LayerRecorder(KVConnector):
    """Moves nothing; records its runner-side calls in ``LAYER_CALLS``, in
    order: ("register", number of KV layers), then each step ("start", its
    step number from ``build_connector_meta``) and, per decoder layer of the
    forward, ("wait", layer) and ("save", layer, whether ``kv_layer`` is the
    registered KV of that layer)."""

    def __init__(self, settings, context):
        super().__init__(settings, context)
        self.step, self.kv_caches = 0, None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self):
        self.step += 1
        return self.step

    def register_kv_caches(self, kv_caches, layout):
        self.kv_caches = kv_caches
        LAYER_CALLS.append(("register", len(kv_caches)))

    def start_load_kv(self, metadata):
        LAYER_CALLS.append(("start", metadata))

    def wait_for_layer_load(self, layer):
        LAYER_CALLS.append(("wait", layer))

    def save_kv_layer(self, layer, kv_layer, attn_metadata):
        LAYER_CALLS.append(("save", layer, kv_layer is self.kv_caches[layer]))


class MemoryStore(KVConnector):
    """Keeps the KV of finished requests' full blocks in host memory, keyed
    by the token prefix they hold, and loads it back for a later request
    with the same prefix (a toy prefix cache beside the pool)."""

    def __init__(self, settings, context):
        super().__init__(settings, context)
        self.store: dict[tuple[int, ...], np.ndarray] = {}
        self.loads, self.saves, self.done = [], [], set()
        self.loaded_blocks = 0
        self.queued = 0

    def request_added(self, request):            # optional: told of every request the engine queues
        self.queued += 1

    def _prefixes(self, request, first, last):
        toks = request.all_token_ids
        return [(i, tuple(toks[:(i + 1) * self.block_size])) for i in range(first, last)]

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = 0
        for _, key in self._prefixes(request, num_computed_tokens // self.block_size,
                                     (request.num_tokens - 1) // self.block_size):
            if key not in self.store:
                break
            n += 1
        return n * self.block_size

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        first = request.num_computed_tokens // self.block_size
        for i, key in self._prefixes(request, first, first + num_external_tokens // self.block_size):
            self.loads.append((block_ids[i], key))

    def request_finished(self, request, block_ids):
        full = min(request.num_computed_tokens // self.block_size, len(block_ids))
        todo = [(block_ids[i], key) for i, key in self._prefixes(request, 0, full) if key not in self.store]
        if todo:
            self.saves.append((request.request_id, todo))
        return bool(todo)

    def build_connector_meta(self):
        meta, self.loads, self.saves = (self.loads, self.saves), [], []
        return meta

    def register_kv_caches(self, kv_caches, layout):
        self.kv_caches, self.spec = kv_caches, layout

    def _rows(self, block_id):
        import paddle
        s = self.spec
        slots = block_id * s.block_size + np.arange(s.block_size)
        return paddle.to_tensor(s.kv_rows(slots).reshape(-1))      # the layout's rows, never the formula

    def start_load_kv(self, metadata):
        import paddle
        if metadata is None:
            return
        loads, saves = metadata
        for rid, blocks in saves:
            for block_id, key in blocks:
                rows = self._rows(block_id)
                self.store[key] = np.stack([paddle.gather(self.spec.row_view(t), rows).numpy()
                                            for kv in self.kv_caches for t in kv])
            self.done.add(rid)
        for block_id, key in loads:
            rows, data = self._rows(block_id), self.store[key]
            for j, t in enumerate(t for kv in self.kv_caches for t in kv):
                self.spec.row_view(t).scatter_(rows, paddle.to_tensor(data[j]), overwrite=True)
            self.loaded_blocks += 1

    def get_finished(self):
        done, self.done = self.done, set()
        return done, set()

    def stats(self):
        return {"loaded_blocks": self.loaded_blocks, "stored_blocks": len(self.store), "queued_requests": self.queued}


# --- registration --------------------------------------------------------------------------

class SlowStep(LogitsProcessor):
    """``extra_args={"sleep_s": x}``: each step that samples for such a
    request sleeps x seconds (the longest asked in the batch), on the engine
    thread as a slow processor would. fdx's tests use it to make a step
    longer than a timeout, or a stream slower than its client."""

    def __init__(self, settings, context):
        super().__init__(settings, context)
        self.sleeps: dict[str, float] = {}
        self.rows: list[str] = []

    @classmethod
    def validate_params(cls, params):
        x = (params.extra_args or {}).get("sleep_s")
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 600):
            raise ValueError(f"extra_args.sleep_s must be a number of seconds in [0, 600], got {x!r}")

    def update_state(self, update):
        for rid in update.removed:
            self.sleeps.pop(rid, None)
        for row in update.added:
            x = (row.params.extra_args or {}).get("sleep_s")
            if x:
                self.sleeps[row.request_id] = float(x)
        self.rows = update.rows

    def apply(self, logits):
        longest = max((self.sleeps.get(rid, 0.0) for rid in self.rows), default=0.0)
        if longest:
            import time
            time.sleep(longest)
        return logits


@hookimpl
def fdx_register_kv_schedulers(register):
    register("example-fifo", FifoScheduler)


@hookimpl
def fdx_register_queue_policies(register):
    register("shortest-first", ShortestFirst)


@hookimpl
def fdx_register_admission_rules(register):
    register("tenant-cap", TenantCap)


@hookimpl
def fdx_register_preemption_policies(register):
    register("most-output", MostOutput)


@hookimpl
def fdx_register_kv_caches(register):
    register("example-blocks", SimpleBlocks)


@hookimpl
def fdx_register_backends(register):
    register("fakedev", FakeDevice)


@hookimpl
def fdx_register_attention_backends(register):
    register("example-naive", NaiveAttention)


@hookimpl
def fdx_register_logits_processors(register):
    register("stop-after", StopAfter)
    register("slow-step", SlowStep)


@hookimpl
def fdx_register_connectors(register):
    register("example-memory", MemoryStore)
    register("example-layer-recorder", LayerRecorder)


# --- a weight format -------------------------------------------------------------------

class TensorInt8(LinearWeight):
    """int8 values ``[rows, cols]`` and one scale for the whole tensor;
    every product dequantizes (a toy: small memory, slow products)."""

    kind = "example-int8"

    def __init__(self, q: np.ndarray, scale: float):
        self.q, self.scale, self.shape = q, scale, q.shape

    @classmethod
    def quantize(cls, w: np.ndarray) -> "TensorInt8":
        scale = float(np.abs(w).max()) / 127 or 1.0
        return cls(np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale)

    @property
    def nbytes(self):
        return self.q.nbytes + 4

    def dequantize(self):
        return self.q.astype(np.float32) * np.float32(self.scale)

    def matmul(self, x):
        import paddle
        y = paddle.matmul(x.astype("float32"), paddle.to_tensor(self.dequantize()), transpose_y=True)
        return y.astype(x.dtype)

    def embedding(self, ids):
        import paddle
        rows = self.q[ids.numpy()]
        return paddle.to_tensor(rows.astype(np.float32) * np.float32(self.scale))

    def take_rows(self, index):
        return TensorInt8(np.ascontiguousarray(self.q[np.asarray(index)]), self.scale)

    def take_cols(self, start, stop):
        return TensorInt8(np.ascontiguousarray(self.q[:, start:stop]), self.scale)


class TensorInt8Format(WeightFormat):
    """``model.quantization: example-int8``: float32 checkpoint tensors (GGUF
    blocks arrive dequantized: keeps_blocks is False) quantized per tensor.
    Written to the one constructor shape, ``(settings, context)``."""

    def __init__(self, settings, context):
        super().__init__(settings, context)

    def load(self, name, tensor, role):
        return TensorInt8.quantize(np.asarray(tensor, dtype=np.float32))


@hookimpl
def fdx_register_weight_formats(register):
    register("example-int8", TensorInt8Format)


@hookimpl
def fdx_engine_started(engine):
    STARTED.append(weakref.ref(engine))


@hookimpl
def fdx_step_finished(step_stats, context):
    STEPS.append((step_stats.step, step_stats.num_scheduled_tokens))
    CONTEXTS.append((context.step, sum(r.num_prefill_tokens for r in context.requests),
                     sum(r.num_decode_tokens for r in context.requests), context.kv_blocks_used))


@hookimpl
def fdx_request_added(request):
    ADDED.append(request.request_id)


@hookimpl
def fdx_request_finished(request, output):
    FINISHED.append(request.request_id)
    OUTPUTS[request.request_id] = (list(output.outputs[0].token_ids), output.outputs[0].finish_reason)


# --- an observer selected by config, with settings -------------------------------

class Recorder(Observer):
    """One JSON line per request added and finished, appended to
    ``settings["path"]`` (flushed at once: another process may read it)."""

    def __init__(self, settings, context):
        super().__init__(settings, context)
        if "path" not in self.settings:
            raise ValueError("the path setting is required: the file to write to")
        self.file = open(self.settings["path"], "a", buffering=1)

    def _write(self, **record):
        import json
        self.file.write(json.dumps(record) + "\n")

    def fdx_request_added(self, request):
        self._write(event="added", request_id=request.request_id, trace_headers=request.trace_headers,
                    num_prompt_tokens=len(request.prompt_token_ids))

    def fdx_request_finished(self, request, output):
        c = output.outputs[0]
        self._write(event="finished", request_id=output.request_id, token_ids=list(c.token_ids),
                    finish_reason=c.finish_reason, first_token_time=output.metrics["first_token_time"],
                    finished_time=output.metrics["finished_time"])

    def close(self):
        self.file.close()


@hookimpl
def fdx_register_observers(register):
    register("example-recorder", Recorder)
