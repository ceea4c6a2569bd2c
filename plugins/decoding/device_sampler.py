"""The ``device`` sampler: sampling with Paddle ops where the logits are
(the GPU backends name it), so only the sampled ids and the logprobs a
request asked for are copied to the host.

Same semantics as the ``host`` sampler (fdx.plugins.decoding.sampler):

- greedy rows take the argmax (an all-greedy batch without logprobs is one
  ``argmax`` and a copy of B ids);
- other rows are divided by their temperature, then filtered by top-k, then
  top-p over what top-k kept, then min-p (relative to the most likely
  token), ties at a cutoff kept; the cutoffs come from one descending sort
  of the rows that need one;
- each sampled row draws one uniform number on the host, from the request's
  own generator when it has one (a seed), else the sampler's (so a seed
  repeats its tokens whatever the batch around it), and picks the token by
  inverse CDF on the device;
- logprobs (and ranks and top-N) are of the raw logits, computed on the
  device for the rows that ask.

``sample`` takes the logits as a Paddle tensor (kept where the model wrote
them) or a numpy array. The logits processors are host code: the runner
moves the logits to the host when one of them is active this step, and
hands the device sampler numpy then.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Sampler as SamplerContract
from fdx.core.interfaces import SamplerOutput, SamplingBatch, TokenLogprobs
from fdx.plugins.decoding.sampler import draw_uniforms

if TYPE_CHECKING:
    import paddle


class DeviceSampler(SamplerContract):
    device_logits = True        # the runner may hand it the model's logits tensor as it is

    def __init__(self, settings=None, context=None, *, seed: int | None = None):
        super().__init__(settings, context)
        config = self.config
        if config is not None and seed is None:
            seed = config.seed
        self.rng = np.random.default_rng(seed)

    def sample(self, logits, batch: SamplingBatch, raw_logits=None) -> SamplerOutput:
        import paddle
        x = _tensor(logits)
        raw = x if raw_logits is None or raw_logits is logits else _tensor(raw_logits)
        if len(x.shape) != 2 or x.shape[0] != len(batch):
            raise ValueError(f"logits {list(x.shape)} do not match a batch of {len(batch)} rows")
        params = batch.params
        greedy = np.array([p.greedy for p in params], dtype=bool)
        if greedy.all():
            ids = paddle.argmax(x, axis=1)
        else:
            ids = self._draw(x, batch, greedy)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs: list[TokenLogprobs | None] = [None] * len(batch)
        if lp_rows:
            for i, lp in zip(lp_rows, _logprobs(raw, ids, lp_rows, [params[i].logprobs for i in lp_rows])):
                logprobs[i] = lp
        return SamplerOutput(ids.numpy().astype(np.int64), logprobs)

    def probs(self, logits, batch: SamplingBatch) -> np.ndarray:
        """The distributions ``sample`` draws from, [B, V] float64 (greedy: one-hot)."""
        import paddle
        x = _tensor(logits)
        out = np.zeros(x.shape, dtype=np.float64)
        greedy = np.array([p.greedy for p in batch.params], dtype=bool)
        for i in np.flatnonzero(greedy):
            out[i, int(paddle.argmax(x[int(i)]).item())] = 1.0
        rows = np.flatnonzero(~greedy)
        if rows.size:
            q = _filtered(paddle.gather(x, paddle.to_tensor(rows)), [batch.params[i] for i in rows]).numpy()
            out[rows] = q / q.sum(axis=1, keepdims=True)
        return out

    def _draw(self, x, batch: SamplingBatch, greedy: np.ndarray):
        import paddle
        rows = np.flatnonzero(~greedy)
        idx = paddle.to_tensor(rows)
        q = _filtered(paddle.gather(x, idx), [batch.params[i] for i in rows])
        u = paddle.to_tensor(self._uniforms(rows, batch), dtype="float32")
        drawn = _inverse_cdf(q, u)
        if rows.size == len(batch):
            return drawn
        ids = paddle.argmax(x, axis=1)
        return paddle.scatter(ids, idx, drawn)

    def _uniforms(self, rows: np.ndarray, batch: SamplingBatch) -> np.ndarray:
        """One uniform per sampled row: the host sampler's rule."""
        return draw_uniforms(self.rng, rows, batch)


