// One Llama-family decoder layer in one call, free of Paddle (bound in fdx_ops.cc).
//
// DecoderLayer: x [N, hidden] (the previous layer's MLP output, or the
// embedding for the first layer) and the residual stream (nullptr for the first
// layer) -> the MLP output and the new residual, through
//   h = rms_norm(x + residual)                 (RmsNorm, fused_kernels.h)
//   qkv = h @ wqkv.T (+ bqkv)                  (quant::Matmul or f32::Matmul, each part)
//   q, k = rms_norm per head (Qwen3's q_norm, k_norm, when given)
//   q = rope(q); k, v -> paged caches          (RopeWriteKv)
//   a = paged_attention(q)                     (PagedAttention, paged_attention_kernel.h)
//     (an int8 cache, LayerArgs::kv8: k, v rotated into a float buffer of the step's rows,
//      quantized into their slots, and the int8 attention: kv8_kernels.h, the calls of
//      kv8_ops.inc's fdx_rope_write_kv8 and fdx_kv8_attention)
//   o = a @ wo.T (+ bo)
//   h = rms_norm(o + residual)
//   out = silu_and_mul(h @ w_gate_up.T (+ b)) @ w_down.T (+ b)
// by calling those kernels in turn: the same functions the separate ops run, so
// the results are theirs; what goes is the Paddle dispatch (about a dozen op
// calls a layer) between them. Every kernel splits its own work over the one
// OpenMP pool. Each weight may carry a bias (Qwen2's q/k/v, ERNIE's and Llama's
// optional ones), added after its product as the composed path adds it. No
// tensor-parallel reduction: such layers take the composed path (the caller decides).
//
// Each of the four weights is one to three parts stacked along its output rows
// (a q/k/v or gate/up that a file stores in different kinds: Q4_K_M's Q5_0 q and k,
// one part at load, beside a Q8_0 v), each part GGML blocks (quant_kernels.h) or float32
// [in, out] (f32_kernels.h), each writing its own columns of the product; block parts of
// one build in one PartsMatmul (fused_parts.h: the activations quantized once for all).
#pragma once

#include <cstdint>
#include <vector>

#include "f32_kernels.h"
#include "fused_kernels.h"
#include "fused_parts.h"
#include "kv8_kernels.h"
#include "paged_attention_kernel.h"
#include "quant_kernels.h"

namespace fdx {

constexpr int kF32Weight = -1;  // a part's kind: float32, [cols, rows] row-major
constexpr int kMaxParts = 3;

struct WeightPart {
  int kind;           // quant::Kind, or kF32Weight
  int variant;        // the build the kernel table passed for the kind (quant::Variant = f32::Variant)
  quant::Weights q;   // the GGML kinds
  const float* f32;   // kF32Weight: [cols, rows]
  int64_t rows, cols;
};

struct LayerWeight {
  WeightPart parts[kMaxParts];
  int num_parts;
  int64_t rows;       // the parts' rows summed: the product's width
  const float* bias;  // [rows], or nullptr
};

// out [N, w.rows] = x [N, cols] @ w.T (+ w.bias), each part into its own columns: a float32
// part and a lone or one-row quantized part write in place, a quantized part of
// several rows beside others through `tmp` (quant::Matmul writes whole rows).
inline void Product(const LayerWeight& w, const float* x, int64_t N, float* out, std::vector<float>& tmp) {
  int64_t col = 0;
  if (quant::PartsOneCall(w.parts, w.num_parts)) {  // fused_parts.h: x quantized once for all the parts
    quant::Weights q[kMaxParts];
    for (int i = 0; i < w.num_parts; ++i) q[i] = w.parts[i].q;
    quant::PartsMatmul(w.parts[0].variant, q, w.num_parts, x, N, out, w.rows, tmp);
    col = w.rows;
  }
  for (int i = 0; i < w.num_parts && col < w.rows; ++i) {
    const WeightPart& p = w.parts[i];
    if (p.kind == kF32Weight) {
      f32::Matmul(p.variant, p.f32, p.cols, p.rows, x, N, out + col, w.rows);
    } else if (w.num_parts == 1 || N == 1) {
      quant::Matmul(p.variant, p.q, x, N, out + col);
    } else {
      tmp.resize(N * p.rows);
      quant::Matmul(p.variant, p.q, x, N, tmp.data());
      for (int64_t t = 0; t < N; ++t)
        std::memcpy(out + t * w.rows + col, tmp.data() + t * p.rows, p.rows * sizeof(float));
    }
    col += p.rows;
  }
  if (w.bias)
    for (int64_t t = 0; t < N; ++t) {
      float* row = out + t * w.rows;
#pragma omp simd
      for (int64_t j = 0; j < w.rows; ++j) row[j] += w.bias[j];
    }
}

struct LayerArgs {
  const float* x;         // [N, hidden]
  const float* residual;  // [N, hidden] or nullptr (first layer: the residual is x)
  const float* input_norm;
  const float* post_norm;  // [hidden]
  LayerWeight qkv, o, gate_up, down;
  RopeArgs rope;  // qkv, q_out set here; the rest (positions, slots, tables, caches, q/k norms, sizes) by the caller
  Args attn;      // q, out set here; k, v, seq_info, tables, sizes by the caller
  int64_t num_seqs, hidden, intermediate;
  float eps;
  float* out;           // [N, hidden]: the MLP output
  float* residual_out;  // [N, hidden]
  bool kv8;             // rope.k_cache/v_cache and attn.k/v are int8 [KVH * num_slots, D + 4] (kv8_kernels.h)
};

struct LayerScratch {
  std::vector<float> h, qkv, q, attn, o, gate_up, act, part, kbuf, vbuf;  // kbuf, vbuf: an int8 cache's rows
  std::vector<int64_t> ident;

