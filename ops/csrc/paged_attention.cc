// Paddle custom op binding of the paged attention kernel (paged_attention_kernel.h):
// fdx_paged_attention(q [N, H, D], k_cache, v_cache [KVH * num_slots, D],
// seq_info int32 [S, 4], block_tables int32 [S, W]) -> [num_out_tokens, H, D].
// All inputs are contiguous float32 / int32 CPU tensors.
#include <vector>

#include "paddle/extension.h"
#include "paged_attention_kernel.h"

namespace {

void CheckFloat2d(const paddle::Tensor& x, const char* name) {
  PD_CHECK(x.is_cpu(), name, " must be a CPU tensor");
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, name, " must be float32");
}

}  // namespace

std::vector<paddle::Tensor> PagedAttentionForward(const paddle::Tensor& q,
                                                  const paddle::Tensor& k_cache,
                                                  const paddle::Tensor& v_cache,
                                                  const paddle::Tensor& seq_info,
                                                  const paddle::Tensor& block_tables,
                                                  float scale,
                                                  int64_t num_kv_heads,
                                                  int64_t block_size,
                                                  int64_t num_out_tokens) {
  CheckFloat2d(q, "q");
  CheckFloat2d(k_cache, "k_cache");
  CheckFloat2d(v_cache, "v_cache");
  PD_CHECK(q.shape().size() == 3, "q must be [N, H, D]");
  PD_CHECK(k_cache.shape().size() == 2 && k_cache.shape() == v_cache.shape(),
           "k_cache and v_cache must both be [KVH * num_slots, D]");
  PD_CHECK(seq_info.dtype() == paddle::DataType::INT32 && block_tables.dtype() == paddle::DataType::INT32,
           "seq_info and block_tables must be int32");
  PD_CHECK(seq_info.shape().size() == 2 && seq_info.shape()[1] == 4, "seq_info must be [S, 4]");
  PD_CHECK(block_tables.shape().size() == 2 && block_tables.shape()[0] == seq_info.shape()[0],
           "block_tables must be [S, W]");
  const int64_t H = q.shape()[1], D = q.shape()[2];
  PD_CHECK(num_kv_heads > 0 && H % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  PD_CHECK(block_size > 0, "block_size must be positive");
  PD_CHECK(k_cache.shape()[1] == D, "cache head_dim differs from q's");
  PD_CHECK(k_cache.shape()[0] % num_kv_heads == 0, "cache rows must be a multiple of num_kv_heads");

  auto out = paddle::empty({num_out_tokens, H, D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const fdx::Args a{q.data<float>(),      k_cache.data<float>(),       v_cache.data<float>(),
                    out.data<float>(),    seq_info.data<int32_t>(),    block_tables.data<int32_t>(),
                    block_tables.shape()[1],  // table_width
                    H,                        // num_heads
                    H / num_kv_heads,         // group
                    D,                        // head_dim
                    block_size,
                    k_cache.shape()[0] / num_kv_heads,  // num_slots
                    scale};
  fdx::PagedAttention(a, seq_info.shape()[0], num_kv_heads);
  return {out};
}

std::vector<std::vector<int64_t>> PagedAttentionInferShape(const std::vector<int64_t>& q_shape,
                                                           const std::vector<int64_t>&,
                                                           const std::vector<int64_t>&,
                                                           const std::vector<int64_t>&,
                                                           const std::vector<int64_t>&,
                                                           float,
                                                           int64_t,
                                                           int64_t,
                                                           int64_t num_out_tokens) {
  return {{num_out_tokens, q_shape[1], q_shape[2]}};
}

std::vector<paddle::DataType> PagedAttentionInferDtype(const paddle::DataType& q_dtype,
                                                       const paddle::DataType&,
                                                       const paddle::DataType&,
                                                       const paddle::DataType&,
                                                       const paddle::DataType&) {
  return {q_dtype};
}

PD_BUILD_OP(fdx_paged_attention)
    .Inputs({"Q", "KCache", "VCache", "SeqInfo", "BlockTables"})
    .Outputs({"Out"})
    .Attrs({"scale: float", "num_kv_heads: int64_t", "block_size: int64_t", "num_out_tokens: int64_t"})
    .SetKernelFn(PD_KERNEL(PagedAttentionForward))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedAttentionInferDtype));
