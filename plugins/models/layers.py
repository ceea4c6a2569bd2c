"""The decoder's compute blocks (fdx.plugins.models.decoder builds a model
of them): the rotary tables, the weights' reader, attention, the MLP and
the pre-norm layer. Imported when a model is built, never by the plugin
manager: it loads Paddle and fdx.ops."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import paddle

from fdx.core.interfaces import AttentionContext, LinearWeight, WeightFormat
from fdx.core.memory import mlp_chunk_rows
from fdx.ops import layer_port
from fdx.ops.activation import silu_and_mul
from fdx.ops.norm import add_rms_norm, rms_norm
from fdx.ops.rotary import RotaryEmbedding
from fdx.plugins.models.decoder_config import DecoderConfig

Tensor = paddle.Tensor
KVCache = tuple[Tensor, Tensor]


# --- rotary embedding ----------------------------------------------------------

def llama3_inv_freq(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """Llama 3.1 frequency scaling (transformers' _compute_llama3_parameters)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled)


class Llama3RotaryEmbedding(RotaryEmbedding):
    """fdx.ops' RotaryEmbedding, whose constructor takes only a base, with
    its cos/sin tables rebuilt from llama3-rescaled frequencies."""

    def __init__(self, head_dim: int, max_position: int, base: float,
                 is_neox_style: bool, scaling: dict[str, Any]):
        super().__init__(head_dim, max_position, base, is_neox_style)
        inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        freqs = np.outer(np.arange(max_position, dtype=np.float64), llama3_inv_freq(inv_freq, scaling))
        freqs = np.concatenate([freqs, freqs], -1) if is_neox_style else np.repeat(freqs, 2, -1)
        self.cos_cache = paddle.to_tensor(np.cos(freqs).astype(np.float32))
        self.sin_cache = paddle.to_tensor(np.sin(freqs).astype(np.float32))


def build_rotary(cfg: DecoderConfig) -> RotaryEmbedding:
    neox = not cfg.rope_interleaved
    if cfg.rope_scaling is not None:
        return Llama3RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                     neox, cfg.rope_scaling)
    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                           is_neox_style=neox)


# --- weights -------------------------------------------------------------------

class Weights:
    """Takes HF-named tensors out of the caller's dict (freeing each as it
    is converted), checks every shape, and hands each matrix to the weight
    format."""

    def __init__(self, arch: str, weights: dict[str, Any], fmt: WeightFormat):
        self.arch, self.weights, self.fmt = arch, weights, fmt

    def _pop(self, name: str, shape: tuple[int, ...]) -> Any:
        if name not in self.weights:
            raise ValueError(f"{self.arch}: missing weight {name!r}")
        w = self.weights.pop(name)
        got = tuple(w.shape) if hasattr(w, "kind") else np.shape(w)   # a QuantizedTensor, or an array
        if got != shape:
            raise ValueError(f"{self.arch}: weight {name!r} has shape {got}, expected {shape}")
        return w

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return np.asarray(self._pop(name, shape), dtype=np.float32)

    def matrix(self, name: str, shape: tuple[int, int], role: str = "linear") -> LinearWeight:
        return self.fmt.load(name, self._pop(name, shape), role)

    def fused(self, names: list[str], in_dim: int, out_dims: list[int], bias: bool
              ) -> tuple[LinearWeight, Tensor | None]:
        """Fuse HF [out, in] linears along out (rows) into one weight."""
        weight = self.fmt.fuse([self.matrix(f"{n}.weight", (o, in_dim)) for n, o in zip(names, out_dims)])
        if not bias:
            return weight, None
        bs = [self.take(f"{n}.bias", (o,)) for n, o in zip(names, out_dims)]
        return weight, paddle.to_tensor(np.concatenate(bs))

    def vector(self, name: str, dim: int) -> Tensor:
        return paddle.to_tensor(self.take(name, (dim,)))


# --- blocks --------------------------------------------------------------------

def linear(x: Tensor, weight: LinearWeight, bias: Tensor | None) -> Tensor:
    """x [M, in] @ weight.T (+ bias), by the weight format's product."""
    y = weight.matmul(x)
    return y if bias is None else y + bias


