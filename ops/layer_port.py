"""The model-level kernel port: whole decoder layers in compiled calls (issue 40 item 5).

A model whose decoder layers describe themselves as
``fdx.plugins.models.layers.FusedLayer`` (norms, the four linear weights as
GGML-block or float32 parts, biases, q/k norms, heads, rope) calls, with
the step's ``AttentionContext`` ``meta``:

- ``decoder_stack(x, layers, kv_caches, meta)``: every layer of ``layers``
  over the embedding ``x`` [N, hidden], the first with no residual ->
  (last MLP output, residual), or None;
- ``decoder_layer(x, residual, layer, kv_cache, meta)``: one layer
  (``residual`` None for the first) -> (MLP output, residual), or None.

None means "compose the layer(s)": the model's own ops, the reference the
compiled layers are tested against (tests/test_decoder_layer.py). Each
call writes the step's K and V into the layer's cache blocks (at
``meta.metadata.slot_mapping``), as ``AttentionBackend.write_kv`` would, so
anything that reads the blocks after a layer sees them.

**KV connectors.** When one runs (``meta.connector``), ``decoder_stack``
still runs compiled: the connector's ``wait_for_layer_load(i)`` before
layer i and ``save_kv_layer(i, kv_caches[i], meta)`` once layer i's K/V
are in its cache blocks, the layers then one C call each (the same kernels
in the same order: equal bits to the one call).

**When it takes a step** (else None): the compiled kernels are loaded and
the active kernel table (fdx.core.kernels) passed ``cpp.decoder_layer`` and
a build of each weight part's kind; the attention metadata carries the
compiled attention's group (the ``cpu`` attention backend's, impl "cpp")
over every row in batch order; fewer rows than the composed path
multiplies any GGML-block part of the layers by dequantize + BLAS from
(fdx.ops.cpp.quant_blas_min_rows: on AVX-512 VNNI never but q5_0 from 512,
so a long prefill runs compiled too, its activations in the kernel's own
buffers, the MLP in the composed layer's row chunks, the buffers handed back
after the call when large: csrc/decoder_layer.h), and
than ``f32_blas_min_rows`` of the float32 build when a weight is float32
(any count under ``backend.batch_invariant``); float32 activations; for the stack, one shape
and one rotary table for all layers. An int8 KV cache (cache.kv_cache_dtype int8) is served too:
the layers write K/V quantized and attend over the int8 rows (csrc/kv8_kernels.h,
by the kernels the composed path calls for such a cache: the same bits).
``FDX_FUSED_LAYERS=0`` turns it off
(every layer composed: the A/B switch of docs/benchmarks.md).

It is not part of ``AttentionBackend``: attention backends own attention
(``write_kv``, ``forward``, ``rope_write_kv``); this port owns whole layers,
and binds the C code one way (fdx.ops.cpp: ``fdx_decoder_stack`` through
ctypes, its structs laid out from what the library reports).
"""
from __future__ import annotations

import math
import os
from typing import Any

import paddle

from fdx.core import kernels
from fdx.ops import cpp

__all__ = ["FUSED_LAYERS_ENV", "decoder_layer", "decoder_stack", "fused_layers_on"]

FUSED_LAYERS_ENV = "FDX_FUSED_LAYERS"     # 0: every layer composed


