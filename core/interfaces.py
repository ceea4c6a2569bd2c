"""The contracts plugins implement, each written here once.

A plugin implements one of these classes (subclassing it, or matching it
method for method) and registers it by name through a registration hook
(core/hookspecs.py); config picks it by that name. Every class the engine
constructs receives ``settings`` from the config section
``plugins: {<kind>: {<name>: {...}}}``: when the class declares a
``Settings`` schema (a pydantic model or a dataclass, as a class attribute),
an instance of it that the engine validated (errors name
``plugins.<kind>.<name>.<key>``; defaults when the section is absent);
otherwise the dict (empty when absent), which the plugin validates itself,
raising ``ValueError`` naming the key.

The data between the parts is plain: dataclasses of ints, strings, lists
and ``SamplingParams``, so a step can cross a process boundary (msgspec
encodes every one of them; see core/messages.py).
"""
from __future__ import annotations

import abc
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from fdx.core.activations import ActivationCapture
from fdx.core.kernels import REFERENCE, KernelTable
from fdx.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fdx.core.config import FdxConfig
    from fdx.core.request import Request


# =============================================================================
# How every kind is constructed: factory(settings, context)
# =============================================================================

@dataclass
class BuildContext:
    """What the engine hands every plugin it constructs, beside its settings:
    every kind's factory is called as ``factory(settings, context)``
    (``fdx.core.plugins.make_plugin``, the one place that constructs a
    plugin). ``settings`` is the validated ``plugins.<kind>.<name>``
    (the class's ``Settings`` instance, or the dict when it declares none);
    ``context`` is this object, with the fields the kind may need set and
    the others left at their defaults:

    - every kind: ``config`` (the engine's ``FdxConfig``), ``plugins`` (the
      plugin manager), ``kind`` and ``name`` (what it was selected as);
    - ``kv_cache``: ``num_blocks``, ``block_size``; ``connector``:
      ``block_size``; ``queue_policy``: ``kv_cache``;
    - ``token_processor``: ``tokenizer`` (None where no request has stop
      strings: the conformance kit); ``logits_processor``: ``tokenizer``,
      ``vocab_size``; ``guided_backend``: ``tokenizer``, ``vocab_size``,
      ``eos_token_ids``;
    - ``request_scheduler``: ``engine`` (the server's ``EngineClient``),
      ``metrics`` (its ``ServerMetrics``);
    - ``weight_format``: ``kernels`` (the backend's probed table);
      ``model``: ``hf_config``, ``weights``, ``weight_format``;
      ``moe_router``: ``moe`` (``Model.moe``); ``proposer``: ``vocab_size``;
    - ``tool_parser``: ``tokenizer``, ``tools`` (the request's);
      ``reasoning_parser``: ``tokenizer``;
    - ``attention_backend``, ``sampler``: ``backend``, ``kernels``;
    - ``model_runner``: ``runner`` (the ``RunnerContext``: model, KV
      tensors, attention, sampler, ...); an executor (``parallel.runner``,
      registered with the model runners): ``assembly`` (the engine's
      ``Assembly``), ``backend``, ``dtype``, ``progress``,
      ``defer_tokenizer``.

    Every fdx base class takes ``(settings, context)`` too, so a subclass
    calls ``super().__init__(settings, context)``. A class whose
    constructor is still one of the older per-kind shapes (docs/plugins.md)
    is called in that shape, with a DeprecationWarning; a subclass that
    calls its base's constructor in the older shape has the call mapped
    (``base_args``), with one too."""
    config: Any = None
    plugins: Any = None
    kind: str = ""
    name: str = ""
    backend: Any = None
    kernels: KernelTable = REFERENCE
    tokenizer: Any = None
    vocab_size: int = 0
    eos_token_ids: Any = frozenset()
    num_blocks: int = 0
    block_size: int = 0
    kv_cache: Any = None
    engine: Any = None
    metrics: Any = None
    hf_config: Any = None
    weights: Any = None
    weight_format: Any = None
    moe: Any = None
    tools: Any = None
    runner: Any = None
    assembly: Any = None
    dtype: str = ""
    progress: bool = True
    defer_tokenizer: bool = False


# Each kind's base-class constructor before issue 36, in order: a subclass that still calls
# ``super().__init__`` so gets ``base_args``' mapping onto (settings, context), with a DeprecationWarning.
# (fdx.core.plugins.OLD_SHAPES is the other half: a class whose own constructor is in an older shape.)
OLD_BASE_ARGS: dict[str, tuple[str, ...]] = {
    "kv_scheduler": ("config", "settings"),
    "queue_policy": ("kv_cache", "settings"),
    "admission_rule": ("config", "settings"),
    "preemption_policy": ("config", "settings"),
    "request_scheduler": ("config", "engine", "metrics", "settings"),
    "kv_cache": ("num_blocks", "block_size", "config", "settings"),
    "connector": ("config", "block_size", "settings"),
    "token_processor": ("tokenizer", "settings"),
    "logits_processor": ("config", "tokenizer", "vocab_size", "settings"),
    "guided_backend": ("tokenizer", "vocab_size", "eos_token_ids", "settings"),
    "sampler": ("config", "settings"),
    "model_runner": ("runner",),
    "weight_format": ("kernels", "settings"),
    "proposer": ("config", "vocab_size", "settings"),
    "tool_parser": ("tokenizer", "tools", "settings"),
    "reasoning_parser": ("tokenizer", "settings"),
    "observer": ("config", "settings"),
}


def base_args(part: Any, kind: str, settings: Any, context: Any, old: tuple,
              kw: dict[str, Any]) -> tuple[Any, BuildContext]:
    """``(settings, context)`` for the base-class constructor of ``kind``
    called by ``part``: as ``(settings, context)``, by position or by name
    (``context`` None, for a part built by hand: an empty ``BuildContext``),
    or, deprecated, in the kind's older shape (``OLD_BASE_ARGS``, by
    position, ``settings`` and the others also by name)."""
    if not old and set(kw) <= {"settings", "context"} and not any(
            name in kw and given is not None for name, given in (("settings", settings), ("context", context))):
        s, c = kw.get("settings", settings), kw.get("context", context)
        if isinstance(c, BuildContext):
            return s, c
        schema = getattr(type(part), "Settings", None)
        if c is None and (s is None or isinstance(s, dict) or (isinstance(schema, type) and isinstance(s, schema))):
            return s, BuildContext(kind=kind)
    names = OLD_BASE_ARGS[kind]
    values = dict(zip(names, (settings, context, *old)))
    values.update(kw)
    unknown = sorted(set(values) - set(names))
    if unknown or len(old) > max(len(names) - 2, 0):
        raise TypeError(f"{type(part).__qualname__}: the {kind} base class takes (settings, context)"
                        + (f", not {unknown[0]!r}" if unknown else ""))
    warnings.warn(f"{type(part).__qualname__} calls its base class's constructor in the older {kind} shape; "
                  f"call super().__init__(settings, context) (docs/plugins.md)", DeprecationWarning, stacklevel=3)
    settings = values.pop("settings", None)
    return settings, BuildContext(kind=kind, **{k: v for k, v in values.items() if v is not None})


# =============================================================================
# The step: what the scheduler hands the model runner, and what comes back
# =============================================================================

@dataclass(slots=True)
class NewRequestData:
    """Everything a runner needs about a request the first time it is
    scheduled, and again when it resumes after a preemption (the runner
    dropped its state then, and rebuilds it from this)."""
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]          # generated before a preemption (recomputed now); [] when new
    sampling_params: SamplingParams
    block_ids: list[int]                 # the whole block table, in token order
    num_computed_tokens: int             # tokens whose KV is already in those blocks (a prefix hit)
    lora_name: str | None = None         # the LoRA adapter it runs with (loaded on every rank), None: the base


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only what changed."""
    request_id: str
    new_block_ids: list[int]             # appended to its block table
    num_computed_tokens: int             # before this step (the runner's own count must agree)


@dataclass(slots=True)
class GuidedStep:
    """The step's guided-decoding mask (filled by the engine's guided
    service, core/guided.py): row i is for ``request_ids[i]``, a request
    that samples this step; bit t of its int32 words (little-endian bit
    order) set means token t is allowed."""
    request_ids: list[str] = field(default_factory=list)
    bitmask: bytes = b""                 # int32 [len(request_ids), ceil(vocab / 32)]


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch, as plain data. Batch order is the order of
    ``num_scheduled_tokens``; every id in it is in ``new_requests`` or
    ``cached_requests``. The runner never sees a ``Request``."""
    step: int = 0                                                        # the scheduler's step number
    new_requests: list[NewRequestData] = field(default_factory=list)     # first scheduled or resumed
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)   # request id -> tokens this step
    total_num_scheduled_tokens: int = 0                                  # their sum, <= the step budget
    finished_req_ids: list[str] = field(default_factory=list)   # left since the last step (finished,
                                                                # aborted, preempted): drop their state
    preempted_req_ids: list[str] = field(default_factory=list)  # of those, preempted (to be recomputed)
    kv_connector_metadata: Any = None    # the KV connector's plain data for its runner side, if any
    guided: GuidedStep | None = None     # the constrained rows' token bitmask (set by the engine)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request id -> proposed tokens
                                         # (speculative decoding): its last num_scheduled_tokens include
                                         # them, after its one pending token; the runner scores all and
                                         # keeps the accepted prefix (ModelRunnerOutput.accepted)
    spec_draft_probs: dict[str, bytes] = field(default_factory=dict)   # of those, the ones whose proposer
                                         # gave draft probabilities: float32 [drafts, vocab] bytes, row j the
                                         # distribution draft j was drawn from (verified by rejection sampling)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int                       # the sampled (or prompt) token
    logprob: float                      # its logprob under the raw logits
    rank: int                           # 1 + number of tokens with a higher logprob
    top: list[tuple[int, float]] = field(default_factory=list)  # top-N (token_id, logprob), best first


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)              # request id -> next token id
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)   # rows that asked for them
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # of prompt tokens
                                    # context_len + 1, ... (the tokens after each one computed this step)
    pooled: dict[str, Any] = field(default_factory=dict)   # pooling requests (Request.pooling) whose prompt
                                    # finished this step -> float32 numpy [hidden]: pooled, normalized as
                                    # model.pooling_type / model.normalize say
    finished_sending: list[str] = field(default_factory=list)   # KV transfers (saves) done: free the blocks
    finished_recving: list[str] = field(default_factory=list)   # KV loads done
    num_recomputed_tokens: int = 0     # filled by the scheduler's helpers (see scheduling.py)
    accepted: dict[str, list[int]] = field(default_factory=dict)   # requests with proposals this step
                                    # (SchedulerOutput.spec_token_ids) -> the tokens verification kept:
                                    # the accepted proposals, then the target's own next token (the
                                    # first is also in ``sampled``); at least one token each
    accepted_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)   # of those, per
                                    # token, for requests that asked for logprobs
    activations: dict[str, list[ActivationCapture]] = field(default_factory=dict)   # request id -> what its
                                    # activation hooks captured this step (SamplingParams.activations;
                                    # rank 0's under tensor parallel: plain data, it crosses msgpack)


