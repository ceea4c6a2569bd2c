"""Batched sampling on the host (numpy): logits processors, greedy, temperature,
top-k, top-p, min-p, per-request seeds, and logprobs.

``Sampler.sample(logits [B, V], batch)`` samples one token per row; row ``i``
of the logits belongs to row ``i`` of the ``SamplingBatch``:

1. the logits processors run in order, on a copy (penalties, min_tokens, ...);
2. greedy rows (temperature ~ 0) take the argmax;
3. the other rows are divided by their temperature and filtered by top-k,
   then top-p, then min-p (vLLM's semantics), then drawn by inverse CDF with
   one uniform number per row. A row with a generator draws it from that
   generator only, so a seed reproduces its tokens whatever the batch around
   it; the other rows share the sampler's generator;
4. logprobs, for rows that ask, are the log-softmax of the RAW logits
   (before processors and temperature), as vLLM's default.

``Sampler.probs`` returns the distributions step 3 draws from. Work is
vectorized over the vocabulary; Python loops run over rows at most.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Sampler as SamplerContract
from fdx.core.interfaces import SamplerOutput, SamplingBatch, TokenLogprobs
from fdx.core.sampling_params import SamplingParams
from fdx.plugins.decoding.logits_processors import BUILTIN_TRANSFORMS

LogitsTransform = Callable[[np.ndarray, SamplingBatch], np.ndarray]

_BLOCK = 256         # inverse-CDF block width (see _inverse_cdf)
_SELECT = 64         # top-k/top-p block width (see _top_k_top_p_cutoff)


def make_generator(params: SamplingParams) -> np.random.Generator | None:
    """The per-request generator a seeded request keeps for its lifetime."""
    return None if params.seed is None else np.random.default_rng(params.seed)


class Sampler(SamplerContract):
    """The ``host`` sampler (numpy).

    Standalone, ``Sampler(logits_processors=..., seed=...)`` applies the
    given functional transforms first (None: the built-in penalties and
    min_tokens). Built by the engine (``context.config`` given), it applies
    none: the runner has run the stateful logits processors already, and
    the seed is ``config.seed``."""

    def __init__(self, settings=None, context=None, *, logits_processors: list[LogitsTransform] | None = None,
                 seed: int | None = None):
        super().__init__(settings, context)
        config = self.config
        if logits_processors is None:
            logits_processors = [] if config is not None else list(BUILTIN_TRANSFORMS.values())
        if config is not None and seed is None:
            seed = config.seed
        self.logits_processors = list(logits_processors)
        self.rng = np.random.default_rng(seed)

    def sample(self, logits: np.ndarray, batch: SamplingBatch, raw_logits: np.ndarray | None = None) -> SamplerOutput:
        """Sample one token per row of ``logits`` [B, V]; ``logits`` itself is
        not modified. Logprobs come from ``raw_logits`` (default: ``logits``)."""
        raw = logits if raw_logits is None else raw_logits
        x = self._processed(logits, batch)
        params = batch.params
        token_ids = np.empty(len(batch), dtype=np.int64)
        greedy = np.array([p.greedy for p in params], dtype=bool)
        if greedy.all():                  # no copy of the rows: argmax over the whole batch
            token_ids[:] = x.argmax(axis=1)
        elif greedy.any():
            token_ids[greedy] = x[greedy].argmax(axis=1)
        rows = np.flatnonzero(~greedy)
        if rows.size:
            weights = _filtered_weights(x[rows], [params[i] for i in rows])
            token_ids[rows] = _inverse_cdf(weights, self._uniforms(rows, batch))

        logprobs: list[TokenLogprobs | None] = [None] * len(batch)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if lp_rows:
            found = _logprobs(raw[lp_rows].astype(np.float32), token_ids[lp_rows],
                              [params[i].logprobs for i in lp_rows])
            for i, lp in zip(lp_rows, found):
                logprobs[i] = lp
        return SamplerOutput(token_ids, logprobs)

    def probs(self, logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
        """The distribution ``sample`` draws each row from, [B, V] float64
        (greedy rows: one-hot at the argmax). Draws no random numbers."""
        x = self._processed(logits, batch)
        out = np.zeros(x.shape)
        greedy = np.array([p.greedy for p in batch.params], dtype=bool)
        out[np.flatnonzero(greedy), x[greedy].argmax(axis=1)] = 1.0
        rows = np.flatnonzero(~greedy)
        if rows.size:
            weights = _filtered_weights(x[rows], [batch.params[i] for i in rows]).astype(np.float64)
            out[rows] = weights / weights.sum(axis=1, keepdims=True)
        return out

    def _processed(self, logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
        """``logits`` as float32 with the logits processors applied: a copy when
        there are processors (they edit in place), else ``logits`` itself when
        it is float32 already (nothing below writes to it: the sampled rows are
        gathered into a new array first)."""
        if logits.ndim != 2 or logits.shape[0] != len(batch):
            raise ValueError(f"logits {logits.shape} do not match a batch of {len(batch)} rows")
        if not self.logits_processors:
            return np.asarray(logits, dtype=np.float32)
        x = np.array(logits, dtype=np.float32)
        for processor in self.logits_processors:
            x = processor(x, batch)
        return x

    def _uniforms(self, rows: np.ndarray, batch: SamplingBatch) -> np.ndarray:
        return draw_uniforms(self.rng, rows, batch)


def draw_uniforms(rng: np.random.Generator, rows: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """One uniform in [0, 1) per sampled row, from the row's own generator if
    it has one. A seeded row without a generator gets a stateless one keyed
    by (seed, tokens generated so far); the other rows share ``rng``. Every
    sampler that draws by inverse CDF uses this rule, so a seed gives the
    same tokens whichever sampler runs."""
    u = np.empty(len(rows))
    shared = []
    for k, i in enumerate(rows):
        gen, seed = batch.generators[i], batch.params[i].seed
        if gen is None and seed is not None:
            gen = np.random.default_rng([seed, len(batch.output_token_ids[i])])
        if gen is None:
            shared.append(k)
        else:
            u[k] = gen.random()
    if shared:
        u[shared] = rng.random(len(shared))
    return u


def _filtered_weights(x: np.ndarray, params: list[SamplingParams]) -> np.ndarray:
    """Temperature, then top-k, top-p and min-p: the unnormalized probabilities
    to sample from (max 1 per row; 0 for dropped tokens). ``x`` [n, V] is
    overwritten."""
    temperature = np.array([p.temperature for p in params], dtype=np.float32)
    if (temperature != 1).any():
        x /= temperature[:, None]
    x -= x.max(axis=1, keepdims=True)
    q = np.exp(x, out=x)                      # unnormalized probabilities, max 1 per row
    vocab = q.shape[1]
    top_k = np.array([p.top_k if 0 < p.top_k < vocab else 0 for p in params], dtype=np.int64)
    top_p = np.array([p.top_p for p in params], dtype=np.float64)
    min_p = np.array([p.min_p for p in params], dtype=np.float32)
    # min_p keeps q >= min_p * max(q) = min_p; it commutes with top-k/top-p,
    # which never drop the most likely token and leave ratios of q unchanged
    cutoff = np.maximum(_top_k_top_p_cutoff(q, top_k, top_p), min_p)
    if (cutoff > 0).any():
        q *= q >= cutoff[:, None]             # a no-op on rows whose cutoff is 0
    return q


def _top_k_top_p_cutoff(q: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Per row of unnormalized probabilities ``q``, the smallest q a token may
    have and be kept by top-k then top-p (0 where neither applies; top_k 0 is
    off). Rows are not sorted whole: see _largest_blocks."""
    n, vocab = q.shape
    cutoff = np.zeros(n, dtype=np.float32)
    need = np.flatnonzero((top_k > 0) | (top_p < 1))
    if not need.size:
        return cutoff
    block_max = np.maximum.reduceat(q if need.size == n else q[need], np.arange(0, vocab, _SELECT), axis=1)
    order = np.argsort(-block_max, axis=1)                   # blocks, largest max first
    with_k = top_k[need] > 0

    a = np.flatnonzero(with_k)                               # top-k (then maybe top-p)
    if a.size:
        rows, k = need[a], top_k[need[a]]
        vals, _ = _largest_blocks(q, rows, block_max[a], order[a], np.minimum(k, block_max.shape[1]))
        k_max = int(k.max())
        if vals.shape[1] > k_max:
            vals = np.partition(vals, -k_max, axis=1)[:, -k_max:]
        cutoff[rows] = _last_kept(np.sort(vals, axis=1)[:, ::-1], k, top_p[rows], None)

    b = np.flatnonzero(~with_k)                              # top-p alone
    if b.size:
        rows = need[b]
        total = q[rows].sum(axis=1).astype(np.float64)
        cut = np.zeros(b.size, dtype=np.float32)
        todo, m, num_blocks = np.arange(b.size), 16, block_max.shape[1]
        while todo.size:            # the 16, then 128 blocks with the largest maxima, then all
            if m < num_blocks:
                vals, t = _largest_blocks(q, rows[todo], block_max[b[todo]], order[b[todo]], np.full(todo.size, m))
            else:
                vals, t = q[rows[todo]], np.zeros(todo.size, dtype=np.float32)
            cut[todo] = _last_kept(np.sort(vals, axis=1)[:, ::-1], None, top_p[rows[todo]], total[todo])
            # where the cutoff is below t, tokens in other blocks may belong in the top-p set
            todo = todo[cut[todo] < t]
            m *= 8
        cutoff[rows] = cut
    return cutoff


