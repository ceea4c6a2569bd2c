"""Built-in logits processors: batched, per-request transforms of the logits.

Each processor is ``(logits: np.ndarray [B, V] float32, batch: SamplingBatch)
-> np.ndarray``: it may edit ``logits`` in place and returns the result. Row
``i`` of ``logits`` belongs to ``batch.params[i]``. Rows whose parameters are
neutral are skipped; the work is over the rows' token ids, never a Python
loop over the vocabulary.
"""
from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Sequence

import numpy as np

from fdx.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from fdx.plugins.decoding.sampler import SamplingBatch


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


BUILTIN_LOGITS_PROCESSORS = {
    "repetition_penalty": repetition_penalty,
    "presence_frequency_penalty": presence_frequency_penalty,
    "min_tokens": min_tokens,
}


@hookimpl
def fdx_register_logits_processors(register):
    for name, processor in BUILTIN_LOGITS_PROCESSORS.items():
        register(name, processor)
