// Paged attention kernel core, free of Paddle (bound in paged_attention.cc).
//
// Cache layout (see fdx/ops/attention.py): k, v are float32 [KVH * num_slots,
// D]; the row of (kv head h, slot s) is h * num_slots + s and slot =
// block_id * block_size + offset, so one block of one head is block_size
// contiguous rows, read where it lies.
//
// A work item is one tile of up to kQueryTile query tokens of one sequence
// against one kv head. It serves the G = H / KVH query heads sharing that kv
// head (Hugging Face repeat_kv: query head h uses kv head h / G), so each K/V
// row is read once per item. Items run in parallel with OpenMP.
//
// seq_info int32 [S, 4]: q_start (row of the sequence's first query token in
// q), query_len, context_len (tokens cached before this step's), out_start
// (row of its first output token). Query t sits at position context_len + t
// and attends to positions 0 .. context_len + t.
// tables int32 [S, table_width]: the sequence's block ids.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FDX_ATTEND_ONE 1
#endif

#if (defined(__x86_64__) || defined(__i386__)) && !defined(FDX_NO_X86) && !defined(FDX_X86_BUILDS)
#define FDX_X86_BUILDS 1  // the x86 translation units (isa_avx2.cc, isa_avx512.cc) are built
#endif

namespace fdx {

constexpr int64_t kQueryTile = 16;          // query tokens per item (bounds the score buffer)
constexpr int64_t kChunk = 16;              // keys per chunk (one 512-bit vector of scores)
constexpr int64_t kTransposeMinRows = 8;    // from this many query rows, transpose K chunks
constexpr int64_t kPvRows = 4;              // score rows per register-blocked P.V group
constexpr int64_t kMinParallelWork = 4096;  // key x query-row products below which one thread is faster

// 16 floats (one AVX-512 register, two AVX2 ones); unaligned loads and stores.
typedef float V16 __attribute__((vector_size(64), aligned(4), may_alias));

inline V16 Load16(const float* p) { return *reinterpret_cast<const V16*>(p); }
inline void Store16(float* p, V16 v) { *reinterpret_cast<V16*>(p) = v; }

struct Args {
  const float* q;    // [N, H, D]
  const float* k;    // [KVH * num_slots, D]
  const float* v;    // [KVH * num_slots, D]
  float* out;        // [num_out_tokens, H, D]
  const int32_t* seq_info;
  const int32_t* tables;
  int64_t table_width, num_heads, group, head_dim, block_size, num_slots;
  float scale;
  bool invariant = false;  // the batch-invariant kernel (invariant_attention.h): backend.batch_invariant
};

struct Scratch {
  std::vector<float> q, scores, acc, inv_sum, kt;
  std::vector<int64_t> rows;  // AttendOne: each key's row within its head
  std::vector<float> p, state;  // invariant_attention.h
  std::vector<int64_t> keys;
};

// The calling thread's scratch, kept across calls: no allocation per call once grown.
inline Scratch& ThreadScratch() {
  thread_local Scratch w;
  return w;
}

template <int64_t kD>
inline float DotN(const float* a, const float* b) {
  V16 acc = {};
#pragma GCC unroll 16
  for (int64_t v = 0; v < kD / 16; ++v) acc += Load16(a + 16 * v) * Load16(b + 16 * v);
  float sum = 0.f;
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) sum += acc[i];
  return sum;
}