def _tensor(logits) -> paddle.Tensor:
    import paddle
    t = logits if isinstance(logits, paddle.Tensor) else paddle.to_tensor(np.asarray(logits))
    return t if t.dtype == paddle.float32 else t.astype("float32")


def _filtered(x: paddle.Tensor, params) -> paddle.Tensor:
    """Temperature, top-k, top-p, min-p: unnormalized probabilities [n, V]
    (max 1 per row, 0 where dropped)."""
    import paddle
    n, vocab = x.shape
    t = paddle.to_tensor(np.array([[p.temperature] for p in params], dtype=np.float32))
    x = x / t
    q = paddle.exp(x - x.max(axis=1, keepdim=True))
    top_k = np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=np.int64)
    top_p = np.array([p.top_p for p in params], dtype=np.float32)
    min_p = paddle.to_tensor(np.array([[p.min_p] for p in params], dtype=np.float32))
    cutoff = min_p
    if (top_k < vocab).any() or (top_p < 1).any():
        width = vocab if (top_p < 1).any() else int(top_k.max())
        vals = paddle.topk(q, k=width, axis=1)[0]                 # descending
        keep_k = paddle.to_tensor(np.arange(width)[None, :] < top_k[:, None])
        p = paddle.where(keep_k, vals, paddle.zeros_like(vals))
        cum = paddle.cumsum(p, axis=1)
        mass = cum[:, -1:]
        inside = ((cum - p) < paddle.to_tensor(top_p[:, None]) * mass) & (p > 0)
        n_keep = inside.astype("int64").sum(axis=1, keepdim=True)          # >= 1
        cut = paddle.take_along_axis(vals, n_keep - 1, axis=1)
        cutoff = paddle.maximum(cut, min_p)
    return q * (q >= cutoff).astype(q.dtype)


def _inverse_cdf(q: paddle.Tensor, u: paddle.Tensor) -> paddle.Tensor:
    """One index per row, with probability proportional to q, from u in [0, 1)."""
    import paddle
    cum = paddle.cumsum(q, axis=1)
    target = u[:, None] * cum[:, -1:]
    drawn = (cum <= target).astype("int64").sum(axis=1)              # the first index whose cum exceeds it
    vocab = q.shape[1]
    # rounding may put the target past the last positive token: take that token then
    last = vocab - 1 - paddle.argmax(paddle.flip((q > 0).astype("int32"), axis=[1]), axis=1)
    return paddle.where(drawn >= vocab, last, paddle.minimum(drawn, last))


def _logprobs(raw: paddle.Tensor, ids: paddle.Tensor, rows: list[int], top_n: list[int]) -> list[TokenLogprobs]:
    import paddle
    idx = paddle.to_tensor(np.asarray(rows, dtype=np.int64))
    x = paddle.gather(raw, idx)
    # composed: Paddle's CPU log_softmax took 0.74 s on a [3, 49152] tensor (this, 2 ms), same values
    z = x - x.max(axis=1, keepdim=True)
    lp = z - paddle.log(paddle.exp(z).sum(axis=1, keepdim=True))
    chosen_ids = paddle.gather(ids, idx)[:, None]
    chosen = paddle.take_along_axis(lp, chosen_ids, axis=1)
    ranks = (lp > chosen).astype("int64").sum(axis=1) + 1
    width = max(top_n)
    if width:
        top_vals, top_ids = paddle.topk(lp, k=width, axis=1)
        top_vals, top_ids = top_vals.numpy(), top_ids.numpy()
    chosen_np, ranks_np, ids_np = chosen.numpy()[:, 0], ranks.numpy(), chosen_ids.numpy()[:, 0]
    return [TokenLogprobs(int(ids_np[k]), float(chosen_np[k]), int(ranks_np[k]),
                          [(int(top_ids[k, j]), float(top_vals[k, j])) for j in range(top_n[k])] if width else [])
            for k in range(len(rows))]


@hookimpl
def fdx_register_samplers(register):
    register("device", DeviceSampler)
