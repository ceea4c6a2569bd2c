"""The MoE compute blocks (fdx.plugins.models.moe_decoder builds a model of
them): the routers, the sparse MLP and the layer that holds it. Imported
when a model is built: it loads Paddle.

The expert product groups the step's rows by expert: the router's choice
(``[rows, k]`` expert ids and weights) is sorted by expert, each expert
that any row chose multiplies all of its rows in one call of its weights'
product (``LinearWeight.matmul``: float32, GGUF blocks or wint8/4, as the
weight format holds it), and the results go back to their (row, slot)
places, where each row sums its k slots in slot order. A row's result
therefore never depends on which other rows share the step, beyond what
the weight format's own product does for a different number of rows.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np
import paddle

from fdx.core.interfaces import LinearWeight
from fdx.ops.activation import silu_and_mul
from fdx.ops.dense import matmul as dense_matmul
from fdx.ops.rotary import RotaryEmbedding
from fdx.plugins.models.decoder_config import DecoderConfig
from fdx.plugins.models.layers import Attention, DecoderLayer, Weights, _take, linear
from fdx.plugins.models.moe_config import ExpertShare, MoeConfig

Tensor = paddle.Tensor

# router(logits float32 [rows, E], bias float32 [E] or None) -> (expert ids int64 [rows, k],
# weights float32 [rows, k]); ``bias`` is the checkpoint's expert-choice correction (ERNIE's
# e_score_correction_bias), None where the architecture has none
Router = Callable[[np.ndarray, "np.ndarray | None"], tuple[np.ndarray, np.ndarray]]


# --- routers (numerically as transformers' modeling_qwen3_moe / modeling_ernie4_5_moe) ----------

def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z, dtype=np.float32)
    return e / e.sum(axis=-1, keepdims=True)


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of each row's k largest scores, largest first (torch.topk's
    order; an exact tie goes to the lower index)."""
    part = np.argpartition(-scores, k - 1, axis=-1)[:, :k] if k < scores.shape[-1] else \
        np.broadcast_to(np.arange(scores.shape[-1]), scores.shape)
    chosen = np.take_along_axis(scores, part, axis=-1)
    order = np.lexsort((part, -chosen), axis=-1)
    return np.take_along_axis(part, order, axis=-1).astype(np.int64)


