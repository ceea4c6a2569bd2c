"""Built-in logits processors: batched, per-request transforms of the logits.

Two layers:
- functional transforms ``(logits [B, V] float32, batch: SamplingBatch) ->
  logits`` (``repetition_penalty``, ``presence_frequency_penalty``,
  ``min_tokens``): row ``i`` belongs to ``batch.params[i]``; they may edit
  ``logits`` in place. The standalone host sampler applies them.
- the ``LogitsProcessor`` plugins the engine runs (contract in
  core/interfaces.py), always on: ``penalties``, ``min_tokens``,
  ``logit_bias``, ``allowed_token_ids`` and ``bad_words``. Each keeps the
  rows' state it needs (``RowsProcessor``) and does nothing for rows whose
  parameters are neutral; the work is over token ids, never a Python loop
  over the vocabulary.
"""
from __future__ import annotations

from itertools import chain
from typing import Sequence

import numpy as np

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import BatchUpdate, LogitsProcessor, RowState, SamplingBatch
from fdx.core.sampling_params import SamplingParams, bad_word_sequences


def _flat_ids(rows: Sequence[int], seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(row index, token id) pairs of every token in ``seqs``; ``seqs[j]`` belongs to ``rows[j]``."""
    lens = [len(s) for s in seqs]
    ids = np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=sum(lens))
    return np.repeat(np.asarray(rows, dtype=np.int64), lens), ids


def repetition_penalty(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """HF/CTRL style, over prompt and output tokens: a seen token's logit is
    divided by the penalty when positive and multiplied by it otherwise."""
    rows = [i for i, p in enumerate(batch.params) if p.repetition_penalty != 1.0]
    if not rows:
        return logits
    seqs = [batch.prompt_token_ids[i] for i in rows] + [batch.output_token_ids[i] for i in rows]
    r, ids = _flat_ids(rows + rows, seqs)
    penalty = np.array([p.repetition_penalty for p in batch.params], dtype=np.float32)[r]
    seen = logits[r, ids]
    # A token seen twice is gathered twice from the original logits and written
    # back with the same value, so each token is penalized once.
    logits[r, ids] = np.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def presence_frequency_penalty(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """OpenAI style, over output tokens only:
    ``logit -= presence * (count > 0) + frequency * count``."""
    rows = [i for i, p in enumerate(batch.params)
            if (p.presence_penalty or p.frequency_penalty) and batch.output_token_ids[i]]
    if not rows:
        return logits
    vocab = logits.shape[1]
    r, ids = _flat_ids(rows, [batch.output_token_ids[i] for i in rows])
    keys, counts = np.unique(r * vocab + ids, return_counts=True)
    r, ids = np.divmod(keys, vocab)
    presence = np.array([p.presence_penalty for p in batch.params], dtype=np.float32)
    frequency = np.array([p.frequency_penalty for p in batch.params], dtype=np.float32)
    logits[r, ids] -= presence[r] + frequency[r] * counts.astype(np.float32)
    return logits


def min_tokens(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """While a request has fewer than ``min_tokens`` output tokens, its stop
    token ids, and the model's eos ids unless ``ignore_eos``, get -inf."""
    eos = sorted(batch.eos_token_ids)
    rows, seqs = [], []
    for i, p in enumerate(batch.params):
        if len(batch.output_token_ids[i]) < p.min_tokens:
            rows.append(i)
            seqs.append(p.stop_token_ids if p.ignore_eos else [*p.stop_token_ids, *eos])
    if rows:
        r, ids = _flat_ids(rows, seqs)
        logits[r, ids] = -np.inf
    return logits


BUILTIN_TRANSFORMS = {
    "repetition_penalty": repetition_penalty,
    "presence_frequency_penalty": presence_frequency_penalty,
    "min_tokens": min_tokens,
}


# --- the engine's stateful processors -----------------------------------------------

class RowsProcessor(LogitsProcessor):
    """Keeps each row's ``RowState`` and the row order; subclasses read
    ``self.rows`` (RowState per logits row) in ``apply``. ``wants(params)``
    says which requests concern it: others cost nothing."""

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        self.states: dict[str, RowState] = {}
        self.rows: list[RowState] = []
        self.active = False                     # some row wants this processor

    def wants(self, params) -> bool:
        return True

    def on_added(self, state: RowState) -> None:
        """A request joined (new or resumed): build its per-request state."""

    def on_removed(self, request_id: str) -> None:
        """A request left."""

    def update_state(self, update: BatchUpdate) -> None:
        for rid in update.removed:
            if self.states.pop(rid, None) is not None:
                self.on_removed(rid)
        for state in update.added:
            if self.wants(state.params):
                self.states[state.request_id] = state
                self.on_added(state)
        if update.rows_changed or update.added or update.removed:
            self.rows = [self.states.get(rid) for rid in update.rows]
            self.active = any(r is not None for r in self.rows)

    def batch(self) -> SamplingBatch:
        """The rows as a SamplingBatch for the functional transforms
        (neutral parameters for rows that do not concern this processor)."""
        neutral = _NEUTRAL
        return SamplingBatch(
            params=[r.params if r is not None else neutral for r in self.rows],
            prompt_token_ids=[r.prompt_token_ids if r is not None else () for r in self.rows],
            output_token_ids=[r.output_token_ids if r is not None else () for r in self.rows],
            eos_token_ids=frozenset(getattr(self.tokenizer, "eos_token_ids", ()) or ()))


_NEUTRAL = SamplingParams(max_tokens=None)


class Penalties(RowsProcessor):
    """Repetition (HF), presence and frequency (OpenAI) penalties."""

    def wants(self, p) -> bool:
        return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)

    def apply(self, logits):
        if self.active:
            batch = self.batch()
            logits = presence_frequency_penalty(repetition_penalty(logits, batch), batch)
        return logits


