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
// 256-bit, in the AVX-512 build too); the k-quants, and every kind in the portable
// build, one weight row against up to four activation rows (RowDot). Every path sums
// a row's blocks in block order into the same accumulators, whatever the tile, the
// row count M or the threads (which split output rows, never blocks): a row's bits do
// not depend on the other rows (issue 40 item 4). Every M takes this path (the
// dequantize + BLAS path for many rows, with float activations, is gone).
// Dequantize(w) -> [rows, cols] float32 (the probes and tests).
//
// Three builds of the same source (quant_kernels.inc, each in a namespace of its
// own): `portable` (plain C++, the compiler's flags), included here; `avx2` (AVX2 +
// FMA + F16C) and `avx512` (AVX-512 F/BW/VL: two activation rows a 512-bit
// register), each in a translation unit of its own (isa_avx2.cc, isa_avx512.cc: the
// only ones that include <immintrin.h>), declared here. On a compiler or CPU without
// x86 (or with FDX_NO_X86 defined) those units are empty and only the portable build
// exists. Which one runs is the caller's choice (the probed kernel table); a variant
// this CPU lacks dies by SIGILL in the probe child, never here.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace fdx::quant {

enum Kind : int { kQ8_0 = 0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K, kWint8, kWint4, kNumKinds };
enum Variant : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// Elements and bytes per block of each kind (wint: per 32 elements).
constexpr int64_t kBlockElems[kNumKinds] = {32, 32, 32, 32, 32, 256, 256, 256, 32, 32};
constexpr int64_t kBlockBytes[kNumKinds] = {34, 18, 20, 22, 24, 144, 176, 210, 32, 16};

struct XBlock {  // one block of 32 activations as int8: x ~ d * q
  float d;
  float dsum;  // d * sum(q), for the weight's offset m
  int8_t q[32];
};

struct Weights {
  const uint8_t* data;  // [rows, row_bytes]
  const float* scales;  // wint8: [rows]; wint4: [rows, cols / group]; else unused
  int64_t rows, cols, row_bytes, group;
  int kind;
};

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

// a * b + c, fused where the build has FMA (one rounding) and plain where it has not:
// written out, so the compiler's contraction does not choose which product to fuse.
inline float Fma(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// How far ahead of a weight row the tiles prefetch, in bytes (TileDot's comment).
constexpr int64_t kQuantPrefetch = 8192;

// Weights decoded per call below this many (rows x cols x M) use one thread.
constexpr int64_t kQuantMinParallel = 1 << 16;

}  // namespace fdx::quant

#if (defined(__x86_64__) || defined(__i386__)) && !defined(FDX_NO_X86)
#define FDX_X86_BUILDS 1
#endif

#define FDX_Q_NS portable
#define FDX_Q_SIMD 0
#include "quant_kernels.inc"
#undef FDX_Q_NS
#undef FDX_Q_SIMD

namespace fdx::quant {

#ifdef FDX_X86_BUILDS
// The x86 builds (isa_avx2.cc, isa_avx512.cc).
void Avx2Matmul(const Weights& w, const float* x, int64_t M, float* out);
void Avx2Dequantize(const Weights& w, float* out);
void Avx512Matmul(const Weights& w, const float* x, int64_t M, float* out);
void Avx512Dequantize(const Weights& w, float* out);
#endif

// Matmul and Dequantize by `variant`; without the x86 builds every variant is the portable one.
inline void Matmul(int variant, const Weights& w, const float* x, int64_t M, float* out) {
  switch (variant) {
#ifdef FDX_X86_BUILDS
    case kAvx512: Avx512Matmul(w, x, M, out); break;
    case kAvx2: Avx2Matmul(w, x, M, out); break;
#endif
    default: portable::Matmul(w, x, M, out); break;
  }
}

inline void Dequantize(int variant, const Weights& w, float* out) {
  switch (variant) {
#ifdef FDX_X86_BUILDS
    case kAvx512: Avx512Dequantize(w, out); break;
    case kAvx2: Avx2Dequantize(w, out); break;
#endif
    default: portable::Dequantize(w, out); break;
  }
}

}  // namespace fdx::quant
