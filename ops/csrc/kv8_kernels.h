// The 8-bit KV cache (cache.kv_cache_dtype: int8): the KV write that quantizes and the
// paged attention that reads int8 rows and dequantizes them in registers. Free of Paddle
// (bound in fdx_ops.cc), compiled with the build's flags (-march=native: AVX-512 or AVX2
// vectors from the GCC vector types below, the int8 loads and stores by the build's
// intrinsics where it has AVX-512 or AVX2; the baseline under FDX_PORTABLE_KERNELS).
//
// Row layout (fdx/core/interfaces.py KVCacheSpec, dtype "int8"): the cache tensors are int8
// [KVH * num_slots, D + 4], the row of (kv head h, slot s) at h * num_slots + s as in the
// float cache; a row holds D int8 values q[d] and then the row's float32 scale (its 4 bytes),
// the value being q[d] * scale. scale = max |x| / 127 over the row (one token, one kv head),
// q = round-half-even(x / scale), in [-127, 127]; an all-zero row has scale 0.
// One scale per row (not llama.cpp's q8_0 blocks of 32 with an f16 scale each): the score
// q . k is then one dot product over the converted int8 values times one scale (16 keys a
// vector, their lanes summed by SumLanes16's tree), and a V row enters P.V as one FMA per
// 16 values with p_j * scale_j folded in, no per-32 scale in the inner loops; the bytes are
// q8_0's at head_dim 64 (68 per row). cache.kv_cache_dtype q8_0 is taken for this layout.
//
// The attention is batch-invariant by construction: a work item is a tile of up to 16 query
// tokens of one sequence against one kv head (their G query heads), and each row's
// reductions (the score's FMA chains over d and its lane tree, the softmax's max and its
// lane sums over the keys in key order, and the P.V sum over keys in key order) are the same
// operations whatever tile, item, register group or thread the row falls in. So
// backend.batch_invariant and the default path run the same code.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if (defined(__AVX512F__) || defined(__AVX2__)) && !defined(FDX_NO_X86)
#include <immintrin.h>
#endif

#include "paged_attention_kernel.h"   // ExpNonPositive (the steps ExpNonPositive16 vectorizes)

namespace fdx::kv8 {

typedef float F16v __attribute__((vector_size(64), aligned(4), may_alias));

typedef int32_t I16v __attribute__((vector_size(64)));

// 16 int8 values as floats. GCC 12 widens int8 vectors (by __builtin_convertvector or a
// loop) with scalar loads and converts, a few times slower than the attention's arithmetic:
// the sign-extending loads of the build's instruction set where it has them (the same values).
inline F16v LoadI8(const int8_t* p) {
#if defined(__AVX512F__) && !defined(FDX_NO_X86)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  F16v v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
#elif defined(__AVX2__) && !defined(FDX_NO_X86)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  F16v v;
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
  return v;
#else
  float r[16];
  for (int i = 0; i < 16; ++i) r[i] = static_cast<float>(p[i]);
  F16v v;
  std::memcpy(&v, r, sizeof(v));
  return v;
#endif
}
inline F16v LoadF(const float* p) { return *reinterpret_cast<const F16v*>(p); }
inline void StoreF(float* p, F16v v) { *reinterpret_cast<F16v*>(p) = v; }

// 16 floats holding integers in [-127, 127] stored as int8 (exact).
inline void StoreI8(int8_t* p, F16v r) {
#if defined(__AVX512F__) && !defined(FDX_NO_X86)
  __m512 f;
  std::memcpy(&f, &r, sizeof(f));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(f)));
#else
  const I16v i = __builtin_convertvector(r, I16v);
  for (int l = 0; l < 16; ++l) p[l] = static_cast<int8_t>(i[l]);
#endif
}

// ExpNonPositive (paged_attention_kernel.h) on 16 lanes, the same steps (the floor by a
// truncating convert and a correction, exact), for the softmax's numerators: each lane's
// value depends on its input only.
inline F16v ExpNonPositive16(F16v x) {
  const F16v lo = F16v{} - 87.0f;
  const F16v xc = x < lo ? lo : x;
  const F16v t = xc * 1.44269504f + 0.5f;
  const F16v tr = __builtin_convertvector(__builtin_convertvector(t, I16v), F16v);
  const F16v n = tr > t ? tr - 1.f : tr;
  const F16v r = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  F16v q = F16v{} + 1.f / 720.f;
  q = q * r + 1.f / 120.f;
  q = q * r + 1.f / 24.f;
  q = q * r + 1.f / 6.f;
  q = q * r + 0.5f;
  q = q * r + 1.f;
  q = q * r + 1.f;
  const I16v bits = (__builtin_convertvector(n, I16v) + 127) << 23;
  F16v scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < lo ? F16v{} : q * scale;
}