inline float Dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void Axpy(float a, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// exp(x), vectorizable, for x <= 88.7 (softmax calls it after subtracting the
// row max, so x <= 0; SiLU through ExpClamped): relative error < 3e-7, 0 below -87.
inline float ExpNonPositive(float x) {
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
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.f : p * scale;
}

// Rows of the keys [c0, c0 + n) of one head in a paged cache (n <= kChunk).
// Softmax in place of a query tile's score rows [rows, width] (row r: query
// first_pos + r / G, which sees keys 0..first_pos + r / G); the rest of each row
// becomes 0, and inv_sum[r] = 1 / the row's sum.
inline void CausalSoftmax(float* scores, int64_t rows, int64_t width, int64_t first_pos, int64_t G,
                          std::vector<float>& inv_sum) {
  inv_sum.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * width;
    const int64_t valid = first_pos + r / G + 1;
    float mx = row[0];
#pragma omp simd reduction(max : mx)
    for (int64_t j = 1; j < valid; ++j) mx = std::max(mx, row[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < valid; ++j) {
      row[j] = ExpNonPositive(row[j] - mx);
      sum += row[j];
    }
    for (int64_t j = valid; j < width; ++j) row[j] = 0.f;
    inv_sum[r] = 1.f / sum;
  }
}

inline void ChunkRows(const float* cache, const int32_t* table, int64_t head_row, int64_t bs, int64_t D,
                      int64_t c0, int64_t n, const float** rows) {
  int64_t block = c0 / bs, offset = c0 % bs;
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = cache + (head_row + static_cast<int64_t>(table[block]) * bs + offset) * D;
    if (++offset == bs) offset = 0, ++block;
  }
}

inline void PrefetchRow(const float* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(row + d);
}

// Rows of chunk c0 into rows[] and of the next chunk into next[] (for
// prefetching, spread over the chunk's work); returns chunk c0's size.
inline int64_t ChunkAndNext(const float* cache, const int32_t* table, int64_t head_row, int64_t bs, int64_t D,
                            int64_t c0, int64_t num_keys, const float** rows, const float** next) {
  const int64_t n = std::min(kChunk, num_keys - c0);
  ChunkRows(cache, table, head_row, bs, D, c0, n, rows);
  const int64_t nn = std::max<int64_t>(0, std::min(kChunk, num_keys - c0 - kChunk));
  ChunkRows(cache, table, head_row, bs, D, c0 + kChunk, nn, next);
  for (int64_t i = nn; i < n; ++i) next[i] = nullptr;
  return n;
}

// scores[rr, 0:kChunk] = q_rr . k_i for kR consecutive query rows against a
// transposed key chunk kt [D, kChunk]; kR independent FMA chains.
template <int64_t kR>
inline void QkGroup(const float* q, const float* kt, int64_t D, float* scores, int64_t width) {
  V16 acc[kR] = {};
  for (int64_t d = 0; d < D; ++d) {
    const V16 k = Load16(kt + d * kChunk);
#pragma GCC unroll 8
    for (int64_t rr = 0; rr < kR; ++rr) acc[rr] += q[rr * D + d] * k;
  }
#pragma GCC unroll 8
  for (int64_t rr = 0; rr < kR; ++rr) Store16(scores + rr * width, acc[rr]);
}

// acc[rr] += sum_i p[rr, i] * v_i for kR consecutive score rows over one key
// chunk, accumulators in registers; each V row is loaded once per group.
template <int64_t kD, int64_t kR>
inline void PvGroup(const float* p, int64_t width, const float* const* vrows, int64_t n, float* acc,
                    const float* const* prefetch) {
  constexpr int64_t kV = kD / 16;
  V16 reg[kR][kV];
#pragma GCC unroll 8
  for (int64_t rr = 0; rr < kR; ++rr)
#pragma GCC unroll 16
    for (int64_t v = 0; v < kV; ++v) reg[rr][v] = Load16(acc + rr * kD + 16 * v);
  for (int64_t i = 0; i < n; ++i) {
    if (prefetch && prefetch[i]) PrefetchRow(prefetch[i], kD);
    V16 vv[kV];
#pragma GCC unroll 16
    for (int64_t v = 0; v < kV; ++v) vv[v] = Load16(vrows[i] + 16 * v);
#pragma GCC unroll 8
    for (int64_t rr = 0; rr < kR; ++rr) {
      const float pr = p[rr * width + i];
#pragma GCC unroll 16
      for (int64_t v = 0; v < kV; ++v) reg[rr][v] += pr * vv[v];
    }
  }
#pragma GCC unroll 8
  for (int64_t rr = 0; rr < kR; ++rr)
#pragma GCC unroll 16
    for (int64_t v = 0; v < kV; ++v) Store16(acc + rr * kD + 16 * v, reg[rr][v]);
}

