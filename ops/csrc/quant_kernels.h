// Products with quantized weights read straight from their blocks (bound in fdx_ops.cc).
//
// A weight is [rows, cols] in numpy order (one output per row, blocks along
// cols), as fdx.ops.quant.QuantizedTensor holds it: GGUF's raw blocks for the
// GGML kinds, int8 + a float scale per row (wint8), or nibble pairs (value + 8,
// low first) + a float scale per group (wint4).
//
// Matmul(x [M, cols], w) -> [M, rows]: the activation rows are first quantized to
// int8 in blocks of 32 (XBlock: scale, sum of the quants, 32 quants), which is
// what every one of these formats' dot products wants: each weight block of 32
// (a k-quant's sub-block) is decoded in registers to 32 small integers q, with
// w = d * q + m (m = 0 for the signed kinds), and its product with an XBlock is
// dx * (d * sum(q * qx) + m * sum(qx)). Output rows are split over the OpenMP
// threads. The kinds with blocks of 32 (q8_0, q4_0/1, q5_0/1, wint8/4) in the SIMD
// builds multiply tiles of two weight rows x up to four activation rows (TileDot,
// 256-bit, in the AVX-512 build too; there q5_0, wint8 from 12 rows take
// 512-bit VNNI tiles on a CPU with AVX-512 VNNI, Q8VnniMatmul, q8_0 at every row count, wint8
// below 12 rows and both at every row count under kCodeInvariant 4 weight rows x up to 11
// activation rows, TileM1VnniQ8, and q4_1, q5_1, q4_0, wint4 at
// every row count 4 weight rows x up to 8 activation rows, M1VnniMatmul; in the AVX2 build from 16
// rows (q8_0, wint8: 32) 2 weight rows x 16 activation rows a lane each, OctMatmul,
// avx2_tiles.inc); every kind in the portable build
// one weight row against one activation row (RowDot). The k-quants quantize the
// activations per 256 instead (XBlockK) and sum each sub-block in int32 times its
// integer scale (TileDotK; with AVX-512 VNNI, vpdpbusd then vpdpwssd by the scales,
// TileKVnni; in the AVX2 build from 16 rows, but q3_k, OctMatmulK): q2_k, q3_k, q4_k, q5_k, q6_k.
// Weights repacked at load (kInterleave rows' blocks side by side) take tiles of 4 weight rows
// from one stream (q4_0 and wint4 only where the probe measured that layout faster on this
// machine: fdx.ops.quant.PROBED_REPACK_KINDS).
// From kPanelMinRows (12-32) activation rows every kind but q2_k/q3_k takes the panel
// product instead where the CPU has AVX-512 VNNI (panel_gemm.inc; under kCodeInvariant only
// q4_0, q4_1, q5_1 and wint4, in TileM1Vnni's float order, from kPanelM1MinRows).
// Dequantize(w) -> [rows, cols] float32, for the large-M path (BLAS).
//
// Three builds of the same source (quant_kernels.inc, included once per
// instruction set under #pragma GCC target, each in a namespace of its own):
// `portable` (plain C++, the compiler's flags), `avx2` (AVX2 + FMA + F16C) and
// `avx512` (AVX-512 F/BW/VL: two activation rows a 512-bit register). Which one
// runs is the caller's choice (the probed kernel table); a variant this CPU
// lacks dies by SIGILL in the probe child, never here.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace fdx::quant {

enum Kind : int { kQ8_0 = 0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K, kWint8, kWint4, kQ2_K, kQ3_K, kNumKinds };
enum Variant : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// Elements and bytes per block of each kind (wint: per 32 elements).
constexpr int64_t kBlockElems[kNumKinds] = {32, 32, 32, 32, 32, 256, 256, 256, 32, 32, 256, 256};
constexpr int64_t kBlockBytes[kNumKinds] = {34, 18, 20, 22, 24, 144, 176, 210, 32, 16, 84, 110};

struct XBlock {  // one block of 32 activations as int8: x ~ d * q
  float d;
  float dsum;  // d * sum(q), for the weight's offset m
  int8_t q[32];
};

struct XBlockK {  // one block of 256 activations as int8 (the k-quants'): x ~ d * q
  float d;
  int16_t bsum[16];  // the sum of each 16 quants
  int8_t q[256];
};

// Row groups of the interleaved (repacked) layout: kInterleave rows' block j lie
// next to each other, block j of row 4g + i at ((4g) * nb + 4j + i) * block bytes,
// so that a tile of 4 rows reads one stream. Only a weight whose rows are a
// multiple of kInterleave is repacked (fdx.ops.quant.QuantizedTensor.repack);
// any other keeps the plain layout (row r at r * row_bytes).
constexpr int64_t kInterleave = 4;

// A weight's kind as the Python side passes it: the Kind in the low 8 bits, then flags.
constexpr int64_t kCodeKindMask = 0xFF;
constexpr int64_t kCodeInterleaved = 1 << 8;  // the rows are interleaved by kInterleave
constexpr int64_t kCodeInvariant = 1 << 9;    // backend.batch_invariant: one path at every row count
constexpr int64_t kCodeRowTiles = 1 << 10;    // benchmarks only: main's kernels (q4_0 without the VNNI
                                              // many-row tiles, the k-quants without VNNI)