class MinTokens(RowsProcessor):
    """No eos (unless ignore_eos) or stop token id before min_tokens outputs."""

    def wants(self, p) -> bool:
        return p.min_tokens > 0

    def apply(self, logits):
        return min_tokens(logits, self.batch()) if self.active else logits


class LogitBias(RowsProcessor):
    """OpenAI's logit_bias: token id -> added to its logit."""

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def wants(self, p) -> bool:
        return bool(p.logit_bias)

    def on_added(self, state):
        bias = state.params.logit_bias
        self._arrays[state.request_id] = (np.fromiter(bias.keys(), np.int64, len(bias)),
                                          np.fromiter(bias.values(), np.float32, len(bias)))

    def on_removed(self, request_id):
        self._arrays.pop(request_id, None)

    def apply(self, logits):
        if self.active:
            for row, state in enumerate(self.rows):
                if state is not None:
                    ids, vals = self._arrays[state.request_id]
                    logits[row, ids] += vals
        return logits


class AllowedTokenIds(RowsProcessor):
    """Only the listed token ids may be sampled."""

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        self._ids: dict[str, np.ndarray] = {}

    def wants(self, p) -> bool:
        return p.allowed_token_ids is not None

    def on_added(self, state):
        self._ids[state.request_id] = np.unique(np.asarray(state.params.allowed_token_ids, dtype=np.int64))

    def on_removed(self, request_id):
        self._ids.pop(request_id, None)

    def apply(self, logits):
        if self.active:
            for row, state in enumerate(self.rows):
                if state is not None:
                    ids = self._ids[state.request_id]
                    kept = logits[row, ids].copy()
                    logits[row] = -np.inf
                    logits[row, ids] = kept
        return logits


class BadWords(RowsProcessor):
    """Never generate the listed words: each word is tokenized as written and
    with a leading space; a sequence's last token is banned wherever the
    tokens before it were the last ones generated (a one-token word is
    always banned). vLLM's semantics."""

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        self._seqs: dict[str, list[tuple[int, ...]]] = {}

    def wants(self, p) -> bool:
        return bool(p.bad_words or p.bad_words_token_ids)

    def on_added(self, state):
        p = state.params
        seqs = p.bad_words_token_ids            # the server tokenized them in its API process
        if seqs is None:
            seqs = bad_word_sequences(lambda t: self.tokenizer.encode(t, add_special_tokens=False), p.bad_words)
        self._seqs[state.request_id] = [tuple(s) for s in seqs]

    def on_removed(self, request_id):
        self._seqs.pop(request_id, None)

    def apply(self, logits):
        if self.active:
            for row, state in enumerate(self.rows):
                if state is None:
                    continue
                out = state.output_token_ids
                banned = [seq[-1] for seq in self._seqs[state.request_id]
                          if len(seq) == 1 or (len(out) >= len(seq) - 1
                                               and tuple(out[len(out) - len(seq) + 1:]) == seq[:-1])]
                if banned:
                    logits[row, banned] = -np.inf
        return logits


class ReasoningBudget(RowsProcessor):
    """``reasoning_max_tokens`` (FastDeploy's meaning): a request whose first
    ``reasoning_max_tokens`` output tokens hold no ``reasoning_end_token_ids``
    (a reasoning parser's ``</think>``, tokenized) is made to write them
    next, one forced token a step, which closes its think block."""

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        self._ended: dict[str, tuple[int, bool]] = {}     # request id -> (tokens searched, end seen)

    def wants(self, p) -> bool:
        return p.reasoning_max_tokens is not None and bool(p.reasoning_end_token_ids)

    def on_added(self, state):
        self._ended[state.request_id] = (0, False)       # resumed too: searched again from its tokens

    def on_removed(self, request_id):
        self._ended.pop(request_id, None)

    def _ended_within(self, state, budget: int) -> bool:
        end = tuple(state.params.reasoning_end_token_ids)
        scanned, seen = self._ended[state.request_id]
        out = state.output_token_ids
        limit = min(len(out), budget)
        for i in range(max(0, scanned - len(end) + 1), limit - len(end) + 1):
            if tuple(out[i:i + len(end)]) == end:
                seen = True
                break
        self._ended[state.request_id] = (limit, seen)
        return seen

    def apply(self, logits):
        if self.active:
            for row, state in enumerate(self.rows):
                if state is None:
                    continue
                budget, end = state.params.reasoning_max_tokens, state.params.reasoning_end_token_ids
                k = len(state.output_token_ids) - budget
                if 0 <= k < len(end) and not self._ended_within(state, budget):
                    logits[row] = -np.inf
                    logits[row, end[k]] = 0.0
        return logits


BUILTIN_LOGITS_PROCESSORS: dict[str, type[RowsProcessor]] = {
    "penalties": Penalties,
    "min_tokens": MinTokens,
    "logit_bias": LogitBias,
    "allowed_token_ids": AllowedTokenIds,
    "bad_words": BadWords,
    "reasoning_budget": ReasoningBudget,        # last: its forced token overrides the others
}


@hookimpl
def fdx_register_logits_processors(register):
    for name, processor in BUILTIN_LOGITS_PROCESSORS.items():
        register(name, processor)
