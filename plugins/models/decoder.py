"""A decoder-only transformer (Llama family) over a paged KV cache.

Llama, Qwen2, Qwen3 and dense ERNIE-4.5 are one network with a few
switches: biases, per-head q/k norms, rotary pairing and defaults. Each
architecture module is a thin subclass of `DecoderForCausalLM` that turns
its Hugging Face config.json into a `DecoderConfig`.

Every matrix (linear layers, embedding, LM head) is a ``LinearWeight``
that the weight format (``model.quantization``, core/interfaces.py) made:
the model calls ``matmul``, ``embedding``, ``take_rows`` / ``take_cols``
and ``cast`` on it and never sees the storage. q/k/v are fused into one
``[(H + 2*KVH) * D, hidden]`` weight and gate/up into ``[2 * I, hidden]``
(``WeightFormat.fuse``). With the float32 format (``none``) the layout is
the one chosen for speed (DESIGN.md, "Facts measured"): linear weights as
[in, out] and a pre-transposed lm_head copy even when tied; a quantized
tied head reads the embedding's own table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np
import paddle

from fdx.core.interfaces import AttentionContext, LinearWeight, Model, WeightFormat
from fdx.ops.activation import silu_and_mul
from fdx.ops.norm import add_rms_norm, rms_norm
from fdx.ops.rotary import RotaryEmbedding

Tensor = paddle.Tensor
KVCache = tuple[Tensor, Tensor]


@dataclass(slots=True, frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None  # llama3 parameters; None = plain RoPE
    rope_interleaved: bool = False  # rotate pairs (2i, 2i+1) (ERNIE) instead of halves
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMS norm on q and k before RoPE (Qwen3)


# --- reading a Hugging Face config.json ------------------------------------

def _rope_settings(hf: dict[str, Any], default_theta: float, arch: str
                   ) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, llama3 scaling or None) from either config format:
    transformers 5 writes ``rope_parameters``; 4.x wrote ``rope_theta`` and
    ``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise NotImplementedError(f"{arch}: partial_rotary_factor={partial} is not supported")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        return theta, dict(scaling)
    raise NotImplementedError(
        f"{arch}: rope scaling type {rope_type!r} is not supported "
        "(supported: default, llama3)")


def decoder_config(hf: dict[str, Any], arch: str, defaults: dict[str, Any],
                   **switches: Any) -> DecoderConfig:
    """The common part of every variant's config parsing.

    ``defaults`` stands in for keys a config.json may omit; they are the
    values of the matching transformers config class. ``switches`` are the
    variant's own DecoderConfig fields (biases, qk_norm, ...)."""
    def get(key: str) -> Any:
        value = hf.get(key)
        if value is not None:
            return value
        if key in defaults:
            return defaults[key]
        raise ValueError(f"{arch} config.json is missing {key!r}")

    act = get("hidden_act")
    if act != "silu":
        raise NotImplementedError(f"{arch}: hidden_act {act!r} is not supported (only silu)")
    num_layers = get("num_hidden_layers")
    layer_types = hf.get("layer_types") or []
    sliding = "sliding_attention" in layer_types or (
        not layer_types and hf.get("use_sliding_window")
        and num_layers > hf.get("max_window_layers", 28))
    if sliding:
        raise NotImplementedError(f"{arch}: sliding-window attention is not supported")

    num_heads, hidden_size = get("num_attention_heads"), get("hidden_size")
    num_kv_heads = hf.get("num_key_value_heads") or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"{arch}: num_attention_heads={num_heads} is not a multiple "
                         f"of num_key_value_heads={num_kv_heads}")
    # A head_dim key that is absent takes the class default (128 for Qwen3 and
    # ERNIE); one set to null means hidden_size // heads, as in transformers.
    head_dim = hf["head_dim"] if "head_dim" in hf else defaults.get("head_dim")
    theta, scaling = _rope_settings(hf, defaults["rope_theta"], arch)
    return DecoderConfig(
        vocab_size=get("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=get("intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=get("max_position_embeddings"),
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        **switches,
    )


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

class _Weights:
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
                 reduce: Callable[[Tensor], Tensor] | None) -> Tensor:
    """``linear`` whose input rows are split over tensor-parallel ranks: each
    rank's partial product is summed (``reduce``) before the bias, which is
    added once."""
    y = weight.matmul(x)
    if reduce is not None:
        y = reduce(y)
    return y if bias is None else y + bias


