"""Built-in attention backends (contract: ``AttentionBackend``), over ops/.

- ``paddle``: the device-agnostic reference in eager Paddle
  (``fdx.ops.attention`` with impl "paddle"); what the GPU backends use
  until they bring kernels of their own.
- ``cpu``: the compiled CPU kernels (ops/csrc/): attention over block
  tables, and ``rope_write_kv``, the fused q/k/v split + q/k RMS norm +
  rotary + KV-cache write the model calls before attention, and
  ``decoder_layer``, a whole Llama-family layer over GGML-block or float32
  weights (biases and Qwen3's q/k norms included) in one compiled call, and
  ``decoder_stack``, all of a step's layers in one (steps of fewer than
  fdx.ops.cpp.QUANT_BLAS_MIN_ROWS tokens, f32_blas_min_rows with a float32
  weight, whose every sequence the compiled attention takes; off with
  ``FDX_FUSED_LAYERS=0``), each where the
  cpu backend's probed kernel table (fdx.core.kernels) passed it. The
  Paddle reference is its fallback when they could not be built or did not
  pass their probe (both logged by the backend), or with
  ``FDX_DISABLE_CPP_OPS=1``. Never chosen by a GPU backend.
"""
from __future__ import annotations

import functools
import os

from fdx.core import kernels
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import AttentionBackend, KVCacheSpec


@functools.cache
def _ops():
    """fdx.ops.attention, imported on first use: it imports Paddle, which a
    tensor parallel engine process (it reads only these classes' names and
    ``layout``) never loads."""
    from fdx.ops import attention
    return attention


@functools.cache
def _cpp():
    """fdx.ops.cpp, imported on first use (it imports Paddle too). Cached:
    its users run once a layer a step, where a function-level ``from fdx.ops
    import cpp`` costs about 2 us (importlib's _handle_fromlist) each time."""
    from fdx.ops import cpp
    return cpp


@functools.cache
def _paddle():
    """Paddle, imported on first use (see _cpp)."""
    import paddle
    return paddle


@functools.cache
def _float32():
    """paddle.float32, Paddle imported on first use (see _cpp)."""
    import paddle
    return paddle.float32


FUSED_LAYERS_ENV = "FDX_FUSED_LAYERS"     # 0: every layer composed (the A/B switch of docs/benchmarks.md)


class PaddleAttention(AttentionBackend):
    name = "paddle"
    impl = "paddle"

    def build_metadata(self, query_lens, context_lens, block_tables, spec: KVCacheSpec, num_heads: int):
        return _ops().build_attention_metadata(
            query_lens, context_lens, block_tables, spec.block_size, spec.num_kv_heads, spec.num_slots,
            impl=self.impl, num_heads=num_heads)

    def write_kv(self, k_cache, v_cache, k, v, metadata) -> None:
        _ops().write_kv(k_cache, v_cache, k, v, metadata)

    def forward(self, q, k_cache, v_cache, metadata, scale: float):
        return _ops().paged_attention(q, k_cache, v_cache, metadata, scale)