// One tile of query tokens [t0, t0 + tq) of sequence s against kv head h.
// Keys go in chunks of kChunk; scores are [rows, keys rounded up to kChunk].
// kD > 0 fixes head_dim at compile time (unrolled rows, accumulators in registers).
template <int64_t kD>
void AttendTile(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, Scratch& w) {
  const int64_t D = kD > 0 ? kD : a.head_dim;
  const int32_t* info = a.seq_info + s * 4;
  const int64_t q_start = info[0], ctx = info[2], out_start = info[3];
  const int32_t* table = a.tables + s * a.table_width;
  const int64_t G = a.group, H = a.num_heads, bs = a.block_size;
  const int64_t rows = tq * G;             // row r = t * G + g, at position first_pos + r / G
  const int64_t num_keys = ctx + t0 + tq;  // keys the tile's last token sees
  const int64_t first_pos = ctx + t0;
  const int64_t head_row = h * a.num_slots;
  const int64_t width = (num_keys + kChunk - 1) / kChunk * kChunk;  // score row stride
  const bool transpose = rows >= kTransposeMinRows;

  w.q.resize(rows * D);
  float* qs = w.q.data();
  for (int64_t t = 0; t < tq; ++t) {
    const float* src = a.q + ((q_start + t0 + t) * H + h * G) * D;
    for (int64_t i = 0; i < G * D; ++i) qs[t * G * D + i] = src[i] * a.scale;
  }
  w.scores.resize(rows * width);
  float* scores = w.scores.data();
  w.kt.resize(D * kChunk);
  float* kt = w.kt.data();
  const float* krows[kChunk];
  const float* next[kChunk];

  // scores[r, j] = q_r . k_j, for chunks the row's token reaches (others stay unset).
  for (int64_t c0 = 0; c0 < num_keys; c0 += kChunk) {
    const int64_t n = ChunkAndNext(a.k, table, head_row, bs, D, c0, num_keys, krows, next);
    const int64_t r0 = std::max<int64_t>(0, c0 - first_pos) * G;  // first row that sees key c0
    if (transpose) {  // kt[d, i] = k_{c0+i}[d]: one FMA row per q element
      for (int64_t i = 0; i < kChunk; ++i) {
        if (i < n && next[i]) PrefetchRow(next[i], D);
        for (int64_t d = 0; d < D; ++d) kt[d * kChunk + i] = i < n ? krows[i][d] : 0.f;
      }
      int64_t r = r0;
      for (; r + 8 <= rows; r += 8) QkGroup<8>(qs + r * D, kt, D, scores + r * width + c0, width);
      for (; r + 4 <= rows; r += 4) QkGroup<4>(qs + r * D, kt, D, scores + r * width + c0, width);
      for (; r < rows; ++r) QkGroup<1>(qs + r * D, kt, D, scores + r * width + c0, width);
    } else {
      for (int64_t i = 0; i < n; ++i) {
        if (next[i]) PrefetchRow(next[i], D);
        for (int64_t r = r0; r < rows; ++r) {
          if constexpr (kD > 0 && kD % 16 == 0)
            scores[r * width + c0 + i] = DotN<kD>(qs + r * D, krows[i]);
          else
            scores[r * width + c0 + i] = Dot(qs + r * D, krows[i], D);
        }
      }
    }
  }

  // Softmax in place over the visible keys; the rest of the row becomes 0.
  CausalSoftmax(scores, rows, width, first_pos, G, w.inv_sum);

  // acc[r] = sum_j p[r, j] * v_j, one key chunk at a time.
  w.acc.assign(rows * D, 0.f);
  const float* vrows[kChunk];
  for (int64_t c0 = 0; c0 < num_keys; c0 += kChunk) {
    const int64_t n = ChunkAndNext(a.v, table, head_row, bs, D, c0, num_keys, vrows, next);
    const int64_t r0 = std::max<int64_t>(0, c0 - first_pos) * G;
    float* acc = w.acc.data();
    if constexpr (kD > 0 && kD % 16 == 0) {
      for (int64_t r = r0; r < rows; r += kPvRows) {
        const float* p = scores + r * width + c0;
        const float* const* pf = r == r0 ? next : nullptr;  // prefetch during the first group only
        switch (std::min(kPvRows, rows - r)) {
          case 1: PvGroup<kD, 1>(p, width, vrows, n, acc + r * kD, pf); break;
          case 2: PvGroup<kD, 2>(p, width, vrows, n, acc + r * kD, pf); break;
          case 3: PvGroup<kD, 3>(p, width, vrows, n, acc + r * kD, pf); break;
          default: PvGroup<kD, kPvRows>(p, width, vrows, n, acc + r * kD, pf); break;
        }
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        if (next[i]) PrefetchRow(next[i], D);
        for (int64_t r = r0; r < rows; ++r) Axpy(scores[r * width + c0 + i], vrows[i], acc + r * D, D);
      }
    }
  }

  for (int64_t t = 0; t < tq; ++t) {
    float* dst = a.out + ((out_start + t0 + t) * H + h * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      const float inv = w.inv_sum[r];
      for (int64_t i = 0; i < D; ++i) dst[g * D + i] = w.acc[r * D + i] * inv;
    }
  }
}

