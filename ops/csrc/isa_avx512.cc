// The AVX-512 builds of fdx's float32 product (f32_kernels.inc) and of the batch-invariant
// attention's primitives (invariant_attention.h): a translation unit of its own (ops/cpp.py
// compiles it apart and links the objects). Empty without x86 (or with FDX_NO_X86), as
// isa_avx2.cc.
#include "f32_kernels.h"
#include "paged_attention_kernel.h"

#ifdef FDX_X86_BUILDS
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f")
#define FDX_F_NS avx512
#define FDX_F_SIMD 3
#include "f32_kernels.inc"
#undef FDX_F_NS
#undef FDX_F_SIMD

namespace fdx::f32 {
void Avx512Matmul(const float* w, int64_t K, int64_t N, const float* x, int64_t M, float* out, int64_t ldo) {
  avx512::Matmul(w, K, N, x, M, out, ldo);
}
}  // namespace fdx::f32


namespace fdx::inv {

// The primitives of invariant_attention.h in AVX-512 registers (head_dim % 32 == 0), in the
// AVX2 build's order, so a row has the same bits on either (each score: a multiply-add chain
// a lane d % 8, the 8 lanes summed ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)); each P.V
// element: a multiply-add chain over the keys in order; the same exp polynomial, the same 8
// lane sums of a part's exps). What changes is how many of them a register holds:
//   - a part's scores for many rows (a prefill tile's, a speculative step's verified rows):
//     its K transposed once (16 keys a register), then each lane chain is a register of 16
//     keys (a broadcast q element times a K row a step), two chains at a time for 3 rows and
//     the part's 4 chunks of 16 keys, summed in Tree's order;
//   - few rows (a decode token's G heads): 4 keys at a time, two keys' 8 lanes a register;
//   - P.V: 16 columns a register, up to 6 rows at once; exp of 16 scores at once.
// Against the AVX2 primitives on Zen 5 (same bits, 1 thread, CPU time): 9 / 3 heads of 64, a
// 512-token prefill after 512 keys 0.55x, 32 decode rows at 256 keys 0.77x.
struct Avx512Ops {
  static constexpr int64_t kTransposeRows = 6;  // from this many rows a part's K is transposed
  static constexpr int kPvGroup = 6;            // rows per P.V group (4 x 6 accumulators at 64 columns)