@dataclass(slots=True)
class StepStats:
    step: int
    num_running: int
    num_waiting: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    kv_usage: float
    step_time_s: float
    num_finished: int
    num_recomputed_tokens: int = 0     # tokens computed again after a preemption, this step
    recompute_tax: float = 0.0         # recomputed / all computed tokens, since the engine started
    # speculative decoding this step (vLLM's spec_decode_* counters): requests that verified proposals,
    # tokens proposed, of those accepted; speculation the cost gate switched off (0 or 1)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_gated: int = 0
    expert_load: list[list[int]] | None = None   # a MoE model (in-process or its TP/EP rank 0): tokens routed to
                                       # each expert, [MoE layer][expert], this step (plugins/models/moe_taps.py)


@dataclass(slots=True)
class RequestStepInfo:
    request_id: str
    num_prefill_tokens: int            # prompt tokens computed this step
    num_decode_tokens: int             # output tokens computed this step (1 per decode)
    context_len: int                   # tokens in the KV cache before this step


@dataclass(slots=True)
class StepContext:
    """What observers get with ``fdx_step_finished``: taken after the forward
    and before ``update()``. ``logits`` and ``hidden_states`` are filled only
    when the taps are on (``decoding.capture_logits``,
    ``decoding.capture_hidden_states``): numpy arrays, one row per request
    that sampled this step, in ``sampled_request_ids`` order."""
    engine: Any
    step: int
    requests: list[RequestStepInfo]
    kv_blocks_used: int
    kv_blocks_free: int
    sampled_request_ids: list[str] = field(default_factory=list)
    logits: Any = None                 # float32 [rows, vocab], the raw logits
    hidden_states: Any = None          # float32 [rows, hidden], the final norm's output


# =============================================================================
# KV cache: the block pool and prefix reuse
# =============================================================================

@dataclass(slots=True, frozen=True)
class PrefixHit:
    """A cached prefix found by ``lookup_prefix``: nothing is taken yet."""
    block_ids: tuple[int, ...] = ()    # cached blocks holding the request's first tokens, in order
    num_tokens: int = 0                # tokens they cover (len(block_ids) * block_size)
    num_evictable: int = 0             # of those blocks, how many no request holds now (they count
                                       # as free until the hit is committed)


class KVCacheManager(abc.ABC):
    """Owns the physical KV blocks and maps each request to its block table.

    A block holds ``block_size`` consecutive token positions of one request.
    Blocks are reference counted: a block is free when no request holds it.
    Called from the engine thread only.

    A prefix hit is two-phase: ``lookup_prefix`` finds cached blocks with no
    side effect; ``allocate_slots(request, n, prefix=hit)`` commits it (takes
    references on the hit blocks) together with the new blocks, all or
    nothing.
    """

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "kv_cache", settings, context, old, kw)
        self.num_blocks = context.num_blocks
        self.block_size = context.block_size
        self.config = context.config
        self.settings = settings or {}

    def lookup_prefix(self, request: "Request") -> PrefixHit:
        """The longest cached prefix of the request's tokens, in whole blocks
        and always short of its last token (which must be computed to sample).
        No side effects. Caches without reuse return ``PrefixHit()``."""
        return PrefixHit()

    @abc.abstractmethod
    def allocate_slots(self, request: "Request", num_new_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Make the request's block table cover ``num_computed_tokens +
        num_new_tokens`` positions; with ``prefix`` (only for a request that
        holds no blocks), its table starts with the hit's blocks and covers
        ``prefix.num_tokens + num_new_tokens``. Returns False, changing
        nothing, when there are not enough free blocks."""

    @abc.abstractmethod
    def free(self, request: "Request") -> None:
        """Drop the request's references to its blocks (finish, abort,
        preemption). Idempotent."""

    @abc.abstractmethod
    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks, in token order ([] when it holds none)."""

    def on_tokens_computed(self, request: "Request") -> None:
        """Called after a step computed tokens for the request (a prefix
        cache registers the blocks that became full). Default: nothing."""

    def close(self) -> None:
        """The engine is done with this cache. Idempotent. Default: nothing."""

    @property
    @abc.abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (cached blocks no request holds count)."""

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks / max(self.num_blocks, 1)

    def stats(self) -> dict[str, float]:
        """Counters for metrics (hit/query tokens for prefix caches)."""
        return {}


# =============================================================================
# KV connector: moving KV blocks in and out of the pool
# =============================================================================

class KVConnector(abc.ABC):
    """Moves KV blocks between this engine's pool and somewhere else (host
    memory, files, another instance). Split by role as vLLM v1's connector:
    the scheduler side runs on the engine thread and decides; the runner
    side moves the bytes. One connector runs at a time (``cache.kv_connector``);
    connectors do not chain.

    A step: the scheduler asks ``get_num_new_matched_tokens`` for a waiting
    request, allocates blocks for them and calls ``update_state_after_alloc``;
    ``build_connector_meta`` turns what the step needs into plain data, which
    rides in ``SchedulerOutput.kv_connector_metadata``; the runner calls
    ``start_load_kv`` before the forward (loaded blocks must be in place
    before any layer reads them, unless the connector waits per layer), and
    the model's forward calls, for each decoder layer ``i`` in order,
    ``wait_for_layer_load(i)`` before that layer's attention reads its KV and
    ``save_kv_layer(i, kv_caches[i], attn_metadata)`` after it wrote it (see
    ``AttentionContext.connector``; not called at all when no connector
    runs); then the runner reports finished transfers with ``get_finished``. A finished request whose ``request_finished`` returned
    True keeps its blocks until the runner reports its id in
    ``finished_sending``.
    """

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "connector", settings, context, old, kw)
        self.config = context.config
        self.block_size = context.block_size
        self.settings = settings or {}

    # -- scheduler side ------------------------------------------------------
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` (the local prefix hit) that the
        external store holds for the request: a multiple of block_size (a
        connector that moves whole requests, as splitwise, may end inside a
        block), and leaving the request's last token to compute. No side
        effects."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """Blocks were allocated for the request (its whole table); the
        ``num_external_tokens`` after its local hit (``request.num_computed_tokens``
        at this call) are to be loaded."""

    @abc.abstractmethod
    def build_connector_meta(self) -> Any:
        """Plain data for the runner side for this step (what to load and
        save); resets the scheduler side's per-step state."""

    def request_finished(self, request: "Request", block_ids: list[int]) -> bool:
        """The request finished (or was aborted or preempted). Return True to
        keep its blocks until the runner side reports the id in
        ``get_finished``'s first set. Default: False."""
        return False

    # -- scheduler side, for KV that arrives from another instance (splitwise) ----
    def request_added(self, request: "Request") -> None:
        """A request joined this engine's queue (called when it is added, before
        any step looks at it, and whether or not the next step reaches it in
        the queue). Default: nothing."""

    def defer_request(self, request: "Request") -> bool:
        """True: leave this waiting request in the queue this step, because its
        KV will come from elsewhere and is not offered yet (asked before
        ``get_num_new_matched_tokens``; the connector bounds the wait and
        ends the request through ``take_failed``). Default: False."""
        return False

    def load_async(self, request: "Request") -> bool:
        """Asked right after ``update_state_after_alloc``. True: the matched
        tokens load in the background; the scheduler keeps the request out of
        every batch (holding its blocks) until the runner side reports its id
        in ``get_finished``'s second set. Default: False (loaded in
        ``start_load_kv`` before the forward)."""
        return False

    def take_failed(self) -> dict[str, str]:
        """Requests whose external KV will never come: request id -> reason.
        The scheduler ends each (aborted, with the reason as stop_reason) and
        frees its blocks. Called once a step; resets. Default: none."""
        return {}

    # -- runner side ------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list, layout: "KVCacheSpec") -> None:
        """The runner's KV tensors, once, before the first step."""

    @abc.abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Load what ``metadata`` says into the KV blocks (before the forward)."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Called in the forward before decoder layer ``layer`` (0, 1, ...,
        ``num_layers - 1``, in order) reads its KV: block until what
        ``start_load_kv`` started for that layer is in place. Default: loads
        are synchronous, nothing to wait for."""

    def save_kv_layer(self, layer: int, kv_layer: Any, attn_metadata: Any) -> None:
        """Called in the forward after decoder layer ``layer`` wrote this
        step's KV into ``kv_layer`` (that layer's ``(k_cache, v_cache)``, as
        registered with ``register_kv_caches``); ``attn_metadata`` is the
        step's ``AttentionContext``. A connector that saves layer by layer
        starts copying here. Default: nothing."""

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(request ids whose saves finished, ids whose loads finished) since
        the last call. Default: none."""
        return set(), set()

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """The engine is stopping: keep what is worth keeping. Idempotent."""


# =============================================================================
# KV scheduler (resource manager) and its extension points
# =============================================================================

@dataclass(slots=True)
class SchedulingExtensions:
    """The pluggable parts a scheduler consults, built by the engine from
    config (``scheduler.policy``, ``scheduler.admission``,
    ``scheduler.preemption``, ``cache.kv_connector``)."""
    queue_policy: "QueuePolicy"
    admission_rules: list["AdmissionRule"] = field(default_factory=list)
    preemption_policy: "PreemptionPolicy | None" = None      # None: newest first
    connector: KVConnector | None = None