def softmax_topk_router(top_k: int, normalize: bool) -> Router:
    """Qwen3-MoE (Qwen3MoeTopKRouter): softmax over all experts, the top k
    probabilities, renormalized to sum 1 when ``norm_topk_prob``."""
    def route(logits: np.ndarray, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        probs = _softmax(logits)
        ids = _top_k(probs, top_k)
        weights = np.take_along_axis(probs, ids, axis=-1)
        if normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return ids, weights.astype(np.float32)
    return route


def ernie_router(top_k: int, norm_min: float) -> Router:
    """ERNIE-4.5-MoE (Ernie4_5_MoeTopKRouter): softmax over all experts; the
    experts are chosen by probability plus ``e_score_correction_bias`` (the
    block passes it as ``bias``), weighted by the plain probability,
    renormalized by the sum (at least ``moe_norm_min``)."""
    def route(logits: np.ndarray, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        probs = _softmax(logits)
        ids = _top_k(probs if bias is None else probs + bias, top_k)
        weights = np.take_along_axis(probs, ids, axis=-1)
        weights = weights / np.maximum(weights.sum(axis=-1, keepdims=True), norm_min)
        return ids, weights.astype(np.float32)
    return route


def default_router(moe: MoeConfig) -> Router:
    if moe.routing == "softmax_topk":
        return softmax_topk_router(moe.top_k, moe.norm_topk_prob)
    if moe.routing == "ernie":
        return ernie_router(moe.top_k, moe.norm_min)
    raise ValueError(f"unknown MoE routing {moe.routing!r}")


# --- the sparse MLP --------------------------------------------------------------------------

def _float_matrix(w: Weights, name: str, shape: tuple[int, int]) -> np.ndarray:
    """A small matrix kept float32 whatever the format (the router: its
    choice must be the checkpoint's, so it is never quantized on load)."""
    t = w._pop(name, shape)
    if hasattr(t, "dequantize"):
        t = t.dequantize()
    return np.asarray(t, dtype=np.float32).reshape(shape)


class SparseMoe:
    """Router, routed experts and optional shared experts of one layer.

    Under expert parallel a rank holds experts ``experts_held`` = [first, end) only
    (``w_gate_up[e - first]``); the router still chooses among all of them on
    every rank, and the rank computes the (row, slot) places that chose one of
    its experts, the others' share of the layer's sum being zero here."""

    is_moe = True

    def __init__(self, cfg: DecoderConfig, moe: MoeConfig, w: Weights, prefix: str, router: Router,
                 share: ExpertShare | None = None):
        p = self.prefix = f"{prefix}.mlp"
        self.fmt = w.fmt
        h, i, e = cfg.hidden_size, moe.moe_intermediate_size, moe.num_experts
        self.num_experts, self.top_k, self.intermediate_size = e, moe.top_k, i
        self.router = router
        self.w_router = paddle.to_tensor(np.ascontiguousarray(_float_matrix(w, f"{p}.gate.weight", (e, h)).T))
        self.score_bias = None
        if moe.score_correction_bias:
            self.score_bias = _float_matrix(w, f"{p}.moe_statics.e_score_correction_bias", (1, e))[0]
        self.experts_held = (0, e) if share is None else share.experts(e)     # [first, end) of the experts held
        self.w_gate_up: list[LinearWeight] = []
        self.w_down: list[LinearWeight] = []
        for x in range(e):
            q = f"{p}.experts.{x}"
            if not self.experts_held[0] <= x < self.experts_held[1]:          # another rank's: dropped, never converted
                for name, shape in ((f"{q}.gate_proj.weight", (i, h)), (f"{q}.up_proj.weight", (i, h)),
                                    (f"{q}.down_proj.weight", (h, i))):
                    w._pop(name, shape)
                continue
            self.w_gate_up.append(w.fused([f"{q}.gate_proj", f"{q}.up_proj"], h, [i, i], False)[0])
            self.w_down.append(w.fused([f"{q}.down_proj"], i, [h], False)[0])
        self.shared = None
        if moe.shared_intermediate_size:
            self.shared = SharedMlp(h, moe.shared_intermediate_size, w, f"{p}.{moe.shared_prefix}", moe.mlp_bias)
        self.w_shared_gate = None
        if moe.shared_gate:
            self.w_shared_gate = paddle.to_tensor(
                np.ascontiguousarray(_float_matrix(w, f"{p}.shared_expert_gate.weight", (1, h)).T))
        self.reduce: Callable[[Tensor], Tensor] | None = None   # tensor parallel: sum over ranks
        self.last_load: np.ndarray = np.zeros(e, dtype=np.int64)
        self._stacks: tuple[Any, Any] | bool | None = None      # grouped(): made on first use

    def route(self, x: Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The router's choice for the rows of x: (ids int64 [rows, k], weights float32 [rows, k])."""
        # the dense layers' float32 product (fdx.ops.dense), so the choice follows the rows' own sums
        logits = dense_matmul(x.astype("float32"), self.w_router).numpy()
        ids, weights = self.router(logits, self.score_bias)
        ids, weights = np.asarray(ids), np.asarray(weights, dtype=np.float32)
        if (ids.ndim != 2 or ids.shape[0] != logits.shape[0] or weights.shape != ids.shape
                or not np.issubdtype(ids.dtype, np.integer) or ids.size and not (
                    0 <= ids.min() and ids.max() < self.num_experts)):
            raise ValueError(f"{self.prefix}: the router (config key 'model.moe_router' when a plugin's) returned "
                             f"expert ids {ids.dtype} {ids.shape} and weights {weights.shape}; expected integer ids "
                             f"in [0, {self.num_experts}) and weights, both [{logits.shape[0]}, k]")
        return ids.astype(np.int64, copy=False), weights

    def grouped(self) -> tuple[Any, Any] | None:
        """The experts' weights stacked for ``fdx.ops.moe.experts`` (gate+up, down),
        made on first use; None when they cannot be (a format or shape the
        grouped kernel does not take, no build of it passed its probe,
        FDX_MOE_GROUPED=0): the per-expert loop then runs."""
        if self._stacks is None:
            self._stacks = False
            if os.environ.get("FDX_MOE_GROUPED", "1") != "0":
                from fdx.core import kernels
                from fdx.ops import moe
                if moe.build(kernels.active()) is not None:
                    gu = stack_experts(self.w_gate_up)
                    dn = None if gu is None else stack_experts(self.w_down)
                    if gu is not None and dn is not None:
                        self._stacks = (gu, dn)
        return self._stacks or None

    def __call__(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        if n == 0:
            return paddle.zeros_like(x)
        ids, weights = self.route(x)
        counts = np.bincount(ids.reshape(-1), minlength=self.num_experts)
        self.last_load = counts                          # the expert-load tap (tokens per expert, all of them)
        if self.experts_held == (0, self.num_experts):
            y = self._experts(x, ids, weights, counts)
        else:
            y = self._held_experts(x, ids, weights)
        return self._finish(x, y)

    def _experts(self, x: Tensor, ids: np.ndarray, weights: np.ndarray, counts: np.ndarray) -> Tensor:
        """The held experts' weighted sum for each row of x (``ids`` counted from the first held expert)."""
        stacks = self.grouped() if x.dtype == paddle.float32 else None
        y = None
        if stacks is not None:                           # one call: grouped by expert, weighted, summed in slot order
            from fdx.ops import moe
            y = moe.experts(x, ids, weights, *stacks)
        if y is None:
            y = self._expert_loop(x, ids, weights, counts)
        return y

    def _held_experts(self, x: Tensor, ids: np.ndarray, weights: np.ndarray) -> Tensor:
        """Expert parallel: this rank's part of each row's sum, from the (row,
        slot) places whose expert it holds. Each such place runs as a row of
        its own (one slot), then goes back to its slot of its row, zeros in the
        slots other ranks hold, and each row sums its k slots in slot order (a
        zero adds nothing exactly: a row whose experts are all here gets the
        one-rank sum)."""
        first, end = self.experts_held
        n, k = ids.shape
        rows, slots = np.nonzero((ids >= first) & (ids < end))   # row-major: each row's slots in order
        if rows.size == 0:
            return paddle.zeros([n, x.shape[1]], dtype=x.dtype)
        local = (ids[rows, slots] - first).reshape(-1, 1)
        xs = x if k == 1 and rows.size == n else paddle.gather(x, paddle.to_tensor(rows))
        ys = self._experts(xs, local, weights[rows, slots].reshape(-1, 1),
                           np.bincount(local.reshape(-1), minlength=end - first))
        if k == 1 and rows.size == n:
            return ys
        places = paddle.zeros([n * k, x.shape[1]], dtype=ys.dtype)
        places = paddle.scatter(places, paddle.to_tensor(rows * k + slots), ys)
        return places.reshape([n, k, -1]).sum(axis=1)

    def _expert_loop(self, x: Tensor, ids: np.ndarray, weights: np.ndarray, counts: np.ndarray) -> Tensor:
        """The experts one product call each (any weight format): the fallback of ``fdx.ops.moe.experts``."""
        n, k = x.shape[0], ids.shape[1]
        order = np.argsort(ids.reshape(-1), kind="stable")   # (row, slot) places grouped by expert
        rows = order // k
        outs, start = [], 0
        for e in np.flatnonzero(counts):
            mine = rows[start:start + counts[e]]
            start += counts[e]
            xe = x if mine.size == n and n == 1 else paddle.gather(x, paddle.to_tensor(mine))
            outs.append(self.w_down[e].matmul(silu_and_mul(self.w_gate_up[e].matmul(xe))))
        y = outs[0] if len(outs) == 1 else paddle.concat(outs)
        # back to (row, slot) order, scaled by the slot's weight, each row's k slots summed in order
        y = paddle.gather(y, paddle.to_tensor(np.argsort(order, kind="stable")))
        y = y * paddle.to_tensor(weights.reshape(-1, 1).astype(np.float32)).astype(y.dtype)
        return y.reshape([n, k, -1]).sum(axis=1) if k > 1 else y

    def _finish(self, x: Tensor, y: Tensor) -> Tensor:
        """The routed experts' sum y plus the shared experts, summed over the tensor-parallel ranks."""
        if self.shared is not None:
            shared = self.shared.partial(x)
            if self.w_shared_gate is not None:
                shared = shared * paddle.nn.functional.sigmoid(paddle.matmul(x, self.w_shared_gate))
            y = y + shared
        if self.reduce is not None:
            y = self.reduce(y)
        if self.shared is not None and self.shared.b_down is not None:
            y = y + self.shared.b_down
        return y

    def shard(self, rank: int, world: int, reduce: Callable[[Tensor], Tensor], groups: int = 1) -> None:
        """Tensor parallel (``groups`` 1): each expert keeps this rank's
        intermediate rows of gate and up and the same columns of down (as
        FeedForward.shard). Expert parallel (``groups`` > 1 groups of
        ``world // groups`` ranks, ``ExpertShare``): the rank keeps its group's
        experts only (if it built them all), each with its part of the
        columns within the group. The router stays whole; the shared experts
        split over all ``world`` ranks."""
        share = ExpertShare(rank, world, groups)
        first, end = share.experts(self.num_experts)
        if self.experts_held != (first, end):
            if self.experts_held != (0, self.num_experts):
                raise ValueError(f"{self.prefix}: built with experts {self.experts_held}, sharded for {(first, end)}")
            self.w_gate_up, self.w_down = self.w_gate_up[first:end], self.w_down[first:end]
            self.experts_held = (first, end)
        parts, part = share.per_group, share.column_part
        if parts > 1:
            i, n = self.intermediate_size, self.intermediate_size // parts
            mine = np.arange(part * n, (part + 1) * n)
            cols = np.concatenate([mine, i + mine])
            self.w_gate_up = [wgu.take_rows(cols) for wgu in self.w_gate_up]
            self.w_down = [self.fmt.shard_cols(f"{self.prefix}.experts.{first + e}.down_proj.weight", wd, part * n,
                                               (part + 1) * n) for e, wd in enumerate(self.w_down)]
            self.intermediate_size = n
        self._stacks = None
        if self.shared is not None:
            self.shared.shard(rank, world)
        self.reduce = reduce

    def held(self) -> list[Any]:
        """Every weight this block holds (for weight_bytes)."""
        out: list[Any] = [self.w_router, self.w_shared_gate, *self.w_gate_up, *self.w_down]
        if self.shared is not None:
            s = self.shared
            out += [s.w_gate_up, s.b_gate_up, s.w_down, s.b_down]
        return out


def stack_experts(ws: list[LinearWeight]) -> Any:
    """One matrix of every expert as a ``fdx.ops.moe.ExpertStack`` (float32
    ``[E, in, out]``, or the same GGML / wint kind and shape: blocks ``[E, rows,
    row_bytes]``), or None for what the grouped kernel does not take (a
    RowStack, mixed kinds, blocks the compiled products cannot read). Each
    expert's own weight then becomes a view of the stack (no second copy), its
    rows repacked in place where the dense path repacks them (``prepare``)."""
    from fdx.ops import cpp, moe
    from fdx.plugins.models.weight_formats import BlockWeight, DenseWeight
    first = ws[0]
    if all(type(w) is DenseWeight and w.t.dtype == paddle.float32 and w.t.shape == first.t.shape for w in ws):
        from paddle.utils.dlpack import from_dlpack
        data = np.ascontiguousarray(np.stack([w.t.numpy() for w in ws]))        # [E, in, out]
        for e, w in enumerate(ws):
            w.t = from_dlpack(data[e])
        return moe.ExpertStack("f32", (data.shape[2], data.shape[1]), data)
    if not all(type(w) is BlockWeight for w in ws):
        return None
    qs = [w.q for w in ws]
    q0 = qs[0]
    if not cpp.quant_supported(q0) or any(
            q.kind != q0.kind or q.shape != q0.shape or q.group_size != q0.group_size
            or (q.scales is None) != (q0.scales is None) for q in qs):
        return None
    stack = moe.stack_from_weights(q0.kind, tuple(q0.shape), [q.plain_data() for q in qs],
                                   None if q0.scales is None else [q.scales for q in qs], q0.group_size, False)
    for e, q in enumerate(qs):
        q.data, q.interleaved, q._tensors = stack.data[e], False, None
        q.scales = None if stack.scales is None else stack.scales[e]
        q.prepare()                                      # repacks the view in place (FDX_REPACK)
    if len({q.interleaved for q in qs}) != 1:            # cannot be (one kind and shape); kept plain if it were
        return None
    stack.interleaved = q0.interleaved
    return stack


class SharedMlp:
    """The shared experts: one SwiGLU MLP every row runs; its down product is
    left unreduced and without bias (the block adds both once)."""

    def __init__(self, hidden: int, inter: int, w: Weights, prefix: str, bias: bool):
        self.prefix, self.fmt, self.intermediate_size = prefix, w.fmt, inter
        self.w_gate_up, self.b_gate_up = w.fused([f"{prefix}.gate_proj", f"{prefix}.up_proj"], hidden,
                                                 [inter, inter], bias)
        self.w_down, self.b_down = w.fused([f"{prefix}.down_proj"], inter, [hidden], bias)

    def partial(self, x: Tensor) -> Tensor:
        return self.w_down.matmul(silu_and_mul(linear(x, self.w_gate_up, self.b_gate_up)))

    def shard(self, rank: int, world: int) -> None:
        i, n = self.intermediate_size, self.intermediate_size // world
        mine = np.arange(rank * n, (rank + 1) * n)
        cols = np.concatenate([mine, i + mine])
        self.w_gate_up = self.w_gate_up.take_rows(cols)
        self.b_gate_up = None if self.b_gate_up is None else _take(self.b_gate_up, cols, axis=0)
        self.w_down = self.fmt.shard_cols(f"{self.prefix}.down_proj.weight", self.w_down, rank * n, (rank + 1) * n)
        self.intermediate_size = n


class MoeDecoderLayer(DecoderLayer):
    """A pre-norm decoder layer whose MLP is a ``SparseMoe``. Never the
    backend's fused layer (``fused`` is None): the composed ops run it."""

    is_moe = True

    def __init__(self, cfg: DecoderConfig, moe: MoeConfig, w: Weights, index: int, rope: RotaryEmbedding,
                 router: Router, share: ExpertShare | None = None):
        prefix = f"model.layers.{index}"
        self.eps = cfg.rms_norm_eps
        self.input_norm = w.vector(f"{prefix}.input_layernorm.weight", cfg.hidden_size)
        self.post_norm = w.vector(f"{prefix}.post_attention_layernorm.weight", cfg.hidden_size)
        self.attn = Attention(cfg, w, prefix, rope)
        self.mlp = SparseMoe(cfg, moe, w, prefix, router, share)
        self._fused = None

    @property
    def fused(self) -> None:
        return None

    def weights_changed(self) -> None:
        self._fused = None
