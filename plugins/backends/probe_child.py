"""The probe of the one-call decoder layer (``cpp.decoder_layer``,
ops/csrc/decoder_layer.h), and the probe child the cpu backend runs.

Its reference is the model plugin's composed layer
(fdx.plugins.models.layers.DecoderLayer), which lives above ops/, so the
probe lives here and not in fdx.ops.probes (ops imports nothing above it).
``python -m fdx.plugins.backends.probe_child [--threads N] NAME...`` is
fdx.ops.probes' child protocol over ops' probes plus this one.
"""
from __future__ import annotations

import sys

import numpy as np

from fdx.ops import probes
from fdx.ops.probes import (_BLOCK, _BLOCKS, _CONTEXT_LENS, _HEADS, _KV_HEADS, _QUERY_LENS, _TABLES, WrongResult,
                            _close, _rng, _tensor, random_quantized)

# --- one decoder layer in one call (csrc/decoder_layer.h) -----------------------------------

_LAYER_HIDDEN, _LAYER_INTER, _LAYER_HEAD_DIM = 128, 256, 32      # 4 query / 2 KV heads of 32


def part_kind(part) -> str:
    """A fused layer's weight part's kind: "f32" for a float32 tensor, else its blocks' kind."""
    return part.kind if hasattr(part, "kind") else "f32"


