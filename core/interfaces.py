"""The contracts plugins implement. Each contract is written here, once."""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fdx.core.config import FdxConfig
    from fdx.core.request import Request


# --- data between scheduler, model runner and token processor -------------

@dataclass(slots=True)
class ScheduledRequest:
    request: "Request"
    num_new_tokens: int          # tokens computed this step, from request.num_computed_tokens on
    block_table: list[int]       # physical KV blocks holding the request's tokens, in order

    @property
    def context_len(self) -> int:
        """Tokens already in the KV cache before this step."""
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token, so
        the model runner samples the next one."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # batch order
    num_scheduled_tokens: int = 0                  # sum of num_new_tokens, <= the step budget
    preempted: list["Request"] = field(default_factory=list)   # freed this step, to recompute
    finished_aborted: list["Request"] = field(default_factory=list)  # aborted or rejected since last step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)     # request_id -> next token id
    logprobs: dict[str, Any] = field(default_factory=dict)    # request_id -> TokenLogprobs


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


# --- KV cache ------------------------------------------------------------

class KVCacheManager(abc.ABC):
    """Owns the physical KV blocks and maps each request to its block table.

    A block holds ``block_size`` consecutive token positions of one request.
    Blocks are reference counted: a block is free when no request holds it.
    All methods are called from the engine thread only.
    """

    def __init__(self, num_blocks: int, block_size: int, config: "FdxConfig | None" = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.config = config

    @abc.abstractmethod
    def get_computed_blocks(self, request: "Request") -> int:
        """Before a request is first scheduled (or rescheduled after
        preemption): attach any cached blocks holding a prefix of its tokens
        and return how many tokens they cover (a multiple of block_size, and
        always less than ``request.num_tokens``: the last token is computed).
        Caches without reuse return 0."""

    @abc.abstractmethod
    def allocate_slots(self, request: "Request", num_new_tokens: int) -> bool:
        """Make the request's block table cover num_computed_tokens +
        num_new_tokens positions. Returns False, changing nothing, when
        there are not enough free blocks."""

    @abc.abstractmethod
    def free(self, request: "Request") -> None:
        """Drop the request's references to its blocks (finish, abort,
        preemption). Idempotent."""

    @abc.abstractmethod
    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks, in token order."""

    def on_tokens_computed(self, request: "Request") -> None:
        """Called after a step computed tokens for the request (a prefix
        cache registers the blocks that became full). Default: nothing."""

    def cached_prefix_len(self, request: "Request") -> int:
        """How many of the request's tokens a prefix hit would cover now,
        without attaching anything (the lpm policy orders by it). Default: 0."""
        return 0

    def attach_kv_tensors(self, kv_caches: list, num_kv_heads: int, model_id: str = "") -> None:
        """Called once by the engine after building the cache: the per-layer
        ``(k, v)`` tensors, ``[num_kv_heads * num_slots, head_dim]`` each (row
        of kv head h and slot s: ``h * num_slots + s``), and a string naming
        the weights (the model path). Caches that copy blocks to another
        tier keep them; default: nothing."""

    def close(self) -> None:
        """The engine is done with this cache: keep what is worth keeping
        (a file tier writes its blocks) and let go of the KV tensors, which
        may be reused. Idempotent. Default: nothing."""

    @property
    @abc.abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now."""

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks / max(self.num_blocks, 1)

    def stats(self) -> dict[str, float]:
        """Counters for metrics (hit/query tokens for prefix caches)."""
        return {}


# --- KV scheduler --------------------------------------------------------

class ResourceManager(abc.ABC):
    """A KV scheduler: decides, each step, which requests run and how many
    of their tokens, and holds their KV blocks through ``kv_cache``.

    Contract: ``schedule()`` never exceeds ``max_num_batched_tokens`` tokens
    or ``max_num_seqs`` running requests, never schedules a request whose
    blocks were not allocated, and never leaves a request waiting forever.
    ``update()`` appends the sampled tokens through the token processor,
    frees the blocks of finished requests and returns the requests whose
    output changed this step.
    """

    def __init__(self, config: "FdxConfig", kv_cache: KVCacheManager,
                 token_processor: "TokenProcessor", max_model_len: int):
        self.config = config
        self.kv_cache = kv_cache
        self.token_processor = token_processor
        self.max_model_len = max_model_len

    @abc.abstractmethod
    def add_request(self, request: "Request") -> None:
        """Queue a validated request."""

    @abc.abstractmethod
    def abort_request(self, request_id: str) -> "Request | None":
        """Remove a waiting or running request and free its blocks; returns
        it (status FINISHED_ABORTED) or None if unknown or already done."""

    @abc.abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch."""

    @abc.abstractmethod
    def update(self, scheduler_output: SchedulerOutput,
               runner_output: ModelRunnerOutput) -> list["Request"]:
        """Account for a step that ran; return the requests that produced a
        token (finished or not)."""

    @property
    @abc.abstractmethod
    def num_running(self) -> int: ...

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int: ...

    def has_unfinished(self) -> bool:
        return self.num_running + self.num_waiting > 0


# --- token processing ----------------------------------------------------

class TokenProcessor(abc.ABC):
    """Turns sampled token ids into request state: appends the token,
    detokenizes incrementally, records logprobs, and decides whether the
    request is finished (eos, stop token ids, stop strings, max_tokens,
    context length), setting ``request.status`` and ``stop_reason``."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def start(self, request: "Request") -> None:
        """Called once when the engine accepts a request (per-request state)."""

    @abc.abstractmethod
    def process(self, request: "Request", token_id: int, logprobs: Any = None) -> bool:
        """Append one sampled token; return True when the request finished."""


# --- device backend ------------------------------------------------------

class Backend(abc.ABC):
    """A device: whether it is present, how to set it up, how much memory
    the KV cache may take. Models and ops run through Paddle on the device
    the backend selects."""

    name: str = ""
    priority: int = 0          # auto picks the available backend with the highest

    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> bool:
        """True when this device can run here (cheap, no side effects)."""

    @abc.abstractmethod
    def setup(self, config: "FdxConfig") -> None:
        """Select the device and set threads; called once before the model loads."""

    @abc.abstractmethod
    def free_memory_bytes(self) -> int:
        """Memory the KV cache may draw from, before applying memory_fraction."""

    def describe(self) -> str:
        return self.name
