// Paddle custom op bindings of fdx's compiled CPU kernels and their portable builds, one
// translation unit (paddle/extension.h is compiled once: it dominates the build time); the
// x86 builds are translation units of their own (isa_avx2.cc, isa_avx512.cc), linked with it.
//
// fdx_paged_attention(q [N, H, D], k_cache, v_cache [KVH * num_slots, D],
//   seq_info int32 [S, 4], block_tables int32 [S, W]) -> [num_out_tokens, H, D]
//   (paged_attention_kernel.h); `route` 0: the default mode, 1: the batch-invariant kernel,
//   2 / 3 (tests only): the default mode's kernels of the AVX2 / portable build at every step.
// fdx_silu_and_mul(x [N, 2I]) -> [N, I] (fused_kernels.h).
// fdx_rms_norm(x [N, H], weight [H]) -> [N, H]; fdx_add_rms_norm(x, residual [N, H],
//   weight) -> (rms_norm(x + residual), x + residual) (fused_kernels.h).
// fdx_rope_write_kv(qkv [N, (H + 2 KVH) D], positions, slots int64 [N],
//   k_cache, v_cache, cos, sin [P, D], q_norm, k_norm [D] or None) -> q [N, H, D];
//   writes k and v into the caches in place (fused_kernels.h).
// fdx_quant_matmul(x [M, cols], data uint8/int8 [rows, row_bytes], scales or None)
//   -> x @ w.T [M, rows], and fdx_quant_dequantize(data, scales) -> w [rows, cols]
//   float32, for quantized weights of `kind` by the instruction-set `variant`
//   (quant_kernels.h).
// fdx_f32_matmul(x [M, K], w float32 [K, N]) -> x @ w [M, N] by the instruction-set
//   `variant` (f32_kernels.h).
// fdx_decoder_stack (a plain C function, called through ctypes: the model-level kernel
//   port, ops/cpp.py decoder_stack and decoder_layer): decoder layers of a step in one call,
//   a whole Llama-family layer each by the kernels above (decoder_layer.h).
// fdx_read_bandwidth (plain C, ctypes: ops/cpp.py read_bandwidth): the threads' memory read
//   rate, which batch-1 decode follows.
// All inputs are contiguous float32 / int32 / int64 CPU tensors.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "decoder_layer.h"
#include "f32_kernels.h"
#include "fused_kernels.h"
#include "kv8_kernels.h"
#include "paddle/extension.h"
#include "paged_attention_kernel.h"
#include "quant_kernels.h"

namespace {

void CheckFloat2d(const paddle::Tensor& x, const char* name) {
  PD_CHECK(x.is_cpu(), name, " must be a CPU tensor");
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, name, " must be float32");
}

}  // namespace

