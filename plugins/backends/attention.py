"""Built-in attention backends (contract: ``AttentionBackend``), over ops/.

- ``paddle``: the device-agnostic reference in eager Paddle
  (``fdx.ops.attention`` with impl "paddle"); what the GPU backends use
  until they bring kernels of their own.
- ``cpu``: the compiled CPU kernel over block tables (ops/csrc/), with the
  Paddle reference as its fallback when it cannot be built (logged once) or
  when ``FDX_DISABLE_CPP_OPS=1``. Never chosen by a GPU backend.
"""
from __future__ import annotations


from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import AttentionBackend, KVCacheSpec
from fdx.ops import attention as ops_attention



class PaddleAttention(AttentionBackend):
    name = "paddle"
    impl = "paddle"

    def build_metadata(self, query_lens, context_lens, block_tables, spec: KVCacheSpec, num_heads: int):
        return ops_attention.build_attention_metadata(
            query_lens, context_lens, block_tables, spec.block_size, spec.num_kv_heads, spec.num_slots,
            impl=self.impl, num_heads=num_heads)

    def write_kv(self, k_cache, v_cache, k, v, metadata) -> None:
        ops_attention.write_kv(k_cache, v_cache, k, v, metadata)

    def forward(self, q, k_cache, v_cache, metadata, scale: float):
        return ops_attention.paged_attention(q, k_cache, v_cache, metadata, scale)


class CpuAttention(PaddleAttention):
    name = "cpu"

    def __init__(self, settings=None):
        super().__init__(settings)
        from fdx.ops import cpp
        self.status = cpp.prepare()          # build or load the kernel now (logged by fdx.ops.cpp)
        self.impl = "cpp" if cpp.available() else "paddle"


@hookimpl
def fdx_register_attention_backends(register):
    register("paddle", PaddleAttention)
    register("cpu", CpuAttention)