  size_t Bytes() const {
    size_t n = ident.capacity() * sizeof(int64_t);
    for (const std::vector<float>* v : {&h, &qkv, &q, &attn, &o, &gate_up, &act, &part, &kbuf, &vbuf})
      n += v->capacity() * sizeof(float);
    return n;
  }
};

// The calling thread's scratch, kept across calls: no allocation per call once grown.
inline LayerScratch& ThreadLayerScratch() {
  thread_local LayerScratch s;
  return s;
}

// Scratch above this is handed back after a call's layers (ReleaseLargeScratch): a
// prefill's activations (512 tokens of a 1.7B shape, hidden 2048 and intermediate 8192:
// 36 MB with the MLP's chunks) are not held resident through the decode steps after it.
constexpr size_t kKeepScratchBytes = size_t{4} << 20;
constexpr int64_t kMlpChunkBytes = int64_t{8} << 20;  // = fdx.core.memory.MLP_CHUNK_BYTES
constexpr int64_t kMlpChunkMinRows = 128;             // = MLP_CHUNK_MIN_ROWS

inline void ReleaseLargeScratch() {
  LayerScratch& s = ThreadLayerScratch();
  if (s.Bytes() > kKeepScratchBytes) s = LayerScratch{};
}

inline void DecoderLayer(LayerArgs a, int64_t N) {
  LayerScratch& s = ThreadLayerScratch();
  const int64_t H = a.rope.num_heads, KVH = a.rope.num_kv_heads, D = a.rope.head_dim;
  s.h.resize(N * a.hidden);
  s.qkv.resize(N * (H + 2 * KVH) * D);
  s.q.resize(N * H * D);
  s.attn.resize(N * H * D);
  s.o.resize(N * a.hidden);
  // The MLP in row chunks as the composed layer runs it (fdx.core.memory.mlp_chunk_rows: k equal
  // chunks of about kMlpChunkBytes of gate/up, none under kMlpChunkMinRows rows): a long step's
  // gate/up and SiLU buffers, its largest, are one chunk's.
  const int64_t I = a.intermediate;
  const int64_t k = N / std::max<int64_t>(kMlpChunkMinRows, kMlpChunkBytes / (2 * I * 4));
  const int64_t chunk = k > 1 ? (N + k - 1) / k : N;
  s.gate_up.resize(chunk * 2 * I);
  s.act.resize(chunk * I);

  if (a.residual) {
    RmsNorm(a.x, a.residual, a.input_norm, a.eps, N, a.hidden, s.h.data(), a.residual_out);
  } else {
    std::memcpy(a.residual_out, a.x, N * a.hidden * sizeof(float));
    RmsNorm(a.x, nullptr, a.input_norm, a.eps, N, a.hidden, s.h.data(), nullptr);
  }
  Product(a.qkv, s.h.data(), N, s.qkv.data(), s.part);
  a.rope.qkv = s.qkv.data();
  a.rope.q_out = s.q.data();
  a.attn.q = s.q.data();
  a.attn.out = s.attn.data();
  if (a.kv8) {
    // token t's head h at row h * N + t of the buffers (slot t of an N-slot cache), then quantized
    s.kbuf.resize(KVH * N * D), s.vbuf.resize(KVH * N * D), s.ident.resize(N);
    for (int64_t t = 0; t < N; ++t) s.ident[t] = t;
    RopeArgs r = a.rope;
    r.slots = s.ident.data(), r.k_cache = s.kbuf.data(), r.v_cache = s.vbuf.data(), r.num_slots = N;
    RopeWriteKv(r, N);
    int8_t* kc = reinterpret_cast<int8_t*>(a.rope.k_cache);
    int8_t* vc = reinterpret_cast<int8_t*>(a.rope.v_cache);
    kv8::WriteKv(s.kbuf.data(), s.vbuf.data(), D, N * D, a.rope.slots, N, KVH, D, a.rope.num_slots, kc, vc);
    const kv8::Args k8{s.q.data(), kc, vc, s.attn.data(), a.attn.seq_info, a.attn.tables, a.attn.table_width,
                       a.attn.num_heads, a.attn.group, D, a.attn.block_size, a.attn.num_slots, a.attn.scale};
    kv8::PagedAttention(k8, a.num_seqs, KVH);
  } else {
    RopeWriteKv(a.rope, N);
    PagedAttention(a.attn, a.num_seqs, KVH);
  }
  Product(a.o, s.attn.data(), N, s.o.data(), s.part);
  // residual_out holds the residual after attention's input norm; add o to it in place
  RmsNorm(s.o.data(), a.residual_out, a.post_norm, a.eps, N, a.hidden, s.h.data(), a.residual_out);
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    Product(a.gate_up, s.h.data() + r0 * a.hidden, n, s.gate_up.data(), s.part);
    SiluAndMul(s.gate_up.data(), s.act.data(), n, I);
    Product(a.down, s.act.data(), n, a.out + r0 * a.hidden, s.part);
  }
}

}  // namespace fdx