constexpr int64_t kCodeNoPanel = 1 << 11;     // benchmarks, tests: no panel product (panel_gemm.inc)
constexpr int64_t kCodePanel = 1 << 12;       // tests, benchmarks: the panel product at every row count

struct Weights {
  const uint8_t* data;  // [rows, row_bytes]
  const float* scales;  // wint8: [rows]; wint4: [rows, cols / group]; else unused
  int64_t rows, cols, row_bytes, group;
  int kind;
  bool interleaved = false;  // kCodeInterleaved
  bool invariant = false;    // kCodeInvariant
  bool row_tiles = false;    // kCodeRowTiles
  bool no_panel = false;     // kCodeNoPanel
  bool panel = false;        // kCodePanel

  // Where row r's blocks start, and the distance from one of its blocks to the next.
  const uint8_t* Row(int64_t r) const {
    if (!interleaved) return data + r * row_bytes;
    return data + (r - r % kInterleave) * row_bytes + (r % kInterleave) * BlockBytes();
  }
  int64_t Stride() const { return interleaved ? kInterleave * BlockBytes() : BlockBytes(); }
  int64_t BlockBytes() const;
};

inline int64_t CodeKind(int64_t code) { return code & kCodeKindMask; }

inline Weights MakeWeights(const uint8_t* data, const float* scales, int64_t rows, int64_t cols, int64_t group,
                           int64_t code) {
  const int kind = static_cast<int>(CodeKind(code));
  const int64_t row_bytes = cols / kBlockElems[kind] * kBlockBytes[kind];
  Weights w{data, scales, rows, cols, row_bytes, group, kind};
  w.interleaved = (code & kCodeInterleaved) != 0 && rows % kInterleave == 0;
  w.invariant = (code & kCodeInvariant) != 0;
  w.row_tiles = (code & kCodeRowTiles) != 0;
  w.no_panel = (code & kCodeNoPanel) != 0;
  w.panel = (code & kCodePanel) != 0;
  return w;
}

// IEEE half -> float without F16C.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while (!(man & 0x400));
    bits = sign | ((112 - e) << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t Load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t Load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A k-quant's 6-bit (scale, min) pair j of 8, from its 12 packed bytes.
inline void ScaleMinK4(int j, const uint8_t* q, int* sc, int* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// q3_k's 12 packed bytes -> its 16 6-bit scales minus 32 (ggml's order).
inline void ScalesQ3K(const uint8_t* p, int8_t* out) {
  constexpr uint32_t kM1 = 0x03030303u, kM2 = 0x0f0f0f0fu;
  const uint32_t a0 = Load32(p), a1 = Load32(p + 4), a2 = Load32(p + 8);
  const uint32_t aux[4] = {(a0 & kM2) | ((a2 & kM1) << 4), (a1 & kM2) | (((a2 >> 2) & kM1) << 4),
                           ((a0 >> 4) & kM2) | (((a2 >> 4) & kM1) << 4), ((a1 >> 4) & kM2) | (((a2 >> 6) & kM1) << 4)};
  uint8_t u[16];
  std::memcpy(u, aux, 16);
  for (int k = 0; k < 16; ++k) out[k] = static_cast<int8_t>(u[k] - 32);
}

inline int64_t Weights::BlockBytes() const {
  return kind == kWint8 ? 32 : kind == kWint4 ? 16 : kBlockBytes[kind];
}

// How far ahead of a weight row the tiles prefetch, in bytes (TileDot's comment).
constexpr int64_t kQuantPrefetch = 8192;

// Weights decoded per call below this many (rows x cols x M) use one thread.
constexpr int64_t kQuantMinParallel = 1 << 16;

}  // namespace fdx::quant

#pragma GCC push_options
#define FDX_Q_NS portable
#define FDX_Q_SIMD 0
#include "quant_kernels.inc"
#undef FDX_Q_NS
#undef FDX_Q_SIMD
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define FDX_Q_NS avx2
#define FDX_Q_SIMD 2
#include "quant_kernels.inc"
#undef FDX_Q_NS
#undef FDX_Q_SIMD
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#define FDX_Q_NS avx512
#define FDX_Q_SIMD 3
#include "quant_kernels.inc"
#undef FDX_Q_NS
#undef FDX_Q_SIMD
#pragma GCC pop_options

namespace fdx::quant {

inline void Matmul(int variant, const Weights& w, const float* x, int64_t M, float* out) {
  if (M <= 0) return;  // no activation rows (a step whose rows need no logits): nothing to write
  switch (variant) {
    case kAvx512: avx512::Matmul(w, x, M, out); break;
    case kAvx2: avx2::Matmul(w, x, M, out); break;
    default: portable::Matmul(w, x, M, out); break;
  }
}

inline void Dequantize(int variant, const Weights& w, float* out) {
  switch (variant) {
    case kAvx512: avx512::Dequantize(w, out); break;
    case kAvx2: avx2::Dequantize(w, out); break;
    default: portable::Dequantize(w, out); break;
  }
}

}  // namespace fdx::quant