class KVScheduler(abc.ABC):
    """A KV scheduler (``scheduler.kv_scheduler``, registered with
    ``fdx_register_kv_schedulers``): each step, which requests run and
    how many of their tokens. It is a policy only: the engine owns the
    scheduling core (``fdx.core.scheduling.SchedulingCore``, passed to
    ``schedule``), which holds the queues and the KV blocks (through
    ``core.kv_cache``) and keeps the bookkeeping rules whatever the policy
    does (preempted requests first, no block held while waiting, rejection
    of what can never fit, freeing, the plain-data step).

    ``schedule(core)`` builds the step through ``core``, a
    ``fdx.core.scheduling.SchedulingView``: the core's documented surface
    and nothing else. ``core.schedule_running()`` (running requests,
    preempting the victim policy's pick when blocks run out),
    ``core.admit_waiting(grant)`` (the admission loop: queue order,
    admission rules, ``max_num_seqs``, the budget; ``grant`` sizes each
    admitted request's tokens) and, for a policy that orders the step
    itself, ``core.schedule_request(request, n)`` after
    ``core.kv_cache.allocate_slots(request, n)``, ``core.rotate_running(n)``,
    ``core.preempt(request)``. What it may read: ``core.running`` (run
    order, oldest first), ``core.waiting`` (queue order), ``core.loading``
    (admitted, KV still loading), ``core.budget`` (tokens left this step),
    ``core.max_num_seqs``, ``core.max_num_batched_tokens``,
    ``core.max_model_len``, ``core.chunked_prefill``, ``core.preempted_ids``
    (this step's preemptions), ``core.kv_cache``, ``core.step``.

    Rules every policy keeps (``fdx.core.testing.check_scheduler`` checks
    them): never more than ``max_num_batched_tokens`` tokens or
    ``max_num_seqs`` running requests; only requests whose blocks cover
    their tokens; a whole prompt at once unless chunked prefill is on;
    no request waits forever; and bounded wait: no waiting request is passed
    over, i.e. a request starts only if every request ahead of it in the
    waiting queue (the queue policy's order) started too or was refused by
    an admission rule that step (``admit_waiting`` keeps this). A policy
    that passes requests over on purpose (shortest-job-first of its own,
    a deliberately unfair experiment) says so with ``bounded_wait = False``;
    the kit then checks only liveness.
    """

    bounded_wait: bool = True

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "kv_scheduler", settings, context, old, kw)
        self.config = context.config
        self.settings = settings or {}

    @abc.abstractmethod
    def schedule(self, core: Any) -> None:
        """Fill this step through ``core``'s helpers (the core opens the
        step before and closes it after: ``core.schedule()``)."""


SchedulerPolicy = KVScheduler       # its name before issue 36, kept one release (docs/plugins.md)


class RequestScheduler(abc.ABC):
    """A request-level scheduler (``scheduler.request_scheduler``,
    registered with ``fdx_register_request_schedulers``): where a server's requests
    run. ``local`` (the default) runs them in the server's own engine and
    is never built (``wraps = False``); any other is built in the API
    process as ``cls(settings, context)`` around the server's
    ``EngineClient`` (``context.engine``; ``context.metrics`` the server's
    ``ServerMetrics``, whose ``registry`` takes its own series;
    ``settings`` from ``plugins.request_scheduler.<name>``, validated into
    ``cls.Settings`` when it declares one) and stands in for it, so it
    keeps the client's interface as the server uses it. It must not import
    Paddle (the API process never does).

    Every other attribute the server reads (``dead``, ``pid``, ``ready``,
    ``hung``, ...) is the client's: ``__getattr__`` hands it through."""

    wraps: bool = True                   # False: requests run in the server's engine, unwrapped

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "request_scheduler", settings, context, old, kw)
        self.config, self.engine, self.metrics = context.config, context.engine, context.metrics
        self.settings = settings if settings is not None else {}

    def __getattr__(self, name: str) -> Any:
        if name == "engine":                           # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)

    async def start(self) -> Any:
        """Start the local engine (``await engine.start()``), then the
        scheduler's own work; return the engine's ``EngineReady``."""
        return await self.engine.start()

    @abc.abstractmethod
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, callback: Any,
            trace: dict[str, str] | None = None) -> None:
        """Run a request somewhere: ``callback`` gets ``SeqDelta``s (only new
        tokens, in order), an ``EngineRejected``, or an ``EngineDeadError``
        when it cannot be served; ``trace`` (``x-request-id``, W3C
        ``traceparent`` / ``tracestate``) goes to the engine that runs it."""

    @abc.abstractmethod
    def abort(self, request_ids: list[str]) -> None:
        """End requests early, wherever they run (the client went away)."""

    def finished(self, request_id: str) -> None:
        """Forget a request whose last delta came. Default: the engine's."""
        self.engine.finished(request_id)

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the scheduler's work, then the local engine."""
        await self.engine.shutdown(timeout)


class QueuePolicy(abc.ABC):
    """The order of the waiting queue (``scheduler.policy``). The core queue
    keeps preempted requests ahead of everything (last preempted first);
    the policy orders the rest by ``key``, smallest first, ties by arrival."""

    dynamic: bool = False   # True: keys change over time; the queue re-sorts each schedule()
    max_dynamic_queue: int | None = None   # past this many waiting, a dynamic policy's re-sort falls
                                           # back to arrival order (its lookups would cost too much)

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "queue_policy", settings, context, old, kw)
        self.kv_cache = context.kv_cache
        self.settings = settings or {}

    @abc.abstractmethod
    def key(self, request: "Request") -> tuple:
        """The sort key (without the arrival tie-break)."""


@dataclass(slots=True)
class SchedulerState:
    """What admission rules and victim policies may read."""
    step: int
    running: Sequence["Request"]       # in run order, oldest first
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    max_num_seqs: int


class AdmissionRule(abc.ABC):
    """May this waiting request start now (``scheduler.admission``, a list:
    all must agree)? A request refused is skipped this step and the next
    one is tried; rules are never asked about preempted requests, which
    resume first. A rule that refuses forever starves a request: bound it."""

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "admission_rule", settings, context, old, kw)
        self.config = context.config
        self.settings = settings or {}

    @abc.abstractmethod
    def admit(self, request: "Request", state: SchedulerState) -> bool: ...


class PreemptionPolicy(abc.ABC):
    """Which running request gives up its blocks when a step runs out of
    them (``scheduler.preemption``)."""

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "preemption_policy", settings, context, old, kw)
        self.config = context.config
        self.settings = settings or {}

    @abc.abstractmethod
    def choose_victim(self, running: Sequence["Request"], state: SchedulerState) -> "Request":
        """One of ``running`` (never empty, in run order, oldest first): the
        running requests not yet scheduled in this step, the one that needs
        blocks included. Asked whenever a victim is needed, also when one
        candidate is left (return it)."""


# =============================================================================
# Decoding: per-request state, sampling, token processing
# =============================================================================

@dataclass(slots=True)
class RowState:
    """What a logits processor may read about one request in the batch.
    The token lists are the runner's own and grow as tokens are sampled."""
    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(slots=True)
class BatchUpdate:
    """How the sampling batch changed since the last step. ``rows`` holds
    the request id of each row of the logits this step; ``added`` the
    requests that joined (new, or resumed after a preemption: rebuild any
    state from ``output_token_ids``), ``removed`` the ids that left
    (finished, aborted, preempted)."""
    added: list[RowState]
    removed: list[str]
    rows: list[str]
    rows_changed: bool                 # False when rows equal the last step's


