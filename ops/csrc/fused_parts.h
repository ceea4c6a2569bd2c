// A fused weight's parts in one product (bound in fdx_ops.cc through fused_parts_ops.inc;
// decoder_layer.h's Product calls it too).
//
// A fused q/k/v or gate/up is one to three parts stacked along its output rows, each in
// the kind the file stores it in (Q4_K_M: q and k in Q4_K, v in Q6_K). quant::Matmul
// quantizes its activation rows on every call, so a part a call quantized the same rows
// again. PartsMatmul quantizes each row once per activation form the parts take
// (quant_kernels.h: XBlock, int8 per 32 with a scale and sum, for q8_0, q4_0/1, q5_0/1,
// wint8/4; XBlockK, int8 per 256 with per-16 sums, for q4_k, q5_k, q6_k) and runs every
// part's product over them: the same functions, tiles, threads and order as quant::Matmul
// on that part alone (Tiles, MatmulKQuantized: under kCodeInvariant q8_0 takes TileM1VnniQ8
// at every row count here too), so each column's bits equal the per-part product's (and a
// row's do not depend on the other rows wherever quant::Matmul's do not: under
// kCodeInvariant at every row count, else up to fdx.ops.cpp.row_invariant_rows).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_kernels.h"

// The per-ISA builds of PartsMatmul come with quant_kernels.h's (fused_parts.inc).

namespace fdx::quant {

constexpr int kMaxFusedParts = 3;

// Whether a fused weight's parts (decoder_layer.h's WeightPart: kind, variant) take one
// PartsMatmul: two or more, every one GGML blocks, all in one build.
template <class Part>
inline bool PartsOneCall(const Part* parts, int n) {
  if (n < 2 || n > kMaxFusedParts) return false;
  for (int i = 0; i < n; ++i)
    if (parts[i].kind < 0 || parts[i].kind >= kWint8 || parts[i].variant != parts[0].variant) return false;
  return true;
}

// out [M, ldo] = x [M, cols] @ [parts].T in columns [0, sum of rows), every part in build `variant`.
inline void PartsMatmul(int variant, const Weights* parts, int n, const float* x, int64_t M, float* out,
                        int64_t ldo, std::vector<float>& tmp) {
  switch (variant) {
    case kAvx512: avx512::PartsMatmul(parts, n, x, M, out, ldo, tmp); break;
    case kAvx2: avx2::PartsMatmul(parts, n, x, M, out, ldo, tmp); break;
    default: portable::PartsMatmul(parts, n, x, M, out, ldo, tmp); break;
  }
}

}  // namespace fdx::quant