def row_parallel(x: Tensor, weight: LinearWeight, bias: Tensor | None,
                 reduce: Callable[[Tensor], Tensor] | None, lora: tuple[Any, dict] | None = None) -> Tensor:
    """``linear`` whose input rows are split over tensor-parallel ranks: each
    rank's partial product is summed (``reduce``) before the bias, which is
    added once. ``lora``: (the step's StepLoRA, the layer's adapters): each
    rank adds its partial delta (its columns of A) before the sum."""
    y = weight.matmul(x)
    if lora is not None:
        y = lora[0].add(y, x, lora[1])
    if reduce is not None:
        y = reduce(y)
    return y if bias is None else y + bias


def _take(t: Tensor, index: np.ndarray, axis: int) -> Tensor:
    return paddle.to_tensor(np.ascontiguousarray(np.take(t.numpy(), index, axis=axis)))


class Attention:
    def __init__(self, cfg: DecoderConfig, w: Weights, prefix: str, rope: RotaryEmbedding):
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.eps = cfg.rms_norm_eps
        self.rope = rope
        p = self.prefix = f"{prefix}.self_attn"
        self.fmt = w.fmt
        self.wqkv, self.bqkv = w.fused([f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"], cfg.hidden_size,
                                       [self.q_size, self.kv_size, self.kv_size], cfg.qkv_bias)
        self.wo, self.bo = w.fused([f"{p}.o_proj"], self.q_size, [cfg.hidden_size], cfg.o_bias)
        self.q_norm = w.vector(f"{p}.q_norm.weight", cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = w.vector(f"{p}.k_norm.weight", cfg.head_dim) if cfg.qk_norm else None
        self.reduce: Callable[[Tensor], Tensor] | None = None   # tensor parallel: sum over ranks
        # LoRA adapters (DecoderForCausalLM.load_lora): name -> (A^T [in, r], B^T [r, out], scale) of the
        # fused q/k/v (B block-diagonal over q, k, v) and of o_proj, this rank's shard
        self.lora_qkv: dict[str, tuple[Tensor, Tensor, float]] = {}
        self.lora_o: dict[str, tuple[Tensor, Tensor, float]] = {}
        self.qkv_rows: np.ndarray | None = None      # tensor parallel: this rank's rows of q/k/v (shard)
        self.o_cols: tuple[int, int] | None = None   # ... and its columns of o_proj

    def __call__(self, x: Tensor, positions: Tensor, kv_cache: KVCache,
                 meta: AttentionContext) -> Tensor:
        n = x.shape[0]
        qkv = linear(x, self.wqkv, self.bqkv)
        if meta.lora is not None:
            qkv = meta.lora.add(qkv, x, self.lora_qkv)
        k_cache, v_cache = kv_cache
        # The attention backend's fused kernel when it has one (cpu: compiled), else the composed ops.
        q = meta.rope_write_kv(qkv, positions, k_cache, v_cache, num_heads=self.num_heads,
                               num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rope=self.rope,
                               q_norm=self.q_norm, k_norm=self.k_norm, eps=self.eps)
        if q is None:
            q, k, v = paddle.split(qkv, [self.q_size, self.kv_size, self.kv_size], axis=-1)
            q = q.reshape([n, self.num_heads, self.head_dim])
            k = k.reshape([n, self.num_kv_heads, self.head_dim])
            v = v.reshape([n, self.num_kv_heads, self.head_dim])
            if self.q_norm is not None:
                q = rms_norm(q, self.q_norm, self.eps)
                k = rms_norm(k, self.k_norm, self.eps)
            q, k = self.rope(positions, q, k)
            meta.write_kv(k_cache, v_cache, k, v)
        out = meta.attention(q, k_cache, v_cache, self.scale)
        return row_parallel(out.reshape([n, self.q_size]), self.wo, self.bo, self.reduce,
                            None if meta.lora is None else (meta.lora, self.lora_o))

    def shard(self, rank: int, world: int, reduce: Callable[[Tensor], Tensor]) -> None:
        """Keep this rank's query heads and their KV heads: its rows (output
        features) of the fused q/k/v weight and its columns of o_proj."""
        h, kvh, d = self.num_heads // world, self.num_kv_heads // world, self.head_dim
        q_cols = np.arange(rank * h * d, (rank + 1) * h * d)
        k_cols = self.q_size + np.arange(rank * kvh * d, (rank + 1) * kvh * d)
        v_cols = k_cols + self.kv_size
        cols = np.concatenate([q_cols, k_cols, v_cols])
        self.wqkv = self.wqkv.take_rows(cols)
        self.bqkv = None if self.bqkv is None else _take(self.bqkv, cols, axis=0)
        self.wo = self.fmt.shard_cols(f"{self.prefix}.o_proj.weight", self.wo, int(q_cols[0]), int(q_cols[-1]) + 1)
        self.num_heads, self.num_kv_heads = h, kvh
        self.q_size, self.kv_size = h * d, kvh * d
        self.reduce = reduce
        self.qkv_rows, self.o_cols = cols, (int(q_cols[0]), int(q_cols[-1]) + 1)


class FeedForward:
    def __init__(self, cfg: DecoderConfig, w: Weights, prefix: str):
        p, i = f"{prefix}.mlp", cfg.intermediate_size
        self.prefix, self.fmt = p, w.fmt
        self.w_gate_up, self.b_gate_up = w.fused([f"{p}.gate_proj", f"{p}.up_proj"],
                                                 cfg.hidden_size, [i, i], cfg.mlp_bias)
        self.w_down, self.b_down = w.fused([f"{p}.down_proj"], i, [cfg.hidden_size], cfg.mlp_bias)
        self.intermediate_size = i
        self.reduce: Callable[[Tensor], Tensor] | None = None   # tensor parallel: sum over ranks
        # LoRA adapters, as Attention's: the fused gate/up (B block-diagonal) and down_proj
        self.lora_gate_up: dict[str, tuple[Tensor, Tensor, float]] = {}
        self.lora_down: dict[str, tuple[Tensor, Tensor, float]] = {}
        self.gate_up_rows: np.ndarray | None = None    # tensor parallel: this rank's rows of gate/up
        self.down_cols: tuple[int, int] | None = None  # ... and its columns of down_proj

    def __call__(self, x: Tensor, lora: Any = None) -> Tensor:
        """``lora``: the step's fdx.core.lora.StepLoRA, when a request has an adapter."""
        if lora is None:
            n = x.shape[0]
            k = n // mlp_chunk_rows(self.intermediate_size)
            if k > 1 and self.reduce is None:   # a long step's gate/up in k row chunks (fdx.core.memory)
                size = -(-n // k)
                return paddle.concat([self(x[i:i + size]) for i in range(0, n, size)])
            return row_parallel(silu_and_mul(linear(x, self.w_gate_up, self.b_gate_up)),
                                self.w_down, self.b_down, self.reduce)
        h = silu_and_mul(lora.add(linear(x, self.w_gate_up, self.b_gate_up), x, self.lora_gate_up))
        return row_parallel(h, self.w_down, self.b_down, self.reduce, (lora, self.lora_down))

    def shard(self, rank: int, world: int, reduce: Callable[[Tensor], Tensor]) -> None:
        """Keep this rank's intermediate rows of gate and up (the fused
        weight stays [gate | up]) and the same columns of down_proj."""
        i, n = self.intermediate_size, self.intermediate_size // world
        mine = np.arange(rank * n, (rank + 1) * n)
        cols = np.concatenate([mine, i + mine])
        self.w_gate_up = self.w_gate_up.take_rows(cols)
        self.b_gate_up = None if self.b_gate_up is None else _take(self.b_gate_up, cols, axis=0)
        self.w_down = self.fmt.shard_cols(f"{self.prefix}.down_proj.weight", self.w_down,
                                          rank * n, (rank + 1) * n)
        self.intermediate_size = n
        self.reduce = reduce
        self.gate_up_rows, self.down_cols = cols, (rank * n, (rank + 1) * n)


@dataclass(slots=True, frozen=True)
class FusedLayer:
    """What a backend's whole-layer kernel needs of one layer
    (fdx.ops.layer_port, the model-level kernel port): its norms, its four linear weights,
    their biases, the per-head q/k norms and the attention shape. Each weight
    is one to three parts stacked along its output rows (a q/k/v or gate/up
    whose parts a file stores in different kinds; same-kind neighbours are
    one part, weight_formats.stack), each part an
    fdx.ops.quant.QuantizedTensor of GGML blocks or a float32 ``[in, out]``
    tensor (the ``none`` format's). ``biases``: each weight's float32 [rows]
    bias or None (Qwen2's q/k/v); ``q_norm``/``k_norm``: float32 [head_dim]
    or None (Qwen3)."""
    input_norm: Tensor
    post_norm: Tensor
    weights: tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]   # qkv, o, gate_up, down
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RotaryEmbedding
    eps: float
    scale: float
    biases: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None] = (None, None, None, None)
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None

    @property
    def has_float(self) -> bool:
        """Whether a weight part is float32 (the backend takes such a layer for fewer rows)."""
        return any(isinstance(p, Tensor) for parts in self.weights for p in parts)


MAX_FUSED_PARTS = 3     # = kMaxParts of csrc/decoder_layer.h


def fused_parts(weight: LinearWeight) -> tuple[Any, ...] | None:
    """A linear weight as the fused kernel's parts: float32 ``[in, out]``
    tensors and whole GGML blocks (QuantizedTensor), one part or a RowStack's
    up to three; None for anything else (wint8/wint4, another dtype)."""
    from fdx.core.interfaces import RowStack
    from fdx.ops import cpp
    from fdx.plugins.models.weight_formats import BlockWeight, DenseWeight
    if isinstance(weight, RowStack):
        if len(weight.parts) > MAX_FUSED_PARTS:
            return None
        parts = [fused_parts(p) for p in weight.parts]
        return None if any(p is None for p in parts) else tuple(q for p in parts for q in p)
    if type(weight) is DenseWeight and weight.t.dtype == paddle.float32:
        return (weight.t,)
    if isinstance(weight, BlockWeight) and weight.kind in cpp.DECODER_LAYER_KINDS and cpp.quant_supported(weight.q):
        weight.q.prepare()
        return (weight.q,)
    return None


def fused_layer(layer: "DecoderLayer") -> FusedLayer | None:
    """The layer as a ``FusedLayer``, or None when it has what the fused
    kernels leave to the composed path: a tensor-parallel split, a weight
    that is neither float32 nor whole GGML blocks (wint8/wint4, bfloat16),
    or norms or biases not in float32."""
    a, m = layer.attn, layer.mlp
    biases = (a.bqkv, a.bo, m.b_gate_up, m.b_down)
    vectors = [layer.input_norm, layer.post_norm, a.q_norm, a.k_norm, *biases]
    if (a.reduce is not None or m.reduce is not None
            or any(t is not None and t.dtype != paddle.float32 for t in vectors)):
        return None
    parts = [fused_parts(w) for w in (a.wqkv, a.wo, m.w_gate_up, m.w_down)]
    if any(p is None for p in parts):
        return None
    return FusedLayer(layer.input_norm, layer.post_norm, tuple(parts), a.num_heads, a.num_kv_heads, a.head_dim,
                      a.rope, layer.eps, a.scale, biases, a.q_norm, a.k_norm)


_UNSET: Any = object()


class DecoderLayer:
    """Pre-norm block. The residual stream is carried separately so that
    each norm fuses the preceding residual add. The attention backend may
    run the whole block in one call (``fused``; else the ops below)."""

    def __init__(self, cfg: DecoderConfig, w: Weights, index: int, rope: RotaryEmbedding):
        prefix = f"model.layers.{index}"
        self.eps = cfg.rms_norm_eps
        self.input_norm = w.vector(f"{prefix}.input_layernorm.weight", cfg.hidden_size)
        self.post_norm = w.vector(f"{prefix}.post_attention_layernorm.weight", cfg.hidden_size)
        self.attn = Attention(cfg, w, prefix, rope)
        self.mlp = FeedForward(cfg, w, prefix)
        self._fused: FusedLayer | None = _UNSET

    @property
    def fused(self) -> FusedLayer | None:
        """``fused_layer(self)``, worked out on first use (after any shard or cast)."""
        if self._fused is _UNSET:
            self._fused = fused_layer(self)
        return self._fused

    def weights_changed(self) -> None:
        """Call after replacing weights (shard, cast): ``fused`` is worked out again."""
        self._fused = _UNSET

    def __call__(self, x: Tensor, residual: Tensor | None, positions: Tensor,
                 kv_cache: KVCache, meta: AttentionContext) -> tuple[Tensor, Tensor]:
        fused = self._fused if self._fused is not _UNSET else self.fused
        if fused is not None and (got := layer_port.decoder_layer(x, residual, fused, kv_cache, meta)) is not None:
            return got
        return self.composed(x, residual, positions, kv_cache, meta)

    def composed(self, x: Tensor, residual: Tensor | None, positions: Tensor, kv_cache: KVCache,
                 meta: AttentionContext, act: Any = None, index: int = -1) -> tuple[Tensor, Tensor]:
        """The layer's ops one by one (the reference of the fused kernel);
        with ``act`` (StepActivations), its attn_out and mlp_out hooks of
        layer ``index`` applied."""
        if residual is None:
            residual, x = x, rms_norm(x, self.input_norm, self.eps)
        else:
            x, residual = add_rms_norm(x, residual, self.input_norm, self.eps)
        x = self.attn(x, positions, kv_cache, meta)
        if act is not None:
            x = act.apply("attn_out", index, x)
        x, residual = add_rms_norm(x, residual, self.post_norm, self.eps)
        x = self.mlp(x) if meta.lora is None else self.mlp(x, meta.lora)
        if act is not None:
            x = act.apply("mlp_out", index, x)
        return x, residual

    def hooked(self, index: int, x: Tensor, residual: Tensor | None, positions: Tensor, kv_cache: KVCache,
               meta: AttentionContext, act: Any) -> tuple[Tensor, Tensor]:
        """Layer ``index`` with activation hooks on some requests' rows. A
        hook inside the layer (attn_out, mlp_out) needs the composed ops:
        they run for every row (writing the step's KV), then, when the
        backend has the whole-layer kernel, it runs too and every other
        request's rows are taken from it, so they keep the bits they have
        without hooks. A residual hook needs only the layer's output."""
        inside = act.inside(index)
        if inside:
            composed = self.composed(x, residual, positions, kv_cache, meta, act, index)
            fused = self._fused if self._fused is not _UNSET else self.fused
            got = None if fused is None else layer_port.decoder_layer(x, residual, fused, kv_cache, meta)
            if got is None:
                out, residual = composed
            else:
                from fdx.core.activations import merge_rows
                out, residual = (merge_rows(t, c, inside) for t, c in zip(got, composed))
        else:
            out, residual = self(x, residual, positions, kv_cache, meta)
        return act.apply_residual(index, out, residual), residual


def allocate_kv_caches(num_layers: int, num_kv_heads: int, head_dim: int,
                       num_blocks: int, block_size: int) -> list[KVCache]:
    """Zeroed per-layer (k, v) caches of shape [num_kv_heads * num_slots, head_dim]."""
    shape = [num_kv_heads * num_blocks * block_size, head_dim]
    return [(paddle.zeros(shape, "float32"), paddle.zeros(shape, "float32"))
            for _ in range(num_layers)]


# --- LoRA adapters ---------------------------------------------------------------------------

def lora_slot(parts: list[tuple[np.ndarray, np.ndarray] | None], outs: list[int], scale: float,
              rows: np.ndarray | None = None, cols: tuple[int, int] | None = None
              ) -> tuple[Tensor, Tensor, float] | None:
    """One fused linear's adapter: ``parts`` the (A [r, in], B [out, r]) of
    each stacked module (None where the adapter does not target it; ``outs``
    their widths) as (A^T [in, sum r], B^T [sum r, sum out] block-diagonal,
    scale), this rank's shard: ``rows`` of the output (column parallel),
    ``cols`` of the input (row parallel). None when no part is targeted."""
    if all(p is None for p in parts):
        return None
    a_t = np.concatenate([p[0].T for p in parts if p is not None], axis=1)
    b_t = np.zeros((a_t.shape[1], sum(outs)), dtype=np.float32)
    r0, o0 = 0, 0
    for p, out in zip(parts, outs):
        if p is not None:
            r = p[0].shape[0]
            b_t[r0:r0 + r, o0:o0 + out] = p[1].T
            r0 += r
        o0 += out
    if rows is not None:
        b_t = b_t[:, rows]
    if cols is not None:
        a_t = a_t[cols[0]:cols[1]]
    return (paddle.to_tensor(np.ascontiguousarray(a_t, dtype=np.float32)),
            paddle.to_tensor(np.ascontiguousarray(b_t, dtype=np.float32)), float(scale))
