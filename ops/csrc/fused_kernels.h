// Fused elementwise kernels of a decoder layer, free of Paddle (bound in fdx_ops.cc).
//
// SiluAndMul: [N, 2I] -> [N, I], out = silu(x[:, :I]) * x[:, I:].
// RmsNorm: [N, H] rows, optionally after adding the residual (which it also returns).
// RopeWriteKv: the fused q/k/v projection [N, (H + 2 KVH) D] -> q [N, H, D]
//   (optional per-head RMS norm, rotary), k likewise into the paged k cache,
//   v copied into the v cache. Cache layout as in paged_attention_kernel.h:
//   the row of (kv head h, slot s) is h * num_slots + s.
// Both split their rows over the OpenMP threads in equal static ranges
// (only GOMP_parallel and omp_get_*: Intel's libiomp5 provides them too),
// and only when the call is large enough to pay for waking the threads.
#pragma once

#include <omp.h>

#include "paged_attention_kernel.h"  // ExpNonPositive

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace fdx {

// Floats below which one thread is faster: these kernels are memory-bound, and
// waking the threads (with other processes on the cores, waiting at the barrier
// for a descheduled one) costs more than a second thread gains on 64 decode rows.
constexpr int64_t kMinParallelElems = 1 << 18;

// Rows [begin, end) of `rows` for this thread of the current parallel region.
inline void ThreadRange(int64_t rows, int64_t* begin, int64_t* end) {
  const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
  const int64_t per = rows / nt, extra = rows % nt;
  *begin = t * per + std::min(t, extra);
  *end = *begin + per + (t < extra ? 1 : 0);
}

// exp(x) for any x (vectorizable): the attention kernel's polynomial with the
// input clamped to 88.7 (no overflow); 0 below -87; relative error < 3e-7.
inline float ExpClamped(float x) { return ExpNonPositive(std::min(x, 88.7f)); }

inline void SiluAndMulRow(const float* x, float* out, int64_t I) {
  const float* up = x + I;
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const float g = x[i];
    out[i] = g / (1.f + ExpClamped(-g)) * up[i];
  }
}

inline void SiluAndMul(const float* x, float* out, int64_t N, int64_t I) {
#pragma omp parallel if (N > 1 && N * I >= kMinParallelElems)
  {
    int64_t begin, end;
    ThreadRange(N, &begin, &end);
    for (int64_t r = begin; r < end; ++r) SiluAndMulRow(x + r * 2 * I, out + r * I, I);
  }
}

// sum of x[i]^2: 8 lanes (x[i] in lane i % 8, a multiply-add chain each), the lanes
// summed ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), the n % 8 tail after in order: one
// order for a row wherever it lies and however many rows share the call (issue 40 item 4).
inline float SumSquares(const float* x, int64_t n) {
  typedef float V8 __attribute__((vector_size(32), aligned(4), may_alias));
  V8 lanes = {};
  const int64_t body = n / 8 * 8;
  for (int64_t i = 0; i < body; i += 8) {
    const V8 v = *reinterpret_cast<const V8*>(x + i);
    lanes = lanes + v * v;
  }
  float ss = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (int64_t i = body; i < n; ++i) ss = ss + x[i] * x[i];
  return ss;
}

// RMS norm of rows [N, H]: out = x * rsqrt(mean(x^2) + eps) * w; with `residual`,
// x + residual is normalized and also written to `summed`.
inline void RmsNormRow(const float* x, const float* residual, const float* w, float eps, int64_t H, float* out,
                       float* summed) {
  if (residual) {
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) summed[i] = x[i] + residual[i];
    x = summed;
  }
  const float inv = 1.f / std::sqrt(SumSquares(x, H) / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) out[i] = x[i] * inv * w[i];
}

inline void RmsNorm(const float* x, const float* residual, const float* w, float eps, int64_t N, int64_t H,
                    float* out, float* summed) {
#pragma omp parallel if (N > 1 && N * H >= kMinParallelElems)
  {
    int64_t begin, end;
    ThreadRange(N, &begin, &end);
    for (int64_t r = begin; r < end; ++r)
      RmsNormRow(x + r * H, residual ? residual + r * H : nullptr, w, eps, H, out + r * H,
                 summed ? summed + r * H : nullptr);
  }
}