def _largest_blocks(q: np.ndarray, rows: np.ndarray, block_max: np.ndarray, order: np.ndarray,
                    m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split each row of ``q`` into blocks of _SELECT tokens. Every value >= t
    lies in a block whose max is >= t; so the blocks with the m largest maxima
    (t: the m-th largest; ties included) hold every value >= t, and, as m
    maxima are >= t, the m largest values. Returns those blocks' values
    ``[len(rows), width]`` (padded with other blocks and zeros) and t."""
    vocab = q.shape[1]
    r = np.arange(len(rows))
    t = block_max[r, order[r, m - 1]]
    width = int((block_max >= t[:, None]).sum(axis=1).max())
    cols = (order[:, :width, None] * _SELECT + np.arange(_SELECT)).reshape(len(rows), -1)
    vals = q[rows[:, None], np.minimum(cols, vocab - 1)]
    vals[cols >= vocab] = 0
    return vals, t


def _last_kept(vals: np.ndarray, k: np.ndarray | None, top_p: np.ndarray, total: np.ndarray | None) -> np.ndarray:
    """``vals``: each row's largest q, descending. The q of the last token kept
    by top-k (None: off) then top-p, whose mass is the top-k set's, or else
    ``total`` (the row's)."""
    p = vals.astype(np.float64)
    if k is not None:
        p[np.arange(p.shape[1]) >= k[:, None]] = 0
    cum = np.cumsum(p, axis=1)
    mass = cum[:, -1] if total is None else total
    n_keep = ((cum - p < top_p[:, None] * mass[:, None]) & (p > 0)).sum(axis=1)   # a prefix, >= 1
    return vals[np.arange(len(vals)), n_keep - 1]


def _inverse_cdf(q: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Draw one index per row with probability proportional to ``q`` [n, V]
    (>= 0, some positive), using the uniforms ``u`` [n] in [0, 1).

    Two levels, so no full-width cumulative sum: pick a block of _BLOCK
    tokens by the blocks' masses, then a token inside it. A token with
    q == 0 is never drawn."""
    n, vocab = q.shape
    rows = np.arange(n)
    block_mass = np.add.reduceat(q, np.arange(0, vocab, _BLOCK), axis=1).astype(np.float64)
    cum = np.cumsum(block_mass, axis=1)
    total = cum[:, -1]
    target = np.minimum(u * total, np.nextafter(total, 0))
    b = (cum <= target[:, None]).sum(axis=1)                 # first block whose cum exceeds target
    frac = (target - (cum[rows, b] - block_mass[rows, b])) / block_mass[rows, b]

    cols = b[:, None] * _BLOCK + np.arange(_BLOCK)
    w = np.take_along_axis(q, np.minimum(cols, vocab - 1), axis=1).astype(np.float64)
    w[cols >= vocab] = 0
    wc = np.cumsum(w, axis=1)
    t = np.minimum(np.maximum(frac, 0) * wc[:, -1], np.nextafter(wc[:, -1], 0))
    return b * _BLOCK + (wc <= t[:, None]).sum(axis=1)


def _logprobs(raw: np.ndarray, token_ids: np.ndarray, top_n: list[int]) -> list[TokenLogprobs]:
    """Logprobs of the sampled tokens and the top-N of each row of ``raw``."""
    x_max = raw.max(axis=1, keepdims=True)
    lse = x_max[:, 0] + np.log(np.exp(raw - x_max).sum(axis=1, dtype=np.float64))
    rows = np.arange(len(raw))
    chosen = raw[rows, token_ids]
    ranks = (raw > chosen[:, None]).sum(axis=1) + 1
    # top-N by repeated argmax: N <= 20, cheaper than a partition of the row
    width = max(top_n)
    top = np.empty((len(raw), width), dtype=np.int64)
    if width:
        work = raw.copy()
        for j in range(width):
            top[:, j] = work.argmax(axis=1)
            work[rows, top[:, j]] = -np.inf
    return [TokenLogprobs(int(token_ids[k]), float(chosen[k] - lse[k]), int(ranks[k]),
                          [(int(t), float(raw[k, t] - lse[k])) for t in top[k, :top_n[k]]])
            for k in range(len(raw))]


def logprobs_of(raw: np.ndarray, token_ids: np.ndarray, top_n: int) -> list[TokenLogprobs]:
    """Logprobs of given tokens, one per row of ``raw`` (prompt logprobs)."""
    return _logprobs(np.asarray(raw, dtype=np.float32), np.asarray(token_ids, dtype=np.int64),
                     [top_n] * len(raw))


@hookimpl
def fdx_register_samplers(register):
    register("host", Sampler)
