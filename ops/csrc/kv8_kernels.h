// The 8-bit KV cache (cache.kv_cache_dtype: int8): the KV write that quantizes and the
// paged attention that reads int8 rows and dequantizes them in registers. Free of Paddle
// (bound in fdx_ops.cc), compiled with the build's flags (-march=native: AVX-512 or AVX2
// vectors from the GCC vector types below; the baseline under FDX_PORTABLE_KERNELS).
//
// Row layout (fdx/core/interfaces.py KVCacheSpec, dtype "int8"): the cache tensors are int8
// [KVH * num_slots, D + 4], the row of (kv head h, slot s) at h * num_slots + s as in the
// float cache; a row holds D int8 values q[d] and then the row's float32 scale (its 4 bytes),
// the value being q[d] * scale. scale = max |x| / 127 over the row (one token, one kv head),
// q = round-half-even(x / scale), in [-127, 127]; an all-zero row has scale 0.
// One scale per row (not llama.cpp's q8_0 blocks of 32 with an f16 scale each): the score
// q . k is then one integer-valued dot product times one scale, and a V row one multiply
// by p_j * scale_j, so the inner loops are a convert and an FMA per 16 values with no
// per-32 scale shuffle; the bytes are the same as q8_0's at head_dim 64 (68 per row).
//
// The attention is batch-invariant by construction: a work item is one query token of one
// sequence against one kv head (its G query heads), whatever the batch, and each row's
// reductions (the dot over D in 16 lanes summed in a fixed order, the softmax and the
// P.V sum over keys in key order) depend on that row's keys alone. So
// backend.batch_invariant and the default path run the same code.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

namespace fdx::kv8 {

typedef float F16v __attribute__((vector_size(64), aligned(4), may_alias));
typedef int8_t I16v __attribute__((vector_size(16), aligned(1), may_alias));

inline F16v LoadI8(const int8_t* p) { return __builtin_convertvector(*reinterpret_cast<const I16v*>(p), F16v); }
inline F16v LoadF(const float* p) { return *reinterpret_cast<const F16v*>(p); }
inline void StoreF(float* p, F16v v) { *reinterpret_cast<F16v*>(p) = v; }

inline float RowScale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(s));
  return s;
}

// One row of D floats into D int8 values and the scale (layout above).
inline void QuantizeRow(const float* x, int64_t D, int8_t* row) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax / 127.f;
  if (scale == 0.f) {
    std::memset(row, 0, D);
  } else {
    for (int64_t d = 0; d < D; ++d) {
      const float r = std::nearbyint(x[d] / scale);
      row[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
    }
  }
  std::memcpy(row + D, &scale, sizeof(scale));
}

// Token t's head h of k and v (float32 rows at t * tok_stride + h * head_stride) -> the
// caches' rows h * num_slots + slots[t] (slots checked by the caller).
inline void WriteKv(const float* k, const float* v, int64_t tok_stride, int64_t head_stride, const int64_t* slots,
                    int64_t N, int64_t KVH, int64_t D, int64_t num_slots, int8_t* k_cache, int8_t* v_cache) {
  const int64_t R = D + 4;
#pragma omp parallel for if (N * KVH >= 256)
  for (int64_t i = 0; i < N * KVH; ++i) {
    const int64_t t = i / KVH, h = i % KVH;
    const int64_t row = h * num_slots + slots[t], src = t * tok_stride + h * head_stride;
    QuantizeRow(k + src, D, k_cache + row * R);
    QuantizeRow(v + src, D, v_cache + row * R);
  }
}

struct Args {
  const float* q;     // [N, H, D]
  const int8_t* k;    // [KVH * num_slots, D + 4]
  const int8_t* v;
  float* out;         // [num_out_tokens, H, D]
  const int32_t* seq_info;  // [S, 4]: q_start, query_len, context_len, out_start (paged_attention_kernel.h)
  const int32_t* tables;    // [S, table_width]
  int64_t table_width, num_heads, group, head_dim, block_size, num_slots;
  float scale;
};

inline float ExpNeg(float x) {  // exp(x) for x <= 0, as paged_attention_kernel.h's ExpNonPositive
  const float xc = std::max(x, -87.0f);
  const float n = std::floor(xc * 1.44269504f + 0.5f);
  const float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float s;
  std::memcpy(&s, &bits, sizeof(s));
  return x < -87.0f ? 0.f : p * s;
}