#ifdef FDX_ATTEND_ONE
// A decode token (one query token: its G query heads) against kv head h, in AVX2
// registers of 8 floats: AttendTile's vector-extension code keeps a [rows, 4 x 16]
// accumulator that spills at this size (measured 2-3x slower per decode token at
// 9 / 3 heads of 64 over 192 keys). Scores 4 keys at a time, each key's D products
// summed across the register by one hadd tree for the 4; P.V in column blocks of
// 32 for up to 3 query heads at once (12 accumulators). kD % 32 == 0.
template <int64_t kGn, int64_t kD>
inline void PvBlockOne(const float* p, int64_t width, const float* vbase, const int64_t* rows, int64_t num_keys,
                       int64_t col, const float* inv, float* dst) {
  __m256 acc[kGn][4];
  for (int64_t g = 0; g < kGn; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < num_keys; ++j) {
    const float* vr = vbase + rows[j] * kD + col;
    const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8), v2 = _mm256_loadu_ps(vr + 16),
                 v3 = _mm256_loadu_ps(vr + 24);
    for (int64_t g = 0; g < kGn; ++g) {
      const __m256 pj = _mm256_broadcast_ss(p + g * width + j);
      acc[g][0] = _mm256_fmadd_ps(pj, v0, acc[g][0]);
      acc[g][1] = _mm256_fmadd_ps(pj, v1, acc[g][1]);
      acc[g][2] = _mm256_fmadd_ps(pj, v2, acc[g][2]);
      acc[g][3] = _mm256_fmadd_ps(pj, v3, acc[g][3]);
    }
  }
  for (int64_t g = 0; g < kGn; ++g) {
    const __m256 s = _mm256_set1_ps(inv[g]);
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(dst + g * kD + col + 8 * c, _mm256_mul_ps(acc[g][c], s));
  }
}

