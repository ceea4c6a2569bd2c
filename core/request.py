"""Requests as the engine sees them, and the outputs handed back."""
from __future__ import annotations

import enum
import numbers
import time
from dataclasses import dataclass, field

from fdx.core.sampling_params import SamplingParams


class PromptError(ValueError):
    """A prompt no engine can take; ``code`` is OpenAI's error code, if any."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


def check_prompt(prompt_token_ids, vocab_size: int, max_model_len: int) -> None:
    """The one prompt check (the server's edge and ``EngineCore.make_request``
    both call it): not empty, integer ids in the vocabulary, room left to
    generate. Raises PromptError."""
    if not prompt_token_ids:
        raise PromptError("the prompt is empty: at least one token is needed")
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size
           for t in prompt_token_ids):
        raise PromptError(f"prompt token ids (prompt_token_ids) must be integers in [0, {vocab_size})")
    n = len(prompt_token_ids)
    if n >= max_model_len:
        raise PromptError(f"the prompt has {n} tokens, but this model's maximum context length (max_model_len) "
                          f"is {max_model_len}: at most {max_model_len - 1} prompt tokens leave room to generate",
                          code="context_length_exceeded")


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
    # filled by the token processor: ids and values only (text is the output processor's, core/output.py)
    logprobs: list | None = None                 # [{token: TokenLogprob}, ...] with logprobs=N
    prompt_logprobs: list | None = None          # [None, {token: TokenLogprob}, ...] with prompt_logprobs=N
    pooled: object | None = None                 # a pooling request's embedding: float32 numpy [hidden]
    activations: dict | None = None              # what its activation hooks captured: {"point.layer":
                                                 # {position: float32 row}} (fdx.core.activations.keep)
    error_status: int | None = None              # FINISHED_REJECTED by its guided compile: the HTTP status
                                                 # (400, 408 timed out, 429 busy), stop_reason the message
    stop_text: object | None = None              # with stop strings: the token processor's TextOutput
                                                 # (core/output.py), matching them as tokens are made
    lora_request: object | None = None           # its fdx.core.lora.LoRARequest (EngineCore.lora), None: base

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

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
    decoded: str | None = None          # the token's text: set by the output processor (core/output.py)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None               # "stop", "length", "abort" or None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, TokenLogprob]] | None = None  # one dict per generated token
    activations: dict | None = None     # SamplingParams.activations captures: {"point.layer": Captured
                                        # (positions, float32 values [n, hidden])} (fdx.core.activations)
    # LLM.chat with tools or a reasoning parser: the OpenAI-shaped assistant message the server
    # answers (role, content, tool_calls, reasoning_content), from the same parsers (core/chat_output.py)
    message: dict | None = None


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
    """One request's ``RequestOutput`` as the engine has it (what
    ``fdx_request_finished`` observers get): its one completion's token ids,
    finish and logprob values, no text (the engine makes none:
    core/output.py), and its times (monotonic clock)."""
    from fdx.core.activations import collect
    out = CompletionOutput(index=index, text="", token_ids=list(req.output_token_ids),
                           finish_reason=req.status.value if req.is_finished else None,
                           stop_reason=req.stop_reason, logprobs=req.logprobs,
                           activations=collect(req.activations))
    return RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids, outputs=[out],
        finished=req.is_finished, num_cached_tokens=req.num_cached_tokens, prompt_logprobs=req.prompt_logprobs,
        metrics={"arrival_time": req.arrival_time, "first_scheduled_time": req.first_scheduled_time,
                 "first_token_time": req.first_token_time, "finished_time": req.finished_time,
                 "num_preemptions": req.num_preemptions})
