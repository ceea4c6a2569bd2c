// The AVX2 + FMA builds of fdx's own kernels, a translation unit of its own (ops/cpp.py
// compiles it apart from the bindings and links the objects): the float32 product
// (f32_kernels.inc), the paged attention's tiles and decode split (paged_attention_kernel.h
// runs them where the CPU has AVX2 + FMA) and the batch-invariant attention's primitives
// (invariant_attention.h). With isa_avx512.cc the only place of these kernels that
// includes <immintrin.h>. Empty without x86 (or with FDX_NO_X86): the portable unit builds
// and runs alone there, and the kernel table offers only the portable builds.
#include "f32_kernels.h"
#include "paged_attention_kernel.h"

#ifdef FDX_X86_BUILDS
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define FDX_F_NS avx2
#define FDX_F_SIMD 2
#include "f32_kernels.inc"
#undef FDX_F_NS
#undef FDX_F_SIMD

namespace fdx::f32 {
void Avx2Matmul(const float* w, int64_t K, int64_t N, const float* x, int64_t M, float* out, int64_t ldo) {
  avx2::Matmul(w, K, N, x, M, out, ldo);
}
}  // namespace fdx::f32

namespace fdx::avx2 {

// dst[r][col .. col + 32) = sum_j p[r * ldp + j] * v_j[col .. col + 32) (times inv[r] when
// inv is given) for R <= 3 score rows over n keys (rows vbase + keys[j] * D), in every
// column block of 32: one multiply-add chain a lane over the keys in order, 12
// accumulators. The P.V of the decode token, of the prefill tile and of the batch-invariant
// kernel's parts (D % 32 == 0).
template <int R>
inline void PvRows(const float* p, int64_t ldp, const float* vbase, const int64_t* keys, int64_t n, int64_t D,
                   const float* inv, float* const* dst) {
  for (int64_t col = 0; col < D; col += 32) {
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = vbase + keys[j] * D + col;
      const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8), v2 = _mm256_loadu_ps(vr + 16),
                   v3 = _mm256_loadu_ps(vr + 24);
      for (int r = 0; r < R; ++r) {
        const __m256 e = _mm256_broadcast_ss(p + r * ldp + j);
        acc[r][0] = _mm256_fmadd_ps(e, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(e, v1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(e, v2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(e, v3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; ++r) {
      if (inv) {
        const __m256 s = _mm256_set1_ps(inv[r]);
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(dst[r] + col + 8 * c, _mm256_mul_ps(acc[r][c], s));
      } else {
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(dst[r] + col + 8 * c, acc[r][c]);
      }
    }
  }
}

inline void Pv(int R, const float* p, int64_t ldp, const float* vbase, const int64_t* keys, int64_t n, int64_t D,
               const float* inv, float* const* dst) {
  if (R == 3) PvRows<3>(p, ldp, vbase, keys, n, D, inv, dst);
  else if (R == 2) PvRows<2>(p, ldp, vbase, keys, n, D, inv, dst);
  else PvRows<1>(p, ldp, vbase, keys, n, D, inv, dst);
}

// A decode token (one query token: its G query heads) against kv head h, in AVX2
// registers of 8 floats: AttendTile's vector-extension code keeps a [rows, 4 x 16]
// accumulator that spills at this size (measured 2-3x slower per decode token at
// 9 / 3 heads of 64 over 192 keys). Scores 4 keys at a time, each key's D products
// summed across the register by one hadd tree for the 4; P.V in column blocks of
// 32 for up to 3 query heads at once (12 accumulators). kD % 32 == 0.
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
    float* const out[3] = {dst + g * kD, dst + (g + 1) * kD, dst + (g + 2) * kD};
    Pv(static_cast<int>(std::min<int64_t>(3, G - g)), scores + g * width, width, vbase, rows, num_keys, kD,
       w.inv_sum.data() + g, out);
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
inline void QkRows(const float* q, const float* kt, int64_t D, float* scores, int64_t width) {
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

template <int64_t kD>
void AttendPrefill(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, Scratch& w) {
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
    for (; r + 6 <= rows; r += 6) QkRows<6>(qs + r * kD, kt, kD, scores + r * width + c0, width);
    switch (rows - r) {
      case 5: QkRows<5>(qs + r * kD, kt, kD, scores + r * width + c0, width); break;
      case 4: QkRows<4>(qs + r * kD, kt, kD, scores + r * width + c0, width); break;
      case 3: QkRows<3>(qs + r * kD, kt, kD, scores + r * width + c0, width); break;
      case 2: QkRows<2>(qs + r * kD, kt, kD, scores + r * width + c0, width); break;
      case 1: QkRows<1>(qs + r * kD, kt, kD, scores + r * width + c0, width); break;
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
    Pv(static_cast<int>(rn), scores + r * width, width, vbase, keys, nk, kD, w.inv_sum.data() + r, dst);
  }
}

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

// The step's non-invariant attention (head_dim 64 or 128, else false): a decode-only batch
// with few items split over the threads, else every item by the AVX2 tiles.
bool PagedAttention(const Args& a, int64_t S, int64_t num_kv_heads) {
  if (a.head_dim != 64 && a.head_dim != 128) return false;
  if (AttendSplit(a, S, num_kv_heads, omp_get_max_threads())) return true;
  RunItems(a, S, num_kv_heads, [](const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, Scratch& w) {
    if (tq == 1) {  // a decode token (or a prefill chunk's last, alone in its tile)
      if (a.head_dim == 64) return AttendOne<64>(a, s, h, t0, w);
      return AttendOne<128>(a, s, h, t0, w);
    }
    if (a.head_dim == 64) return AttendPrefill<64>(a, s, h, t0, tq, w);
    return AttendPrefill<128>(a, s, h, t0, tq, w);
  });
  return true;
}

}  // namespace fdx::avx2

namespace fdx {
bool Avx2PagedAttention(const Args& a, int64_t S, int64_t num_kv_heads) {
  return avx2::PagedAttention(a, S, num_kv_heads);
}
}  // namespace fdx

namespace fdx::inv {

// The primitives of invariant_attention.h in AVX2 registers, head_dim % 32 == 0.
struct Avx2Ops : InThrees<Avx2Ops> {
  // The lanes of v summed ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)) (two hadds, the halves added).
  static inline float Tree(__m256 v) {
    const __m256 h = _mm256_hadd_ps(v, v);
    const __m256 h2 = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
  }

  template <int R>
  static inline void ScoresR(const float* q, int64_t D, const float* const* k, float* out, int64_t ld) {
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r) {
      const __m256 q0 = _mm256_loadu_ps(q + r * D);
      for (int u = 0; u < 4; ++u) acc[r][u] = _mm256_mul_ps(q0, _mm256_loadu_ps(k[u]));
    }
    for (int64_t d = 8; d < D; d += 8) {
      const __m256 k0 = _mm256_loadu_ps(k[0] + d), k1 = _mm256_loadu_ps(k[1] + d), k2 = _mm256_loadu_ps(k[2] + d),
                   k3 = _mm256_loadu_ps(k[3] + d);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * D + d);
        acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(qv, k2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(qv, k3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; ++r) {
      // per key: ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), as Tree, four keys at once
      const __m256 hh = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
      _mm_storeu_ps(out + r * ld, _mm_add_ps(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1)));
    }
  }

  static void Scores(int R, const float* q, int64_t D, const float* const* k, float* out, int64_t ld) {
    if (R == 3) ScoresR<3>(q, D, k, out, ld);
    else if (R == 2) ScoresR<2>(q, D, k, out, ld);
    else ScoresR<1>(q, D, k, out, ld);
  }

  // exp(x) for x <= 0 (ExpNonPositive's polynomial), 0 below -87 and for -inf.
  static inline __m256 Exp8(__m256 x) {
    const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), e);
  }

  static float Exp1(float x) { return _mm_cvtss_f32(_mm256_castps256_ps128(Exp8(_mm256_set1_ps(x)))); }

  // In place: row[0, n) -> exp(row - max); the 8-lane blocks past n read as -inf (0 after).
  static void ExpSum(float* row, int64_t n, float* mx, float* sum) {
    const int64_t padded = (n + 7) / 8 * 8;  // <= kPartKeys: row has room
    for (int64_t j = n; j < padded; ++j) row[j] = -INFINITY;
    __m256 m8 = _mm256_loadu_ps(row);
    for (int64_t j = 8; j < padded; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(row + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, m8);
    float m = lanes[0];
    for (int i = 1; i < 8; ++i) m = std::max(m, lanes[i]);
    const __m256 mv = _mm256_set1_ps(m);
    __m256 s = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
      const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), mv));
      _mm256_storeu_ps(row + j, e);
      s = _mm256_add_ps(s, e);
    }
    *mx = m;
    *sum = Tree(s);
  }

  static void Pv(int R, const float* p, int64_t ldp, const float* vbase, const int64_t* keys, int64_t n, int64_t D,
                 float* acc) {
    float* const dst[3] = {acc, acc + D, acc + 2 * D};
    avx2::Pv(R, p, ldp, vbase, keys, n, D, nullptr, dst);
  }

  static void Merge(float* m, float* l, float* o, float pm, float pl, const float* pacc, int64_t D) {
    const float top = std::max(*m, pm);
    const float a = Exp1(*m - top), b = Exp1(pm - top);
    *m = top;
    *l = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(*l), _mm_set_ss(a), _mm_mul_ss(_mm_set_ss(pl), _mm_set_ss(b))));
    const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b);
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(o + d, _mm256_fmadd_ps(_mm256_loadu_ps(o + d), av, _mm256_mul_ps(_mm256_loadu_ps(pacc + d), bv)));
  }

  static void Finish(const float* o, float l, int64_t D, float* dst) {
    const __m256 inv = _mm256_set1_ps(1.f / l);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
  }
};

// head_dim % 32 == 0 (the caller checks).
void Avx2Attention(const Args& a, int64_t S, int64_t num_kv_heads, int threads) {
  Kernel<Avx2Ops>::Run(a, S, num_kv_heads, threads);
}

}  // namespace fdx::inv

#pragma GCC pop_options
#endif  // FDX_X86_BUILDS