class LogitsProcessor(abc.ABC):
    """A batched, stateful transform of the logits (``decoding.logits_processors``
    adds to the built-ins: penalties, min_tokens, logit_bias,
    allowed_token_ids, bad_words). Each step the runner calls
    ``update_state`` then ``apply`` on the logits of the requests that sample,
    one row each. Per-request arguments ride in ``SamplingParams.extra_args``
    (over HTTP: the body's ``extra_args`` / ``vllm_xargs``).

    ``active`` (an attribute, True by default) says whether ``apply`` would
    change anything this step: a processor no row asks for sets it False
    after ``update_state``, and when none is active the runner may sample
    on the device without moving the logits to the host."""

    active: bool = True

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "logits_processor", settings, context, old, kw)
        self.config = context.config
        self.tokenizer = context.tokenizer
        self.vocab_size = context.vocab_size
        self.settings = settings or {}

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Check a request's arguments when it arrives; raise ValueError
        naming the field (the server answers 400). Default: nothing."""

    @abc.abstractmethod
    def update_state(self, update: BatchUpdate) -> None:
        """Called every step before ``apply``."""

    @abc.abstractmethod
    def apply(self, logits: Any) -> Any:
        """Transform float32 logits [rows, vocab] (in place or not); return them."""


@dataclass(slots=True)
class SamplingBatch:
    """What the sampler knows about each row of the logits (lists of length B)."""
    params: list[SamplingParams]
    prompt_token_ids: list[Sequence[int]]
    output_token_ids: list[Sequence[int]]      # generated so far
    generators: list[Any] | None = None        # per-row numpy Generator or None; None: none has one
    eos_token_ids: frozenset[int] | set[int] = frozenset()   # the model's
    request_ids: list[str] | None = None

    def __post_init__(self) -> None:
        if self.generators is None:
            self.generators = [None] * len(self.params)
        n = len(self.params)
        if not (len(self.prompt_token_ids) == len(self.output_token_ids) == len(self.generators) == n):
            raise ValueError("SamplingBatch: params, prompt_token_ids, output_token_ids "
                             "and generators must have one entry per row")

    def __len__(self) -> int:
        return len(self.params)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: Any                          # int64 [B]
    logprobs: list[TokenLogprobs | None]    # per row; None where params.logprobs is None


class Sampler(abc.ABC):
    """Draws one token per row from processed logits (temperature, top-k,
    top-p, min-p, seeds) and computes logprobs from the raw logits. The
    backend names the sampler (``Backend.sampler``).

    ``device_logits`` (False by default): the sampler takes the model's
    logits tensor as it is (on the device), so a step with no active
    logits processor, no guided bitmask and no prompt logprobs skips the
    move to the host; False: ``sample`` gets host (numpy) logits.

    Speculative decoding's verify step (rejection sampling of sampled
    requests' drafts) also calls ``probs(logits, batch)``, the distribution
    ``sample`` draws each row from, and draws an unseeded row's random
    numbers from ``rng`` (the sampler's shared stream, a
    ``numpy.random.Generator``; None: a fresh one each time)."""

    device_logits: bool = False
    rng: Any = None

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "sampler", settings, context, old, kw)
        self.config = context.config
        self.settings = settings or {}

    @abc.abstractmethod
    def sample(self, logits: Any, batch: SamplingBatch, raw_logits: Any = None) -> SamplerOutput:
        """``logits``: processed float32 [B, V]; ``raw_logits``: before the
        processors (for logprobs; None: the same as ``logits``)."""

    def probs(self, logits: Any, batch: SamplingBatch) -> Any:
        """The distribution ``sample`` draws each row of ``logits`` from,
        [B, V] float64 (a greedy row: one-hot at the argmax), drawing no
        random numbers. Default: NotImplementedError, so speculative
        decoding of sampled requests with this sampler fails naming it."""
        raise NotImplementedError(f"{type(self).__name__} does not give the distribution it samples from "
                                  "(Sampler.probs): speculative decoding of sampled requests needs it")


@dataclass(slots=True)
class Proposal:
    """What a proposer returns for one request: up to k draft tokens and,
    optionally, the draft distribution each was drawn from."""
    token_ids: list[int]
    draft_probs: Any = None             # float [len(token_ids), vocab] numpy, row j the distribution
                                        # token_ids[j] was drawn from; None: deterministic drafts (each
                                        # proposed with probability 1, as n-gram lookups are)


class Proposer(abc.ABC):
    """Speculative decoding's draft side (``speculative.method`` names one;
    registered by ``fdx_register_proposers``). The engine asks it, before
    each step, for up to ``k`` tokens that may follow a request's tokens;
    one forward of the target model scores the request's pending token and
    the proposals together, and verification keeps the longest prefix the
    target agrees with plus the target's own next token (greedy: equal to
    its argmax; sampled: rejection sampling, which keeps the target's
    distribution exactly). A proposer can therefore change speed, never
    output.

    Built once per engine as ``cls(settings, context)`` (``context.vocab_size``)
    in the engine process (``settings``: ``plugins.proposer.<name>``, validated
    into ``cls.Settings`` when the class declares one; the built-ins read
    the ``speculative`` section). Called on the engine thread, between
    steps; it must be quick (it runs every step for every decoding
    request). The calls, per request, in order:

    - ``add_request`` when the engine accepts it;
    - ``propose`` whenever it decodes and may speculate, then
      ``on_accepted`` with how many of those proposals were kept;
    - ``on_preempted`` when it loses its KV (it resumes later with the
      same tokens; proposing continues after it recomputes them);
    - ``remove_request`` once, when it finishes or is aborted.

    Requests a proposer is never asked about: guided ones, ones whose
    sampling parameters need a logits processor (penalties, min_tokens,
    logit_bias, allowed_token_ids, bad_words), ones that opted out
    (``SamplingParams.extra_args={"speculative": False}``), and all of
    them on a step the cost gate skips (docs/speculative.md)."""

    uses_hidden_states: bool = False     # room for MTP-style heads: not delivered yet (propose gets None)
    uses_sampling_params: bool = False   # True: add_request also gets ``sampling_params=`` (the request's
                                         # SamplingParams), so drafts can be drawn as the request samples

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "proposer", settings, context, old, kw)
        self.config = context.config
        self.vocab_size = context.vocab_size
        self.settings = settings if settings is not None else {}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """A request joined. Default: nothing."""

    @abc.abstractmethod
    def propose(self, request_id: str, token_ids: Sequence[int], k: int,
                hidden_states: Any = None) -> "list[int] | Proposal":
        """Up to ``k`` (>= 1) token ids to follow ``token_ids`` (the
        request's prompt and output so far, the last one not yet computed);
        ``[]`` to propose nothing this step. Every id must be below
        ``vocab_size`` and there must be at most ``k``: anything else is a
        ``ProposerError`` naming the proposer (fdx.core.spec). Return a
        ``Proposal`` to give draft probabilities."""

    def on_accepted(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """How many of the last proposals for the request the target kept
        (a prefix of them). Default: nothing."""

    def on_preempted(self, request_id: str) -> None:
        """The request lost its KV and waits to be recomputed. Default: nothing."""

    def remove_request(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """The request finished or was aborted, with these output tokens
        (a suffix proposer may keep them for later requests). Default: nothing."""

    def close(self) -> None:
        """The engine shuts down. Default: nothing."""

    # -- optional: a proposer that overrides these gets more from the engine --------------------
    def propose_batch(self, items: Sequence[tuple[str, Sequence[int], int]]) -> "dict[str, Any] | None":
        """Drafts for every request that decodes this step at once (a draft
        model runs one forward a draft position for all of them): ``items``
        are (request id, its tokens, k); return request id -> what
        ``propose`` would return (a request left out proposes nothing).
        Asked once a step, before ``propose``, only when a subclass
        overrides it. Default: None (the engine asks ``propose`` per
        request)."""
        return None

    def draft_class(self, request_id: str) -> "int | None":
        """A small int naming the kind of the request's last proposal (suffix:
        the strength of the match it came from): the engine learns how often
        each kind's drafts are kept, per position, and cuts a proposal where
        a row is unlikely to pay. Default: None (the engine classes drafts by
        how the request's last ones fared)."""
        return None

    def kv_bytes(self, block_size: int, max_num_seqs: int) -> tuple[int, int]:
        """(bytes the proposer's own KV cache adds per target KV block, bytes
        it holds whatever the target's block count): the engine sizes the
        target's KV cache from what is left of the budget. Default: (0, 0),
        no KV cache of its own."""
        return (0, 0)

    def forget_history(self) -> None:
        """Forget what finished requests taught (``fdx bench`` between rounds,
        so a round does not draft from an earlier round's same outputs).
        Default: nothing."""


class TokenProcessor(abc.ABC):
    """Turns sampled token ids into request state on the engine side:
    appends the token, records its logprob ids and values
    (``request.logprobs``: one ``{token id: TokenLogprob}`` per token,
    ``decoded`` left None), and decides whether the request is finished
    (eos, stop token ids, stop strings, min_tokens, max_tokens, context
    length), setting ``request.status`` and ``stop_reason`` (the stop token
    id or the stop string).

    Stop strings are matched here, where the tokens are made, so no token
    past one is computed: a request with ``stop`` strings is detokenized
    incrementally with ``tokenizer`` (``fdx.core.output.TextOutput`` holds
    the rule: the earliest stop ending in the newest token's text, once
    ``min_tokens`` are out; eos and stop token ids are checked first, the
    length last). The text callers get, cut at the stop string, and
    logprob text are the output processor's (core/output.py), which serves
    ``LLM`` and the server alike. Built as ``cls(settings, context)``
    (``context.tokenizer``; ``plugins.token_processor.<name>``); the serving engine's tokenizer is
    built on first use (a ``DeferredTokenizer``: the first request with
    stop strings builds it)."""

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "token_processor", settings, context, old, kw)
        self.tokenizer = context.tokenizer
        self.settings = settings or {}

    def start(self, request: "Request") -> None:
        """Called once when the engine accepts a request (per-request state)."""

    @abc.abstractmethod
    def process(self, request: "Request", token_id: int, logprobs: TokenLogprobs | None = None) -> bool:
        """Append one sampled token; return True when the request finished."""

    def add_prompt_logprobs(self, request: "Request", start: int, entries: list[TokenLogprobs]) -> None:
        """Record the logprobs of prompt tokens ``start + 1 ...`` (one entry
        each) computed this step. Default: nothing."""


class Observer:
    """An observer an engine builds because its config selects it
    (``observability.observers``; registered by ``fdx_register_observers``),
    one per engine, constructed as ``cls(settings, context)`` with
    ``settings`` from ``plugins.observer.<name>`` (raise ``ValueError`` on a
    bad one: the engine reports it as a config error naming that key).

    Its methods are the observer hooks of ``fdx.core.hookspecs``, by the
    same names, each taking any subset of the hook's arguments by name;
    define only those you need (a hook it does not define costs nothing):

    - ``fdx_engine_started(engine)``: once, the engine built;
    - ``fdx_request_added(request)``: a ``Request`` joined the engine
      (``trace_headers``: the W3C trace context and ``x-request-id`` it came
      with, or None);
    - ``fdx_step_finished(scheduler_output, step_stats, context)``: each step;
    - ``fdx_request_finished(request, output)``: the ``Request`` in its final
      state and its ``RequestOutput``.

    All run on the engine thread: be quick, hand slow work (exporting) to a
    thread of your own. ``close()`` is called once when the engine shuts
    down (flush what is buffered). Module-level hook implementations, by
    contrast, observe every engine in the process and take no settings."""

    name: str = ""                                # set by the engine: the name it was selected by

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "observer", settings, context, old, kw)
        self.config = context.config
        self.settings = settings or {}

    def close(self) -> None:
        """The engine is shutting down."""

    # The observer hooks, declared with a default that does nothing; the engine calls only those a subclass
    # overrides (``observes``), so one it does not define costs nothing.
    def fdx_engine_started(self, engine: Any) -> None:
        """Once, the engine built."""

    def fdx_request_added(self, request: "Request", trace_headers: dict | None = None) -> None:
        """A ``Request`` joined the engine."""

    def fdx_step_finished(self, scheduler_output: Any, step_stats: Any, context: Any) -> None:
        """Each step."""

    def fdx_request_finished(self, request: "Request", output: Any) -> None:
        """The ``Request`` in its final state and its ``RequestOutput``."""

    def observes(self, hook_name: str) -> bool:
        """Whether this observer's class overrides the hook ``hook_name``."""
        return getattr(type(self), hook_name) is not getattr(Observer, hook_name)


# -- guided decoding (decoding.guided_backend; the built-in `guided` logits processor drives it) --

GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class GuidedMatcher(abc.ABC):
    """One request's position in its grammar. Not thread-safe; used from the
    engine thread only."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``: a numpy int32
        array [rows, ceil(vocab_size / 32)] where bit ``t % 32`` of word
        ``t // 32`` set means token ``t`` may be sampled. Once the grammar is
        complete only the eos ids are allowed."""

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the
        grammar does not allow it. Accepting an eos id completes the match."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The match is complete (an eos id was accepted, or the grammar
        allows nothing more)."""

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids``, from the start, the grammar allows in a
        row from here; the state is unchanged (speculative drafts are cut
        there). By default accepted one by one and rolled back; a backend
        whose refused token spoils its state overrides it."""
        n = 0
        for t in token_ids:
            if not self.accept_token(int(t)):
                break
            n += 1
        if n:
            self.rollback(n)
        return n


@dataclass
class GuidedSettings:
    """The settings every guided backend takes (``plugins.guided_backend.<name>``),
    read by the guided-decoding service around it; a backend's own ``Settings``
    dataclass subclasses it and adds its keys."""
    compile_threads: int = 2                     # threads compiling constraints (>= 1)
    cache_size: int = 512                        # compiled constraints kept (>= 1)


class GuidedBackend(abc.ABC):
    """Compiles constraints for one model's tokenizer and makes matchers
    (``fdx_register_guided_backends``). Built once per model, from fdx's
    own tokenizer (``tokenizer.backend`` is a ``tokenizers.Tokenizer``), and
    heavy libraries are imported in ``__init__``, not at module import: a
    missing one raises ImportError naming the package to install."""

    kinds: tuple[str, ...] = GUIDED_KINDS[:5]    # the constraint kinds it compiles (GUIDED_KINDS)
    requires: tuple[str, ...] = ()               # importable packages it needs (checked at start-up)
    Settings: type | None = None                 # a GuidedSettings subclass (validated); None: a dict,
    setting_keys: tuple[str, ...] = ()           # checked against these keys (the older form)

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "guided_backend", settings, context, old, kw)
        self.tokenizer = context.tokenizer
        self.vocab_size = context.vocab_size     # the model's (bitmask width), >= the tokenizer's
        self.eos_token_ids = sorted(context.eos_token_ids)
        self.settings = settings or {}

    @abc.abstractmethod
    def compile(self, kind: str, spec: str, whitespace_flexible: bool = False) -> Any:
        """Compile one constraint: ``kind`` in ``self.kinds``; ``spec`` is the
        JSON schema's text (json), "" (json_object), the regex, the choices as
        a JSON list (choice), the GBNF-style grammar, or the structural tag's
        JSON. JSON output is compact unless ``whitespace_flexible``. Raise
        ValueError with the compiler's message for a bad constraint. Called
        from worker threads: must be thread-safe."""

    @abc.abstractmethod
    def matcher(self, compiled: Any) -> GuidedMatcher:
        """A fresh matcher at the start of ``compiled``."""


