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
// Three builds of one source (f32_kernels.inc, each in a namespace of its own):
// `portable` (the compiler's flags), included here; `avx2` (AVX2 + FMA) and `avx512`
// (AVX-512 F), in the x86 translation units (isa_avx2.cc, isa_avx512.cc), declared
// here, as for quant_kernels.h. Which runs is the caller's choice (the probed kernel
// table): a build this CPU lacks is never called.
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

#if (defined(__x86_64__) || defined(__i386__)) && !defined(FDX_NO_X86)
#define FDX_X86_BUILDS 1
#endif

#define FDX_F_NS portable
#define FDX_F_SIMD 0
#include "f32_kernels.inc"
#undef FDX_F_NS
#undef FDX_F_SIMD

namespace fdx::f32 {

#ifdef FDX_X86_BUILDS
// The x86 builds (isa_avx2.cc, isa_avx512.cc).
void Avx2Matmul(const float* w, int64_t K, int64_t N, const float* x, int64_t M, float* out, int64_t ldo);
void Avx512Matmul(const float* w, int64_t K, int64_t N, const float* x, int64_t M, float* out, int64_t ldo);
#endif

inline void Matmul(int variant, const float* w, int64_t K, int64_t N, const float* x, int64_t M, float* out,
                   int64_t ldo) {
  switch (variant) {
#ifdef FDX_X86_BUILDS
    case kAvx512: Avx512Matmul(w, K, N, x, M, out, ldo); break;
    case kAvx2: Avx2Matmul(w, K, N, x, M, out, ldo); break;
#endif
    default: portable::Matmul(w, K, N, x, M, out, ldo); break;
  }
}

}  // namespace fdx::f32
