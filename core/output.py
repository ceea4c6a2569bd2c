"""The output processor: the engine's token ids -> what callers get.

The engine emits token ids, finish reasons and logprob ids/values only
(its token processor checks eos, stop token ids, min/max_tokens and the
context length). One path carries them to callers, the same for
``LLM.generate/chat`` (in-process) and the server (engine process -> API
process), so the two give the same text, logprob text and stop behaviour:

- ``DeltaTracker`` (the engine side): each changed engine request -> one
  ``SeqDelta`` (core/messages.py), its new token ids since the last one,
  their logprobs as ``[token_id, logprob, rank]`` rows, the finish and
  stop reasons, the engine's timings. The serving engine process sends
  these over the wire; ``OutputProcessor`` hands them over in-process;
- ``SequenceState.apply`` (the caller side): a ``SeqDelta`` -> one
  choice's state and text; ``LLM`` and the server's RequestGroup both
  apply every delta through it;

- ``split_n``: the one place a request becomes its ``n`` children. The
  seed rule: with ``seed`` given, child ``i`` samples with
  ``(seed + i) % 2**63``; without one, every child draws its own;
- ``TextOutput``: incremental detokenizing and the stop-string rule. A stop
  string counts only once ``min_tokens`` tokens are out, and only if it
  ends inside the newest token's text; the earliest match wins; the text is
  cut before it (or after it with include_stop_str_in_output); the token
  that completed it is the last one counted. The engine's token processor
  runs it where the tokens are made (plugins/decoding/token_processor.py),
  so the engine finishes the request with that token ("stop", the string
  as ``stop_reason``) and computes none past it; here the same rule cuts
  the text of the sequence the engine stopped;
- ``token_text``: a logprob's token as text (OpenAI's ``token``, vLLM's
  ``decoded_token``);
- ``SequenceState``: one sequence's state (one choice of one prompt),
  handing out text deltas. A chat choice with tools or a reasoning parser
  carries its parsers beside them (``chat_output``), fed those deltas.
  While stop strings are live, the last ``len(longest stop) - 1``
  characters are held back from streaming, since they may turn out to
  begin a stop string.

``SamplingParams.detokenize=False`` means no text: token ids (and logprob
ids/values) only, and no stop strings (validate refuses them).
"""
from __future__ import annotations

import dataclasses
import time

from fdx.core.messages import SeqDelta
from fdx.core.request import TokenLogprob
from fdx.core.sampling_params import SamplingParams

SEED_MODULUS = 2**63          # seeds are in [0, 2**63) (SamplingParams.validate)


def split_n(sp: SamplingParams) -> list[SamplingParams]:
    """A request's ``n`` children, each ``n=1``: child ``i`` gets seed
    ``(seed + i) % 2**63`` when a seed is given (n=1: the params as they are)."""
    if sp.n == 1:
        return [sp]
    return [dataclasses.replace(sp, n=1, seed=None if sp.seed is None else (sp.seed + i) % SEED_MODULUS)
            for i in range(sp.n)]


def token_text(tokenizer, token_id: int) -> str:
    """One token as text, special tokens kept: a logprob entry's token."""
    return tokenizer.decode([int(token_id)], skip_special_tokens=False)