inline float Sum16(F16v a) {  // a fixed tree
  float l[8];
  for (int i = 0; i < 8; ++i) l[i] = a[i] + a[i + 8];
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

struct Scratch {
  std::vector<float> q, scores, acc;
  std::vector<int64_t> rows;
};

// One query token t of sequence s (position ctx + t, keys 0..ctx + t) against kv head h:
// its G query heads. kD > 0: head_dim fixed at compile time (a multiple of 16).
template <int64_t kD>
void AttendToken(const Args& a, int64_t s, int64_t h, int64_t t, Scratch& w) {
  const int64_t D = kD > 0 ? kD : a.head_dim, R = D + 4, G = a.group, bs = a.block_size;
  const int32_t* info = a.seq_info + s * 4;
  const int64_t n = info[2] + t + 1;  // keys this token sees
  const int32_t* table = a.tables + s * a.table_width;
  w.rows.resize(n);
  int64_t* rows = w.rows.data();
  for (int64_t j = 0, block = 0, off = 0; j < n; ++j) {
    rows[j] = (h * a.num_slots + static_cast<int64_t>(table[block]) * bs + off) * R;
    if (++off == bs) off = 0, ++block;
  }
  w.q.resize(G * D);
  float* qs = w.q.data();
  const float* src = a.q + ((info[0] + t) * a.num_heads + h * G) * D;
  for (int64_t i = 0; i < G * D; ++i) qs[i] = src[i] * a.scale;
  w.scores.resize(G * n);
  float* sc = w.scores.data();
  // scores[g, j] = (q_g . kq_j) * kscale_j
  for (int64_t j = 0; j < n; ++j) {
    const int8_t* kr = a.k + rows[j];
    if (j + 4 < n) __builtin_prefetch(a.k + rows[j + 4]);
    const float ks = RowScale(kr, D);
    if constexpr (kD > 0) {
      F16v kv[kD / 16];
#pragma GCC unroll 8
      for (int64_t c = 0; c < kD / 16; ++c) kv[c] = LoadI8(kr + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        F16v acc = kv[0] * LoadF(qs + g * kD);
#pragma GCC unroll 8
        for (int64_t c = 1; c < kD / 16; ++c) acc += kv[c] * LoadF(qs + g * kD + 16 * c);
        sc[g * n + j] = Sum16(acc) * ks;
      }
    } else {
      for (int64_t g = 0; g < G; ++g) {
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += qs[g * D + d] * static_cast<float>(kr[d]);
        sc[g * n + j] = acc * ks;
      }
    }
  }
  // softmax numerators, then p_j * vscale_j in place; inv[g] = 1 / sum
  float inv[64];
  float* invp = G <= 64 ? inv : nullptr;
  std::vector<float> inv_big;
  if (!invp) inv_big.resize(G), invp = inv_big.data();
  for (int64_t g = 0; g < G; ++g) {
    float* row = sc + g * n;
    float mx = row[0];
    for (int64_t j = 1; j < n; ++j) mx = std::max(mx, row[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = ExpNeg(row[j] - mx);
      sum += row[j];
    }
    invp[g] = 1.f / sum;
  }
  for (int64_t j = 0; j < n; ++j) {
    const float vs = RowScale(a.v + rows[j], D);
    for (int64_t g = 0; g < G; ++g) sc[g * n + j] *= vs;
  }
  float* out = a.out + ((info[3] + t) * a.num_heads + h * G) * D;
  if constexpr (kD > 0) {
    for (int64_t g = 0; g < G; ++g) {
      const float* p = sc + g * n;
      F16v acc[kD / 16] = {};
      for (int64_t j = 0; j < n; ++j) {
        const int8_t* vr = a.v + rows[j];
        if (j + 4 < n) __builtin_prefetch(a.v + rows[j + 4]);
        const float pj = p[j];
#pragma GCC unroll 8
        for (int64_t c = 0; c < kD / 16; ++c) acc[c] += pj * LoadI8(vr + 16 * c);
      }
#pragma GCC unroll 8
      for (int64_t c = 0; c < kD / 16; ++c) StoreF(out + g * kD + 16 * c, acc[c] * invp[g]);
    }
  } else {
    w.acc.assign(D, 0.f);
    for (int64_t g = 0; g < G; ++g) {
      std::fill(w.acc.begin(), w.acc.end(), 0.f);
      const float* p = sc + g * n;
      for (int64_t j = 0; j < n; ++j) {
        const int8_t* vr = a.v + rows[j];
        for (int64_t d = 0; d < D; ++d) w.acc[d] += p[j] * static_cast<float>(vr[d]);
      }
      for (int64_t d = 0; d < D; ++d) out[g * D + d] = w.acc[d] * invp[g];
    }
  }
}

inline void AttendTokenDispatch(const Args& a, int64_t s, int64_t h, int64_t t, Scratch& w) {
  switch (a.head_dim) {
    case 64: return AttendToken<64>(a, s, h, t, w);
    case 128: return AttendToken<128>(a, s, h, t, w);
    case 256: return AttendToken<256>(a, s, h, t, w);
    default: return AttendToken<0>(a, s, h, t, w);
  }
}

// Every (sequence, kv head, query token) item of S sequences, on the OpenMP threads.
inline void PagedAttention(const Args& a, int64_t S, int64_t KVH) {
  struct Item {
    int64_t s, h, t;
  };
  std::vector<Item> items;
  int64_t work = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = a.seq_info[s * 4 + 1], ctx = a.seq_info[s * 4 + 2];
    work += (ctx + q_len) * q_len;
    for (int64_t t = q_len - 1; t >= 0; --t)  // the longest rows first
      for (int64_t h = 0; h < KVH; ++h) items.push_back({s, h, t});
  }
  work *= a.group * KVH;
  const int64_t n = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
#pragma omp parallel if (n > 1 && work >= 4096)
  {
    thread_local Scratch w;
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      AttendTokenDispatch(a, items[i].s, items[i].h, items[i].t, w);
  }
}

}  // namespace fdx::kv8