# =============================================================================
# Weights: how a model's linear layers are held and multiplied
# =============================================================================

class LinearWeight(abc.ABC):
    """One weight matrix as a weight format holds it. Logically it is
    ``[rows, cols]`` = Hugging Face's ``[out_features, in_features]``
    (an embedding table is ``[vocab, hidden]``), whatever the storage:
    fp32, GGUF blocks along ``cols``, int8 with scales, ...

    The model calls only these methods; none of them may change ``self``
    (shards and casts return new weights)."""

    kind: str = ""                     # what it holds, for memory reports: "f32", "q4_1", "wint8", ...
    shape: tuple[int, int] = (0, 0)    # (rows, cols)

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes held in memory (data and scales)."""

    @abc.abstractmethod
    def matmul(self, x: Any) -> Any:
        """``x [M, cols]`` (a Paddle tensor) ``@ W.T`` -> ``[M, rows]``, in
        x's dtype."""

    def embedding(self, ids: Any) -> Any:
        """Rows ``ids`` (int64 tensor [N]) of the table, ``[N, cols]``
        float32 (only asked of weights loaded with role ``embedding``)."""
        raise NotImplementedError(f"{type(self).__name__} is not an embedding table")

    @abc.abstractmethod
    def take_rows(self, index: Any) -> "LinearWeight":
        """Rows ``index`` (int64 numpy, a permutation or a subset): a
        column-parallel shard, llama.cpp's Q/K un-permutation."""

    @abc.abstractmethod
    def take_cols(self, start: int, stop: int) -> "LinearWeight":
        """Columns ``[start, stop)``: a row-parallel shard. Raise
        ``ValueError`` saying why when the storage cannot split there (a
        block or group of columns would be cut)."""

    @abc.abstractmethod
    def dequantize(self) -> Any:
        """float32 numpy ``[rows, cols]``: the values this weight stands for
        (references, fallbacks)."""

    def cast(self, dtype: str) -> "LinearWeight":
        """This weight for a model computing in ``dtype`` (default: itself;
        ``matmul`` answers in x's dtype either way)."""
        return self


class RowStack(LinearWeight):
    """Weights of different kinds stacked along rows (a fused q/k/v whose
    parts a file stores in different types): each part multiplies on its
    own and the outputs are concatenated. ``WeightFormat.fuse``'s default."""

    def __init__(self, parts: Sequence[LinearWeight]):
        self.parts = list(parts)
        cols = {p.shape[1] for p in self.parts}
        if len(cols) != 1:
            raise ValueError(f"cannot stack weights of {sorted(cols)} columns")
        self.shape = (sum(p.shape[0] for p in self.parts), cols.pop())
        self.kind = "+".join(dict.fromkeys(p.kind for p in self.parts))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def kinds(self) -> dict[str, int]:
        """kind -> bytes of the parts."""
        out: dict[str, int] = {}
        for p in self.parts:
            out[p.kind] = out.get(p.kind, 0) + p.nbytes
        return out

    def matmul(self, x: Any) -> Any:
        import paddle
        return paddle.concat([p.matmul(x) for p in self.parts], axis=-1)

    def take_rows(self, index: Any) -> LinearWeight:
        import numpy as np
        index, parts, start = np.asarray(index), [], 0
        if np.any(np.diff(index) <= 0):
            raise ValueError("RowStack.take_rows takes increasing row indices only")
        for p in self.parts:
            mine = index[(index >= start) & (index < start + p.shape[0])] - start
            if mine.size:
                parts.append(p.take_rows(mine))
            start += p.shape[0]
        return parts[0] if len(parts) == 1 else RowStack(parts)

    def take_cols(self, start: int, stop: int) -> LinearWeight:
        return RowStack([p.take_cols(start, stop) for p in self.parts])

    def dequantize(self) -> Any:
        import numpy as np
        return np.concatenate([p.dequantize() for p in self.parts], axis=0)

    def cast(self, dtype: str) -> LinearWeight:
        return RowStack([p.cast(dtype) for p in self.parts])


class WeightFormat(abc.ABC):
    """How a model holds its linear layers, embedding and LM head (vLLM's
    linear method, FastDeploy's quant method). ``model.quantization``
    names one (``fdx_register_weight_formats``); the engine constructs it
    with the backend's probed kernel table and its ``plugins`` settings,
    and the model asks it for every matrix it loads.

    The loader hands each 2-D checkpoint tensor in HF order ``[out, in]``:
    float32 numpy, or, for a GGUF tensor in a block type when
    ``keeps_blocks`` is true, ``fdx.model_io.loader.GGUFBlocks``
    holding the file's raw blocks (llama.cpp's Q/K row permutation already
    undone).
    1-D tensors (norms, biases) never reach the format: they stay float32.

    A value the format cannot hold (a type it has no loader for, a shape
    it cannot quantize) is a ``ValueError`` whose message starts with
    ``config key 'model.quantization':`` and names the tensor."""

    name: str = ""
    keeps_blocks: bool = False      # True: GGUF block tensors arrive as QuantizedTensor, else float32 numpy

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "weight_format", settings, context, old, kw)
        self.kernels = context.kernels  # the backend's probed table: which products have a kernel here
        self.settings = settings or {}

    @abc.abstractmethod
    def load(self, name: str, tensor: Any, role: str) -> LinearWeight:
        """The weight ``name`` (its HF name) from the loader's ``tensor``.
        ``role``: ``"linear"`` (a projection in a layer), ``"embedding"``
        (the token table: ``embedding`` and, when tied, ``matmul`` are
        asked of it) or ``"lm_head"`` (an untied output projection)."""

    def fuse(self, parts: Sequence[LinearWeight]) -> LinearWeight:
        """One weight for ``parts`` stacked along rows (fused q/k/v,
        gate/up). Default: a ``RowStack``; a format that can concatenate
        its storage returns one weight."""
        return parts[0] if len(parts) == 1 else RowStack(parts)

    def tied_head(self, embedding: LinearWeight) -> LinearWeight:
        """The LM head of a model whose head is its embedding table.
        Default: the table itself (``matmul`` of ``[vocab, hidden]``)."""
        return embedding

    def shard_cols(self, name: str, weight: LinearWeight, start: int, stop: int) -> LinearWeight:
        """Columns ``[start, stop)`` of ``weight`` for a row-parallel
        shard. Default: ``weight.take_cols``, whose ``ValueError`` ends the
        load naming ``parallel.tensor_parallel_size`` and the weight."""
        try:
            return weight.take_cols(start, stop)
        except ValueError as e:
            raise ValueError(f"config key 'parallel.tensor_parallel_size': weight {name!r} "
                             f"({weight.kind}, {weight.shape[1]} columns) cannot be split at "
                             f"[{start}, {stop}): {e}") from None

    def describe(self) -> str:
        """One line for the log: what this format holds."""
        return self.name


class LoRALoader(abc.ABC):
    """Reads a LoRA adapter in one file format (``fdx_register_lora_loaders``;
    ``lora.lora_loader`` picks one, built-in ``peft``: a PEFT folder with
    adapter_config.json and adapter_model.safetensors). Constructed as
    ``cls(settings, context)``; runs wherever the model runs (every tensor parallel
    rank), never in the API process.

    ``load`` returns a ``fdx.core.lora.LoRAWeights``: per (layer, module)
    float32 ``A [r, in]`` and ``B [out, r]`` and the adapter's scale, module
    names as Hugging Face's (``q_proj`` ... ``down_proj``). The engine then
    checks it against the model (shapes, known modules, layers, rank at most
    ``lora.max_lora_rank``) whatever the loader; a file the loader cannot
    read (missing, malformed, an option it does not support) is a
    ``ValueError`` saying which file and why."""

    name: str = ""

    def __init__(self, settings: Any = None, context: "BuildContext | None" = None):
        self.settings = settings if settings is not None else {}

    @abc.abstractmethod
    def load(self, path: str) -> Any:
        """The adapter at ``path`` (a folder or file, as the format has it)."""


# =============================================================================
# Model: a causal language model the runner drives
# =============================================================================

