// One Llama-family decoder layer in one call, free of Paddle (bound in fdx_ops.cc).
//
// DecoderLayer: x [N, hidden] (the previous layer's MLP output, or the
// embedding for the first layer) and the residual stream (nullptr for the first
// layer) -> the MLP output and the new residual, through
//   h = rms_norm(x + residual)                 (RmsNorm, fused_kernels.h)
//   qkv = h @ wqkv.T                           (quant::Matmul, quant_kernels.h)
//   q = rope(q); k, v -> paged caches          (RopeWriteKv)
//   a = paged_attention(q)                     (PagedAttention, paged_attention_kernel.h)
//   o = a @ wo.T
//   h = rms_norm(o + residual)
//   out = silu_and_mul(h @ w_gate_up.T) @ w_down.T
// by calling those kernels in turn: the same functions the separate ops run, so
// the results are theirs; what goes is the Paddle dispatch (about a dozen op
// calls a layer) between them. Every kernel splits its own work over the one
// OpenMP pool. No biases, no tensor-parallel reduction: those layers take the
// composed path (the caller decides).
#pragma once

#include <cstdint>
#include <vector>

#include "fused_kernels.h"
#include "paged_attention_kernel.h"
#include "quant_kernels.h"

namespace fdx {

struct LayerWeight {
  quant::Weights w;
  int variant;  // quant::Variant: the build the kernel table passed for w.kind
};

struct LayerArgs {
  const float* x;         // [N, hidden]
  const float* residual;  // [N, hidden] or nullptr (first layer: the residual is x)
  const float* input_norm;
  const float* post_norm;  // [hidden]
  LayerWeight qkv, o, gate_up, down;
  RopeArgs rope;  // qkv, q_out set here; the rest (positions, slots, tables, caches, sizes) by the caller
  Args attn;      // q, out set here; k, v, seq_info, tables, sizes by the caller
  int64_t num_seqs, hidden, intermediate;
  float eps;
  float* out;           // [N, hidden]: the MLP output
  float* residual_out;  // [N, hidden]
};

struct LayerScratch {
  std::vector<float> h, qkv, q, attn, o, gate_up, act;
};

inline void DecoderLayer(LayerArgs a, int64_t N) {
  thread_local LayerScratch s;  // kept across calls: no allocation per call once grown
  const int64_t H = a.rope.num_heads, KVH = a.rope.num_kv_heads, D = a.rope.head_dim;
  s.h.resize(N * a.hidden);
  s.qkv.resize(N * (H + 2 * KVH) * D);
  s.q.resize(N * H * D);
  s.attn.resize(N * H * D);
  s.o.resize(N * a.hidden);
  s.gate_up.resize(N * 2 * a.intermediate);
  s.act.resize(N * a.intermediate);

  if (a.residual) {
    RmsNorm(a.x, a.residual, a.input_norm, a.eps, N, a.hidden, s.h.data(), a.residual_out);
  } else {
    std::memcpy(a.residual_out, a.x, N * a.hidden * sizeof(float));
    RmsNorm(a.x, nullptr, a.input_norm, a.eps, N, a.hidden, s.h.data(), nullptr);
  }
  quant::Matmul(a.qkv.variant, a.qkv.w, s.h.data(), N, s.qkv.data());
  a.rope.qkv = s.qkv.data();
  a.rope.q_out = s.q.data();
  RopeWriteKv(a.rope, N);
  a.attn.q = s.q.data();
  a.attn.out = s.attn.data();
  PagedAttention(a.attn, a.num_seqs, KVH);
  quant::Matmul(a.o.variant, a.o.w, s.attn.data(), N, s.o.data());
  // residual_out holds the residual after attention's input norm; add o to it in place
  RmsNorm(s.o.data(), a.residual_out, a.post_norm, a.eps, N, a.hidden, s.h.data(), a.residual_out);
  quant::Matmul(a.gate_up.variant, a.gate_up.w, s.h.data(), N, s.gate_up.data());
  SiluAndMul(s.gate_up.data(), s.act.data(), N, a.intermediate);
  quant::Matmul(a.down.variant, a.down.w, s.act.data(), N, a.out);
}

}  // namespace fdx