class TextOutput:
    """One sequence's text: incremental detokenizing and stop strings."""

    __slots__ = ("params", "detok", "text")

    def __init__(self, tokenizer, params: SamplingParams):
        # the tokenizer (model I/O's) makes the detokenizer: core imports no tokenizer module, and
        # the serving engine process builds its deferred one only for a request with stop strings
        self.params = params
        self.detok = tokenizer.detokenizer(skip_special_tokens=params.skip_special_tokens)
        self.text = ""

    def add(self, token_id: int, num_tokens: int, check_stop: bool = True) -> str | None:
        """Append one token (the sequence's ``num_tokens``-th). Returns the
        stop string it completed, having cut the text there, or None.
        ``check_stop`` is False when the token already ended the sequence
        (eos, a stop token id: those are checked first)."""
        prev_len = len(self.text)
        self.text += self.detok.add([token_id])
        sp = self.params
        if sp.stop and check_stop and num_tokens >= sp.min_tokens:
            return self._check_stop(prev_len)
        return None

    def finish(self) -> None:
        """The sequence ended: flush a tail that never completed a character."""
        self.text += self.detok.finish()

    def _check_stop(self, prev_len: int) -> str | None:
        """The earliest stop string ending inside the new text."""
        sp = self.params
        best: tuple[int, str] | None = None
        for stop in sp.stop:
            idx = self.text.find(stop, max(0, prev_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if sp.include_stop_str_in_output else self.text[:idx]
        return stop


class SequenceState:
    def __init__(self, request_id: str, index: int, prompt_index: int, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer, arrival_time: float | None = None):
        self.request_id = request_id
        self.index = index                        # the choice index in the response
        self.prompt_index = prompt_index
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.out = TextOutput(tokenizer, params) if params.detokenize else None   # None: token ids only
        stops = params.stop
        self.holdback = max(len(s) for s in stops) - 1 if stops and not params.include_stop_str_in_output else 0
        self.token_ids: list[int] = []
        self.num_sent_chars = 0
        self.logprobs: list[list[list[float]]] | None = [] if params.logprobs is not None else None
        self.num_sent_logprobs = 0
        # with prompt_logprobs=N: per prompt token [[token_id, logprob, rank], ...] by rank, None first
        self.prompt_logprobs: list[list[list[float]] | None] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.chat_output = None                   # the choice's chat parsers (core/chat_output.py)
        self.queue_time: float | None = None      # the engine's: arrival to first scheduled
        self.prefill_time: float | None = None    # the engine's: first scheduled to first token
        self.decode_time: float | None = None     # the engine's: first token to finished
        self.activations: list | None = None      # SeqDelta.activations (the finishing delta's)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, delta: SeqDelta) -> None:
        """Take one of the engine's deltas for this sequence (``DeltaTracker``'s,
        in-process or off the wire): timings, prefix-cache hits, prompt
        logprobs and activations as they come, then the new tokens."""
        if self.finished:
            return
        if delta.queue_time_s is not None:
            self.queue_time = delta.queue_time_s
        if delta.prefill_time_s is not None:
            self.prefill_time = delta.prefill_time_s
        if delta.decode_time_s is not None:
            self.decode_time = delta.decode_time_s
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.activations is not None:        # activation captures, with the finishing delta
            self.activations = delta.activations
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.add(delta.token_ids, delta.finish_reason, delta.stop_reason, delta.logprobs)

    def add(self, token_ids: list[int], finish_reason: str | None = None, stop_reason=None,
            logprobs: list | None = None) -> None:
        """Take the engine's new tokens; with ``finish_reason``, the last one
        ended the sequence (a stop string ``stop_reason``: the text is cut
        there, by the rule the engine matched it with)."""
        if self.finished:
            return
        now = time.monotonic()
        if token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
        last = len(token_ids) - 1
        stopped_by_string = finish_reason == "stop" and isinstance(stop_reason, str)
        for i, tid in enumerate(token_ids):
            self.token_ids.append(tid)
            if self.logprobs is not None and logprobs is not None and i < len(logprobs):
                self.logprobs.append(logprobs[i])
            if self.out is not None:
                self.out.add(tid, len(self.token_ids), check_stop=stopped_by_string and i == last)
        if finish_reason is not None:
            if self.out is not None and not stopped_by_string:
                self.out.finish()
            self._finish(finish_reason, stop_reason, now)

    @property
    def text(self) -> str:
        return self.out.text if self.out is not None else ""

    def chat_message(self) -> dict | None:
        """The finished chat choice's assistant message through its parsers
        (content, tool_calls, reasoning_content; core/chat_output.py), or
        None for a choice without parsers (its message is the text)."""
        return self.chat_output.message(self.text) if self.chat_output is not None else None

    def chat_finish_reason(self) -> str | None:
        """The finish reason a chat answer gives: ``tool_calls`` for a choice
        that called (auto, required), else the engine's. After ``chat_message``
        (or the streamed deltas): the parsers count the calls there."""
        return self.chat_output.finish_reason(self.finish_reason) if self.chat_output is not None else self.finish_reason

    def _finish(self, reason: str, stop_reason, now: float) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finished_time = now

    def take_text(self) -> str:
        """The text not yet handed out that is safe to hand out."""
        end = len(self.text) if self.finished else max(self.num_sent_chars, len(self.text) - self.holdback)
        delta = self.text[self.num_sent_chars:end]
        self.num_sent_chars = end
        return delta

    def take_logprobs(self) -> list[tuple[int, list[list[float]]]]:
        """(sampled token id, [[token_id, logprob, rank], ...] by rank) per
        token not yet handed out."""
        if self.logprobs is None:
            return []
        start, self.num_sent_logprobs = self.num_sent_logprobs, len(self.logprobs)
        return list(zip(self.token_ids[start:], self.logprobs[start:]))


def wire_logprobs(entries: dict) -> list[list[float]]:
    """One token's {token id: TokenLogprob} as a SeqDelta carries it:
    [[token_id, logprob, rank], ...] by rank."""
    return [[float(t.token_id), t.logprob, float(t.rank)] for t in sorted(entries.values(), key=lambda t: t.rank)]


def logprob_dict(tokenizer, rows: list[list[float]] | None) -> dict[int, TokenLogprob] | None:
    """A SeqDelta's logprob rows for one token -> ``{token id: TokenLogprob}``
    (``LLM``'s form, vLLM's), each with its token's text (``decoded``)."""
    if rows is None:
        return None
    return {int(t): TokenLogprob(int(t), lp, int(rank), token_text(tokenizer, int(t))) for t, lp, rank in rows}


class DeltaTracker:
    """The engine side of the output path: how many tokens of each request
    were handed on, and the ``SeqDelta`` of a changed request. Used by the
    serving engine process (entrypoints/serving/engine_proc.py, which adds a
    pooling request's embedding and the activation captures to a finishing
    delta, and sends refusals as EngineRejected) and by ``OutputProcessor``."""

    def __init__(self):
        self.num_sent: dict[str, int] = {}       # request id -> tokens already handed on

    def track(self, request_id: str) -> None:
        self.num_sent[request_id] = 0

    def forget(self, request_id: str) -> None:
        self.num_sent.pop(request_id, None)

    def tracking(self, request_id: str) -> bool:
        return request_id in self.num_sent

    def delta(self, req) -> SeqDelta:
        """The changed request's ``SeqDelta``: its new tokens since the last
        one (none for a constrained request whose constraint just compiled),
        with the finish reason once it is finished (then forgotten)."""
        sent = self.num_sent[req.request_id]
        new = req.output_token_ids[sent:]
        finished = req.is_finished
        lps = None
        if req.logprobs is not None:
            lps = [wire_logprobs(d) for d in req.logprobs[sent:sent + len(new)]]
        prompt_lps = None
        if sent == 0 and new and req.prompt_logprobs is not None:   # the whole prompt is computed by now
            prompt_lps = [None if d is None else wire_logprobs(d) for d in req.prompt_logprobs]
        queue_time = prefill_time = decode_time = None
        if sent == 0 and req.first_scheduled_time is not None:
            queue_time = req.first_scheduled_time - req.arrival_time
            if req.first_token_time is not None:
                prefill_time = req.first_token_time - req.first_scheduled_time
        if finished and req.first_token_time is not None and req.finished_time is not None:
            decode_time = req.finished_time - req.first_token_time
        if finished:
            del self.num_sent[req.request_id]
        else:
            self.num_sent[req.request_id] = sent + len(new)
        return SeqDelta(req.request_id, list(new),
                        finish_reason=req.status.value if finished else None,
                        stop_reason=req.stop_reason if finished else None,
                        logprobs=lps, num_cached_tokens=req.num_cached_tokens, queue_time_s=queue_time,
                        prefill_time_s=prefill_time, decode_time_s=decode_time, prompt_logprobs=prompt_lps)


class OutputProcessor:
    """The in-process engine's outputs -> one ``SequenceState`` per engine
    request (``LLM``): each step's changed requests become ``SeqDelta``s
    (``DeltaTracker``, as in the serving engine process) applied to their
    sequences (``SequenceState.apply``, as in the server's API process).
    ``add`` the requests ``make_request`` built from ``split_n``'s children;
    after each engine step ``process`` its changed requests."""

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.seqs: dict[str, SequenceState] = {}
        self.tracker = DeltaTracker()

    def add(self, request, index: int = 0, prompt_index: int = 0, chat_output=None) -> SequenceState:
        """``chat_output``: the choice's chat parsers (core/chat_output.py's
        ChoiceOutput), as the server gives each chat choice."""
        seq = SequenceState(request.request_id, index, prompt_index, request.prompt_token_ids,
                            request.sampling_params, self.tokenizer, request.arrival_time)
        seq.chat_output = chat_output
        self.seqs[request.request_id] = seq
        self.tracker.track(request.request_id)
        return seq

    def process(self, changed) -> list[SequenceState]:
        """Apply one step's changed requests; the sequences that finished."""
        finished = []
        for req in changed:
            seq = self.seqs.get(req.request_id)
            if seq is None or seq.finished or not self.tracker.tracking(req.request_id):
                continue
            seq.apply(self.tracker.delta(req))
            if seq.finished:
                finished.append(seq)
        return finished

    def pop(self, request_id: str) -> SequenceState | None:
        self.tracker.forget(request_id)
        return self.seqs.pop(request_id, None)