// Keys [k0, k1) of that token's num_keys: with dst_max and dst_sum null, the whole
// softmax (k0 = 0, k1 = num_keys) normalized into dst; else one part of a split
// (AttendSplit): dst holds the part's P.V unnormalized, dst_max and dst_sum each query
// head's score maximum and sum of exp(score - maximum), which AttendSplit merges.
template <int64_t kD>
void AttendOne(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t k0, int64_t k1, Scratch& w, float* dst,
               float* dst_max, float* dst_sum) {
  static_assert(kD % 32 == 0, "column blocks of 32");
  constexpr int64_t kV = kD / 8;
  constexpr int64_t kOneAhead = 16;  // keys
  const int32_t* info = a.seq_info + s * 4;
  const int64_t q_start = info[0];
  const int32_t* table = a.tables + s * a.table_width;
  const int64_t G = a.group, H = a.num_heads, bs = a.block_size;
  const int64_t num_keys = k1 - k0;
  const int64_t width = (num_keys + 3) / 4 * 4;
  const float* kbase = a.k + h * a.num_slots * kD;
  const float* vbase = a.v + h * a.num_slots * kD;
  w.rows.resize(num_keys);
  int64_t* rows = w.rows.data();
  for (int64_t j = 0, block = k0 / bs, offset = k0 % bs; j < num_keys; ++j) {  // as ChunkRows walks them
    rows[j] = static_cast<int64_t>(table[block]) * bs + offset;
    if (++offset == bs) offset = 0, ++block;
  }
  w.scores.resize(G * width);
  w.inv_sum.resize(G);
  float* scores = w.scores.data();
  const float* q = a.q + ((q_start + t0) * H + h * G) * kD;
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int64_t g = 0; g < G; ++g) {
    __m256 qv[kV];
    for (int64_t v = 0; v < kV; ++v) qv[v] = _mm256_mul_ps(_mm256_loadu_ps(q + g * kD + 8 * v), scale);
    float* row = scores + g * width;
    for (int64_t j = 0; j < num_keys; j += 4) {
      const float* kr[4];
      for (int64_t i = 0; i < 4; ++i) kr[i] = kbase + rows[std::min(j + i, num_keys - 1)] * kD;
      if (g == 0 && j + kOneAhead < num_keys)  // the first pass reads K from memory: fetch K and V ahead
        for (int64_t i = 0; i < 4; ++i) {
          const int64_t r = rows[std::min(j + kOneAhead + i, num_keys - 1)] * kD;
          PrefetchRow(kbase + r, kD);
          PrefetchRow(vbase + r, kD);
        }
      __m256 acc[4];
      for (int i = 0; i < 4; ++i) acc[i] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr[i]));
      for (int64_t v = 1; v < kV; ++v)
        for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(qv[v], _mm256_loadu_ps(kr[i] + 8 * v), acc[i]);
      const __m256 hh = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
      _mm_storeu_ps(row + j, _mm_add_ps(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1)));
    }
    float mx = row[0];
#pragma omp simd reduction(max : mx)
    for (int64_t j = 1; j < num_keys; ++j) mx = std::max(mx, row[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < num_keys; ++j) {
      row[j] = ExpNonPositive(row[j] - mx);
      sum += row[j];
    }
    w.inv_sum[g] = dst_max ? 1.f : 1.f / sum;
    if (dst_max) dst_max[g] = mx, dst_sum[g] = sum;
  }
  for (int64_t g = 0; g < G; g += 3) {
    const int64_t gn = std::min<int64_t>(3, G - g);
    for (int64_t col = 0; col < kD; col += 32) {
      const float* p = scores + g * width;
      float* out = dst + g * kD;
      const float* inv = w.inv_sum.data() + g;
      if (gn == 3) PvBlockOne<3, kD>(p, width, vbase, rows, num_keys, col, inv, out);
      else if (gn == 2) PvBlockOne<2, kD>(p, width, vbase, rows, num_keys, col, inv, out);
      else PvBlockOne<1, kD>(p, width, vbase, rows, num_keys, col, inv, out);
    }
  }
}

template <int64_t kD>
void AttendOne(const Args& a, int64_t s, int64_t h, int64_t t0, Scratch& w) {
  const int32_t* info = a.seq_info + s * 4;
  float* out = a.out + ((info[3] + t0) * a.num_heads + h * a.group) * kD;
  AttendOne<kD>(a, s, h, t0, 0, info[2] + t0 + 1, w, out, nullptr, nullptr);
}

// A tile of query tokens (tq > 1: a prefill chunk) against kv head h in AVX2
// registers of 8 floats. AttendTile's vector-extension code keeps 8 score rows x 16
// keys and 4 rows x 64 accumulators, 16 and 32 ymm registers (spilled on every FMA
// without AVX-512: 3-5 GFLOP/s measured on the Zen 3, a fifth of a 128-token
// prefill's attention + products). Here: Q.K^T against each transposed 16-key chunk in
// groups of 6 score rows (12 accumulators), then P.V over all the keys a group of 3
// rows sees in column blocks of 32 (12 accumulators), the output written scaled.
template <int64_t kR>
inline void QkRowsAvx2(const float* q, const float* kt, int64_t D, float* scores, int64_t width) {
  __m256 acc[kR][2];
  for (int64_t r = 0; r < kR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * kChunk), k1 = _mm256_loadu_ps(kt + d * kChunk + 8);
    for (int64_t r = 0; r < kR; ++r) {
      const __m256 qv = _mm256_broadcast_ss(q + r * D + d);
      acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
    }
  }
  for (int64_t r = 0; r < kR; ++r) {
    _mm256_storeu_ps(scores + r * width, acc[r][0]);
    _mm256_storeu_ps(scores + r * width + 8, acc[r][1]);
  }
}