struct RopeArgs {
  const float* qkv;        // [N, (H + 2 KVH) D]
  const int64_t* positions;  // [N]
  const int64_t* slots;    // [N]
  const float* cos;        // [P, D]: the rotary tables (1 and 0 past rotary_dim)
  const float* sin;        // [P, D]
  const float* q_norm;     // [D] or nullptr
  const float* k_norm;     // [D] or nullptr
  float* q_out;            // [N, H, D]
  float* k_cache;          // [KVH * num_slots, D]
  float* v_cache;
  int64_t num_heads, num_kv_heads, head_dim, rotary_dim, num_slots;
  bool neox;
  float eps;
};

// dst = rope(rms_norm(src) * weight) (norm only when weight is given) for one head.
template <int64_t kD>
inline void NormRopeHead(const RopeArgs& a, const float* src, const float* weight, const float* cos,
                         const float* sin, float* dst) {
  const int64_t D = kD > 0 ? kD : a.head_dim;
  float buf[kD > 0 ? kD : 1024];
  const float* x = src;
  if (weight) {
    const float inv = 1.f / std::sqrt(SumSquares(src, D) / static_cast<float>(D) + a.eps);
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) buf[i] = src[i] * inv * weight[i];
    x = buf;
  }
  const int64_t rd = a.rotary_dim;
  if (a.neox) {  // out[i] = x[i] cos[i] - x[i + h] sin[i]; out[i + h] = x[i + h] cos[i + h] + x[i] sin[i + h]
    const int64_t h = rd / 2;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) {
      const float x1 = x[i], x2 = x[i + h];
      dst[i] = x1 * cos[i] - x2 * sin[i];
      dst[i + h] = x2 * cos[i + h] + x1 * sin[i + h];
    }
  } else {  // out[2j] = x[2j] cos[2j] - x[2j+1] sin[2j]; out[2j+1] = x[2j+1] cos[2j+1] + x[2j] sin[2j+1]
#pragma omp simd
    for (int64_t j = 0; j < rd / 2; ++j) {
      const float x1 = x[2 * j], x2 = x[2 * j + 1];
      dst[2 * j] = x1 * cos[2 * j] - x2 * sin[2 * j];
      dst[2 * j + 1] = x2 * cos[2 * j + 1] + x1 * sin[2 * j + 1];
    }
  }
  for (int64_t i = rd; i < D; ++i) dst[i] = x[i];  // past rotary_dim: unrotated
}

template <int64_t kD>
inline void RopeWriteKvRows(const RopeArgs& a, int64_t begin, int64_t end) {
  const int64_t D = kD > 0 ? kD : a.head_dim;
  const int64_t H = a.num_heads, KVH = a.num_kv_heads;
  const int64_t width = (H + 2 * KVH) * D;
  for (int64_t t = begin; t < end; ++t) {
    const float* row = a.qkv + t * width;
    const float* cos = a.cos + a.positions[t] * D;
    const float* sin = a.sin + a.positions[t] * D;
    const int64_t slot = a.slots[t];
    for (int64_t h = 0; h < H; ++h)
      NormRopeHead<kD>(a, row + h * D, a.q_norm, cos, sin, a.q_out + (t * H + h) * D);
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t cache_row = (h * a.num_slots + slot) * D;
      NormRopeHead<kD>(a, row + (H + h) * D, a.k_norm, cos, sin, a.k_cache + cache_row);
      std::memcpy(a.v_cache + cache_row, row + (H + KVH + h) * D, D * sizeof(float));
    }
  }
}

inline void RopeWriteKv(const RopeArgs& a, int64_t N) {
  const int64_t elems = N * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim;
#pragma omp parallel if (N > 1 && elems >= kMinParallelElems)
  {
    int64_t begin, end;
    ThreadRange(N, &begin, &end);
    switch (a.head_dim) {
      case 64: RopeWriteKvRows<64>(a, begin, end); break;
      case 128: RopeWriteKvRows<128>(a, begin, end); break;
      default: RopeWriteKvRows<0>(a, begin, end); break;
    }
  }
}

}  // namespace fdx
