"""The built-in ``guided`` logits processor: runs each constrained
request's matcher and masks the batch's logits with one bitmask per step.

Rows without a constraint cost nothing (the processor is inactive when no
row has one). For a constrained row, at the start of ``apply`` the matcher
accepts the tokens the row sampled since the last step (the runner appends
them to ``RowState.output_token_ids``), then fills its row of the bitmask;
all rows are masked in one vectorized pass (``fdx.core.guided.apply_bitmask``).
A request that leaves (finished, aborted, preempted) drops its matcher; a
resumed one is added again with its outputs so far and replays them. When
the matcher is terminated, only the eos ids stay, so the request ends with
finish_reason "stop" (or at max_tokens: "length").
"""
from __future__ import annotations

import logging

import numpy as np

from fdx.core.guided import GuidedDecoding, apply_bitmask, constraint_of
from fdx.core.hookspecs import hookimpl
from fdx.plugins.decoding.logits_processors import RowsProcessor

log = logging.getLogger("fdx.guided")


class _Row:
    __slots__ = ("matcher", "accepted", "done")

    def __init__(self, matcher):
        self.matcher = matcher          # None: the constraint failed to compile (eos only)
        self.accepted = 0               # output tokens the matcher has accepted
        self.done = matcher is None     # eos only from now on


class GuidedProcessor(RowsProcessor):
    """Masks each constrained row to what its grammar allows next."""

    def __init__(self, config, tokenizer, vocab_size, settings=None):
        super().__init__(config, tokenizer, vocab_size, settings)
        self.guided = GuidedDecoding.of(tokenizer)
        self.matchers: dict[str, _Row] = {}
        self.eos = np.asarray(sorted(getattr(tokenizer, "eos_token_ids", ()) or ()), dtype=np.int64)
        self.words = (vocab_size + 31) // 32

    def wants(self, p) -> bool:
        return (p.guided_json is not None or p.guided_json_object or p.guided_regex is not None
                or p.guided_choice is not None or p.guided_grammar is not None or p.structural_tag is not None)

    def on_added(self, state):
        guided = self.guided
        if guided is None or not guided.enabled:    # make_request refuses these; be safe anyway
            self.matchers[state.request_id] = _Row(None)
            return
        try:
            compiled = guided.future(state.params).result()   # done: admission waited for it
            row = _Row(guided.backend.matcher(compiled))
        except ValueError as e:
            log.warning("request %s: guided constraint failed (%s); ending it", state.request_id, e)
            row = _Row(None)
        self.matchers[state.request_id] = row
        self._advance(row, state.output_token_ids)       # a resumed request replays its outputs

    def on_removed(self, request_id):
        self.matchers.pop(request_id, None)

    def _advance(self, row: _Row, out) -> None:
        while row.accepted < len(out):
            token = out[row.accepted]
            row.accepted += 1
            if row.done:
                continue
            if not row.matcher.accept_token(int(token)):
                row.done = True         # e.g. ignore_eos sampling past the end: eos only from now on
            elif row.matcher.is_terminated():
                row.done = True

    def apply(self, logits):
        if not self.active:
            return logits
        idx = [i for i, r in enumerate(self.rows) if r is not None]
        bitmask = np.zeros((len(idx), self.words), dtype=np.int32)
        eos_only = []
        for j, i in enumerate(idx):
            state = self.rows[i]
            row = self.matchers[state.request_id]
            self._advance(row, state.output_token_ids)
            if row.done:
                eos_only.append(j)
            else:
                row.matcher.fill_bitmask(bitmask, j)
        if eos_only and self.eos.size:
            words, bits = np.divmod(self.eos, 32)
            for j in eos_only:
                bitmask[j] = 0
                np.bitwise_or.at(bitmask[j], words, (np.int64(1) << bits).astype(np.uint32).view(np.int32))
        apply_bitmask(logits, bitmask, idx)
        # a row left with nothing (another processor banned what the grammar allows): let it end
        dead = np.isneginf(logits[idx]).all(axis=1)
        if dead.any() and self.eos.size:
            for j in np.flatnonzero(dead):
                logits[idx[j], self.eos] = 0.0
        return logits

    @classmethod
    def validate_params(cls, params) -> None:
        # types and "one constraint" are SamplingParams.validate's; the engine's guided
        # service checks the backend and compiles (EngineCore.make_request)
        constraint_of(params)


@hookimpl
def fdx_register_logits_processors(register):
    register("guided", GuidedProcessor)
