// The AVX512 builds of the quantized and float32 products (quant_kernels.inc,
// f32_kernels.inc): a file of their own (compilable alone; fdx_ops.cc includes it at
// its end, so the extension links one source), the only place besides
// isa_avx2.cc that includes <immintrin.h>. Empty on a compiler or CPU
// without x86 (or with FDX_NO_X86): the portable unit (fdx_ops.cc) builds and runs
// alone there, and the kernel table offers only the portable builds.
#include "f32_kernels.h"
#include "quant_kernels.h"

#ifdef FDX_X86_BUILDS
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#define FDX_Q_NS avx512
#define FDX_Q_SIMD 3
#include "quant_kernels.inc"
#undef FDX_Q_NS
#undef FDX_Q_SIMD
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f")
#define FDX_F_NS avx512
#define FDX_F_SIMD 3
#include "f32_kernels.inc"
#undef FDX_F_NS
#undef FDX_F_SIMD
#pragma GCC pop_options

namespace fdx::quant {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
void Avx512Matmul(const Weights& w, const float* x, int64_t M, float* out) { avx512::Matmul(w, x, M, out); }
void Avx512Dequantize(const Weights& w, float* out) { avx512::Dequantize(w, out); }
#pragma GCC pop_options

}  // namespace fdx::quant

namespace fdx::f32 {

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f")
void Avx512Matmul(const float* w, int64_t K, int64_t N, const float* x, int64_t M, float* out, int64_t ldo) {
  avx512::Matmul(w, K, N, x, M, out, ldo);
}
#pragma GCC pop_options

}  // namespace fdx::f32
#endif