class CpuAttention(PaddleAttention):
    name = "cpu"

    @property
    def impl(self) -> str:
        """'cpp' where the installed kernel table passed the compiled attention."""
        return _ops().default_impl()

    def rope_write_kv(self, qkv, positions, k_cache, v_cache, metadata, *, num_heads, num_kv_heads, head_dim, rope,
                      q_norm=None, k_norm=None, eps=1e-6):
        """The compiled fused kernel (fdx.ops.cpp.rope_write_kv) on float32
        tensors where the kernel table passed it; None (the model composes
        the ops) without it."""
        cpp = _cpp()
        if not kernels.active().usable("cpp.rope_write_kv") or not cpp.loaded() or qkv.dtype != _float32():
            return None
        return cpp.rope_write_kv(qkv, positions, metadata.slot_mapping, k_cache, v_cache,
                                 rope.cos_cache, rope.sin_cache, q_norm, k_norm, num_heads, num_kv_heads,
                                 getattr(rope, "rotary_dim", head_dim), rope.is_neox_style, eps)

    def __init__(self, settings: dict | None = None):
        super().__init__(settings)
        self.fused_layers = os.environ.get(FUSED_LAYERS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
        self._variants: tuple[object, dict[str, str | None]] = (None, {})
        self._stack = None      # (key, fdx.ops.cpp.StackLayers or None): decoder_stack's table

    def _variant(self, kind: str) -> str | None:
        """The build of ``kind``'s product the active table passed ("avx2", ...), or None;
        kind "f32": the float32 product's."""
        cpp = _cpp()
        table = kernels.active()
        if self._variants[0] is not table:
            self._variants = (table, {})
        found = self._variants[1]
        if kind not in found:
            found[kind] = next((v for v in cpp.QUANT_VARIANTS if kind in cpp.DECODER_LAYER_KINDS + ("f32",)
                                and table.usable(cpp.quant_kernel_name(kind, v))), None)
        return found[kind]

    def _f32_rows(self, rows: int) -> bool:
        """Whether a float32 weight's product is the compiled one at ``rows`` rows
        (fdx.ops.cpp.f32_blas_min_rows of the passed build; from there MKL's; every
        row count under backend.batch_invariant: MKL's order depends on the rows)."""
        cpp = _cpp()
        if kernels.active().batch_invariant:
            return True
        return cpp.F32_MIN_ROWS <= rows < cpp.f32_blas_min_rows(self._variant("f32"))

    def _fits(self, x, metadata) -> bool:
        """Whether the step fits the compiled layer (see decoder_layer)."""
        cpp = _cpp()
        group = metadata.cpp
        return not (not self.fused_layers or group is None or group.num_tokens != metadata.num_tokens
                    or metadata.num_tokens >= cpp.QUANT_BLAS_MIN_ROWS or metadata.out_perm is not None
                    or x.dtype != _float32() or not kernels.active().usable("cpp.decoder_layer")
                    or not cpp.loaded())

    def decoder_stack(self, x, layers, kv_caches, metadata):
        """Every layer in one compiled call (fdx.ops.cpp.decoder_stack) when
        each would take ``decoder_layer``'s kernel (same checks: the rows a
        float32 weight is taken for among them) and they share one shape and
        rotary table; else None. The table of pointers is built once per
        (layers, caches, kernel table) and kept."""
        cpp = _cpp()
        if not layers or any(f is None for f in layers) or not self._fits(x, metadata):
            return None
        key = (kernels.active(), [id(f) for f in layers])
        cached = self._stack
        if cached is None or cached[0] != key or (cached[1] is not None and not cached[1].valid_for(kv_caches)):
            cached = self._stack = (key, self._stack_table(layers, kv_caches))
        table = cached[1]
        if table is None or (table.has_float and not self._f32_rows(metadata.num_tokens)):
            return None
        group = metadata.cpp
        return cpp.decoder_stack(x, table, metadata.positions, metadata.slot_mapping, group.seq_info,
                                 group.block_tables, metadata.block_size, kernels.active().batch_invariant)

    def _parts_variants(self, layer) -> list[list[str | None]]:
        """The passed build of each of the layer's weight parts ("f32" for a float32 one)."""
        float_tensor = _paddle().Tensor
        return [[self._variant("f32" if isinstance(p, float_tensor) else p.kind) for p in parts]
                for parts in layer.weights]

    def _stack_table(self, layers, kv_caches):
        """fdx.ops.cpp.stack_layers for these layers, or None when they differ
        in shape, rotary table, or in which of biases and q/k norms they
        have, or a weight part's kind has no passed build."""
        cpp = _cpp()
        first = layers[0]

        def shape(f):
            return (f.num_heads, f.num_kv_heads, f.head_dim, f.eps, f.scale,
                    [sum(p.shape[1] if isinstance(p, _paddle().Tensor) else p.shape[0] for p in parts)
                     for parts in f.weights],
                    [b is None for b in f.biases], f.q_norm is None, f.k_norm is None)
        want = shape(first)
        if any(shape(f) != want or f.rope is not first.rope for f in layers):
            return None
        variants = [self._parts_variants(f) for f in layers]
        if any(None in parts for vs in variants for parts in vs):
            return None
        return cpp.stack_layers(layers, variants, kv_caches)

    def decoder_layer(self, x, residual, layer, k_cache, v_cache, metadata):
        """The compiled whole layer (fdx.ops.cpp.decoder_layer) where the
        kernel table passed it and the step fits: every sequence in the
        compiled attention's group (rows in batch order), fewer tokens than
        QUANT_BLAS_MIN_ROWS (from there the composed products dequantize and
        multiply by BLAS, faster than the kernel's int8 dot products), or than
        f32_blas_min_rows(build) when a weight is float32 (from there MKL's sgemm is),
        float32 activations, and a passed build for each weight part's kind.
        Else None."""
        cpp = _cpp()
        if not self._fits(x, metadata):
            return None
        group = metadata.cpp
        if layer.has_float and not self._f32_rows(metadata.num_tokens):
            return None
        variants = self._parts_variants(layer)
        if any(None in v for v in variants):
            return None
        rope = layer.rope
        return cpp.decoder_layer(x, residual, layer.input_norm, layer.post_norm, layer.weights, variants,
                                 metadata.positions, metadata.slot_mapping, k_cache, v_cache, rope.cos_cache,
                                 rope.sin_cache, group.seq_info, group.block_tables, layer.num_heads,
                                 layer.num_kv_heads, getattr(rope, "rotary_dim", layer.head_dim),
                                 metadata.block_size, rope.is_neox_style, layer.eps, layer.scale,
                                 layer.biases, layer.q_norm, layer.k_norm, kernels.active().batch_invariant)


@hookimpl
def fdx_register_attention_backends(register):
    register("paddle", PaddleAttention)
    register("cpu", CpuAttention)
