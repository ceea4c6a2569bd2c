// The AVX2 + FMA builds of fdx's own kernels: the float32 product (f32_kernels.inc) and
// the batch-invariant attention's primitives (invariant_attention.h). A file of its own,
// compilable alone, and with isa_avx512.cc the only place of inv's kernels that includes
// <immintrin.h>; fdx_ops.cc includes it at its end (ops/cpp.py: the extension links one
// source). Empty without x86 (or with FDX_NO_X86): the portable unit builds and runs
// alone there, and the kernel table offers only the portable builds.
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

namespace fdx::inv {

// The primitives of invariant_attention.h in AVX2 registers, head_dim % 32 == 0.
struct Avx2Ops {
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

  template <int R>
  static inline void PvR(const float* p, int64_t ldp, const float* vbase, const int64_t* keys, int64_t n, int64_t D,
                         float* acc) {
    for (int64_t col = 0; col < D; col += 32) {
      __m256 a[R][4];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const float* vr = vbase + keys[j] * D + col;
        const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8), v2 = _mm256_loadu_ps(vr + 16),
                     v3 = _mm256_loadu_ps(vr + 24);
        for (int r = 0; r < R; ++r) {
          const __m256 e = _mm256_broadcast_ss(p + r * ldp + j);
          a[r][0] = _mm256_fmadd_ps(e, v0, a[r][0]);
          a[r][1] = _mm256_fmadd_ps(e, v1, a[r][1]);
          a[r][2] = _mm256_fmadd_ps(e, v2, a[r][2]);
          a[r][3] = _mm256_fmadd_ps(e, v3, a[r][3]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + r * D + col + 8 * c, a[r][c]);
    }
  }

  static void Pv(int R, const float* p, int64_t ldp, const float* vbase, const int64_t* keys, int64_t n, int64_t D,
                 float* acc) {
    if (R == 3) PvR<3>(p, ldp, vbase, keys, n, D, acc);
    else if (R == 2) PvR<2>(p, ldp, vbase, keys, n, D, acc);
    else PvR<1>(p, ldp, vbase, keys, n, D, acc);
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
