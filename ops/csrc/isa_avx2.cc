// The AVX2 builds of the quantized and float32 products (quant_kernels.inc,
// f32_kernels.inc): a file of their own (compilable alone; fdx_ops.cc includes it at
// its end, so the extension links one source), the only place besides
// isa_avx512.cc that includes <immintrin.h>. Empty on a compiler or CPU
// without x86 (or with FDX_NO_X86): the portable unit (fdx_ops.cc) builds and runs
// alone there, and the kernel table offers only the portable builds.
#include "f32_kernels.h"
#include "quant_kernels.h"

#ifdef FDX_X86_BUILDS
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define FDX_Q_NS avx2
#define FDX_Q_SIMD 2
#include "quant_kernels.inc"
#undef FDX_Q_NS
#undef FDX_Q_SIMD
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define FDX_F_NS avx2
#define FDX_F_SIMD 2
#include "f32_kernels.inc"
#undef FDX_F_NS
#undef FDX_F_SIMD
#pragma GCC pop_options

namespace fdx::quant {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
void Avx2Matmul(const Weights& w, const float* x, int64_t M, float* out) { avx2::Matmul(w, x, M, out); }
void Avx2Dequantize(const Weights& w, float* out) { avx2::Dequantize(w, out); }
#pragma GCC pop_options

}  // namespace fdx::quant

namespace fdx::f32 {

#pragma GCC push_options
#pragma GCC target("avx2,fma")
void Avx2Matmul(const float* w, int64_t K, int64_t N, const float* x, int64_t M, float* out, int64_t ldo) {
  avx2::Matmul(w, K, N, x, M, out, ldo);
}
#pragma GCC pop_options

}  // namespace fdx::f32
#endif