  // keys u and u + 1's 8 floats at d in one register (u's in the low half).
  static inline __m512 KeyPair(const float* const* k, int u, int64_t d) {
    const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(k[u] + d)));
    return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(k[u + 1] + d)), 1));
  }
  // q's 8 floats at d in both halves.
  static inline __m512 QTwice(const float* q) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q))));
  }
  // hadd in each 128-bit lane, as _mm256_hadd_ps: [x0 + x1, x2 + x3, y0 + y1, y2 + y3].
  static inline __m512 Hadd(__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
  }

  // Avx2Ops::ScoresR's values (R <= 4 rows, 4 keys), two keys a 16-float register (keys 0, 1
  // and 2, 3): half its multiply-adds, its hadd tree on 128-bit lanes.
  template <int R>
  static inline void ScoresZ(const float* q, int64_t D, const float* const* k, float* out, int64_t ld) {
    __m512 acc[R][2];
    {
      const __m512 k01 = KeyPair(k, 0, 0), k23 = KeyPair(k, 2, 0);
      for (int r = 0; r < R; ++r) {
        const __m512 qv = QTwice(q + r * D);
        acc[r][0] = _mm512_mul_ps(qv, k01);
        acc[r][1] = _mm512_mul_ps(qv, k23);
      }
    }
    for (int64_t d = 8; d < D; d += 8) {
      const __m512 k01 = KeyPair(k, 0, d), k23 = KeyPair(k, 2, d);
      for (int r = 0; r < R; ++r) {
        const __m512 qv = QTwice(q + r * D + d);
        acc[r][0] = _mm512_fmadd_ps(qv, k01, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(qv, k23, acc[r][1]);
      }
    }
    const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int r = 0; r < R; ++r) {
      const __m512 h1 = Hadd(acc[r][0], acc[r][1]);  // 128-bit lanes: key 0 (+ 2) lanes 0-3, 4-7, key 1 (+ 3) ...
      const __m512 h2 = Hadd(h1, h1);                  // [(0+1)+(2+3) of keys 0, 2], [(4+5)+(6+7)], keys 1, 3 ...
      const __m512 s = _mm512_add_ps(h2, _mm512_shuffle_f32x4(h2, h2, 0xB1));  // lanes 0-3 + lanes 4-7
      _mm_storeu_ps(out + r * ld, _mm512_castps512_ps128(_mm512_permutexvar_ps(order, s)));
    }
  }

  // r[0..16) (16 floats each) transposed in place: r[c][i] = the old r[i][c].
  static inline void Transpose16(__m512* r) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    __m512 u[16];  // u[4 * i + m], 128-bit lane k: column 4k + m of rows 4i .. 4i + 3
    for (int i = 0; i < 4; ++i) {
      const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
      const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
      u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
      u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
      u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int m = 0; m < 4; ++m) {
      const __m512 x0 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x44), x1 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xEE);
      const __m512 y0 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x44),
                   y1 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xEE);
      r[m] = _mm512_shuffle_f32x4(x0, y0, 0x88);
      r[4 + m] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
      r[8 + m] = _mm512_shuffle_f32x4(x1, y1, 0x88);
      r[12 + m] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
    }
  }

  // kt[(c * D + d) * 16 + i] = k[16 c + i][d] for keys < n16 (a multiple of 16).
  static void TransposeKeys(const float* const* k, int64_t n16, int64_t D, float* kt) {
    for (int64_t c = 0; c < n16; c += 16)
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(k[c + i] + d0);
        Transpose16(r);
        float* dst = kt + (c * D + d0 * 16);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * 16, r[i]);
      }
  }

  // out[r][c] = P_l + P_{l+1} for R rows and NC chunks of 16 keys (kc: the first chunk's
  // transposed K, chunk stride 16 D): P_l, lane chain l of a score, is q_r[l] k[l] (a product)
  // then + q_r[d] k[d] (multiply-adds) for d = l + 8, l + 16, ... in order.
  template <int R, int NC>
  static inline void LanePair(const float* q, int64_t D, const float* kc, int l, __m512 (&out)[R][NC]) {
    __m512 a[R][NC], b[R][NC];
    for (int c = 0; c < NC; ++c) {
      __m512 k0 = _mm512_loadu_ps(kc + c * 16 * D + l * 16), k1 = _mm512_loadu_ps(kc + c * 16 * D + (l + 1) * 16);
      asm("" : "+v"(k0), "+v"(k1));  // in registers: the q elements broadcast from memory
      for (int r = 0; r < R; ++r) {
        a[r][c] = _mm512_mul_ps(_mm512_set1_ps(q[r * D + l]), k0);
        b[r][c] = _mm512_mul_ps(_mm512_set1_ps(q[r * D + l + 1]), k1);
      }
    }
    for (int64_t d = 8 + l; d < D; d += 8)
      for (int c = 0; c < NC; ++c) {
        __m512 k0 = _mm512_loadu_ps(kc + c * 16 * D + d * 16), k1 = _mm512_loadu_ps(kc + c * 16 * D + (d + 1) * 16);
        asm("" : "+v"(k0), "+v"(k1));
        for (int r = 0; r < R; ++r) {
          a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), k0, a[r][c]);
          b[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d + 1]), k1, b[r][c]);
        }
      }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NC; ++c) out[r][c] = _mm512_add_ps(a[r][c], b[r][c]);
  }

  // p[r * ldp + 16 c + i] = q_r . k_{16 c + i} for R rows and NC chunks of the transposed K
  // (kc: the first), the lane chains taken two at a time and summed as Tree sums them:
  // ((P0 + P1) + (P2 + P3)) + ((P4 + P5) + (P6 + P7)); 4 registers a row and chunk.
  template <int R, int NC>
  static inline void ScoresBlock(const float* q, int64_t D, const float* kc, float* p, int64_t ldp) {
    __m512 x[R][NC], y[R][NC];
    LanePair<R, NC>(q, D, kc, 0, x);
    LanePair<R, NC>(q, D, kc, 2, y);
    for (int r = 0; r < R; ++r)  // (P0 + P1) + (P2 + P3), parked in p
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(p + r * ldp + 16 * c, _mm512_add_ps(x[r][c], y[r][c]));
    LanePair<R, NC>(q, D, kc, 4, x);
    LanePair<R, NC>(q, D, kc, 6, y);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NC; ++c) {
        float* dst = p + r * ldp + 16 * c;
        _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), _mm512_add_ps(x[r][c], y[r][c])));
      }
  }

  // R rows against chunks [0, chunks) of the transposed kt (chunks <= 4: a part), a block
  // of 4 chunks (a whole part: 3 rows x 4 chunks x 2 chains, 24 registers), else of 2 and 1.
  template <int R>
  static inline void ScoresT(const float* q, int64_t D, const float* kt, int64_t chunks, float* p, int64_t ldp) {
    if (chunks == 4) return ScoresBlock<R, 4>(q, D, kt, p, ldp);
    int64_t c = 0;
    for (; c + 2 <= chunks; c += 2) ScoresBlock<R, 2>(q, D, kt + c * 16 * D, p + 16 * c, ldp);
    if (c < chunks) ScoresBlock<R, 1>(q, D, kt + c * 16 * D, p + 16 * c, ldp);
  }

  static void ScoresRows(int64_t R, const float* q, int64_t D, const float* const* k, const int64_t* len, float* p,
                         int64_t ldp, Scratch& w) {
    if (R >= kTransposeRows) {
      const int64_t n16 = (len[R - 1] + 15) / 16 * 16;
      w.kt.resize(kPartKeys * D);
      float* kt = w.kt.data();
      TransposeKeys(k, n16, D, kt);
      for (int64_t r = 0; r < R; r += 3) {
        const int n = static_cast<int>(std::min<int64_t>(3, R - r));
        const int64_t chunks = (len[r + n - 1] + 15) / 16;
        if (n == 3) ScoresT<3>(q + r * D, D, kt, chunks, p + r * ldp, ldp);
        else if (n == 2) ScoresT<2>(q + r * D, D, kt, chunks, p + r * ldp, ldp);
        else ScoresT<1>(q + r * D, D, kt, chunks, p + r * ldp, ldp);
      }
      return;
    }
    for (int64_t r = 0; r < R; r += 4) {  // R < 6: groups of 4 (G = 4: one), then the rest
      const int n = static_cast<int>(std::min<int64_t>(4, R - r));
      for (int64_t j = 0; j < len[r + n - 1]; j += 4) {
        if (n == 4) ScoresZ<4>(q + r * D, D, k + j, p + r * ldp + j, ldp);
        else if (n == 3) ScoresZ<3>(q + r * D, D, k + j, p + r * ldp + j, ldp);
        else if (n == 2) ScoresZ<2>(q + r * D, D, k + j, p + r * ldp + j, ldp);
        else ScoresZ<1>(q + r * D, D, k + j, p + r * ldp + j, ldp);
      }
    }
  }

  // exp(x) for x <= 0, Avx2Ops::Exp8's operations lane for lane; 0 below -87 and for -inf.
  static inline __m512 Exp16(__m512 x) {
    const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ), e);
  }

  static float Exp1(float x) { return _mm512_cvtss_f32(Exp16(_mm512_set1_ps(x))); }

  static inline float Tree(__m256 v) {
    const __m256 h = _mm256_hadd_ps(v, v);
    const __m256 h2 = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
  }

  // In place: row[0, n) -> exp(row - max), the row up to a multiple of 16 past n -> 0 (the
  // row has room: kPartKeys); the sum in 8 lanes (key j in lane j % 8) as Avx2Ops::ExpSum.
  static void ExpSum(float* row, int64_t n, float* mx, float* sum) {
    const int64_t padded = (n + 15) / 16 * 16;
    for (int64_t j = n; j < padded; ++j) row[j] = -INFINITY;
    __m512 m16 = _mm512_loadu_ps(row);
    for (int64_t j = 16; j < padded; j += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(row + j));
    const float m = _mm512_reduce_max_ps(m16);
    const __m512 mv = _mm512_set1_ps(m);
    __m256 s = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 16) {
      const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), mv));
      _mm512_storeu_ps(row + j, e);
      s = _mm256_add_ps(s, _mm512_castps512_ps256(e));  // keys j .. j + 7, then j + 8 .. j + 15 (0 past n)
      s = _mm256_add_ps(s, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    *mx = m;
    *sum = Tree(s);
  }

  // dst[r][col .. col + 16 C) = sum_j p[r * ldp + j] v_j[...] for R rows over n keys.
  template <int R, int C>
  static inline void PvBlock(const float* p, int64_t ldp, const float* vbase, const int64_t* keys, int64_t n,
                             int64_t D, int64_t col, float* acc) {
    __m512 o[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) o[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = vbase + keys[j] * D + col;
      __m512 v[C];
      for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vr + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512 e = _mm512_set1_ps(p[r * ldp + j]);
        for (int c = 0; c < C; ++c) o[r][c] = _mm512_fmadd_ps(e, v[c], o[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * D + col + 16 * c, o[r][c]);
  }

  template <int R>
  static inline void PvR(const float* p, int64_t ldp, const float* vbase, const int64_t* keys, int64_t n, int64_t D,
                         float* acc) {
    int64_t col = 0;
    for (; col + 64 <= D; col += 64) PvBlock<R, 4>(p, ldp, vbase, keys, n, D, col, acc);
    if (col < D) PvBlock<R, 2>(p, ldp, vbase, keys, n, D, col, acc);  // D % 32 == 0
  }

  static void PvRows(int64_t R, const float* p, int64_t ldp, const float* vbase, const int64_t* keys,
                     const int64_t* len, int64_t D, float* acc, Scratch&) {
    for (int64_t r = 0; r < R; r += kPvGroup) {
      const int64_t n = std::min<int64_t>(kPvGroup, R - r), nk = len[r + n - 1];
      const float* pr = p + r * ldp;
      float* ar = acc + r * D;
      switch (n) {
        case 1: PvR<1>(pr, ldp, vbase, keys, nk, D, ar); break;
        case 2: PvR<2>(pr, ldp, vbase, keys, nk, D, ar); break;
        case 3: PvR<3>(pr, ldp, vbase, keys, nk, D, ar); break;
        case 4: PvR<4>(pr, ldp, vbase, keys, nk, D, ar); break;
        case 5: PvR<5>(pr, ldp, vbase, keys, nk, D, ar); break;
        default: PvR<6>(pr, ldp, vbase, keys, nk, D, ar); break;
      }
    }
  }

  static void Merge(float* m, float* l, float* o, float pm, float pl, const float* pacc, int64_t D) {
    const float top = std::max(*m, pm);
    const float a = Exp1(*m - top), b = Exp1(pm - top);
    *m = top;
    *l = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(*l), _mm_set_ss(a), _mm_mul_ss(_mm_set_ss(pl), _mm_set_ss(b))));
    const __m512 av = _mm512_set1_ps(a), bv = _mm512_set1_ps(b);
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(o + d, _mm512_fmadd_ps(_mm512_loadu_ps(o + d), av, _mm512_mul_ps(_mm512_loadu_ps(pacc + d), bv)));
  }

  static void Finish(const float* o, float l, int64_t D, float* dst) {
    const __m512 inv = _mm512_set1_ps(1.f / l);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), inv));
  }
};

// head_dim % 32 == 0 (the caller checks, and that the CPU has AVX-512 F).
void Avx512Attention(const Args& a, int64_t S, int64_t num_kv_heads, int threads) {
  Kernel<Avx512Ops>::Run(a, S, num_kv_heads, threads);
}

}  // namespace fdx::inv

#pragma GCC pop_options
#endif  // FDX_X86_BUILDS