def fused_layers_on() -> bool:
    return os.environ.get(FUSED_LAYERS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class _Port:
    """The port's state: the passed build of each kind under the active table, and the
    stack's table of pointers, built once per (layers, caches, kernel table) and kept."""

    def __init__(self):
        self._variants: tuple[object, dict[str, str | None]] = (None, {})
        self._stack: tuple[Any, Any, float] | None = None     # (key, cpp.StackLayers or None, blas_rows)

    def variant(self, kind: str) -> str | None:
        """The build of ``kind``'s product the active table passed ("avx2", ...), or None;
        kind "f32": the float32 product's."""
        table = kernels.active()
        if self._variants[0] is not table:
            self._variants = (table, {})
        found = self._variants[1]
        if kind not in found:
            found[kind] = next((v for v in cpp.QUANT_VARIANTS if kind in cpp.DECODER_LAYER_KINDS + ("f32",)
                                and table.usable(cpp.quant_kernel_name(kind, v))), None)
        return found[kind]

    def f32_rows(self, rows: int) -> bool:
        """Whether a float32 weight's product is the compiled one at ``rows`` rows (from
        f32_blas_min_rows of the passed build: MKL's; every count under batch_invariant:
        MKL's order depends on the rows)."""
        if kernels.active().batch_invariant:
            return True
        return cpp.F32_MIN_ROWS <= rows < cpp.f32_blas_min_rows(self.variant("f32"))

    @staticmethod
    def fits(x, metadata) -> bool:
        group = getattr(metadata, "cpp", None)
        return not (group is None or group.num_tokens != metadata.num_tokens or metadata.out_perm is not None
                    or x.dtype != paddle.float32 or not fused_layers_on()
                    or not kernels.active().usable("cpp.decoder_layer") or not cpp.loaded())

    def parts_variants(self, layer) -> list[list[str | None]]:
        """The passed build of each of the layer's weight parts ("f32" for a float32 one)."""
        tensor = paddle.Tensor
        return [[self.variant("f32" if isinstance(p, tensor) else p.kind) for p in parts] for parts in layer.weights]

    def stack_table(self, layers, kv_caches):
        """(cpp.stack_layers for these layers, or None when they differ in shape, rotary
        table, or in which of biases and q/k norms they have, or a part has no passed build;
        the fewest rows the stack leaves to the composed layers, ``blas_rows``)."""
        tensor = paddle.Tensor

        def shape(f):
            return (f.num_heads, f.num_kv_heads, f.head_dim, f.eps, f.scale,
                    [sum(p.shape[1] if isinstance(p, tensor) else p.shape[0] for p in parts) for parts in f.weights],
                    [b is None for b in f.biases], f.q_norm is None, f.k_norm is None)
        first = layers[0]
        want = shape(first)
        if any(shape(f) != want or f.rope is not first.rope for f in layers):
            return None, 0
        variants = [self.parts_variants(f) for f in layers]
        if any(None in parts for vs in variants for parts in vs):
            return None, 0
        return cpp.stack_layers(layers, variants, kv_caches), min(self.blas_rows(f, vs)
                                                                   for f, vs in zip(layers, variants))

    def blas_rows(self, layer, variants) -> float:
        """The fewest rows at which a GGML-block part of ``layer`` is multiplied by dequantize +
        BLAS on the composed path (fdx.ops.cpp.quant_blas_min_rows; never under batch_invariant),
        or infinity: from there the layer is composed, so that it keeps that path's product."""
        if kernels.active().batch_invariant:
            return math.inf
        tensor = paddle.Tensor
        least = [cpp.quant_blas_min_rows(p.kind, v) for parts, vs in zip(layer.weights, variants)
                 for p, v in zip(parts, vs) if not isinstance(p, tensor)]
        return min((r for r in least if r is not None), default=math.inf)

    def decoder_stack(self, x, layers, kv_caches, meta):
        metadata = meta.metadata
        if not layers or any(f is None for f in layers) or not self.fits(x, metadata):
            return None
        key = (kernels.active(), [id(f) for f in layers])
        cached = self._stack
        if cached is None or cached[0] != key or (cached[1] is not None and not cached[1].valid_for(kv_caches)):
            cached = self._stack = (key, *self.stack_table(layers, kv_caches))
        _, table, blas_rows = cached
        if table is None or metadata.num_tokens >= blas_rows or (
                table.has_float and not self.f32_rows(metadata.num_tokens)):
            return None
        between = None
        connector = meta.connector
        if connector is not None:
            def between(i: int, when: str) -> None:
                if when == "before":
                    connector.wait_for_layer_load(i)
                else:
                    connector.save_kv_layer(i, kv_caches[i], meta)
        group = metadata.cpp
        args = (x, table, metadata.positions, metadata.slot_mapping, group.seq_info, group.block_tables,
                metadata.block_size, kernels.active().batch_invariant)
        return cpp.decoder_stack(*args) if between is None else cpp.decoder_stack(*args, between=between)

    def decoder_layer(self, x, residual, layer, kv_cache, meta):
        metadata = meta.metadata
        if layer is None or not self.fits(x, metadata):
            return None
        if layer.has_float and not self.f32_rows(metadata.num_tokens):
            return None
        variants = self.parts_variants(layer)
        if any(None in v for v in variants) or metadata.num_tokens >= self.blas_rows(layer, variants):
            return None
        rope, group = layer.rope, metadata.cpp
        return cpp.decoder_layer(x, residual, layer.input_norm, layer.post_norm, layer.weights, variants,
                                 metadata.positions, metadata.slot_mapping, kv_cache[0], kv_cache[1], rope.cos_cache,
                                 rope.sin_cache, group.seq_info, group.block_tables, layer.num_heads,
                                 layer.num_kv_heads, getattr(rope, "rotary_dim", layer.head_dim),
                                 metadata.block_size, rope.is_neox_style, layer.eps, layer.scale,
                                 layer.biases, layer.q_norm, layer.k_norm, kernels.active().batch_invariant)


_PORT = _Port()


def decoder_stack(x, layers: list, kv_caches: list, meta) -> tuple[Any, Any] | None:
    """Every layer of ``layers`` (FusedLayer each) in compiled calls over the embedding x, or None
    (module docstring); with ``meta.connector``, its per-layer hooks around each layer."""
    return _PORT.decoder_stack(x, layers, kv_caches, meta)


def decoder_layer(x, residual, layer, kv_cache, meta) -> tuple[Any, Any] | None:
    """One layer (a FusedLayer) in a compiled call, or None (module docstring)."""
    return _PORT.decoder_layer(x, residual, layer, kv_cache, meta)