class Model(abc.ABC):
    """A causal language model, registered by its Hugging Face architecture
    name (``fdx_register_models``: ``config.json``'s ``architectures[0]``, or
    the GGUF architecture fdx maps to one). Subclass it: the engine refuses a
    registered class that does not.

    Construction: ``cls(settings, context)``. ``context.hf_config`` is the
    Hugging Face config dict; ``context.weights`` maps Hugging Face tensor
    names to float32 numpy arrays (or, when ``fmt.keeps_blocks``, to GGUF
    block tensors the format loads); ``context.weight_format`` (``fmt``) is
    the ``WeightFormat`` that ``model.quantization`` names, whose ``load``
    turns a tensor into a ``LinearWeight``, when the class says
    ``takes_weight_format``. A class that does not takes
    ``model.quantization`` none or auto only, and gets float32 weights (any
    other value is a config error). A
    ValueError from the constructor that starts with ``config key`` is shown
    as a config error.

    The shape, set by the constructor and read by the engine (KV cache
    layout, context length, the sampler's width): ``num_layers``,
    ``num_heads``, ``num_kv_heads``, ``head_dim``, ``vocab_size``,
    ``max_position_embeddings``.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str = "float32"            # what cast() last put the weights in

    #: True when forward() sets ``last_hidden_states`` while
    #: ``capture_hidden_states`` is on (``decoding.capture_hidden_states``
    #: asks for it; a model that says False is a config error naming the key,
    #: never a silently empty tap).
    supports_hidden_states: bool = False
    capture_hidden_states: bool = False   # set by the runner when the tap is on
    last_hidden_states: Any = None        # forward's final hidden states [M, hidden], the logits' rows
    #: True when forward() sets ``pooling_hidden_states`` (the final norm's
    #: output for every input token row, [N, hidden]) while
    #: ``capture_pooling_hidden_states`` is on: ``model.task: embed`` needs it.
    supports_pooling: bool = False
    capture_pooling_hidden_states: bool = False
    pooling_hidden_states: Any = None
    #: True when forward() runs the step's activation hooks (``meta.activations``,
    #: fdx.core.activations.StepActivations, set when a request of the step has
    #: ``SamplingParams.activations``): for decoder layer k, ``x =
    #: meta.activations.apply(point, k, x)`` with point "attn_out" on the attention
    #: output (after o_proj), "mlp_out" on the MLP output and "residual" on the
    #: residual stream after the layer (``apply_residual`` when the stream is carried
    #: as (layer output, residual)). A request that asks a model which says False
    #: is refused with an error naming the field.
    supports_activation_hooks: bool = False
    #: True when the model applies LoRA adapters (``load_lora`` / ``unload_lora``
    #: and ``lora_shapes``; in forward, ``meta.lora``, a fdx.core.lora.StepLoRA, adds
    #: each adapter's delta to its requests' rows of every linear it targets). A
    #: config with ``lora.enable_lora`` over a model that says False is a ConfigError.
    supports_lora: bool = False
    #: A class constructed as ``(settings, context)``: True when it builds its
    #: linears with ``context.weight_format`` (any ``model.quantization``); False
    #: (the default) when it takes float32 weights only (``model.quantization``
    #: none or auto: auto dequantizes a GGUF file's blocks before construction).
    #: A class in the older ``(hf_config, weights, weight_format=...)`` shape says
    #: so by its ``weight_format`` keyword instead.
    takes_weight_format: bool = False
    #: The parsed config (``parse_config``'s result: ``hidden_size``,
    #: ``intermediate_size``, ...) when the model keeps one, else None; the
    #: engine reads it through ``ModelShape.cfg`` (tensor parallel's head and
    #: width checks, an activation vector's length).
    cfg: Any = None
    #: The shape of the model's mixture-of-experts layers (number of experts,
    #: top-k, ...) when it has any, else None; a MoE router
    #: (``model.moe_router``) is built over it and handed to ``set_router``.
    moe: Any = None

    def set_router(self, router: Any) -> None:
        """Route every MoE layer with ``router`` (``(logits, bias) -> (ids,
        weights)``). Only a model whose ``moe`` is set is asked."""
        raise NotImplementedError(f"{type(self).__name__} has no mixture-of-experts layers to route")

    def last_expert_load(self) -> list[list[int]] | None:
        """Tokens routed to each expert in each MoE layer by the last forward
        (``[moe layers][num_experts]``), for ``StepStats.expert_load``.
        Default None: no MoE layers."""
        return None

    @classmethod
    def shard_errors(cls, config: dict[str, Any], world: int, groups: int = 1) -> list[str] | None:
        """Why the checkpoint's ``config`` cannot split over ``world`` tensor
        parallel ranks in ``groups`` expert-parallel groups (each reason names
        its config key; [] when it can). Default None: a model without
        mixture-of-experts layers (expert parallel is refused, and the dense
        tensor-parallel checks apply)."""
        return None

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """The unsharded ``(out_features, in_features)`` of each module an
        adapter may target (``q_proj``, ``k_proj``, ... ``down_proj``), the
        same in every layer: what a loaded adapter is checked against."""
        raise NotImplementedError(f"{type(self).__name__} does not apply LoRA adapters")

    def load_lora(self, name: str, adapter: Any) -> None:
        """Hold ``adapter`` (a checked fdx.core.lora.LoRAWeights) as ``name``,
        this rank's shard of it (A of a row-parallel module split by input,
        B of a column-parallel one by output, as the base weights)."""
        raise NotImplementedError(f"{type(self).__name__} does not apply LoRA adapters")

    def unload_lora(self, name: str) -> None:
        """Drop adapter ``name`` (no request of a step uses it any more)."""
        raise NotImplementedError(f"{type(self).__name__} does not apply LoRA adapters")

    @classmethod
    def parse_config(cls, config: dict) -> Any:
        """The shape from the Hugging Face config alone, without weights: an
        object with the six shape attributes above (and ``intermediate_size``
        when the MLP is split by tensor parallel). The tensor parallel
        executor reads the shape here (the engine process loads no weights:
        its workers do); a class without it (the default raises
        NotImplementedError) runs at tensor_parallel_size 1 only (a
        ConfigError naming parallel.tensor_parallel_size above)."""
        raise NotImplementedError

    @abc.abstractmethod
    def forward(self, input_ids: Any, positions: Any, kv_caches: list, meta: "AttentionContext",
                logits_indices: Any) -> Any:
        """One step of a mixed batch: ``input_ids`` and ``positions`` (int64
        [N], the step's new tokens of every sequence, in order), one
        ``(k_cache, v_cache)`` per layer in the engine's ``KVCacheSpec``
        layout, and ``meta`` (an ``AttentionContext``: call its
        ``write_kv`` and ``attention`` per layer; try ``rope_write_kv``
        first). Returns float32 logits [M, vocab_size] for the rows
        ``logits_indices`` (int64 [M]) only.

        ``meta.layout`` (a ``BatchLayout``) says which request each row is:
        its id, row span, positions, which rows sample and its model
        arguments (activation hooks). A model that treats requests apart
        reads it there, never the engine's ``last_schedule`` (the previous
        step's while a forward runs). A row's result must not depend on
        the other rows of the step."""

    def shard(self, rank: int, world: int, reduce: Any) -> None:
        """Tensor parallel: keep rank ``rank`` of ``world``'s share of the
        heads and MLP columns; ``reduce(t)`` sums a tensor over the ranks.
        The default refuses (``parallel.tensor_parallel_size`` above 1 is a
        config error for a class that does not override it)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be sharded")

    @classmethod
    def shardable(cls) -> bool:
        """Whether the class overrides ``shard``."""
        return cls.shard is not Model.shard

    def drop_lm_head(self) -> None:
        """A tensor-parallel rank that never reads logits (ranks above 0) may
        free its head here. Default: keep it."""

    def cast(self, dtype: str) -> None:
        """Hold the weights in ``dtype`` (a backend's ``dtypes`` entry other
        than float32). The default refuses anything but float32."""
        if dtype != "float32":
            raise ValueError(f"config key 'model.dtype': {type(self).__name__} computes in float32 only, "
                             f"not {dtype}")

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights held, by kind ("q4_1", "f32", ...), for the
        start-up log, ``fdx bench throughput`` and ``/v1/engine/stats``.
        Default: {} (not reported)."""
        return {}


# =============================================================================
# Device: backend, attention backend, model runner
# =============================================================================

@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    """How the KV cache is laid out in memory, as the backend chose it."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    dtype: str                         # "float32", "float16", "bfloat16", or "int8" (cache.kv_cache_dtype;
                                       # head_major only: rows of head_dim int8 values + a float32 scale,
                                       # head_dim + 4 bytes, fdx/ops/csrc/kv8_kernels.h)
    layout: str = "head_major"         # the attention backend's (AttentionBackend.layout), one of:
    # "head_major": per layer (k, v), each [num_kv_heads * num_slots, head_dim]; the row of
    #     (kv head h, slot s) is h * num_slots + s, slot = block_id * block_size + offset.
    # "block_major": per layer (k, v), each [num_blocks, num_kv_heads, block_size, head_dim]
    #     (Paddle's block_multihead_attention); viewed as rows [-1, head_dim], the row of
    #     (h, s) is block_id * num_kv_heads * block_size + h * block_size + offset.
    # Whoever reads or writes blocks outside attention (KV connectors) goes through
    # ``kv_rows`` and ``row_view``, never the formula.

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def shape(self) -> list[int]:
        """The shape of one layer's k (and v) tensor in this layout."""
        if self.layout == "block_major":
            if self.dtype == "int8":
                raise ValueError("an int8 KV cache (cache.kv_cache_dtype) is laid out head_major only")
            return [self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim]
        if self.layout == "head_major":
            return [self.num_kv_heads * self.num_slots, self.row_width]
        raise ValueError(f"unknown KV cache layout {self.layout!r}; expected head_major or block_major")

    def kv_rows(self, slots: Any) -> Any:
        """int64 numpy [num_kv_heads, len(slots)]: the rows of these slots, per KV head, in a
        cache tensor seen through ``row_view``."""
        import numpy as np
        slots = np.asarray(slots, dtype=np.int64)
        heads = np.arange(self.num_kv_heads, dtype=np.int64)[:, None]
        if self.layout == "block_major":
            bs = self.block_size
            return heads * bs + (slots // bs * (self.num_kv_heads * bs) + slots % bs)[None, :]
        self.shape()                                   # rejects an unknown layout
        return heads * self.num_slots + slots[None, :]

    def row_view(self, tensor: Any) -> Any:
        """A cache tensor as rows [-1, head_dim] sharing its memory (writes go through)."""
        return tensor if len(tensor.shape) == 2 else tensor.reshape([-1, self.head_dim])

    @property
    def row_width(self) -> int:
        """Elements of one (kv head, slot) row: head_dim, or head_dim + 4 for int8 (the scale's bytes)."""
        return self.head_dim + 4 if self.dtype == "int8" else self.head_dim

    @property
    def bytes_per_block(self) -> int:
        itemsize = {"float32": 4, "int8": 1}.get(self.dtype, 2)
        return 2 * self.num_layers * self.num_kv_heads * self.row_width * self.block_size * itemsize


class AttentionBackend(abc.ABC):
    """Attention over the paged KV cache: the metadata builder (index and
    mask math, once per step) and the kernels every layer calls. The
    backend names the one it uses (``Backend.attention_backend``); ops/ holds
    the device-agnostic Paddle reference."""

    name: str = ""
    layout: str = "head_major"  # the KV cache layout it reads and writes (KVCacheSpec.layout)
    status: str = ""           # what it built or loaded at start-up, in words (reported when ready)

    def __init__(self, settings: dict | None = None, context: "BuildContext | None" = None):
        """Build or load any compiled kernel here: the engine constructs its
        attention backend before it reports ready, never on a request."""
        self.settings = settings or {}

    @abc.abstractmethod
    def build_metadata(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                       spec: KVCacheSpec, num_heads: int) -> Any:
        """Per-step metadata for a batch: each sequence's new tokens
        (``query_lens``), tokens already cached (``context_lens``) and blocks.
        The result must have ``positions`` (int64 tensor [num_tokens])."""

    @abc.abstractmethod
    def write_kv(self, k_cache: Any, v_cache: Any, k: Any, v: Any, metadata: Any) -> None:
        """Write the step's new K/V ([N, KVH, D]) into one layer's caches."""

    @abc.abstractmethod
    def forward(self, q: Any, k_cache: Any, v_cache: Any, metadata: Any, scale: float) -> Any:
        """Causal attention of q [N, H, D] over context + new tokens -> [N, H, D]."""

    def rope_write_kv(self, qkv: Any, positions: Any, k_cache: Any, v_cache: Any, metadata: Any, *, num_heads: int,
                      num_kv_heads: int, head_dim: int, rope: Any, q_norm: Any = None, k_norm: Any = None,
                      eps: float = 1e-6) -> Any | None:
        """Optional fused step before ``forward``: from one layer's fused
        projection ``qkv`` [N, (num_heads + 2 * num_kv_heads) * head_dim]
        (q, then k, then v; bias already added), RMS-normalize each q and k
        head with ``q_norm`` / ``k_norm`` [head_dim] when given (Qwen3), rotate
        q and k at ``positions`` (int64 [N]) with ``rope`` (fdx.ops.rotary's
        RotaryEmbedding: ``cos_cache``, ``sin_cache`` [max_position, head_dim],
        ``is_neox_style``, ``rotary_dim``), write k and v as ``write_kv`` would,
        and return q [N, num_heads, head_dim].

        Return None (the default) when the backend has no fused kernel for
        this call: the model then runs the composed ops (split, rms_norm,
        rotary, ``write_kv``), which are the reference the fused kernel must
        match."""
        return None

    # Whole decoder layers in one compiled call are not an attention backend's: the model calls
    # the model-level kernel port (fdx.ops.layer_port) for them.


@dataclass(slots=True, frozen=True)
class BatchLayout:
    """The step's batch as the model sees it: which request each token row
    belongs to. Request i owns rows ``[row_starts[i], row_starts[i] +
    num_rows[i])``, the tokens at positions ``start_positions[i]`` onward
    (its rows are consecutive positions). Set by the model runner on
    ``AttentionContext.layout`` for the step that is running (never the
    previous step's: nothing in a forward reads ``engine.last_schedule``)."""
    request_ids: tuple[str, ...]        # the step's requests, in row order
    row_starts: tuple[int, ...]         # request i's first row
    num_rows: tuple[int, ...]           # request i's rows this step
    start_positions: tuple[int, ...]    # position of request i's first row this step
    sample_rows: tuple[int, ...]        # the rows whose logits are computed, in logits order
    model_args: tuple[Any, ...]         # per request: its ``ModelArgs`` (activation hooks, LoRA adapter),
                                        # None when it has neither

    def rows_of(self, request_id: str) -> range:
        i = self.request_ids.index(request_id)
        return range(self.row_starts[i], self.row_starts[i] + self.num_rows[i])


@dataclass(slots=True, frozen=True)
class ModelArgs:
    """One request's model arguments (a ``BatchLayout.model_args`` entry):
    what the forward does for its rows only."""
    activations: Any = None             # fdx.core.activations.ActivationSpec, or None
    lora: str | None = None             # the name of its LoRA adapter (Model.load_lora), or None

    @staticmethod
    def of(activations: Any = None, lora: str | None = None) -> "ModelArgs | None":
        return None if activations is None and lora is None else ModelArgs(activations, lora)


@dataclass(slots=True)
class AttentionContext:
    """What a model's forward gets as ``attn_metadata``: the attention
    backend and this step's metadata, so layers call ``write_kv`` and
    ``attention`` (and try ``rope_write_kv`` first) without knowing which
    kernel runs; the step's ``layout`` (which request each row is); and
    ``activations``, the step's activation hooks when a request asked for
    any (else None: a model then does nothing more)."""
    backend: AttentionBackend
    metadata: Any
    # The KV connector's per-layer hooks, when one runs (None: none, and a model calls nothing). A
    # model's forward, for decoder layer i:  if meta.connector is not None:
    # meta.connector.wait_for_layer_load(i) before the layer's attention, and
    # meta.connector.save_kv_layer(i, kv_caches[i], meta) after it (KVConnector). The compiled
    # layers (fdx.ops.layer_port) make these calls themselves, around each layer they run.
    connector: "KVConnector | None" = None
    layout: BatchLayout | None = None   # set by the runner every step (None only outside a step:
                                        # a memory profile, a kernel probe)
    # fdx.core.activations.StepActivations built from ``layout`` when a request of the step has activation
    # hooks (a model with ``supports_activation_hooks`` calls its ``apply`` at the named points)
    activations: Any = None
    # fdx.core.lora.StepLoRA when a request of the step runs with a LoRA adapter (else None): the rows of
    # each adapter, grouped (a model with ``supports_lora`` calls its ``delta`` after each targeted linear)
    lora: Any = None

    @property
    def positions(self) -> Any:
        return self.metadata.positions

    def write_kv(self, k_cache, v_cache, k, v) -> None:
        self.backend.write_kv(k_cache, v_cache, k, v, self.metadata)

    def attention(self, q, k_cache, v_cache, scale: float):
        return self.backend.forward(q, k_cache, v_cache, self.metadata, scale)

    def rope_write_kv(self, qkv, positions, k_cache, v_cache, **layout):
        """The backend's fused q/k norm + rotary + KV write, or None (see
        ``AttentionBackend.rope_write_kv``): the caller then composes it."""
        return self.backend.rope_write_kv(qkv, positions, k_cache, v_cache, self.metadata, **layout)


class Backend(abc.ABC):
    """A device: whether it is present, how to set it up, and what runs on
    it. The engine asks the backend which attention backend, sampler and
    model runner to use (names in their registries), which dtypes it
    computes in, how to lay out and allocate the KV cache, and how much
    memory the KV cache may take."""

    name: str = ""
    priority: int = 0                  # auto picks the available backend with the highest
    attention_backend: str = "paddle"  # a name registered by fdx_register_attention_backends
    sampler: str = "host"              # a name registered by fdx_register_samplers
    model_runner: str = "default"      # a name registered by fdx_register_model_runners
    dtypes: tuple[str, ...] = ("float32",)   # model.dtype values it computes in; the first is "auto"
    captures_cuda_graphs: bool = False       # set when a graph-capturing model runner accepted this
                                             # backend (its check_backend)
    kernels: KernelTable = REFERENCE         # set by setup: the kernels beyond plain Paddle math that passed
                                             # their probe here (fdx.core.kernels); the model runner
                                             # installs it for each step

    def __init__(self, settings: dict | None = None, context: "BuildContext | None" = None):
        self.settings = settings or {}

    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> bool:
        """True when this device can run here (cheap, no side effects)."""

    @abc.abstractmethod
    def setup(self, config: "FdxConfig") -> None:
        """Select the device and set threads, and probe the kernels it may call
        (set ``self.kernels``); called once before the model loads. Under
        tensor parallel it runs in each worker only: the engine process
        never loads Paddle and takes rank 0's kernel table and the plain
        values setup set on the instance (docs/backends.md)."""

    def kernel_choices(self) -> dict[str, str]:
        """What runs for each op, in words, for the start-up log line and
        ``fdx env`` (default: each probed kernel's finding)."""
        return {name: "ok" if why is None else why for name, why in self.kernels.findings.items()}

    def kernel_summary(self) -> str:
        """One line on the kernels for /v1/engine/stats (default: the choices)."""
        return ", ".join(f"{op}={what}" for op, what in self.kernel_choices().items())

    @abc.abstractmethod
    def free_memory_bytes(self) -> int:
        """Memory the KV cache may draw from, before applying memory_fraction."""

    def total_memory_bytes(self) -> int | None:
        """The memory ``cache.memory_fraction`` is a share of, for the
        default KV cache's cap: a fixed figure (the host's or device's
        whole memory), so that the same settings give the same KV cache on
        every start. Default None: the share is of ``free_memory_bytes()``
        after the profile forward instead (what free memory there is)."""
        return None

    def prepare_model(self, model: Any, dtype: str) -> None:
        """The model is loaded (float32 weights): put it in ``dtype`` (one of
        ``dtypes``) and on this device. Default: nothing (float32 only)."""

    def profile_peak_bytes(self, run: Any) -> int:
        """Call ``run()`` (one forward at the largest batch) once and return
        the memory it needed at its peak beyond what was in use before, in
        bytes. Default: the process's resident set (host memory)."""
        from fdx.core.host import host_peak_bytes
        return host_peak_bytes(run)

    def kv_cache_dtype(self, model_dtype: str) -> str:
        """The KV cache's dtype for a model computing in ``model_dtype``."""
        return model_dtype

    def allocate_kv_cache(self, spec: KVCacheSpec) -> list:
        """Zeroed per-layer (k, v) tensors in ``spec``'s layout."""
        import paddle
        shape = spec.shape()
        return [(paddle.zeros(shape, dtype=spec.dtype), paddle.zeros(shape, dtype=spec.dtype))
                for _ in range(spec.num_layers)]

    def row_invariant_rows(self, weight_kinds, head_dim: int | None = None) -> int | None:
        """The largest one-sequence step (query rows) in which this backend's
        default mode (not ``backend.batch_invariant``) gives every row the
        bits of a one-row step, for a model whose weights are of
        ``weight_kinds`` (``Model.weight_bytes``' keys) and whose attention
        heads are ``head_dim`` wide (None: not known). A batch-1
        speculative step of k + 1 rows within it keeps decoding's greedy
        tokens; the engine says at start whether k fits. Default None: not
        known (nothing is promised past batch invariance)."""
        return None

    def describe(self) -> str:
        return self.name


@dataclass(slots=True)
class RunnerContext:
    """Everything the engine hands a model runner when it builds it."""
    config: "FdxConfig"
    model: Any
    kv_caches: list
    kv_spec: KVCacheSpec
    attention: AttentionBackend
    sampler: Sampler
    logits_processors: list[LogitsProcessor]
    eos_token_ids: frozenset[int]
    connector: KVConnector | None = None
    settings: Any = field(default_factory=dict)   # plugins.model_runner.<name>: the runner class's
                                        # Settings instance, or the dict when it declares none
    kernels: KernelTable = REFERENCE    # the backend's probed kernel table: a runner steps under
                                        # ``fdx.core.kernels.using(kernels)``
    rank: int = 0                       # this runner's tensor parallel rank (0: the one that samples)
    world_size: int = 1                 # how many ranks run this runner, each over its shard
    share_sampled: Any = None           # under tensor parallel: ``share_sampled(ids)`` hands rank 0's
                                        # sampled ids (int64 numpy [rows]; zeros elsewhere) to every
                                        # rank and returns them; None at world_size 1
    plugins: Any = None                 # the engine's PluginManager (registered activation functions, ...)


class ModelRunner(abc.ABC):
    """Turns a ``SchedulerOutput`` (plain data) into one batched forward and
    sampled tokens. It keeps a persistent batch of its own per-request state
    (token ids, block tables, sampling state), built from ``new_requests``
    and updated from ``cached_requests``; it never sees a ``Request``.

    On an embed engine (``config.model.task == "embed"``) every request is a
    pooling one: in the step its prompt's last token is computed, the runner
    puts its pooled, optionally normalized final hidden state in
    ``ModelRunnerOutput.pooled`` (``model.pooling_type``, ``model.normalize``);
    the token it samples then is never shown.

    ``backend.model_runner`` picks a runner over the backend's choice; its
    ``check_backend(config, backend)`` (a classmethod, called once when the
    backend is chosen) raises ``ConfigError`` when it cannot run there.

    The executor runs the same runner class on every rank (``Executor``).
    Under tensor parallel (``ctx.world_size`` above 1) each rank's runner
    gets every step, runs the forward over its model shard (the model's
    all-reduces join the ranks), and then: rank 0 alone reads logits, runs
    the logits processors and the guided bitmask, samples, and calls
    ``ctx.share_sampled(ids)``; the other ranks call it with zeros and
    append the ids it returns, so every rank's persistent batch stays the
    same (they hold no logits processors, and do not compute prompt
    logprobs). Rank 0's ``ModelRunnerOutput`` and taps are the step's. A
    runner class that does not follow this sets ``tensor_parallel =
    False``: ``parallel.tensor_parallel_size`` above 1 with it is a
    ConfigError naming ``backend.model_runner``."""

    tensor_parallel: bool = False       # follows the rank contract above (DefaultModelRunner does)

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "model_runner", settings, context, old, kw)
        self.ctx: RunnerContext = context.runner

    @abc.abstractmethod
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @classmethod
    def check_backend(cls, config: "FdxConfig", backend: "Backend") -> None:
        """Called once when ``backend.model_runner`` picks this class over
        the backend's choice: raise ``ConfigError`` when it cannot run on
        ``backend``. Default: it can."""

    def last_step_taps(self) -> dict[str, Any]:
        """The last step's ``sampled_request_ids``, ``logits`` and
        ``hidden_states`` for the StepContext (empty when not captured)."""
        return {}

    def close(self) -> None:
        """Release what the runner holds (device graphs, threads) when its
        executor closes. Default: nothing."""


@dataclass(slots=True, frozen=True)
class ModelShape:
    """What the engine reads of the model, wherever its weights live (the
    executor's ``shape``): a ``Model.parse_config`` result's six shape
    attributes, and that result itself (``cfg``: intermediate_size, ...)."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    cfg: Any = None
    supports_activation_hooks: bool = False     # the class's (a request's hooks are refused without)

    @classmethod
    def of(cls, m: Any, cfg: Any = None, hooks: bool | None = None) -> "ModelShape":
        """The shape of a model (``cfg``: its ``Model.cfg``), or of a
        ``parse_config`` result (pass it as ``cfg`` too, and ``hooks``: the
        class's ``supports_activation_hooks``)."""
        return cls(m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size,
                   m.max_position_embeddings, cfg if cfg is not None else m.cfg,
                   m.supports_activation_hooks if hooks is None else hooks)


class Executor(abc.ABC):
    """Where the model runs: the engine's one way to it at every tensor
    parallel size (``UniProcExecutor`` in core/executor.py: rank 0 in this
    process; ``parallel.runner``, ``tp`` in plugins/backends/tp.py: ranks 0
    .. N-1 in worker processes). The engine holds no model: it sizes the
    KV cache, builds it and steps only through these methods.

    Built as ``cls(settings, context)`` with ``context.assembly``, ``backend``,
    ``dtype``, ``progress`` and ``defer_tokenizer`` (``core.assembly.Assembly.executor``
    builds the class ``parallel.runner`` names, or ``UniProcExecutor``): it sets the
    backend up wherever the model runs (``backend``, the engine's, ends up
    holding what that setup found, and ``assembly.set_backend`` has run),
    loads the checkpoint (``checkpoint``: its config, tokenizer and
    generation config, no weights; the engine takes it and sets it None)
    and sets ``shape``. A combination that cannot run (a model that cannot
    be sharded, a runner that does not follow the rank contract of
    ``ModelRunner``, a feature that does not run at this size) is a
    ConfigError naming the key, raised here before any rank starts.

    Then, in order: ``kv_budget`` (only when ``cache.num_kv_blocks`` is not
    set), ``allocate`` once, then ``execute`` per step; ``reconfigure`` on
    an idle engine; ``close`` last (idempotent)."""

    shape: ModelShape
    checkpoint: Any = None              # the loaded checkpoint's metadata, until the engine takes it
    budget: Any = None                  # the last kv_budget's figures (core.memory.KVBudget), or None
    # what runs in this process (UniProcExecutor: rank 0's parts), None under tensor parallel
    model: Any = None
    runner: "ModelRunner | None" = None
    kv_caches: list = []
    attention: "AttentionBackend | None" = None
    sampler: "Sampler | None" = None
    logits_processors: list = []

    @abc.abstractmethod
    def kv_budget(self, num_tokens: int, num_seqs: int, memory_fraction: float) -> int:
        """Bytes the KV cache may take on each rank: ``memory_fraction`` of
        what one forward of ``num_tokens`` tokens in ``num_seqs`` sequences
        leaves (under tensor parallel, the least any rank has; a KV block's
        bytes count whole, which is conservative)."""

    @abc.abstractmethod
    def allocate(self, kv_spec: KVCacheSpec, connector: "KVConnector | None" = None) -> None:
        """Allocate ``kv_spec``'s KV tensors on every rank (each its share
        of the KV heads) and build each rank's runner (with ``connector``,
        the engine's, in this process)."""

    @abc.abstractmethod
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank; rank 0's output, whole."""

    @abc.abstractmethod
    def reconfigure(self, assembly: Any, connector: "KVConnector | None" = None) -> None:
        """Rebuild each rank's runner (logits processors, sampler, runner)
        for ``assembly.config`` (an ``Assembly`` of the new config) over the
        same model and KV tensors: the engine is idle, so no persistent
        batch is lost. A config this executor cannot run is a ConfigError
        naming the key, raised before anything changes."""

    def last_step_taps(self) -> dict[str, Any]:
        """Rank 0's runner's ``last_step_taps`` for the last step."""
        return {}

    def load_lora(self, name: str, path: str) -> None:
        """Load the LoRA adapter at ``path`` as ``name`` on every rank
        (``lora.lora_loader`` reads it, fdx.core.lora checks it against the
        model and ``lora.max_lora_rank``, each rank keeps its shard). A bad
        adapter is a ValueError saying why, and no rank keeps any of it."""
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters")

    def unload_lora(self, name: str) -> None:
        """Drop adapter ``name`` on every rank."""
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters")

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights held, by kind, summed over the ranks."""
        return {}

    def last_expert_load(self) -> list[list[int]] | None:
        """The model's ``Model.last_expert_load()`` of the last step, from
        rank 0 (None by default: no MoE layers, or not counted)."""
        return None

    def close(self) -> None:
        """Stop what the executor started (idempotent)."""


# =============================================================================
# Chat output parsers (the API process): tool calls and reasoning in the text
# =============================================================================

@dataclass(slots=True)
class ToolCall:
    """One function call found in the output. ``arguments`` is the JSON
    text of the arguments as the model wrote it (OpenAI's field is a
    string, and it may not be valid JSON: the client validates it)."""
    name: str
    arguments: str


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of the call at ``index`` (0, 1, ... in the order the calls
    appear). ``name`` is set in the call's first piece only; ``arguments``
    pieces concatenate to the call's whole ``arguments``."""
    index: int
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ToolParseResult:
    content: str | None                 # the text that is not a call (None: nothing but whitespace)
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(slots=True)
class ToolParseDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser(abc.ABC):
    """Finds function calls in a model's chat output (``server.tool_call_parser``
    picks one by name; registered through ``fdx_register_tool_parsers``).

    The server makes one instance per choice of a request with ``tools``
    and ``tool_choice="auto"``, so an instance may keep state for streaming.
    ``tools`` is the request's list of tools (OpenAI's shape). Both methods
    must never raise on any text: a malformed call is plain content.

    ``extract(text)`` reads a whole output. ``stream(delta, final)`` is fed
    the output in pieces (``final``: the last piece, maybe empty) and
    returns what may be sent now; over a whole output its pieces must
    concatenate to what ``extract`` returns for the same text. The default
    ``stream`` holds everything back and answers ``extract`` at the end:
    correct, not incremental."""

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "tool_parser", settings, context, old, kw)
        self.tokenizer = context.tokenizer
        self.tools = context.tools or []
        self.settings = settings or {}
        self._held = ""

    @abc.abstractmethod
    def extract(self, text: str) -> ToolParseResult: ...

    def stream(self, delta: str, final: bool) -> ToolParseDelta:
        self._held += delta
        if not final:
            return ToolParseDelta()
        result = self.extract(self._held)
        return ToolParseDelta(result.content or "", [ToolCallDelta(i, c.name, c.arguments)
                                                     for i, c in enumerate(result.tool_calls)])


@dataclass(slots=True)
class ReasoningResult:
    reasoning: str | None               # the thinking text (None: none)
    content: str | None                 # the answer (None: none)


class ReasoningParser(abc.ABC):
    """Splits a thinking model's output into reasoning and content
    (``server.reasoning_parser``; registered through
    ``fdx_register_reasoning_parsers``). One instance per choice.

    ``start`` / ``end`` are the texts that open and close a think block:
    the server forces ``end``'s tokens for ``reasoning_max_tokens`` and
    starts a guided constraint after them. ``begin(prompt)`` is called once
    with the rendered prompt before any output: True when the prompt has
    opened a think block the output continues, False when it closed one
    (``enable_thinking: false``: no reasoning follows), None when the model
    decides; ``implicit_reasoning`` says what the format makes of that:
    True, the output is reasoning until ``end`` (DeepSeek-R1), False, only
    an output that opens with ``start`` reasons (Qwen3). A guided
    constraint starts after ``end`` when reasoning comes first (``begin``
    True, or None with ``implicit_reasoning``), else from the first token.
    ``extract`` and ``stream`` follow ``ToolParser``'s rules (never raise;
    the pieces of ``stream`` concatenate to ``extract``'s result)."""

    start: str = "<think>"
    end: str = "</think>"
    implicit_reasoning: bool = False

    def reasons_first(self) -> bool:
        """After ``begin``: does the output start in reasoning?"""
        return self.prompt_state is True or (self.prompt_state is None and self.implicit_reasoning)

    def __init__(self, settings: Any = None, context: BuildContext | None = None, /, *old: Any, **kw: Any):
        settings, context = base_args(self, "reasoning_parser", settings, context, old, kw)
        self.tokenizer = context.tokenizer
        self.settings = settings or {}
        self.prompt_state: bool | None = None
        self._held = ""

    def begin(self, prompt: str) -> bool | None:
        tail = prompt.rstrip()
        if self.end and tail.endswith(self.end):
            self.prompt_state = False
        elif self.start and tail.endswith(self.start):
            self.prompt_state = True
        else:
            self.prompt_state = None
        return self.prompt_state

    @abc.abstractmethod
    def extract(self, text: str) -> ReasoningResult: ...

    def stream(self, delta: str, final: bool) -> ReasoningResult:
        self._held += delta
        if not final:
            return ReasoningResult(None, None)
        return self.extract(self._held)