def _take(t: Tensor, index: np.ndarray, axis: int) -> Tensor:
    return paddle.to_tensor(np.ascontiguousarray(np.take(t.numpy(), index, axis=axis)))


class Attention:
    def __init__(self, cfg: DecoderConfig, w: _Weights, prefix: str, rope: RotaryEmbedding):
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

    def __call__(self, x: Tensor, positions: Tensor, kv_cache: KVCache,
                 meta: AttentionContext) -> Tensor:
        n = x.shape[0]
        qkv = linear(x, self.wqkv, self.bqkv)
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
        return row_parallel(out.reshape([n, self.q_size]), self.wo, self.bo, self.reduce)

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


class FeedForward:
    def __init__(self, cfg: DecoderConfig, w: _Weights, prefix: str):
        p, i = f"{prefix}.mlp", cfg.intermediate_size
        self.prefix, self.fmt = p, w.fmt
        self.w_gate_up, self.b_gate_up = w.fused([f"{p}.gate_proj", f"{p}.up_proj"],
                                                 cfg.hidden_size, [i, i], cfg.mlp_bias)
        self.w_down, self.b_down = w.fused([f"{p}.down_proj"], i, [cfg.hidden_size], cfg.mlp_bias)
        self.intermediate_size = i
        self.reduce: Callable[[Tensor], Tensor] | None = None   # tensor parallel: sum over ranks

    def __call__(self, x: Tensor) -> Tensor:
        return row_parallel(silu_and_mul(linear(x, self.w_gate_up, self.b_gate_up)),
                            self.w_down, self.b_down, self.reduce)

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


class DecoderLayer:
    """Pre-norm block. The residual stream is carried separately so that
    each norm fuses the preceding residual add."""

    def __init__(self, cfg: DecoderConfig, w: _Weights, index: int, rope: RotaryEmbedding):
        prefix = f"model.layers.{index}"
        self.eps = cfg.rms_norm_eps
        self.input_norm = w.vector(f"{prefix}.input_layernorm.weight", cfg.hidden_size)
        self.post_norm = w.vector(f"{prefix}.post_attention_layernorm.weight", cfg.hidden_size)
        self.attn = Attention(cfg, w, prefix, rope)
        self.mlp = FeedForward(cfg, w, prefix)

    def __call__(self, x: Tensor, residual: Tensor | None, positions: Tensor,
                 kv_cache: KVCache, meta: AttentionContext) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual, x = x, rms_norm(x, self.input_norm, self.eps)
        else:
            x, residual = add_rms_norm(x, residual, self.input_norm, self.eps)
        x = self.attn(x, positions, kv_cache, meta)
        x, residual = add_rms_norm(x, residual, self.post_norm, self.eps)
        return self.mlp(x), residual


# --- the model -----------------------------------------------------------------

