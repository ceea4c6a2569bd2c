// The AVX-512 build of fdx's float32 product (f32_kernels.inc): a file of its own,
// compilable alone, included at the end of fdx_ops.cc (ops/cpp.py: the extension links
// one source). Empty without x86 (or with FDX_NO_X86), as isa_avx2.cc.
#include "f32_kernels.h"

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

#pragma GCC pop_options
#endif  // FDX_X86_BUILDS
