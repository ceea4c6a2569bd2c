"""Built-in attention backends (contract: ``AttentionBackend``), over ops/.

- ``paddle``: the device-agnostic reference in eager Paddle
  (``fdx.ops.attention`` with impl "paddle"); what the GPU backends use
  until they bring kernels of their own.
- ``cpu``: the compiled CPU kernels (ops/csrc/): attention over block
  tables, and ``rope_write_kv``, the fused q/k/v split + q/k RMS norm +
  rotary + KV-cache write the model calls before attention, each where the
  cpu backend's probed kernel table (fdx.core.kernels) passed it. (Whole
  layers in one compiled call are the model-level kernel port's,
  fdx.ops.layer_port, which takes a step whose metadata this backend built.) The
  Paddle reference is its fallback when they could not be built or did not
  pass their probe (both logged by the backend), or with
  ``FDX_DISABLE_CPP_OPS=1``. Never chosen by a GPU backend.
"""
from __future__ import annotations

import functools

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
def _float32():
    """paddle.float32, Paddle imported on first use (see _cpp)."""
    import paddle
    return paddle.float32


FUSED_LAYERS_ENV = "FDX_FUSED_LAYERS"     # = fdx.ops.layer_port's: 0, every layer composed (docs/benchmarks.md's A/B)


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


@hookimpl
def fdx_register_attention_backends(register):
    register("paddle", PaddleAttention)
    register("cpu", CpuAttention)
