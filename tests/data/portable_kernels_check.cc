// inv's portable kernels alone, without any x86 extension (tests/test_portable_build.py):
// the float32 product, the RMS norm and the paged attention (main's and the
// batch-invariant one), compiled with FDX_NO_X86 and the x86 extensions switched off,
// behind a few C functions the test calls through ctypes and compares with numpy. Not
// part of fdx's build. (The quantized products are helper repack's: quant_kernels.h.)
#include "f32_kernels.h"
#include "fused_kernels.h"
#include "paged_attention_kernel.h"

#if defined(__AVX__) || defined(__AVX2__) || defined(__FMA__) || defined(__SSE4_2__)
#error "built with an x86 extension: the test builds this with them off"
#endif
#if defined(_IMMINTRIN_H_INCLUDED) || defined(FDX_X86_BUILDS)
#error "the portable unit included <immintrin.h> or declared the x86 builds"
#endif

extern "C" {

void check_f32_matmul(const float* w, int64_t K, int64_t N, const float* x, int64_t M, float* out) {
  fdx::f32::Matmul(fdx::f32::kAvx2, w, K, N, x, M, out, N);  // any variant: only the portable build exists here
}

void check_rms_norm(const float* x, const float* w, float eps, int64_t N, int64_t H, float* out) {
  fdx::RmsNorm(x, nullptr, w, eps, N, H, out, nullptr);
}

void check_attention(const float* q, const float* k, const float* v, float* out, const int32_t* seq_info,
                     const int32_t* tables, int64_t table_width, int64_t H, int64_t KVH, int64_t D,
                     int64_t block_size, int64_t num_slots, float scale, int64_t S, int invariant) {
  fdx::Args a{q, k, v, out, seq_info, tables, table_width, H, H / KVH, D, block_size, num_slots, scale};
  a.invariant = invariant != 0;
  fdx::PagedAttention(a, S, KVH);
}

}  // extern "C"
