"""Token ids -> text: the one detokenize + stop-string implementation.

``TextOutput`` is used by the engine's default token processor (so by
``LLM``) and, through ``SequenceState``, by the API process, so the
server's text equals ``LLM.generate``'s. Its rules:

- a stop string counts only once ``min_tokens`` tokens are out, and only if
  it ends inside the newest token's text; the earliest match wins;
- the text is cut before it (or after it with include_stop_str_in_output);
- the token that completed it is the last one counted.

``SequenceState`` (one per engine request of the server: one choice of
one prompt) hands out text deltas; a chat choice with tools or a reasoning
parser carries its parsers beside them (``chat_output``), fed those deltas. While stop strings are live, the last ``len(longest stop) - 1`` characters
are held back from streaming, since they may turn out to begin a stop string.
"""
from __future__ import annotations

import time

from fdx.core.sampling_params import SamplingParams
from fdx.core.checkpoint.tokenizer import IncrementalDetokenizer


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
        self.out = TextOutput(tokenizer, params)
        stops = params.stop
        self.holdback = max(len(s) for s in stops) - 1 if stops and not params.include_stop_str_in_output else 0
        self.token_ids: list[int] = []
        self.num_sent_chars = 0
        self.logprobs: list[list[list[float]]] | None = [] if params.logprobs is not None else None
        self.num_sent_logprobs = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.queue_time: float | None = None
        self.chat_output = None                   # the choice's chat parsers (core/serving/chat_output.py)
        self.queue_time: float | None = None      # the engine's: arrival to first scheduled
        self.prefill_time: float | None = None    # the engine's: first scheduled to first token
        self.decode_time: float | None = None     # the engine's: first token to finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_ids: list[int], finish_reason: str | None = None, stop_reason=None,
            logprobs: list | None = None) -> bool:
        """Take the engine's new tokens. Returns True when a stop string ended
        the sequence here (the engine does not know: abort it there)."""
        if self.finished:
            return False
        now = time.monotonic()
        if token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
        last = len(token_ids) - 1
        for i, tid in enumerate(token_ids):
            self.token_ids.append(tid)
            if self.logprobs is not None and logprobs is not None and i < len(logprobs):
                self.logprobs.append(logprobs[i])
            engine_stopped_here = i == last and finish_reason == "stop"   # eos / stop token id: checked first
            stop = self.out.add(tid, len(self.token_ids), check_stop=not engine_stopped_here)
            if stop is not None:
                self._finish("stop", stop, now)
                return True
        if finish_reason is not None:
            self.out.finish()
            self._finish(finish_reason, stop_reason, now)
        return False

    @property
    def text(self) -> str:
        return self.out.text

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
