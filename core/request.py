"""Requests as the engine sees them, and the outputs handed back."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from fdx.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_REJECTED = "rejected"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0                            # lower runs first under scheduler.policy=priority
    cache_salt: str | None = None                # prefix-cache isolation: only equal salts share blocks
    pooling: bool = False                        # model.task embed: runs its prompt, returns ``pooled``
    trace_headers: dict[str, str] | None = None  # what it came with over HTTP: W3C traceparent /
                                                 # tracestate and x-request-id (observers read it)
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 0                       # set by the engine
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0                 # tokens whose KV is in the cache
    num_cached_tokens: int = 0                   # prompt tokens served by a prefix hit
    num_preemptions: int = 0
    max_num_computed_tokens: int = 0             # high-water mark: below it, computing again is recompute
    stop_reason: int | str | None = None         # the stop string or token that ended it
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # filled by the token processor
    output_text: str = ""
    logprobs: list | None = None
    prompt_logprobs: list | None = None          # [None, {token: TokenLogprob}, ...] with prompt_logprobs=N
    detokenizer: object | None = None            # the token processor's TextOutput
    pooled: object | None = None                 # a pooling request's embedding: float32 numpy [hidden]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: max_tokens, bounded by the context left."""
        room = self.max_model_len - self.num_prompt_tokens
        mt = self.sampling_params.max_tokens
        return room if mt is None else min(mt, room)

    @property
    def is_finished(self) -> bool:
        return self.status.finished


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    decoded: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None               # "stop", "length", "abort" or None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, TokenLogprob]] | None = None  # one dict per generated token


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, TokenLogprob] | None] | None = None   # None for the first token
    metrics: dict | None = None


def request_output(req: Request, index: int = 0) -> RequestOutput:
    """One request's ``RequestOutput`` as it stands (what ``fdx_request_finished``
    observers get): its one completion, and its times (monotonic clock)."""
    out = CompletionOutput(index=index, text=req.output_text, token_ids=list(req.output_token_ids),
                           finish_reason=req.status.value if req.is_finished else None,
                           stop_reason=req.stop_reason, logprobs=req.logprobs)
    return RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids, outputs=[out],
        finished=req.is_finished, num_cached_tokens=req.num_cached_tokens, prompt_logprobs=req.prompt_logprobs,
        metrics={"arrival_time": req.arrival_time, "first_scheduled_time": req.first_scheduled_time,
                 "first_token_time": req.first_token_time, "finished_time": req.finished_time,
                 "num_preemptions": req.num_preemptions})