std::vector<paddle::Tensor> PagedAttentionForward(const paddle::Tensor& q,
                                                  const paddle::Tensor& k_cache,
                                                  const paddle::Tensor& v_cache,
                                                  const paddle::Tensor& seq_info,
                                                  const paddle::Tensor& block_tables,
                                                  float scale,
                                                  int64_t num_kv_heads,
                                                  int64_t block_size,
                                                  int64_t num_out_tokens,
                                                  int64_t route) {
  CheckFloat2d(q, "q");
  CheckFloat2d(k_cache, "k_cache");
  CheckFloat2d(v_cache, "v_cache");
  PD_CHECK(q.shape().size() == 3, "q must be [N, H, D]");
  PD_CHECK(k_cache.shape().size() == 2 && k_cache.shape() == v_cache.shape(),
           "k_cache and v_cache must both be [KVH * num_slots, D]");
  PD_CHECK(seq_info.dtype() == paddle::DataType::INT32 && block_tables.dtype() == paddle::DataType::INT32,
           "seq_info and block_tables must be int32");
  PD_CHECK(seq_info.shape().size() == 2 && seq_info.shape()[1] == 4, "seq_info must be [S, 4]");
  PD_CHECK(block_tables.shape().size() == 2 && block_tables.shape()[0] == seq_info.shape()[0],
           "block_tables must be [S, W]");
  const int64_t H = q.shape()[1], D = q.shape()[2];
  PD_CHECK(num_kv_heads > 0 && H % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  PD_CHECK(block_size > 0, "block_size must be positive");
  PD_CHECK(k_cache.shape()[1] == D, "cache head_dim differs from q's");
  PD_CHECK(k_cache.shape()[0] % num_kv_heads == 0, "cache rows must be a multiple of num_kv_heads");
  PD_CHECK(route >= 0 && route <= 3, "route must be 0 to 3");

  auto out = paddle::empty({num_out_tokens, H, D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const fdx::Args a{q.data<float>(),      k_cache.data<float>(),       v_cache.data<float>(),
                    out.data<float>(),    seq_info.data<int32_t>(),    block_tables.data<int32_t>(),
                    block_tables.shape()[1],  // table_width
                    H,                        // num_heads
                    H / num_kv_heads,         // group
                    D,                        // head_dim
                    block_size,
                    k_cache.shape()[0] / num_kv_heads,  // num_slots
                    scale,
                    route == 1,
                    route >= 2 ? static_cast<fdx::ForceDefault>(route - 1) : fdx::ForceDefault::kNo};
  fdx::PagedAttention(a, seq_info.shape()[0], num_kv_heads);
  return {out};
}

std::vector<std::vector<int64_t>> PagedAttentionInferShape(const std::vector<int64_t>& q_shape,
                                                           const std::vector<int64_t>&,
                                                           const std::vector<int64_t>&,
                                                           const std::vector<int64_t>&,
                                                           const std::vector<int64_t>&,
                                                           float,
                                                           int64_t,
                                                           int64_t,
                                                           int64_t num_out_tokens,
                                                           int64_t) {
  return {{num_out_tokens, q_shape[1], q_shape[2]}};
}

std::vector<paddle::DataType> PagedAttentionInferDtype(const paddle::DataType& q_dtype,
                                                       const paddle::DataType&,
                                                       const paddle::DataType&,
                                                       const paddle::DataType&,
                                                       const paddle::DataType&) {
  return {q_dtype};
}

PD_BUILD_OP(fdx_paged_attention)
    .Inputs({"Q", "KCache", "VCache", "SeqInfo", "BlockTables"})
    .Outputs({"Out"})
    .Attrs({"scale: float", "num_kv_heads: int64_t", "block_size: int64_t", "num_out_tokens: int64_t",
            "route: int64_t"})
    .SetKernelFn(PD_KERNEL(PagedAttentionForward))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedAttentionInferDtype));

// --- SiLU and mul ---------------------------------------------------------------

std::vector<paddle::Tensor> SiluAndMulForward(const paddle::Tensor& x) {
  CheckFloat2d(x, "x");
  PD_CHECK(x.shape().size() == 2 && x.shape()[1] % 2 == 0, "x must be [N, 2I]");
  const int64_t N = x.shape()[0], I = x.shape()[1] / 2;
  auto out = paddle::empty({N, I}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  fdx::SiluAndMul(x.data<float>(), out.data<float>(), N, I);
  return {out};
}

std::vector<std::vector<int64_t>> SiluAndMulInferShape(const std::vector<int64_t>& x_shape) {
  return {{x_shape[0], x_shape[1] / 2}};
}

std::vector<paddle::DataType> SiluAndMulInferDtype(const paddle::DataType& x_dtype) { return {x_dtype}; }

PD_BUILD_OP(fdx_silu_and_mul)
    .Inputs({"X"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(SiluAndMulForward))
    .SetInferShapeFn(PD_INFER_SHAPE(SiluAndMulInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SiluAndMulInferDtype));

// --- RMS norm, with the residual add -----------------------------------------------

namespace {

void CheckNormArgs(const paddle::Tensor& x, const paddle::Tensor& weight) {
  CheckFloat2d(x, "x");
  CheckFloat2d(weight, "weight");
  PD_CHECK(x.shape().size() == 2 && weight.numel() == x.shape()[1], "x must be [N, H] and weight [H]");
}

}  // namespace

std::vector<paddle::Tensor> RmsNormForward(const paddle::Tensor& x, const paddle::Tensor& weight, float eps) {
  CheckNormArgs(x, weight);
  const int64_t N = x.shape()[0], H = x.shape()[1];
  auto out = paddle::empty({N, H}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  fdx::RmsNorm(x.data<float>(), nullptr, weight.data<float>(), eps, N, H, out.data<float>(), nullptr);
  return {out};
}

std::vector<paddle::Tensor> AddRmsNormForward(const paddle::Tensor& x, const paddle::Tensor& residual,
                                              const paddle::Tensor& weight, float eps) {
  CheckNormArgs(x, weight);
  PD_CHECK(residual.shape() == x.shape(), "residual must have x's shape");
  CheckFloat2d(residual, "residual");
  const int64_t N = x.shape()[0], H = x.shape()[1];
  auto out = paddle::empty({N, H}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto summed = paddle::empty({N, H}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  fdx::RmsNorm(x.data<float>(), residual.data<float>(), weight.data<float>(), eps, N, H, out.data<float>(),
               summed.data<float>());
  return {out, summed};
}

std::vector<std::vector<int64_t>> RmsNormInferShape(const std::vector<int64_t>& x_shape,
                                                    const std::vector<int64_t>&, float) {
  return {x_shape};
}

std::vector<std::vector<int64_t>> AddRmsNormInferShape(const std::vector<int64_t>& x_shape,
                                                       const std::vector<int64_t>&,
                                                       const std::vector<int64_t>&, float) {
  return {x_shape, x_shape};
}

std::vector<paddle::DataType> RmsNormInferDtype(const paddle::DataType& x_dtype, const paddle::DataType&) {
  return {x_dtype};
}

std::vector<paddle::DataType> AddRmsNormInferDtype(const paddle::DataType& x_dtype, const paddle::DataType&,
                                                   const paddle::DataType&) {
  return {x_dtype, x_dtype};
}

PD_BUILD_OP(fdx_rms_norm)
    .Inputs({"X", "Weight"})
    .Outputs({"Out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsNormForward))
    .SetInferShapeFn(PD_INFER_SHAPE(RmsNormInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RmsNormInferDtype));

PD_BUILD_OP(fdx_add_rms_norm)
    .Inputs({"X", "Residual", "Weight"})
    .Outputs({"Out", "Summed"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(AddRmsNormForward))
    .SetInferShapeFn(PD_INFER_SHAPE(AddRmsNormInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AddRmsNormInferDtype));

// --- q/k/v split, q/k RMS norm, rotary, KV-cache write ---------------------------

namespace {

const float* NormWeight(const paddle::optional<paddle::Tensor>& w, int64_t D, const char* name) {
  if (!w) return nullptr;
  CheckFloat2d(*w, name);
  PD_CHECK(w->numel() == D, name, " must have head_dim elements");
  return w->data<float>();
}

}  // namespace

std::vector<paddle::Tensor> RopeWriteKvForward(const paddle::Tensor& qkv,
                                               const paddle::Tensor& positions,
                                               const paddle::Tensor& slots,
                                               const paddle::Tensor& k_cache,
                                               const paddle::Tensor& v_cache,
                                               const paddle::Tensor& cos,
                                               const paddle::Tensor& sin,
                                               const paddle::optional<paddle::Tensor>& q_norm,
                                               const paddle::optional<paddle::Tensor>& k_norm,
                                               int64_t num_heads,
                                               int64_t num_kv_heads,
                                               int64_t rotary_dim,
                                               bool neox,
                                               float eps) {
  for (auto [t, name] : {std::pair{&qkv, "qkv"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&cos, "cos"},
                         {&sin, "sin"}})
    CheckFloat2d(*t, name);
  PD_CHECK(positions.dtype() == paddle::DataType::INT64 && slots.dtype() == paddle::DataType::INT64,
           "positions and slots must be int64");
  PD_CHECK(num_heads > 0 && num_kv_heads > 0, "num_heads and num_kv_heads must be positive");
  PD_CHECK(k_cache.shape().size() == 2 && k_cache.shape() == v_cache.shape(),
           "k_cache and v_cache must both be [KVH * num_slots, D]");
  const int64_t D = k_cache.shape()[1];
  PD_CHECK(D <= 1024, "head_dim above 1024 is not supported");
  PD_CHECK(qkv.shape().size() == 2 && qkv.shape()[1] == (num_heads + 2 * num_kv_heads) * D,
           "qkv must be [N, (num_heads + 2 * num_kv_heads) * head_dim]");
  const int64_t N = qkv.shape()[0];
  PD_CHECK(positions.numel() == N && slots.numel() == N, "positions and slots must have N elements");
  PD_CHECK(cos.shape().size() == 2 && cos.shape() == sin.shape() && cos.shape()[1] == D,
           "cos and sin must both be [max_position, head_dim]");
  PD_CHECK(rotary_dim > 0 && rotary_dim <= D && rotary_dim % 2 == 0, "rotary_dim must be even, in (0, head_dim]");
  PD_CHECK(k_cache.shape()[0] % num_kv_heads == 0, "cache rows must be a multiple of num_kv_heads");
  const int64_t num_slots = k_cache.shape()[0] / num_kv_heads, max_pos = cos.shape()[0];
  const int64_t* pos = positions.data<int64_t>();
  const int64_t* slot = slots.data<int64_t>();
  for (int64_t t = 0; t < N; ++t) {  // checked here: no error can leave the parallel region
    PD_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary table [0, ", max_pos, ")");
    PD_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " outside the cache [0, ", num_slots, ")");
  }

  auto q = paddle::empty({N, num_heads, D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const fdx::RopeArgs a{qkv.data<float>(),
                        pos,
                        slot,
                        cos.data<float>(),
                        sin.data<float>(),
                        NormWeight(q_norm, D, "q_norm"),
                        NormWeight(k_norm, D, "k_norm"),
                        q.data<float>(),
                        const_cast<float*>(k_cache.data<float>()),  // written in place, as scatter_ does
                        const_cast<float*>(v_cache.data<float>()),
                        num_heads,
                        num_kv_heads,
                        D,
                        rotary_dim,
                        num_slots,
                        neox,
                        eps};
  fdx::RopeWriteKv(a, N);
  return {q};
}

std::vector<std::vector<int64_t>> RopeWriteKvInferShape(const std::vector<int64_t>& qkv_shape,
                                                        const std::vector<int64_t>&,
                                                        const std::vector<int64_t>&,
                                                        const std::vector<int64_t>& k_cache_shape,
                                                        const std::vector<int64_t>&,
                                                        const std::vector<int64_t>&,
                                                        const std::vector<int64_t>&,
                                                        const paddle::optional<std::vector<int64_t>>&,
                                                        const paddle::optional<std::vector<int64_t>>&,
                                                        int64_t num_heads,
                                                        int64_t,
                                                        int64_t,
                                                        bool,
                                                        float) {
  return {{qkv_shape[0], num_heads, k_cache_shape[1]}};
}

std::vector<paddle::DataType> RopeWriteKvInferDtype(const paddle::DataType& qkv_dtype,
                                                    const paddle::DataType&,
                                                    const paddle::DataType&,
                                                    const paddle::DataType&,
                                                    const paddle::DataType&,
                                                    const paddle::DataType&,
                                                    const paddle::DataType&,
                                                    const paddle::optional<paddle::DataType>&,
                                                    const paddle::optional<paddle::DataType>&) {
  return {qkv_dtype};
}

PD_BUILD_OP(fdx_rope_write_kv)
    .Inputs({"QKV", "Positions", "Slots", "KCache", "VCache", "Cos", "Sin", paddle::Optional("QNorm"),
             paddle::Optional("KNorm")})
    .Outputs({"Q"})
    .Attrs({"num_heads: int64_t", "num_kv_heads: int64_t", "rotary_dim: int64_t", "neox: bool", "eps: float"})
    .SetKernelFn(PD_KERNEL(RopeWriteKvForward))
    .SetInferShapeFn(PD_INFER_SHAPE(RopeWriteKvInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RopeWriteKvInferDtype));

// --- the 8-bit KV cache (kv8_kernels.h, bindings in kv8_ops.inc) -------------------

#include "kv8_ops.inc"

// --- products with quantized weights (quant_kernels.h) -----------------------------

namespace {

// code: the Kind, plus kCodeInterleaved / kCodeInvariant (quant_kernels.h).
fdx::quant::Weights QuantWeights(const paddle::Tensor& data, const paddle::optional<paddle::Tensor>& scales,
                                 int64_t code, int64_t rows, int64_t cols, int64_t group) {
  using namespace fdx::quant;
  const int64_t kind = CodeKind(code);
  PD_CHECK(code >= 0 && kind < kNumKinds, "unknown quantized kind ", code);
  PD_CHECK(data.is_cpu() && (data.dtype() == paddle::DataType::UINT8 || data.dtype() == paddle::DataType::INT8),
           "data must be a uint8 or int8 CPU tensor");
  PD_CHECK(rows > 0 && cols > 0 && cols % kBlockElems[kind] == 0, "cols (", cols,
           ") must be a positive multiple of the block (", kBlockElems[kind], ")");
  const int64_t row_bytes = cols / kBlockElems[kind] * kBlockBytes[kind];
  PD_CHECK(data.shape().size() == 2 && data.shape()[0] == rows && data.shape()[1] == row_bytes, "data must be [",
           rows, ", ", row_bytes, "]");
  const float* s = nullptr;
  if (kind == kWint8 || kind == kWint4) {
    PD_CHECK(scales, "wint kinds need their scales");
    CheckFloat2d(*scales, "scales");
    const int64_t per_row = kind == kWint8 ? 1 : cols / std::max<int64_t>(group, 1);
    PD_CHECK(kind == kWint8 || (group > 0 && group % 32 == 0 && cols % group == 0),
             "wint4 group size must be a multiple of 32 dividing cols");
    PD_CHECK(scales->numel() == rows * per_row, "scales must have ", rows * per_row, " elements");
    s = scales->data<float>();
  }
  PD_CHECK(!(code & kCodeInterleaved) || rows % kInterleave == 0, "interleaved rows must be a multiple of ",
           kInterleave);
  return MakeWeights(static_cast<const uint8_t*>(data.data()), s, rows, cols, group, code);
}

}  // namespace

std::vector<paddle::Tensor> QuantMatmulForward(const paddle::Tensor& x, const paddle::Tensor& data,
                                               const paddle::optional<paddle::Tensor>& scales, int64_t kind,
                                               int64_t variant, int64_t rows, int64_t cols, int64_t group) {
  CheckFloat2d(x, "x");
  PD_CHECK(x.shape().size() == 2 && x.shape()[1] == cols, "x must be [M, ", cols, "]");
  const auto w = QuantWeights(data, scales, kind, rows, cols, group);
  const int64_t M = x.shape()[0];
  auto out = paddle::empty({M, rows}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  fdx::quant::Matmul(static_cast<int>(variant), w, x.data<float>(), M, out.data<float>());
  return {out};
}

std::vector<std::vector<int64_t>> QuantMatmulInferShape(const std::vector<int64_t>& x_shape,
                                                        const std::vector<int64_t>&,
                                                        const paddle::optional<std::vector<int64_t>>&, int64_t,
                                                        int64_t, int64_t rows, int64_t, int64_t) {
  return {{x_shape[0], rows}};
}

std::vector<paddle::DataType> QuantMatmulInferDtype(const paddle::DataType& x_dtype, const paddle::DataType&,
                                                    const paddle::optional<paddle::DataType>&) {
  return {x_dtype};
}

PD_BUILD_OP(fdx_quant_matmul)
    .Inputs({"X", "Data", paddle::Optional("Scales")})
    .Outputs({"Out"})
    .Attrs({"kind: int64_t", "variant: int64_t", "rows: int64_t", "cols: int64_t", "group: int64_t"})
    .SetKernelFn(PD_KERNEL(QuantMatmulForward))
    .SetInferShapeFn(PD_INFER_SHAPE(QuantMatmulInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(QuantMatmulInferDtype));

std::vector<paddle::Tensor> QuantDequantizeForward(const paddle::Tensor& data,
                                                   const paddle::optional<paddle::Tensor>& scales, int64_t kind,
                                                   int64_t variant, int64_t rows, int64_t cols, int64_t group) {
  const auto w = QuantWeights(data, scales, kind, rows, cols, group);
  auto out = paddle::empty({rows, cols}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  fdx::quant::Dequantize(static_cast<int>(variant), w, out.data<float>());
  return {out};
}

std::vector<std::vector<int64_t>> QuantDequantizeInferShape(const std::vector<int64_t>&,
                                                            const paddle::optional<std::vector<int64_t>>&, int64_t,
                                                            int64_t, int64_t rows, int64_t cols, int64_t) {
  return {{rows, cols}};
}

std::vector<paddle::DataType> QuantDequantizeInferDtype(const paddle::DataType&,
                                                        const paddle::optional<paddle::DataType>&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fdx_quant_dequantize)
    .Inputs({"Data", paddle::Optional("Scales")})
    .Outputs({"Out"})
    .Attrs({"kind: int64_t", "variant: int64_t", "rows: int64_t", "cols: int64_t", "group: int64_t"})
    .SetKernelFn(PD_KERNEL(QuantDequantizeForward))
    .SetInferShapeFn(PD_INFER_SHAPE(QuantDequantizeInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(QuantDequantizeInferDtype));

// --- the float32 small-M product (f32_kernels.h) -----------------------------------------

std::vector<paddle::Tensor> F32MatmulForward(const paddle::Tensor& x, const paddle::Tensor& w, int64_t variant) {
  CheckFloat2d(x, "x");
  CheckFloat2d(w, "w");
  PD_CHECK(w.shape().size() == 2 && x.shape().size() == 2 && x.shape()[1] == w.shape()[0],
           "x must be [M, K] and w [K, N]");
  PD_CHECK(variant >= 0 && variant <= 2, "unknown variant ", variant);
  const int64_t M = x.shape()[0], K = w.shape()[0], N = w.shape()[1];
  auto out = paddle::empty({M, N}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  fdx::f32::Matmul(static_cast<int>(variant), w.data<float>(), K, N, x.data<float>(), M, out.data<float>(), N);
  return {out};
}

std::vector<std::vector<int64_t>> F32MatmulInferShape(const std::vector<int64_t>& x_shape,
                                                      const std::vector<int64_t>& w_shape, int64_t) {
  return {{x_shape[0], w_shape[1]}};
}

std::vector<paddle::DataType> F32MatmulInferDtype(const paddle::DataType& x_dtype, const paddle::DataType&) {
  return {x_dtype};
}

PD_BUILD_OP(fdx_f32_matmul)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .Attrs({"variant: int64_t"})
    .SetKernelFn(PD_KERNEL(F32MatmulForward))
    .SetInferShapeFn(PD_INFER_SHAPE(F32MatmulInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(F32MatmulInferDtype));

// --- decoder layers in one plain C call (ops/cpp.py decoder_stack / decoder_layer, through ctypes) ---
// The model-level kernel port's one binding route (fdx.ops.layer_port): a step's layers, or
// one of them, without Paddle's op dispatch (about 40 us of Python and custom-op overhead a
// layer call goes; a batch-1 step of SmolLM2 is 30 of them). Every layer runs DecoderLayer;
// the first reads x (and adds it into `residual` in place when residual_in is set, else
// residual = x), the others read `out` and write it in place (DecoderLayer reads its x
// only before its first product, and adds into the residual elementwise), so a step needs
// no buffers beyond out and residual. ops/cpp.py builds its ctypes structs from the layout
// fdx_stack_layout reports (no mirror written by hand).

extern "C" {

struct FdxStackLayer {  // what stays fixed from step to step
  const float* input_norm;
  const float* post_norm;
  // qkv, o, gate_up, down: each 1 to kMaxParts parts stacked along rows, each GGML block bytes
  // [rows, row_bytes] or float32 [cols, rows] (kind -1)
  const void* weights[4][fdx::kMaxParts];
  const float* biases[4];  // [rows] of each weight, or null
  const float* q_norm;     // [head_dim] or null (Qwen3's per-head norms)
  const float* k_norm;
  float* k_cache;  // [KVH * num_slots, D], written in place
  float* v_cache;
  int64_t num_parts[4];
  int64_t info[4][fdx::kMaxParts][4];  // (kind, variant, rows, cols) of each part
};

struct FdxStackStep {
  const float* x;   // [N, hidden]: the embedding
  float* out;       // [N, hidden]: the last layer's MLP output
  float* residual;  // [N, hidden]: the residual stream after the last layer
  const int64_t* positions;  // [N]
  const int64_t* slots;      // [N]
  const int32_t* seq_info;   // [S, 4], the N rows in order
  const int32_t* tables;     // [S, table_width]
  const float* cos;          // [max_pos, D]
  const float* sin;
  const FdxStackLayer* layers;
  int64_t num_layers, N, hidden, num_seqs, table_width, num_heads, num_kv_heads, head_dim, rotary_dim,
      block_size, num_slots, max_pos, neox;
  float eps, scale;
  int64_t invariant;    // the batch-invariant attention (backend.batch_invariant)
  int64_t residual_in;  // 1: `residual` holds the residual stream before the first layer (x is then
                        // the previous layer's output, which may be `out` itself); 0: x is the embedding
  int64_t kv8;          // 1: the layers' caches are int8 [KVH * num_slots, D + 4] (cache.kv_cache_dtype int8)
};

// The layout of the two structs above, from which ops/cpp.py builds its ctypes structs when
// it loads the library: one line a struct ("Name size") and one a field ("Name.field offset
// size kind", kind p: pointers, i: int64, f: float; an array's size is its whole size). A
// field added, moved or resized here reaches Python with the build, never read as garbage.
extern "C++" {
template <class F>
constexpr char FieldKind() {
  using E = std::remove_all_extents_t<F>;
  static_assert(std::is_pointer_v<E> || std::is_same_v<E, int64_t> || std::is_same_v<E, float>,
                "fields are pointers, int64_t or float (ops/cpp.py's kinds)");
  return std::is_pointer_v<E> ? 'p' : std::is_same_v<E, float> ? 'f' : 'i';
}
}  // extern "C++"

const char* fdx_stack_layout() {
  static const std::string text = [] {
    std::string out;
    auto line = [&out](const char* name, size_t offset, size_t size, char kind) {
      out += name;
      out += " " + std::to_string(offset);
      if (kind) out += " " + std::to_string(size) + " " + kind;
      out += "\n";
    };
#define FDX_FIELD(T, f) line(#T "." #f, offsetof(T, f), sizeof(T::f), FieldKind<decltype(T::f)>())
    line("FdxStackLayer", sizeof(FdxStackLayer), 0, 0);
    FDX_FIELD(FdxStackLayer, input_norm); FDX_FIELD(FdxStackLayer, post_norm); FDX_FIELD(FdxStackLayer, weights);
    FDX_FIELD(FdxStackLayer, biases); FDX_FIELD(FdxStackLayer, q_norm); FDX_FIELD(FdxStackLayer, k_norm);
    FDX_FIELD(FdxStackLayer, k_cache); FDX_FIELD(FdxStackLayer, v_cache); FDX_FIELD(FdxStackLayer, num_parts);
    FDX_FIELD(FdxStackLayer, info);
    line("FdxStackStep", sizeof(FdxStackStep), 0, 0);
    FDX_FIELD(FdxStackStep, x); FDX_FIELD(FdxStackStep, out); FDX_FIELD(FdxStackStep, residual);
    FDX_FIELD(FdxStackStep, positions); FDX_FIELD(FdxStackStep, slots); FDX_FIELD(FdxStackStep, seq_info);
    FDX_FIELD(FdxStackStep, tables); FDX_FIELD(FdxStackStep, cos); FDX_FIELD(FdxStackStep, sin);
    FDX_FIELD(FdxStackStep, layers); FDX_FIELD(FdxStackStep, num_layers); FDX_FIELD(FdxStackStep, N);
    FDX_FIELD(FdxStackStep, hidden); FDX_FIELD(FdxStackStep, num_seqs); FDX_FIELD(FdxStackStep, table_width);
    FDX_FIELD(FdxStackStep, num_heads); FDX_FIELD(FdxStackStep, num_kv_heads); FDX_FIELD(FdxStackStep, head_dim);
    FDX_FIELD(FdxStackStep, rotary_dim); FDX_FIELD(FdxStackStep, block_size); FDX_FIELD(FdxStackStep, num_slots);
    FDX_FIELD(FdxStackStep, max_pos); FDX_FIELD(FdxStackStep, neox); FDX_FIELD(FdxStackStep, eps);
    FDX_FIELD(FdxStackStep, scale); FDX_FIELD(FdxStackStep, invariant); FDX_FIELD(FdxStackStep, residual_in);
    FDX_FIELD(FdxStackStep, kv8);
#undef FDX_FIELD
    return out;
  }();
  return text.c_str();
}

// 0, or -1 with a message in err (nothing was computed then).
int fdx_decoder_stack(const FdxStackStep* s, char* err, int64_t err_len) {
  using namespace fdx::quant;
  auto fail = [&](const std::string& msg) {
    std::snprintf(err, static_cast<size_t>(err_len), "%s", msg.c_str());
    return -1;
  };
  const int64_t N = s->N, hidden = s->hidden, H = s->num_heads, KVH = s->num_kv_heads, D = s->head_dim;
  if (N <= 0 || hidden <= 0 || s->num_layers <= 0 || s->num_seqs <= 0) return fail("empty step");
  if (H <= 0 || KVH <= 0 || H % KVH) return fail("num_heads must be a positive multiple of num_kv_heads");
  if (D <= 0 || D > 1024) return fail("head_dim must be in (0, 1024]");
  if (s->rotary_dim <= 0 || s->rotary_dim > D || s->rotary_dim % 2) return fail("rotary_dim must be even, in (0, head_dim]");
  if (s->block_size <= 0) return fail("block_size must be positive");
  for (int64_t t = 0; t < N; ++t) {  // checked here: no error can leave the parallel regions
    if (s->positions[t] < 0 || s->positions[t] >= s->max_pos)
      return fail("position " + std::to_string(s->positions[t]) + " outside the rotary table");
    if (s->slots[t] < 0 || s->slots[t] >= s->num_slots)
      return fail("slot " + std::to_string(s->slots[t]) + " outside the cache");
  }
  int64_t covered = 0;
  for (int64_t q = 0; q < s->num_seqs; ++q) {
    const int32_t* info = s->seq_info + 4 * q;
    if (info[0] != covered || info[3] != covered || info[1] <= 0) return fail("seq_info must cover the N rows in order");
    covered += info[1];
  }
  if (covered != N) return fail("seq_info does not cover the N rows");
  const int64_t q_size = H * D, kv_size = KVH * D;
  const int64_t intermediate = s->layers[0].info[3][0][3];  // down's columns
  const int64_t want[4][2] = {{q_size + 2 * kv_size, hidden}, {hidden, q_size}, {2 * intermediate, hidden},
                              {hidden, intermediate}};
  for (int64_t l = 0; l < s->num_layers; ++l)
    for (int i = 0; i < 4; ++i) {
      const FdxStackLayer& L = s->layers[l];
      auto what = [&] { return "layer " + std::to_string(l) + ": weight " + std::to_string(i); };  // on failure only
      if (L.num_parts[i] < 1 || L.num_parts[i] > fdx::kMaxParts) return fail(what() + ": 1 to 3 parts");
      int64_t rows = 0;
      for (int j = 0; j < L.num_parts[i]; ++j) {
        const int64_t* wi = L.info[i][j];
        const bool f32 = wi[0] == fdx::kF32Weight;
        const int64_t kind = f32 ? wi[0] : CodeKind(wi[0]);  // quant: flags above the kind (quant_kernels.h)
        if ((!f32 && (wi[0] < 0 || kind >= kWint8)) || wi[1] < kPortable || wi[1] > kAvx512 || !L.weights[i][j])
          return fail(what() + " has no kernel");
        if (wi[2] <= 0 || wi[3] != want[i][1] || (!f32 && wi[3] % kBlockElems[kind]) ||
            (!f32 && (wi[0] & kCodeInterleaved) && wi[2] % kInterleave))
          return fail(what() + " has the wrong shape");
        rows += wi[2];
      }
      if (rows != want[i][0]) return fail(what() + " has the wrong shape");
    }
  fdx::LayerArgs a{};
  a.rope = fdx::RopeArgs{nullptr, s->positions, s->slots, s->cos, s->sin, nullptr, nullptr, nullptr, nullptr,
                         nullptr, H, KVH, D, s->rotary_dim, s->num_slots, s->neox != 0, s->eps};
  a.attn = fdx::Args{nullptr, nullptr, nullptr, nullptr, s->seq_info, s->tables, s->table_width, H, H / KVH, D,
                     s->block_size, s->num_slots, s->scale, s->invariant != 0};
  a.num_seqs = s->num_seqs;
  a.hidden = hidden;
  a.intermediate = intermediate;
  a.eps = s->eps;
  a.out = s->out;
  a.residual_out = s->residual;
  a.kv8 = s->kv8 != 0;
  for (int64_t l = 0; l < s->num_layers; ++l) {
    const FdxStackLayer& L = s->layers[l];
    fdx::LayerWeight* lw[4] = {&a.qkv, &a.o, &a.gate_up, &a.down};
    for (int i = 0; i < 4; ++i) {
      fdx::LayerWeight& w = *lw[i];
      w = fdx::LayerWeight{};
      w.num_parts = static_cast<int>(L.num_parts[i]);
      w.bias = L.biases[i];
      for (int j = 0; j < w.num_parts; ++j) {
        const int64_t* wi = L.info[i][j];
        const int kind = static_cast<int>(wi[0] < 0 ? wi[0] : CodeKind(wi[0])), variant = static_cast<int>(wi[1]);
        fdx::WeightPart& p = w.parts[j];
        if (kind == fdx::kF32Weight) {
          p = fdx::WeightPart{kind, variant, {}, static_cast<const float*>(L.weights[i][j]), wi[2], wi[3]};
        } else {
          p = fdx::WeightPart{kind, variant,
                              MakeWeights(static_cast<const uint8_t*>(L.weights[i][j]), nullptr, wi[2], wi[3], 0,
                                          wi[0]),
                              nullptr, wi[2], wi[3]};
        }
        w.rows += wi[2];
      }
    }
    a.rope.q_norm = L.q_norm;
    a.rope.k_norm = L.k_norm;
    a.x = l == 0 ? s->x : s->out;
    a.residual = l == 0 && !s->residual_in ? nullptr : s->residual;
    a.input_norm = L.input_norm;
    a.post_norm = L.post_norm;
    a.rope.k_cache = L.k_cache;
    a.rope.v_cache = L.v_cache;
    a.attn.k = L.k_cache;
    a.attn.v = L.v_cache;
    fdx::DecoderLayer(a, N);
  }
  fdx::ReleaseLargeScratch();  // a prefill's activations: not kept through the decode steps
  return 0;
}

}  // extern "C"

// --- the memory read rate of the product threads (fdx.ops.cpp.read_bandwidth) --------------
// Batch-1 decode streams every weight once a token, so its speed follows the rate at which
// the cores can read memory together, which on a VM can change while the guest runs (on
// the 2-vCPU Zen 5 of docs/backends.md "Batch-1 decode and memory bandwidth": 2 threads
// read at about 85 or about 52 GB/s, flipping every few seconds to minutes; 1 thread at
// 40-45 either way). Benchmarks record it beside their figures. `buf` [bytes] is summed by
// `threads` OpenMP threads (the pool the products use), each over its part, `rounds`
// times; the best round's GB/s (a round's wall time covers the slowest thread).
// The sum of n words (a multiple of 8); cloned per instruction set where GCC can (a
// baseline build's 16-byte loads read at about 35 GB/s a thread on the Zen 5, 512-bit at 43).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static uint64_t SumWords(const uint64_t* p, int64_t n) {
  uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; i += 8)
    for (int k = 0; k < 8; ++k) a[k] += p[i + k];
  return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

extern "C" double fdx_read_bandwidth(const void* buf, int64_t bytes, int threads, int rounds) {
  const uint64_t* p = static_cast<const uint64_t*>(buf);
  const int64_t n = bytes / 8 / 32 * 32;  // whole groups of 32 words
  double best = 0.0;
  volatile uint64_t sink = 0;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t begin = n / 32 * t / nt * 32, end = n / 32 * (t + 1) / nt * 32;
      total += SumWords(p + begin, end - begin);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sink = sink + total;
    if (secs > 0) best = std::max(best, static_cast<double>(n * 8) / secs / 1e9);
  }
  return best;
}


// --- mixture-of-experts: a layer's routed experts in one call (moe_kernels.h) ---------------
// fdx_moe_experts(x [N, H], ids int64 [N, k], weights float32 [N, k], the stacked gate+up
// and down weights and their scales) -> [N, H]; a stack's code is quant_kernels.h's kind
// code, or -1 for float32 [E, in, out].

#include "moe_kernels.h"

namespace {

fdx::moe::ExpertStack MoeStack(const paddle::Tensor& data, const paddle::optional<paddle::Tensor>& scales,
                               int64_t code, int64_t experts, int64_t rows, int64_t cols, int64_t group,
                               const char* name) {
  using namespace fdx::quant;
  PD_CHECK(data.is_cpu() && data.shape().size() == 3 && data.shape()[0] == experts, name,
           " must be a CPU tensor [", experts, ", ...]");
  fdx::moe::ExpertStack s{data.data(), nullptr, code, rows, cols, group};
  if (code == fdx::moe::kF32Experts) {
    PD_CHECK(data.dtype() == paddle::DataType::FLOAT32 && data.shape()[1] == cols && data.shape()[2] == rows, name,
             " must be float32 [", experts, ", ", cols, ", ", rows, "]");
    return s;
  }
  const int64_t kind = CodeKind(code);
  PD_CHECK(code >= 0 && kind < kNumKinds, name, ": unknown quantized kind ", code);
  PD_CHECK(data.dtype() == paddle::DataType::UINT8 || data.dtype() == paddle::DataType::INT8, name,
           " must be uint8 or int8");
  PD_CHECK(rows > 0 && cols > 0 && cols % kBlockElems[kind] == 0, name, ": cols (", cols,
           ") must be a positive multiple of the block (", kBlockElems[kind], ")");
  PD_CHECK(!(code & kCodeInterleaved) || rows % kInterleave == 0, name, ": interleaved rows must be a multiple of ",
           kInterleave);
  const int64_t row_bytes = cols / kBlockElems[kind] * kBlockBytes[kind];
  PD_CHECK(data.shape()[1] == rows && data.shape()[2] == row_bytes, name, " must be [", experts, ", ", rows, ", ",
           row_bytes, "]");
  if (kind == kWint8 || kind == kWint4) {
    PD_CHECK(kind == kWint8 || (group > 0 && group % 32 == 0 && cols % group == 0), name,
             ": wint4 group size must be a multiple of 32 dividing cols");
    PD_CHECK(scales && scales->is_cpu() && scales->dtype() == paddle::DataType::FLOAT32, name,
             ": wint kinds need float32 scales");
    s.scales = scales->data<float>();
    PD_CHECK(scales->numel() == experts * s.ScalesPerExpert(), name, ": scales must have ",
             experts * s.ScalesPerExpert(), " elements");
  }
  return s;
}

}  // namespace

std::vector<paddle::Tensor> MoeExpertsForward(const paddle::Tensor& x, const paddle::Tensor& ids,
                                              const paddle::Tensor& weights, const paddle::Tensor& gu_data,
                                              const paddle::optional<paddle::Tensor>& gu_scales,
                                              const paddle::Tensor& down_data,
                                              const paddle::optional<paddle::Tensor>& down_scales, int64_t gu_code,
                                              int64_t down_code, int64_t variant, int64_t experts, int64_t inter,
                                              int64_t gu_group, int64_t down_group) {
  CheckFloat2d(x, "x");
  CheckFloat2d(weights, "weights");
  PD_CHECK(x.shape().size() == 2, "x must be [N, H]");
  const int64_t N = x.shape()[0], H = x.shape()[1];
  PD_CHECK(ids.is_cpu() && ids.dtype() == paddle::DataType::INT64 && ids.shape().size() == 2 && ids.shape()[0] == N,
           "ids must be int64 [", N, ", k]");
  const int64_t k = ids.shape()[1];
  PD_CHECK(k >= 1 && weights.shape() == ids.shape(), "weights must be [", N, ", ", k, "] as ids");
  PD_CHECK(variant >= 0 && variant <= 2, "unknown variant ", variant);
  PD_CHECK(experts >= 1 && inter >= 1, "experts and inter must be positive");
  const int64_t* id = ids.data<int64_t>();
  for (int64_t p = 0; p < N * k; ++p) PD_CHECK(id[p] >= 0 && id[p] < experts, "expert id ", id[p], " out of range");
  const auto gu = MoeStack(gu_data, gu_scales, gu_code, experts, 2 * inter, H, gu_group, "gate_up");
  const auto dn = MoeStack(down_data, down_scales, down_code, experts, H, inter, down_group, "down");
  auto out = paddle::empty({N, H}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  if (N > 0)
    fdx::moe::MoeExperts(static_cast<int>(variant), x.data<float>(), N, H, id, weights.data<float>(), k, experts,
                         inter, gu, dn, out.data<float>());
  return {out};
}

std::vector<std::vector<int64_t>> MoeExpertsInferShape(
    const std::vector<int64_t>& x_shape, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const paddle::optional<std::vector<int64_t>>&, const std::vector<int64_t>&,
    const paddle::optional<std::vector<int64_t>>&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t) {
  return {x_shape};
}

std::vector<paddle::DataType> MoeExpertsInferDtype(const paddle::DataType& x_dtype, const paddle::DataType&,
                                                   const paddle::DataType&, const paddle::DataType&,
                                                   const paddle::optional<paddle::DataType>&,
                                                   const paddle::DataType&,
                                                   const paddle::optional<paddle::DataType>&) {
  return {x_dtype};
}

PD_BUILD_OP(fdx_moe_experts)
    .Inputs({"X", "Ids", "Weights", "GateUp", paddle::Optional("GateUpScales"), "Down",
             paddle::Optional("DownScales")})
    .Outputs({"Out"})
    .Attrs({"gu_code: int64_t", "down_code: int64_t", "variant: int64_t", "experts: int64_t", "inter: int64_t",
            "gu_group: int64_t", "down_group: int64_t"})
    .SetKernelFn(PD_KERNEL(MoeExpertsForward))
    .SetInferShapeFn(PD_INFER_SHAPE(MoeExpertsInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(MoeExpertsInferDtype));
// --- end of mixture-of-experts ---------------------------------------------------------------

// --- a fused weight's parts in one product (fused_parts.h, bindings in fused_parts_ops.inc) -
#include "fused_parts_ops.inc"
