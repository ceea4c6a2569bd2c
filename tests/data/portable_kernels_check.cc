// The portable kernels alone, without any x86 extension (tests/test_portable_build.py):
// the headers fdx_ops.cc binds, compiled with FDX_NO_X86 and the x86 extensions
// switched off, behind a few C functions the test calls through ctypes and compares
// with numpy. Not part of fdx's build.
#include "decoder_layer.h"

#if defined(__AVX__) || defined(__AVX2__) || defined(__FMA__) || defined(__SSE4_2__)
#error "built with an x86 extension: the test builds this with them off"
#endif
#if defined(_IMMINTRIN_H_INCLUDED) || defined(FDX_X86_BUILDS)
#error "the portable unit included <immintrin.h> or declared the x86 builds"
#endif

extern "C" {

void check_quant_matmul(int kind, const uint8_t* data, const float* scales, int64_t rows, int64_t cols,
                        int64_t row_bytes, int64_t group, const float* x, int64_t M, float* out) {
  const fdx::quant::Weights w{data, scales, rows, cols, row_bytes, group, kind};
  fdx::quant::Matmul(fdx::quant::kAvx2, w, x, M, out);  // any variant: only the portable build exists here
}

void check_f32_matmul(const float* w, int64_t K, int64_t N, const float* x, int64_t M, float* out) {
  fdx::f32::Matmul(fdx::f32::kAvx2, w, K, N, x, M, out, N);
}

void check_rms_norm(const float* x, const float* w, float eps, int64_t N, int64_t H, float* out) {
  fdx::RmsNorm(x, nullptr, w, eps, N, H, out, nullptr);
}

void check_attention(const float* q, const float* k, const float* v, float* out, const int32_t* seq_info,
                     const int32_t* tables, int64_t table_width, int64_t H, int64_t KVH, int64_t D,
                     int64_t block_size, int64_t num_slots, float scale, int64_t S) {
  const fdx::Args a{q, k, v, out, seq_info, tables, table_width, H, H / KVH, D, block_size, num_slots, scale};
  fdx::PagedAttention(a, S, KVH);
}

}  // extern "C"
