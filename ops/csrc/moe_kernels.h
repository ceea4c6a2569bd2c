// The routed experts of one mixture-of-experts layer in one call (bound in fdx_ops.cc,
// fdx_moe_experts; fdx.ops.moe drives it).
//
// The experts' weights are stacked: gate+up [E, 2I, H] and down [E, H, I] in numpy
// order (one output per row), each expert's matrix laid out exactly as the dense
// products read a 2-D weight (quant_kernels.h: GGUF's raw blocks, wint8/wint4 with
// their scales [E, rows(, groups)], the rows interleaved when repacked at load), or
// float32 [E, in, out] (f32_kernels.h's [K, N] layout), so each expert multiplies
// by the dense path's own row kernels (quant::Matmul, f32::Matmul): nothing here
// decodes a block.
//
// MoeExperts(x [N, H], ids [N, k], weights [N, k]) -> out [N, H]:
//   1. the N * k (row, slot) places are sorted by expert (a stable counting sort:
//      within an expert, by row then slot) and x's rows gathered in that order;
//   2. each expert that any place chose multiplies all of its rows in one call:
//      gate+up, then silu(gate) * up (fused_kernels.h's SiluAndMul), then down;
//   3. each row sums its k slots in slot order: out = w_0 * d_0, then += w_j * d_j.
// A row's result is the same whatever other rows share the call: the row kernels
// give a row the same bits at every row count under kCodeInvariant (the dense
// path's backend.batch_invariant: quant_kernels.h) and always for float32
// (f32_kernels.h), the output rows split over threads never split a sum, and
// step 3's order is the slots'.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "f32_kernels.h"
#include "fused_kernels.h"
#include "quant_kernels.h"

namespace fdx::moe {

constexpr int64_t kF32Experts = -1;  // a stack's code: float32 [E, in, out]

struct ExpertStack {
  const void* data;      // quant: uint8 [E, rows, row_bytes]; float32: [E, cols, rows]
  const float* scales;   // wint8: [E, rows]; wint4: [E, rows, cols / group]; else null
  int64_t code;          // quant_kernels.h's kind code (with its flags), or kF32Experts
  int64_t rows, cols, group;

  int64_t ScalesPerExpert() const {
    const int64_t kind = quant::CodeKind(code);
    return kind == quant::kWint8 ? rows : kind == quant::kWint4 ? rows * (cols / group) : 0;
  }

  // x [M, cols] @ expert e's matrix.T -> out [M, rows], by the dense path's row kernels.
  void Product(int variant, int64_t e, const float* x, int64_t M, float* out) const {
    if (code == kF32Experts) {
      const float* w = static_cast<const float*>(data) + e * rows * cols;
      f32::Matmul(variant, w, cols, rows, x, M, out, rows);
      return;
    }
    const int64_t kind = quant::CodeKind(code);
    const int64_t row_bytes = cols / quant::kBlockElems[kind] * quant::kBlockBytes[kind];
    const uint8_t* d = static_cast<const uint8_t*>(data) + e * rows * row_bytes;
    const float* s = scales == nullptr ? nullptr : scales + e * ScalesPerExpert();
    quant::Matmul(variant, quant::MakeWeights(d, s, rows, cols, group, code), x, M, out);
  }
};

// counts[e]: places that chose expert e; order: the places (row * k + slot) grouped by expert.
inline void GroupByExpert(const int64_t* ids, int64_t places, int64_t experts, std::vector<int64_t>* counts,
                          std::vector<int64_t>* order) {
  counts->assign(experts, 0);
  for (int64_t p = 0; p < places; ++p) ++(*counts)[ids[p]];
  std::vector<int64_t> next(experts, 0);
  for (int64_t e = 1; e < experts; ++e) next[e] = next[e - 1] + (*counts)[e - 1];
  order->resize(places);
  for (int64_t p = 0; p < places; ++p) (*order)[next[ids[p]]++] = p;
}

inline void MoeExperts(int variant, const float* x, int64_t N, int64_t H, const int64_t* ids, const float* weights,
                       int64_t k, int64_t experts, int64_t inter, const ExpertStack& gate_up,
                       const ExpertStack& down, float* out) {
  const int64_t P = N * k;
  std::vector<int64_t> counts, order;
  GroupByExpert(ids, P, experts, &counts, &order);
  std::vector<float> xs(P * H), gu(P * 2 * inter), act(P * inter), ys(P * H);
  std::vector<int64_t> where(P);  // place -> its row in the grouped buffers
  for (int64_t i = 0; i < P; ++i) {
    where[order[i]] = i;
    std::memcpy(&xs[i * H], x + (order[i] / k) * H, H * sizeof(float));
  }
  for (int64_t e = 0, start = 0; e < experts; start += counts[e], ++e)
    if (counts[e]) gate_up.Product(variant, e, &xs[start * H], counts[e], &gu[start * 2 * inter]);
  SiluAndMul(gu.data(), act.data(), P, inter);
  for (int64_t e = 0, start = 0; e < experts; start += counts[e], ++e)
    if (counts[e]) down.Product(variant, e, &act[start * inter], counts[e], &ys[start * H]);
  for (int64_t n = 0; n < N; ++n) {
    float* o = out + n * H;
    const float w0 = weights[n * k];
    const float* y0 = &ys[where[n * k] * H];
    for (int64_t h = 0; h < H; ++h) o[h] = w0 * y0[h];
    for (int64_t j = 1; j < k; ++j) {
      const float w = weights[n * k + j];
      const float* y = &ys[where[n * k + j] * H];
      for (int64_t h = 0; h < H; ++h) o[h] += w * y[h];
    }
  }
}

}  // namespace fdx::moe