template <int64_t kR, int64_t kD>
inline void PvRowsAvx2(const float* p, int64_t width, const float* vbase, const int64_t* keys, int64_t num_keys,
                       int64_t col, const float* inv, float* const* dst) {
  __m256 acc[kR][4];
  for (int64_t r = 0; r < kR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < num_keys; ++j) {
    const float* vr = vbase + keys[j] * kD + col;
    for (int64_t r = 0; r < kR; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p + r * width + j);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * c), acc[r][c]);
    }
  }
  for (int64_t r = 0; r < kR; ++r) {
    const __m256 s = _mm256_set1_ps(inv[r]);
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(dst[r] + col + 8 * c, _mm256_mul_ps(acc[r][c], s));
  }
}

template <int64_t kD>
void AttendTileAvx2(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, Scratch& w) {
  static_assert(kD % 32 == 0, "column blocks of 32");
  const int32_t* info = a.seq_info + s * 4;
  const int64_t q_start = info[0], ctx = info[2], out_start = info[3];
  const int32_t* table = a.tables + s * a.table_width;
  const int64_t G = a.group, H = a.num_heads, bs = a.block_size;
  const int64_t rows = tq * G;             // row r = t * G + g, at position first_pos + r / G
  const int64_t num_keys = ctx + t0 + tq;  // keys the tile's last token sees
  const int64_t first_pos = ctx + t0;
  const int64_t width = (num_keys + kChunk - 1) / kChunk * kChunk;
  const float* kbase = a.k + h * a.num_slots * kD;
  const float* vbase = a.v + h * a.num_slots * kD;
  w.rows.resize(width);
  int64_t* keys = w.rows.data();  // each key's row within its head
  for (int64_t j = 0, b = 0; j < num_keys; j += bs, ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * bs, n = std::min(bs, num_keys - j);
    for (int64_t i = 0; i < n; ++i) keys[j + i] = base + i;
  }
  w.q.resize(rows * kD);
  float* qs = w.q.data();
  for (int64_t t = 0; t < tq; ++t) {
    const float* src = a.q + ((q_start + t0 + t) * H + h * G) * kD;
    for (int64_t i = 0; i < G * kD; ++i) qs[t * G * kD + i] = src[i] * a.scale;
  }
  w.scores.resize(rows * width);
  float* scores = w.scores.data();
  w.kt.resize(kD * kChunk);
  float* kt = w.kt.data();

  for (int64_t c0 = 0; c0 < num_keys; c0 += kChunk) {
    const int64_t n = std::min(kChunk, num_keys - c0);
    for (int64_t i = 0; i < kChunk; ++i) {  // kt[d, i] = k_{c0+i}[d]
      if (i < n) {
        const float* kr = kbase + keys[c0 + i] * kD;
        for (int64_t d = 0; d < kD; ++d) kt[d * kChunk + i] = kr[d];
      } else {
        for (int64_t d = 0; d < kD; ++d) kt[d * kChunk + i] = 0.f;
      }
    }
    int64_t r = std::max<int64_t>(0, c0 - first_pos) * G;  // first row that sees key c0
    for (; r + 6 <= rows; r += 6) QkRowsAvx2<6>(qs + r * kD, kt, kD, scores + r * width + c0, width);
    switch (rows - r) {
      case 5: QkRowsAvx2<5>(qs + r * kD, kt, kD, scores + r * width + c0, width); break;
      case 4: QkRowsAvx2<4>(qs + r * kD, kt, kD, scores + r * width + c0, width); break;
      case 3: QkRowsAvx2<3>(qs + r * kD, kt, kD, scores + r * width + c0, width); break;
      case 2: QkRowsAvx2<2>(qs + r * kD, kt, kD, scores + r * width + c0, width); break;
      case 1: QkRowsAvx2<1>(qs + r * kD, kt, kD, scores + r * width + c0, width); break;
      default: break;
    }
  }

  CausalSoftmax(scores, rows, width, first_pos, G, w.inv_sum);

  for (int64_t r = 0; r < rows; r += 3) {
    const int64_t rn = std::min<int64_t>(3, rows - r);
    const int64_t nk = std::min(num_keys, first_pos + (r + rn - 1) / G + 1);  // keys the group's last row sees
    float* dst[3];
    for (int64_t i = 0; i < rn; ++i) {
      const int64_t t = (r + i) / G, g = (r + i) % G;
      dst[i] = a.out + ((out_start + t0 + t) * H + h * G + g) * kD;
    }
    const float* p = scores + r * width;
    const float* inv = w.inv_sum.data() + r;
    for (int64_t col = 0; col < kD; col += 32) {
      if (rn == 3) PvRowsAvx2<3, kD>(p, width, vbase, keys, nk, col, inv, dst);
      else if (rn == 2) PvRowsAvx2<2, kD>(p, width, vbase, keys, nk, col, inv, dst);
      else PvRowsAvx2<1, kD>(p, width, vbase, keys, nk, col, inv, dst);
    }
  }
}
#endif