class DecoderForCausalLM(Model):
    """Construct with the HF config.json dict and HF-named weights (float32
    numpy, or ``QuantizedTensor`` for a GGUF block tensor when the format
    keeps blocks), and the weight format (None: float32, ``none``). The
    weights dict is consumed: each entry is popped as it is converted, so
    the numpy copy is freed once the caller drops its own references;
    entries the model does not use are left in it."""

    architecture: ClassVar[str] = "DecoderForCausalLM"
    supports_hidden_states = True
    supports_pooling = True

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        raise NotImplementedError

    def __init__(self, config: dict[str, Any], weights: dict[str, Any],
                 weight_format: WeightFormat | None = None):
        if weight_format is None:
            from fdx.plugins.models.weight_formats import NoQuantization
            weight_format = NoQuantization()
        self.weight_format = weight_format
        cfg = self.cfg = self.parse_config(config)
        self.num_layers = cfg.num_layers
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.capture_hidden_states = False        # research tap: keep the final hidden states
        self.last_hidden_states: Tensor | None = None
        self.capture_pooling_hidden_states = False  # model.task embed: keep every token row's final state
        self.pooling_hidden_states: Tensor | None = None
        self.head_dim = cfg.head_dim
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings

        w = _Weights(self.architecture, weights, weight_format)
        self.embed_tokens = w.matrix("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), "embedding")
        if cfg.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
            self.lm_head = weight_format.tied_head(self.embed_tokens)
        else:
            self.lm_head = w.matrix("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), "lm_head")

        rope = build_rotary(cfg)
        self.layers = [DecoderLayer(cfg, w, i, rope) for i in range(cfg.num_layers)]
        self.norm = w.vector("model.norm.weight", cfg.hidden_size)

    def shard(self, rank: int, world: int, reduce: Callable[[Tensor], Tensor]) -> None:
        """Keep only tensor-parallel rank ``rank`` of ``world``'s part: its
        query and KV heads in attention, its intermediate columns in the MLP;
        ``reduce`` sums a tensor over the ranks (after o_proj and down_proj).
        Embedding, norms and lm_head stay whole on every rank."""
        cfg = self.cfg
        for key, count in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                           ("intermediate_size", cfg.intermediate_size)):
            if count % world:
                raise ValueError(f"{self.architecture}: {key}={count} does not divide by "
                                 f"tensor_parallel_size={world}")
        for layer in self.layers:
            layer.attn.shard(rank, world, reduce)
            layer.mlp.shard(rank, world, reduce)
        self.num_heads, self.num_kv_heads = cfg.num_heads // world, cfg.num_kv_heads // world

    def drop_lm_head(self) -> None:
        """A rank that never reads logits (tensor parallel ranks above 0):
        a 1-wide float32 head in place of the vocabulary."""
        from fdx.plugins.models.weight_formats import DenseWeight
        self.lm_head = DenseWeight(paddle.zeros([self.cfg.hidden_size, 1], dtype=getattr(self, "dtype", "float32")))

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights held, by kind ("q4_1", "f32", ...): every
        matrix, norm and bias once (a tied head that reads the embedding's
        table is not counted twice), rotary tables left out."""
        from fdx.plugins.models.weight_formats import weight_bytes
        held = [self.embed_tokens, self.norm] + ([] if self.lm_head is self.embed_tokens else [self.lm_head])
        for layer in self.layers:
            a, m = layer.attn, layer.mlp
            held += [layer.input_norm, layer.post_norm, a.wqkv, a.bqkv, a.wo, a.bo, a.q_norm, a.k_norm,
                     m.w_gate_up, m.b_gate_up, m.w_down, m.b_down]
        return weight_bytes(held)

    def cast(self, dtype: str) -> None:
        """Hold every weight (and the rotary tables) in ``dtype``; logits come
        out in it too (the runner reads them as float32)."""
        def conv(obj, names):
            for name in names:
                t = getattr(obj, name)
                if t is not None:
                    setattr(obj, name, t.cast(dtype) if isinstance(t, LinearWeight) else t.astype(dtype))
        tied = self.lm_head is self.embed_tokens
        conv(self, ("embed_tokens", "norm") if tied else ("embed_tokens", "lm_head", "norm"))
        if tied:
            self.lm_head = self.embed_tokens
        ropes = set()
        for layer in self.layers:
            conv(layer, ("input_norm", "post_norm"))
            conv(layer.attn, ("wqkv", "bqkv", "wo", "bo", "q_norm", "k_norm"))
            conv(layer.mlp, ("w_gate_up", "b_gate_up", "w_down", "b_down"))
            ropes.add(layer.attn.rope)
        for rope in ropes:
            conv(rope, [n for n in ("cos_cache", "sin_cache") if hasattr(rope, n)])
        self.dtype = dtype

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[KVCache],
                meta: AttentionContext, logits_indices: Tensor) -> Tensor:
        """Run the new tokens of a mixed batch; float32 logits [M, vocab]
        for the rows in ``logits_indices`` only. ``meta`` is an
        ``AttentionContext``: the attention backend and the step's metadata."""
        x = self.embed_tokens.embedding(input_ids)
        residual = None
        hooks = meta.connector              # the KV connector's per-layer calls, only when one runs
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if hooks is not None:
                hooks.wait_for_layer_load(i)
            x, residual = layer(x, residual, positions, kv_cache, meta)
            if hooks is not None:
                hooks.save_kv_layer(i, kv_cache, meta)
        x, _ = add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        if self.capture_pooling_hidden_states:
            self.pooling_hidden_states = x
        x = paddle.gather(x, logits_indices)
        if self.capture_hidden_states:
            self.last_hidden_states = x
        return self.lm_head.matmul(x)

    __call__ = forward


def allocate_kv_caches(num_layers: int, num_kv_heads: int, head_dim: int,
                       num_blocks: int, block_size: int) -> list[KVCache]:
    """Zeroed per-layer (k, v) caches of shape [num_kv_heads * num_slots, head_dim]."""
    shape = [num_kv_heads * num_blocks * block_size, head_dim]
    return [(paddle.zeros(shape, "float32"), paddle.zeros(shape, "float32"))
            for _ in range(num_layers)]
