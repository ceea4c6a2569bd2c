// The float32 product for a few activation rows (bound in fdx_ops.cc, called by
// decoder_layer.h).
//
// Matmul(w [K, N], x [M, K]) -> out [M, N] (row stride ldo, so a product can
// write a slice of a wider buffer): the weight as fdx's dense format holds it,
// [in, out] row-major. At a batch of one a product is memory bound: the weight
// must stream once at the machine's read bandwidth, so every weight row block
// (kDepth rows, read in sequence) is applied to all M activation rows while it
// sits in L1, the output columns split over the OpenMP threads. For many rows a
// BLAS sgemm wins (it blocks for registers and caches); the caller picks by M.
//
// Three builds of one source (f32_kernels.inc under #pragma GCC target, each in
// a namespace of its own): `portable` (the compiler's flags), `avx2` (AVX2 +
// FMA), `avx512` (AVX-512 F). Which runs is the caller's choice (the probed
// kernel table), as for quant_kernels.h: a build this CPU lacks is never called.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace fdx::f32 {

enum Variant : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };  // = quant::Variant

// Products below this many multiply-adds run on one thread.
constexpr int64_t kMinParallel = 1 << 16;

}  // namespace fdx::f32

#pragma GCC push_options
#define FDX_F_NS portable
#define FDX_F_SIMD 0
#include "f32_kernels.inc"
#undef FDX_F_NS
#undef FDX_F_SIMD
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define FDX_F_NS avx2
#define FDX_F_SIMD 2
#include "f32_kernels.inc"
#undef FDX_F_NS
#undef FDX_F_SIMD
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f")
#define FDX_F_NS avx512
#define FDX_F_SIMD 3
#include "f32_kernels.inc"
#undef FDX_F_NS
#undef FDX_F_SIMD
#pragma GCC pop_options

namespace fdx::f32 {

inline void Matmul(int variant, const float* w, int64_t K, int64_t N, const float* x, int64_t M, float* out,
                   int64_t ldo) {
  switch (variant) {
    case kAvx512: avx512::Matmul(w, K, N, x, M, out, ldo); break;
    case kAvx2: avx2::Matmul(w, K, N, x, M, out, ldo); break;
    default: portable::Matmul(w, K, N, x, M, out, ldo); break;
  }
}

}  // namespace fdx::f32
