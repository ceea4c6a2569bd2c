"""The output processor: the engine's token ids -> what callers get.

The engine emits token ids, finish reasons and logprob ids/values only
(its token processor checks eos, stop token ids, min/max_tokens and the
context length). Everything made of text happens here, once, for
``LLM.generate/chat`` (``OutputProcessor``, in-process) and for the
server (one ``SequenceState`` per choice, in the API process), so the two
give the same text, logprob text and stop behaviour:

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

from fdx.core.sampling_params import SamplingParams
from fdx.core.checkpoint.tokenizer import IncrementalDetokenizer

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
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
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


def decode_logprobs(tokenizer, entries: list | None) -> None:
    """Fill ``decoded`` of engine logprob entries ({token id: TokenLogprob}
    per token, None for a prompt's first) in place: the engine emits ids
    and values only."""
    for d in entries or ():
        for lp in (d or {}).values():
            if lp.decoded is None:
                lp.decoded = token_text(tokenizer, lp.token_id)


class OutputProcessor:
    """The in-process engine's outputs -> one ``SequenceState`` per engine
    request (``LLM``; the server's API process keeps its SequenceStates in
    its RequestGroups, fed the same fields over the wire). ``add`` the
    requests ``make_request`` built from ``split_n``'s children; after each
    engine step ``process`` its changed requests: new token ids, logprobs
    (their text decoded here), the finish reason (a stop string's too: the
    engine's token processor matched it)."""

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.seqs: dict[str, SequenceState] = {}

    def add(self, request, index: int = 0, prompt_index: int = 0) -> SequenceState:
        seq = SequenceState(request.request_id, index, prompt_index, request.prompt_token_ids,
                            request.sampling_params, self.tokenizer, request.arrival_time)
        self.seqs[request.request_id] = seq
        return seq

    def process(self, changed) -> list[SequenceState]:
        """Apply one step's changed requests; the sequences that finished."""
        finished = []
        for req in changed:
            seq = self.seqs.get(req.request_id)
            if seq is None or seq.finished:
                continue
            sent = len(seq.token_ids)
            new = req.output_token_ids[sent:]
            lps = None
            if req.logprobs is not None:
                lps = req.logprobs[sent:sent + len(new)]
                decode_logprobs(self.tokenizer, lps)
            done = req.is_finished
            seq.add(new, req.status.value if done else None, req.stop_reason if done else None, lps)
            if seq.finished:
                finished.append(seq)
        return finished

    def pop(self, request_id: str) -> SequenceState | None:
        return self.seqs.pop(request_id, None)