// Lane i of the result: the sum of v[i]'s 16 lanes, for every i by the same tree (lanes l and
// l + 8, then the 8 partial sums' l and l + 4, then + 2, then + 1), by whole-vector shuffles
// and adds: 15 adds for 16 sums.
inline F16v SumLanes16(const F16v* v) {
  F16v w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)   // lanes 0-7: v[2i]'s l + (l + 8), lanes 8-15: v[2i + 1]'s
    w[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], I16v{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1], I16v{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  for (int i = 0; i < 4; ++i)   // 4 lanes a key, keys 4i .. 4i + 3 in order
    x[i] = __builtin_shuffle(w[2 * i], w[2 * i + 1], I16v{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
           __builtin_shuffle(w[2 * i], w[2 * i + 1], I16v{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  for (int i = 0; i < 2; ++i)   // 2 lanes a key, keys 8i .. 8i + 7
    y[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], I16v{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
           __builtin_shuffle(x[2 * i], x[2 * i + 1], I16v{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
  return __builtin_shuffle(y[0], y[1], I16v{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
         __builtin_shuffle(y[0], y[1], I16v{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

inline float RowScale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(s));
  return s;
}

// One row of D floats into D int8 values and the scale (layout above). D a multiple of 16:
// 16 lanes at a time, the same values as the scalar loop (max is exact in any order; the
// rounding to nearest-even by adding and subtracting 1.5 * 2^23, exact for |r| < 2^22, as
// nearbyint in the default rounding mode; the division kept, not a reciprocal's product).
inline void QuantizeRow(const float* x, int64_t D, int8_t* row) {
  float amax = 0.f;
  if (D % 16 == 0) {
    F16v m = {};
    for (int64_t d = 0; d < D; d += 16) {
      const F16v v = LoadF(x + d);
      const F16v a = v < 0 ? -v : v;
      m = m > a ? m : a;
    }
    for (int l = 0; l < 16; ++l) amax = std::max(amax, m[l]);
  } else {
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  }
  const float scale = amax / 127.f;
  if (scale == 0.f) {
    std::memset(row, 0, D);
  } else if (D % 16 == 0) {
    const F16v magic = F16v{} + 12582912.f, lo = F16v{} - 127.f, hi = F16v{} + 127.f;
    for (int64_t d = 0; d < D; d += 16) {
      F16v r = LoadF(x + d) / scale;
      r = (r + magic) - magic;
      r = r < lo ? lo : r;
      r = r > hi ? hi : r;
      StoreI8(row + d, r);
    }
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

struct Scratch {
  std::vector<float> q, scores, acc, kt;
  std::vector<int64_t> rows;
};

constexpr int64_t kTile = 16;   // query tokens per work item
constexpr int64_t kKeys = 16;   // keys per chunk: one vector of scores
// Query tokens [t0, t0 + tq) of sequence s (token t at position ctx + t sees keys 0..ctx + t)
// against kv head h: their G query heads each, row r = (t - t0) * G + g. Each key chunk is
// converted to floats once for all rows; a row's score for key j is, with kD > 0 (head_dim
// fixed at compile time, a multiple of 16), the FMA chain over d's 16-lane vectors and then
// SumLanes16's tree, else the scalar FMA chain over d from a transposed chunk, times k_j's
// scale; its softmax and its P.V sum run over its own keys in key order.
template <int64_t kD>
void AttendTile(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, Scratch& w) {
  const int64_t D = kD > 0 ? kD : a.head_dim, R = D + 4, G = a.group, bs = a.block_size;
  const int32_t* info = a.seq_info + s * 4;
  const int64_t first = info[2] + t0;          // the tile's first token's position
  const int64_t n = first + tq;                // keys the tile's last token sees
  const int64_t rows = tq * G;
  const int64_t width = (n + kKeys - 1) / kKeys * kKeys;
  const int32_t* table = a.tables + s * a.table_width;
  w.rows.resize(n);
  int64_t* krow = w.rows.data();
  for (int64_t j = 0, block = 0, off = 0; j < n; ++j) {
    krow[j] = (h * a.num_slots + static_cast<int64_t>(table[block]) * bs + off) * R;
    if (++off == bs) off = 0, ++block;
  }
  w.q.resize(rows * D);
  float* qs = w.q.data();
  for (int64_t t = 0; t < tq; ++t) {
    const float* src = a.q + ((info[0] + t0 + t) * a.num_heads + h * G) * D;
    for (int64_t i = 0; i < G * D; ++i) qs[t * G * D + i] = src[i] * a.scale;
  }
  w.scores.resize(rows * width);
  float* sc = w.scores.data();
  w.kt.resize(D * kKeys + 2 * width);         // a chunk's keys (or values) as floats, the keys' V and K scales
  float* kt = w.kt.data();
  float* vscale = kt + D * kKeys;              // each key's V scale
  float* kscales = vscale + width;              // and K scale; 0 past the n keys
  for (int64_t j = 0; j < width; ++j) {
    kscales[j] = j < n ? RowScale(a.k + krow[j], D) : 0.f;
    vscale[j] = j < n ? RowScale(a.v + krow[j], D) : 0.f;
  }
  // scores[r, j] = (sum_d q_r[d] k_j[d]) * kscale_j, 16 keys per vector
  if constexpr (kD > 0) {
    // each chunk's keys converted to floats once, row by row (no transpose); a row's score for
    // key j: the 16 lanes of the FMA chain over d's vectors in d order, then summed by
    // SumLanes16's fixed tree; the same operations for a key whatever its chunk or row.
    float* kf = kt;                            // [kKeys, kD]
    for (int64_t c0 = 0; c0 < n; c0 += kKeys) {
      const int64_t m = std::min(kKeys, n - c0);
      for (int64_t i = 0; i < kKeys; ++i)
#pragma GCC unroll 16
        for (int64_t c = 0; c < kD / 16; ++c)
          StoreF(kf + i * kD + 16 * c, i < m ? LoadI8(a.k + krow[c0 + i] + 16 * c) : F16v{});
      if (c0 + kKeys < n) __builtin_prefetch(a.k + krow[c0 + kKeys]);
      const F16v kscale = LoadF(kscales + c0);
      for (int64_t r = std::max<int64_t>(0, c0 - first) * G; r < rows; ++r) {  // rows whose token sees key c0
        F16v qv[kD / 16], part[kKeys];
#pragma GCC unroll 16
        for (int64_t c = 0; c < kD / 16; ++c) qv[c] = LoadF(qs + r * kD + 16 * c);
        for (int64_t i = 0; i < kKeys; ++i) {
          F16v acc = qv[0] * LoadF(kf + i * kD);
#pragma GCC unroll 16
          for (int64_t c = 1; c < kD / 16; ++c) acc += qv[c] * LoadF(kf + i * kD + 16 * c);
          part[i] = acc;
        }
        StoreF(sc + r * width + c0, SumLanes16(part) * kscale);
      }
    }
  } else {
    for (int64_t c0 = 0; c0 < n; c0 += kKeys) {
      const int64_t m = std::min(kKeys, n - c0);
      for (int64_t i = 0; i < kKeys; ++i)
        for (int64_t d = 0; d < D; ++d) kt[d * kKeys + i] = i < m ? static_cast<float>(a.k[krow[c0 + i] + d]) : 0.f;
      const F16v kscale = LoadF(kscales + c0);
      for (int64_t r = std::max<int64_t>(0, c0 - first) * G; r < rows; ++r) {
        const float* qr = qs + r * D;
        F16v acc = qr[0] * LoadF(kt);
        for (int64_t d = 1; d < D; ++d) acc += qr[d] * LoadF(kt + d * kKeys);
        StoreF(sc + r * width + c0, acc * kscale);
      }
    }
  }
  // softmax numerators times each key's V scale; inv[r] = 1 / the row's sum
  w.acc.assign(rows * D + rows, 0.f);
  float* acc = w.acc.data();
  float* inv = acc + rows * D;
  const I16v iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const F16v neg_inf = F16v{} - INFINITY;
  for (int64_t r = 0; r < rows; ++r) {
    // 16 keys a vector; lanes of keys the row does not see are 0 (they add +-0 to P.V: nothing).
    // The sum: 16 lane sums over the chunks in key order, then the lanes in lane order.
    float* row = sc + r * width;
    const int64_t valid = first + r / G + 1;
    F16v m = neg_inf;
    for (int64_t c0 = 0; c0 < valid; c0 += kKeys) {
      const F16v x = LoadF(row + c0);
      m = (iota + static_cast<int32_t>(c0) < static_cast<int32_t>(valid) && x > m) ? x : m;
    }
    float mx = m[0];
    for (int l = 1; l < 16; ++l) mx = std::max(mx, m[l]);
    F16v sum = {};
    for (int64_t c0 = 0; c0 < width; c0 += kKeys) {
      if (c0 >= valid) {
        StoreF(row + c0, F16v{});
        continue;
      }
      const F16v e = ExpNonPositive16(LoadF(row + c0) - mx);
      const F16v p = iota + static_cast<int32_t>(c0) < static_cast<int32_t>(valid) ? e : F16v{};
      sum += p;
      StoreF(row + c0, p * LoadF(vscale + c0));
    }
    float total = sum[0];
    for (int l = 1; l < 16; ++l) total += sum[l];
    inv[r] = 1.f / total;
  }
  // acc[r] = sum_j p[r, j] v_j over the row's keys, in key order (one FMA a key and value)
  if constexpr (kD > 0) {
    // a chunk's V rows converted to floats once; rows kPvRows at a time, accumulators in registers
    // (the float kernel's PvGroup: each row's sum in key order, one FMA a key and value)
    float* vf = kt;                            // [kKeys, kD]
    const float* vrows[kKeys];
    for (int64_t c0 = 0; c0 < n; c0 += kKeys) {
      const int64_t m = std::min(kKeys, n - c0);
      for (int64_t i = 0; i < m; ++i) {
        const int8_t* vr = a.v + krow[c0 + i];
        if (c0 + i + kKeys < n) __builtin_prefetch(a.v + krow[c0 + i + kKeys]);
#pragma GCC unroll 16
        for (int64_t c = 0; c < kD / 16; ++c) StoreF(vf + i * kD + 16 * c, LoadI8(vr + 16 * c));
        vrows[i] = vf + i * kD;
      }
      for (int64_t r = std::max<int64_t>(0, c0 - first) * G; r < rows; r += kPvRows) {  // rows that see key c0
        const float* p = sc + r * width + c0;
        float* o = acc + r * kD;
        switch (std::min(kPvRows, rows - r)) {
          case 1: PvGroup<kD, 1>(p, width, vrows, m, o, nullptr); break;
          case 2: PvGroup<kD, 2>(p, width, vrows, m, o, nullptr); break;
          case 3: PvGroup<kD, 3>(p, width, vrows, m, o, nullptr); break;
          default: PvGroup<kD, 4>(p, width, vrows, m, o, nullptr); break;
        }
      }
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const int8_t* vr = a.v + krow[j];
      for (int64_t r = std::max<int64_t>(0, j - first) * G; r < rows; ++r) {
        const float p = sc[r * width + j];
        float* o = acc + r * D;
        for (int64_t d = 0; d < D; ++d) o[d] += p * static_cast<float>(vr[d]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = a.out + ((info[3] + t0 + r / G) * a.num_heads + h * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) out[d] = acc[r * D + d] * inv[r];
  }
}

inline void AttendTileDispatch(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, Scratch& w) {
  switch (a.head_dim) {
    case 64: return AttendTile<64>(a, s, h, t0, tq, w);
    case 128: return AttendTile<128>(a, s, h, t0, tq, w);
    case 256: return AttendTile<256>(a, s, h, t0, tq, w);
    default: return AttendTile<0>(a, s, h, t0, tq, w);
  }
}

// Every (sequence, kv head, tile of query tokens) item of S sequences, on the OpenMP
// threads, longest first.
inline void PagedAttention(const Args& a, int64_t S, int64_t KVH) {
  struct Item {
    int64_t s, h, t0, tq;
  };
  std::vector<Item> items;
  int64_t work = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = a.seq_info[s * 4 + 1], ctx = a.seq_info[s * 4 + 2];
    work += (ctx + q_len) * q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += kTile)
      for (int64_t h = 0; h < KVH; ++h) items.push_back({s, h, t0, std::min(kTile, q_len - t0)});
  }
  work *= a.group * KVH;
  const int32_t* info = a.seq_info;
  auto cost = [info](const Item& it) { return (info[it.s * 4 + 2] + it.t0 + it.tq) * it.tq; };
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) { return cost(x) > cost(y); });
  const int64_t n = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
#pragma omp parallel if (n > 1 && work >= 4096)
  {
    thread_local Scratch w;
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      AttendTileDispatch(a, items[i].s, items[i].h, items[i].t0, items[i].tq, w);
  }
}

}  // namespace fdx::kv8