def random_layer(kind, rng, hidden: int = _LAYER_HIDDEN, inter: int = _LAYER_INTER,
                 heads: int = _HEADS, kv_heads: int = _KV_HEADS, head_dim: int = _LAYER_HEAD_DIM,
                 table=None, max_position: int = 64):
    """A Llama decoder layer (fdx.plugins.models.layers.DecoderLayer) with random
    ``kind`` blocks for its linears ("f32": float32 weights; a dict: the kind of
    each projection, "q_proj" ... "down_proj", parts of different kinds fused as
    a RowStack) and norm weights near 1, kept as blocks by the ``auto`` format
    under ``table`` (default: the portable builds of the kinds passed), and its
    DecoderConfig."""
    from fdx.core.interfaces import BuildContext
    from fdx.core.kernels import KernelTable
    from fdx.ops import cpp
    from fdx.plugins.models import layers
    from fdx.plugins.models.decoder_config import DecoderConfig
    from fdx.plugins.models.weight_formats import AutoFormat
    cfg = DecoderConfig(vocab_size=32, hidden_size=hidden, intermediate_size=inter, num_layers=1,
                                num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                max_position_embeddings=max_position, rms_norm_eps=1e-6, rope_theta=10000.0)
    p = "model.layers.0"
    shapes = {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
              "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    kinds = {n: kind[n.split(".")[1]] if isinstance(kind, dict) else kind for n in shapes}

    def weight(k: str, shape):
        if k == "f32":                       # the scale of the blocks' weights
            return (0.05 * rng.standard_normal(shape)).astype(np.float32)
        return random_quantized(k, *shape, rng)

    weights = {f"{p}.{n}.weight": weight(kinds[n], shape) for n, shape in shapes.items()}
    for n in ("input_layernorm", "post_attention_layernorm"):
        weights[f"{p}.{n}.weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    if table is None:
        table = KernelTable({cpp.quant_kernel_name(k, "portable"): None for k in set(kinds.values()) if k != "f32"})
    w = layers.Weights("LlamaForCausalLM", weights, AutoFormat({}, BuildContext(kernels=table)))
    return layers.DecoderLayer(cfg, w, 0, layers.build_rotary(cfg)), cfg


def run_layer(layer, x, residual, caches, impl: str, variant="portable"):
    """(MLP output, residual, k cache, v cache) as numpy after one layer over
    the probes' mixed step (_QUERY_LENS over _CONTEXT_LENS, caches copied
    first): ``impl`` "fused" by fdx.ops.cpp.decoder_layer (weights by the
    ``variant`` build, or a function of each part's kind that names it),
    "composed" by the layer's own ops with the Paddle attention (under
    whatever kernel table is active)."""
    import paddle
    from fdx.core.interfaces import AttentionContext
    from fdx.ops import attention, cpp
    from fdx.plugins.backends.attention import PaddleAttention
    k_cache, v_cache = (paddle.to_tensor(c.copy()) for c in caches)
    slots = k_cache.shape[0] // layer.attn.num_kv_heads
    meta = attention.build_attention_metadata(_QUERY_LENS, _CONTEXT_LENS, _TABLES, _BLOCK, layer.attn.num_kv_heads,
                                              slots, impl="cpp" if impl == "fused" else "paddle")
    x_t = _tensor(x)
    r_t = None if residual is None else _tensor(residual)
    if impl == "fused":
        f = layer.fused
        pick = variant if callable(variant) else (lambda kind: variant)
        builds = [[pick(part_kind(p)) for p in parts] for parts in f.weights]
        out, res = cpp.decoder_layer(x_t, r_t, f.input_norm, f.post_norm, list(f.weights), builds,
                                     meta.positions, meta.slot_mapping, k_cache, v_cache, f.rope.cos_cache,
                                     f.rope.sin_cache, meta.cpp.seq_info, meta.cpp.block_tables, f.num_heads,
                                     f.num_kv_heads, f.head_dim, _BLOCK, f.rope.is_neox_style, f.eps, f.scale,
                                     f.biases, f.q_norm, f.k_norm)
    else:
        out, res = layer(x_t, r_t, meta.positions, (k_cache, v_cache), AttentionContext(PaddleAttention(), meta))
    return out.numpy(), res.numpy(), k_cache.numpy(), v_cache.numpy()


def add_biases_and_qk_norms(layer, rng) -> None:
    """Give ``layer`` (random_layer's) a float32 bias on each of its four
    weights and Qwen3's per-head q/k norm weights (near 1), as Qwen2, Qwen3
    and biased ERNIE/Llama layers hold them."""
    import paddle
    a, m = layer.attn, layer.mlp

    def vec(n: int, loc: float = 0.0):
        return paddle.to_tensor((loc + 0.3 * rng.standard_normal(n)).astype(np.float32))
    a.bqkv, a.bo = vec(a.q_size + 2 * a.kv_size), vec(layer.input_norm.shape[0])
    m.b_gate_up, m.b_down = vec(2 * m.intermediate_size), vec(layer.input_norm.shape[0])
    a.q_norm, a.k_norm = vec(a.head_dim, 1.0), vec(a.head_dim, 1.0)
    layer.weights_changed()


# A layer like llama.cpp's Q4_K_M of SmolLM2: fused parts of different kinds (RowStacks).
MIXED_LAYER = {"q_proj": "q5_0", "k_proj": "q5_0", "v_proj": "q8_0", "o_proj": "q4_1", "gate_proj": "q5_0",
               "up_proj": "q4_0", "down_proj": "q6_k"}


def _probe_decoder_layer(dtype: str = "float32") -> None:
    """The whole layer against its composed ops (the same portable products, the
    rest Paddle), first layer (no residual) and a later one: Q4_1, Q8_0, float32,
    a layer of mixed kinds, and a Q8_0 one with biases and q/k norms."""
    from fdx.core import kernels
    from fdx.core.kernels import KernelTable
    from fdx.ops import cpp
    rng = _rng()
    n = sum(_QUERY_LENS)
    for kind in ("q4_1", "q8_0", "f32", MIXED_LAYER, "q8_0+biases"):
        extras = kind == "q8_0+biases"
        if extras:
            kind = "q8_0"
        layer, cfg = random_layer(kind, rng)
        if extras:
            add_biases_and_qk_norms(layer, rng)
        if layer.fused is None:
            raise WrongResult(f"wrong result ({kind}: the layer does not take the fused path)")
        caches = [rng.standard_normal((_KV_HEADS * _BLOCKS * _BLOCK, cfg.head_dim)).astype(np.float32)
                  for _ in range(2)]
        x = rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)
        kinds = set(kind.values()) if isinstance(kind, dict) else {kind}
        table = KernelTable({cpp.quant_kernel_name(k, "portable"): None for k in kinds if k != "f32"})
        for residual in (None, rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)):
            got = run_layer(layer, x, residual, caches, "fused")
            with kernels.using(table):
                want = run_layer(layer, x, residual, caches, "composed")
            what = (f"{'mixed' if isinstance(kind, dict) else kind}{' with biases' if extras else ''}, "
                    f"{'first layer' if residual is None else 'with residual'}")
            for g, w, part in zip(got, want, ("out", "residual", "k cache", "v cache")):
                scale = float(np.abs(w).max()) or 1.0
                _close(g / scale, w / scale, f"{what}: {part}", atol=1e-3, rtol=0)


PROBES = {**probes.PROBES, "cpp.decoder_layer": _probe_decoder_layer}


if __name__ == "__main__":
    sys.exit(probes.main(probes=PROBES))