inline void AttendTileDispatch(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, Scratch& w) {
#ifdef FDX_ATTEND_ONE
  if (tq == 1) {  // a decode token (or a prefill chunk's last, alone in its tile)
    if (a.head_dim == 64) return AttendOne<64>(a, s, h, t0, w);
    if (a.head_dim == 128) return AttendOne<128>(a, s, h, t0, w);
  }
  if (a.head_dim == 64) return AttendTileAvx2<64>(a, s, h, t0, tq, w);
  if (a.head_dim == 128) return AttendTileAvx2<128>(a, s, h, t0, tq, w);
#endif
  switch (a.head_dim) {
    case 64: return AttendTile<64>(a, s, h, t0, tq, w);
    case 128: return AttendTile<128>(a, s, h, t0, tq, w);
    default: return AttendTile<0>(a, s, h, t0, tq, w);
  }
}

#ifdef FDX_ATTEND_ONE
// Decode steps with fewer (sequence, kv head) items than twice the threads (batch 1:
// 3 kv heads on 2 threads, which left one thread idle a third of the time, or both
// when the work was under kMinParallelWork) split each item's keys into parts of at
// least kMinSplitKeys, one work item a part, and merge the parts' softmaxes after
// (flash-decoding). Batch 1 of SmolLM2 (9 / 3 heads of 64), 30 layers with the caches
// evicted between passes, Zen 5, 2 threads, median of 30: 128 keys 0.66 ms serially
// -> 0.46 split, 192 1.03 -> 0.64, 512 2.70 -> 1.54, 1024 5.38 -> 2.79.
constexpr int64_t kMinSplitKeys = 32;
constexpr int64_t kMinSplitWork = 1024;  // key x query-head products below which one thread is faster

// True when it ran the step (a decode-only batch of head_dim 64 or 128, worth splitting).
inline bool AttendSplit(const Args& a, int64_t S, int64_t num_kv_heads, int64_t threads) {
  const int32_t* info = a.seq_info;
  const int64_t D = a.head_dim, G = a.group, items = S * num_kv_heads;
  if ((D != 64 && D != 128) || threads < 2 || items >= 2 * threads) return false;
  int64_t work = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (info[s * 4 + 1] != 1) return false;
    work += info[s * 4 + 2] + 1;
  }
  if (work * G * num_kv_heads < kMinSplitWork) return false;
  const int64_t want = (2 * threads + items - 1) / items;  // parts an item
  struct Part {
    int64_t s, h, k0, k1;
  };
  std::vector<Part> parts;
  std::vector<int64_t> first(items + 1);  // item i's parts: [first[i], first[i + 1])
  for (int64_t s = 0; s < S; ++s) {
    const int64_t keys = info[s * 4 + 2] + 1;
    const int64_t np = std::max<int64_t>(1, std::min(want, keys / kMinSplitKeys));
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      first[s * num_kv_heads + h] = static_cast<int64_t>(parts.size());
      for (int64_t p = 0; p < np; ++p) parts.push_back({s, h, keys * p / np, keys * (p + 1) / np});
    }
  }
  first[items] = static_cast<int64_t>(parts.size());
  const int64_t n = static_cast<int64_t>(parts.size());
  thread_local std::vector<float> buf;  // per part: G x D unnormalized outputs, G maxima, G sums
  const int64_t stride = G * (D + 2);
  buf.resize(n * stride);
  float* const parts_out = buf.data();  // the caller's (buf names each thread's own in the region)
  std::atomic<int64_t> next{0};
