// The batch-invariant attention (invariant_attention.h) by each build of its primitives on
// the same step, behind one C function (tests/test_batch_invariance.py, which compiles this
// with isa_avx2.cc and isa_avx512.cc under fdx's own flags): primitives 0 portable, 1 AVX2,
// 2 AVX-512. Not part of fdx's build.
#include "paged_attention_kernel.h"

extern "C" void check_invariant_attention(const float* q, const float* k, const float* v, float* out,
                                          const int32_t* seq_info, const int32_t* tables, int64_t table_width,
                                          int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t num_slots,
                                          float scale, int64_t S, int threads, int primitives) {
  fdx::Args a{q, k, v, out, seq_info, tables, table_width, H, H / KVH, D, block_size, num_slots, scale, true};
  if (primitives == 2) fdx::inv::Avx512Attention(a, S, KVH, threads);
  else if (primitives == 1) fdx::inv::Avx2Attention(a, S, KVH, threads);
  else fdx::inv::Kernel<fdx::inv::PortableOps>::Run(a, S, KVH, threads);
}