#pragma omp parallel if (n > 1)
  {
    Scratch& w = ThreadScratch();
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      const Part& p = parts[i];
      float* out = parts_out + i * stride;
      if (D == 64) AttendOne<64>(a, p.s, p.h, 0, p.k0, p.k1, w, out, out + G * D, out + G * D + G);
      else AttendOne<128>(a, p.s, p.h, 0, p.k0, p.k1, w, out, out + G * D, out + G * D + G);
    }
  }
  for (int64_t it = 0; it < items; ++it) {
    const int64_t s = it / num_kv_heads, h = it % num_kv_heads;
    float* dst = a.out + (info[s * 4 + 3] * a.num_heads + h * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      float mx = -INFINITY;
      for (int64_t i = first[it]; i < first[it + 1]; ++i) mx = std::max(mx, parts_out[i * stride + G * D + g]);
      float total = 0.f;
      float* o = dst + g * D;
      std::fill(o, o + D, 0.f);
      for (int64_t i = first[it]; i < first[it + 1]; ++i) {
        const float* part = parts_out + i * stride;
        const float f = std::exp(part[G * D + g] - mx);
        total += f * part[G * D + G + g];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += f * part[g * D + d];
      }
      const float inv = 1.f / total;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
  return true;
}
#endif

}  // namespace fdx

#include "invariant_attention.h"

namespace fdx {

namespace inv {
#ifdef FDX_X86_BUILDS
void Avx2Attention(const Args& a, int64_t S, int64_t num_kv_heads, int threads);  // isa_avx2.cc
#endif
}  // namespace inv

// Runs every (sequence, kv head, query tile) item of a batch of S sequences.
inline void PagedAttention(const Args& a, int64_t S, int64_t num_kv_heads) {
  if (a.invariant) {
#if defined(FDX_X86_BUILDS) && defined(__AVX2__) && defined(__FMA__)
    if (a.head_dim % 32 == 0) return inv::Avx2Attention(a, S, num_kv_heads, omp_get_max_threads());
#endif
    return inv::Kernel<inv::PortableOps>::Run(a, S, num_kv_heads, omp_get_max_threads());
  }
#ifdef FDX_ATTEND_ONE
  if (AttendSplit(a, S, num_kv_heads, omp_get_max_threads())) return;
#endif
  const int32_t* info = a.seq_info;
  struct Item {
    int64_t s, h, t0, tq;
  };
  std::vector<Item> items;
  int64_t work = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = info[s * 4 + 1], ctx = info[s * 4 + 2];
    work += (ctx + q_len) * q_len;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t t0 = 0; t0 < q_len; t0 += kQueryTile) items.push_back({s, h, t0, std::min(kQueryTile, q_len - t0)});
  }
  work *= a.group * num_kv_heads;
  const int64_t n = static_cast<int64_t>(items.size());
  // Longest items first, so that no thread is left with a long one at the end.
  auto cost = [info](const Item& it) { return (info[it.s * 4 + 2] + it.t0 + it.tq) * it.tq; };
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) { return cost(x) > cost(y); });

  // Dynamic scheduling by hand: only GOMP_parallel is needed, which Intel's
  // libiomp5 (MKL's runtime, shared with Paddle's GEMMs) provides too.
  std::atomic<int64_t> next{0};
#pragma omp parallel if (n > 1 && work >= kMinParallelWork)
  {
    Scratch& w = ThreadScratch();
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      AttendTileDispatch(a, items[i].s, items[i].h, items[i].t0, items[i].tq, w);
  }
}

}  // namespace fdx
