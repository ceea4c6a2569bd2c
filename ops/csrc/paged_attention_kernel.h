// Paged attention kernel core, free of Paddle (bound in fdx_ops.cc; the AVX2 build of the
// tiles, of the decode split and of the batch-invariant kernel's primitives: isa_avx2.cc).
//
// Cache layout (see fdx/ops/attention.py): k, v are float32 [KVH * num_slots,
// D]; the row of (kv head h, slot s) is h * num_slots + s and slot =
// block_id * block_size + offset, so one block of one head is block_size
// contiguous rows, read where it lies.
//
// A work item is one tile of up to kQueryTile query tokens of one sequence
// against one kv head. It serves the G = H / KVH query heads sharing that kv
// head (Hugging Face repeat_kv: query head h uses kv head h / G), so each K/V
// row is read once per item. Items run in parallel with OpenMP.
//
// seq_info int32 [S, 4]: q_start (row of the sequence's first query token in
// q), query_len, context_len (tokens cached before this step's), out_start
// (row of its first output token). Query t sits at position context_len + t
// and attends to positions 0 .. context_len + t.
// tables int32 [S, table_width]: the sequence's block ids.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if (defined(__x86_64__) || defined(__i386__)) && !defined(FDX_NO_X86) && !defined(FDX_X86_BUILDS)
#define FDX_X86_BUILDS 1  // the x86 translation units (isa_avx2.cc, isa_avx512.cc) are built
#endif

namespace fdx {

// query tokens per item (bounds the score buffer). 32: each key chunk transposed once for
// twice the rows of 16 (a 512-token prefill's attention, 32 heads of 64, AVX-512 AttendTile,
// one thread, CPU time: 11.8-12.3 ms a layer against 13.7-13.9)
constexpr int64_t kQueryTile = 32;
constexpr int64_t kChunk = 16;              // keys per chunk (one 512-bit vector of scores)
constexpr int64_t kTransposeMinRows = 8;    // from this many query rows, transpose K chunks
constexpr int64_t kPvRows = 4;              // score rows per register-blocked P.V group
constexpr int64_t kMinParallelWork = 4096;  // key x query-row products below which one thread is faster

// 16 floats (one AVX-512 register, two AVX2 ones); unaligned loads and stores.
typedef float V16 __attribute__((vector_size(64), aligned(4), may_alias));

inline V16 Load16(const float* p) { return *reinterpret_cast<const V16*>(p); }
inline void Store16(float* p, V16 v) { *reinterpret_cast<V16*>(p) = v; }

// Tests only (ops/cpp.py paged_attention's `default_kernels`): the default mode's kernels of one
// build at every step, whatever InvariantStep would pick. A CPU that runs the invariant kernel's
// AVX-512 primitives takes that kernel at every step (head_dim % 32 == 0), so without this no
// test would reach the default kernels there, which AVX2-only CPUs still run.
enum class ForceDefault : int8_t {
  kNo,        // production: InvariantStep decides
  kAvx2,      // the AVX2 build's (isa_avx2.cc: head_dim 64 or 128, else the portable tiles)
  kPortable,  // the portable AttendTile (this unit's flags: -march=native, or the baseline)
};

struct Args {
  const float* q;    // [N, H, D]
  const float* k;    // [KVH * num_slots, D]
  const float* v;    // [KVH * num_slots, D]
  float* out;        // [num_out_tokens, H, D]
  const int32_t* seq_info;
  const int32_t* tables;
  int64_t table_width, num_heads, group, head_dim, block_size, num_slots;
  float scale;
  bool invariant = false;  // the batch-invariant kernel (invariant_attention.h): backend.batch_invariant
  ForceDefault force_default = ForceDefault::kNo;  // tests only (above); invariant wins over it
};

struct Scratch {
  std::vector<float> q, scores, acc, inv_sum, kt;
  std::vector<int64_t> rows;  // AttendOne: each key's row within its head
  std::vector<float> p, state;  // invariant_attention.h
  std::vector<int64_t> keys;
};

// The calling thread's scratch, kept across calls: no allocation per call once grown.
inline Scratch& ThreadScratch() {
  thread_local Scratch w;
  return w;
}

template <int64_t kD>
inline float DotN(const float* a, const float* b) {
  V16 acc = {};
#pragma GCC unroll 16
  for (int64_t v = 0; v < kD / 16; ++v) acc += Load16(a + 16 * v) * Load16(b + 16 * v);
  float sum = 0.f;
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) sum += acc[i];
  return sum;
}

inline float Dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void Axpy(float a, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// exp(x), vectorizable, for x <= 88.7 (softmax calls it after subtracting the
// row max, so x <= 0; SiLU through ExpClamped): relative error < 3e-7, 0 below -87.
inline float ExpNonPositive(float x) {
  const float xc = std::max(x, -87.0f);
  const float n = std::floor(xc * 1.44269504f + 0.5f);
  const float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.f : p * scale;
}

// Rows of the keys [c0, c0 + n) of one head in a paged cache (n <= kChunk).
// Softmax in place of a query tile's score rows [rows, width] (row r: query
// first_pos + r / G, which sees keys 0..first_pos + r / G); the rest of each row
// becomes 0, and inv_sum[r] = 1 / the row's sum.
inline void CausalSoftmax(float* scores, int64_t rows, int64_t width, int64_t first_pos, int64_t G,
                          std::vector<float>& inv_sum) {
  inv_sum.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * width;
    const int64_t valid = first_pos + r / G + 1;
    float mx = row[0];
#pragma omp simd reduction(max : mx)
    for (int64_t j = 1; j < valid; ++j) mx = std::max(mx, row[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < valid; ++j) {
      row[j] = ExpNonPositive(row[j] - mx);
      sum += row[j];
    }
    for (int64_t j = valid; j < width; ++j) row[j] = 0.f;
    inv_sum[r] = 1.f / sum;
  }
}

inline void ChunkRows(const float* cache, const int32_t* table, int64_t head_row, int64_t bs, int64_t D,
                      int64_t c0, int64_t n, const float** rows) {
  int64_t block = c0 / bs, offset = c0 % bs;
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = cache + (head_row + static_cast<int64_t>(table[block]) * bs + offset) * D;
    if (++offset == bs) offset = 0, ++block;
  }
}

inline void PrefetchRow(const float* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(row + d);
}

// Rows of chunk c0 into rows[] and of the next chunk into next[] (for
// prefetching, spread over the chunk's work); returns chunk c0's size.
inline int64_t ChunkAndNext(const float* cache, const int32_t* table, int64_t head_row, int64_t bs, int64_t D,
                            int64_t c0, int64_t num_keys, const float** rows, const float** next) {
  const int64_t n = std::min(kChunk, num_keys - c0);
  ChunkRows(cache, table, head_row, bs, D, c0, n, rows);
  const int64_t nn = std::max<int64_t>(0, std::min(kChunk, num_keys - c0 - kChunk));
  ChunkRows(cache, table, head_row, bs, D, c0 + kChunk, nn, next);
  for (int64_t i = nn; i < n; ++i) next[i] = nullptr;
  return n;
}

// scores[rr, 0:kChunk] = q_rr . k_i for kR consecutive query rows against a
// transposed key chunk kt [D, kChunk]; kR independent FMA chains.
template <int64_t kR>
inline void QkGroup(const float* q, const float* kt, int64_t D, float* scores, int64_t width) {
  V16 acc[kR] = {};
  for (int64_t d = 0; d < D; ++d) {
    const V16 k = Load16(kt + d * kChunk);
#pragma GCC unroll 8
    for (int64_t rr = 0; rr < kR; ++rr) acc[rr] += q[rr * D + d] * k;
  }
#pragma GCC unroll 8
  for (int64_t rr = 0; rr < kR; ++rr) Store16(scores + rr * width, acc[rr]);
}

// acc[rr] += sum_i p[rr, i] * v_i for kR consecutive score rows over one key
// chunk, accumulators in registers; each V row is loaded once per group.
template <int64_t kD, int64_t kR>
inline void PvGroup(const float* p, int64_t width, const float* const* vrows, int64_t n, float* acc,
                    const float* const* prefetch) {
  constexpr int64_t kV = kD / 16;
  V16 reg[kR][kV];
#pragma GCC unroll 8
  for (int64_t rr = 0; rr < kR; ++rr)
#pragma GCC unroll 16
    for (int64_t v = 0; v < kV; ++v) reg[rr][v] = Load16(acc + rr * kD + 16 * v);
  for (int64_t i = 0; i < n; ++i) {
    if (prefetch && prefetch[i]) PrefetchRow(prefetch[i], kD);
    V16 vv[kV];
#pragma GCC unroll 16
    for (int64_t v = 0; v < kV; ++v) vv[v] = Load16(vrows[i] + 16 * v);
#pragma GCC unroll 8
    for (int64_t rr = 0; rr < kR; ++rr) {
      const float pr = p[rr * width + i];
#pragma GCC unroll 16
      for (int64_t v = 0; v < kV; ++v) reg[rr][v] += pr * vv[v];
    }
  }
#pragma GCC unroll 8
  for (int64_t rr = 0; rr < kR; ++rr)
#pragma GCC unroll 16
    for (int64_t v = 0; v < kV; ++v) Store16(acc + rr * kD + 16 * v, reg[rr][v]);
}

// One tile of query tokens [t0, t0 + tq) of sequence s against kv head h.
// Keys go in chunks of kChunk; scores are [rows, keys rounded up to kChunk].
// kD > 0 fixes head_dim at compile time (unrolled rows, accumulators in registers).
template <int64_t kD>
void AttendTile(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, Scratch& w) {
  const int64_t D = kD > 0 ? kD : a.head_dim;
  const int32_t* info = a.seq_info + s * 4;
  const int64_t q_start = info[0], ctx = info[2], out_start = info[3];
  const int32_t* table = a.tables + s * a.table_width;
  const int64_t G = a.group, H = a.num_heads, bs = a.block_size;
  const int64_t rows = tq * G;             // row r = t * G + g, at position first_pos + r / G
  const int64_t num_keys = ctx + t0 + tq;  // keys the tile's last token sees
  const int64_t first_pos = ctx + t0;
  const int64_t head_row = h * a.num_slots;
  const int64_t width = (num_keys + kChunk - 1) / kChunk * kChunk;  // score row stride
  const bool transpose = rows >= kTransposeMinRows;

  w.q.resize(rows * D);
  float* qs = w.q.data();
  for (int64_t t = 0; t < tq; ++t) {
    const float* src = a.q + ((q_start + t0 + t) * H + h * G) * D;
    for (int64_t i = 0; i < G * D; ++i) qs[t * G * D + i] = src[i] * a.scale;
  }
  w.scores.resize(rows * width);
  float* scores = w.scores.data();
  w.kt.resize(D * kChunk);
  float* kt = w.kt.data();
  const float* krows[kChunk];
  const float* next[kChunk];

  // scores[r, j] = q_r . k_j, for chunks the row's token reaches (others stay unset).
  for (int64_t c0 = 0; c0 < num_keys; c0 += kChunk) {
    const int64_t n = ChunkAndNext(a.k, table, head_row, bs, D, c0, num_keys, krows, next);
    const int64_t r0 = std::max<int64_t>(0, c0 - first_pos) * G;  // first row that sees key c0
    if (transpose) {  // kt[d, i] = k_{c0+i}[d]: one FMA row per q element
      for (int64_t i = 0; i < kChunk; ++i) {
        if (i < n && next[i]) PrefetchRow(next[i], D);
        for (int64_t d = 0; d < D; ++d) kt[d * kChunk + i] = i < n ? krows[i][d] : 0.f;
      }
      int64_t r = r0;
      for (; r + 8 <= rows; r += 8) QkGroup<8>(qs + r * D, kt, D, scores + r * width + c0, width);
      for (; r + 4 <= rows; r += 4) QkGroup<4>(qs + r * D, kt, D, scores + r * width + c0, width);
      for (; r < rows; ++r) QkGroup<1>(qs + r * D, kt, D, scores + r * width + c0, width);
    } else {
      for (int64_t i = 0; i < n; ++i) {
        if (next[i]) PrefetchRow(next[i], D);
        for (int64_t r = r0; r < rows; ++r) {
          if constexpr (kD > 0 && kD % 16 == 0)
            scores[r * width + c0 + i] = DotN<kD>(qs + r * D, krows[i]);
          else
            scores[r * width + c0 + i] = Dot(qs + r * D, krows[i], D);
        }
      }
    }
  }

  // Softmax in place over the visible keys; the rest of the row becomes 0.
  CausalSoftmax(scores, rows, width, first_pos, G, w.inv_sum);

  // acc[r] = sum_j p[r, j] * v_j, one key chunk at a time.
  w.acc.assign(rows * D, 0.f);
  const float* vrows[kChunk];
  for (int64_t c0 = 0; c0 < num_keys; c0 += kChunk) {
    const int64_t n = ChunkAndNext(a.v, table, head_row, bs, D, c0, num_keys, vrows, next);
    const int64_t r0 = std::max<int64_t>(0, c0 - first_pos) * G;
    float* acc = w.acc.data();
    if constexpr (kD > 0 && kD % 16 == 0) {
      for (int64_t r = r0; r < rows; r += kPvRows) {
        const float* p = scores + r * width + c0;
        const float* const* pf = r == r0 ? next : nullptr;  // prefetch during the first group only
        switch (std::min(kPvRows, rows - r)) {
          case 1: PvGroup<kD, 1>(p, width, vrows, n, acc + r * kD, pf); break;
          case 2: PvGroup<kD, 2>(p, width, vrows, n, acc + r * kD, pf); break;
          case 3: PvGroup<kD, 3>(p, width, vrows, n, acc + r * kD, pf); break;
          default: PvGroup<kD, kPvRows>(p, width, vrows, n, acc + r * kD, pf); break;
        }
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        if (next[i]) PrefetchRow(next[i], D);
        for (int64_t r = r0; r < rows; ++r) Axpy(scores[r * width + c0 + i], vrows[i], acc + r * D, D);
      }
    }
  }

  for (int64_t t = 0; t < tq; ++t) {
    float* dst = a.out + ((out_start + t0 + t) * H + h * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      const float inv = w.inv_sum[r];
      for (int64_t i = 0; i < D; ++i) dst[g * D + i] = w.acc[r * D + i] * inv;
    }
  }
}


// The portable tile of a work item (the AVX2 ones are isa_avx2.cc's).
inline void AttendTileDispatch(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, Scratch& w) {
  switch (a.head_dim) {
    case 64: return AttendTile<64>(a, s, h, t0, tq, w);
    case 128: return AttendTile<128>(a, s, h, t0, tq, w);
    default: return AttendTile<0>(a, s, h, t0, tq, w);
  }
}

// Runs tile(a, s, h, t0, tq, scratch) for every (sequence, kv head, query tile) item of a
// batch of S sequences, longest first, on the OpenMP threads (the AVX2 build hands in
// its own tiles, isa_avx2.cc).
template <class Tile>
void RunItems(const Args& a, int64_t S, int64_t num_kv_heads, Tile tile) {
  const int32_t* info = a.seq_info;
  struct Item {
    int64_t s, h, t0, tq;
  };
  std::vector<Item> items;
  int64_t work = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = info[s * 4 + 1], ctx = info[s * 4 + 2];
    work += (ctx + q_len) * q_len;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t t0 = 0; t0 < q_len; t0 += kQueryTile) items.push_back({s, h, t0, std::min(kQueryTile, q_len - t0)});
  }
  work *= a.group * num_kv_heads;
  const int64_t n = static_cast<int64_t>(items.size());
  // Longest items first, so that no thread is left with a long one at the end.
  auto cost = [info](const Item& it) { return (info[it.s * 4 + 2] + it.t0 + it.tq) * it.tq; };
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) { return cost(x) > cost(y); });

  // Dynamic scheduling by hand: only GOMP_parallel is needed, which Intel's
  // libiomp5 (MKL's runtime, shared with Paddle's GEMMs) provides too.
  std::atomic<int64_t> next{0};
#pragma omp parallel if (n > 1 && work >= kMinParallelWork)
  {
    Scratch& w = ThreadScratch();
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      tile(a, items[i].s, items[i].h, items[i].t0, items[i].tq, w);
  }
}

}  // namespace fdx

#include "invariant_attention.h"

namespace fdx {

#ifdef FDX_X86_BUILDS
// The AVX2 + FMA builds (isa_avx2.cc): the step's attention (false when it does not take
// it: head_dim other than 64 or 128), and the batch-invariant kernel's (head_dim % 32 == 0).
bool Avx2PagedAttention(const Args& a, int64_t S, int64_t num_kv_heads);
namespace inv {
void Avx2Attention(const Args& a, int64_t S, int64_t num_kv_heads, int threads);
void Avx512Attention(const Args& a, int64_t S, int64_t num_kv_heads, int threads);  // isa_avx512.cc
}  // namespace inv

// Whether this CPU runs the AVX2 + FMA builds (asked once).
inline bool CpuHasAvx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
// Whether it runs the AVX-512 F build of the invariant attention's primitives (asked once).
inline bool CpuHasAvx512() {
  static const bool yes = CpuHasAvx2() && __builtin_cpu_supports("avx512f");
  return yes;
}
#endif

// The batch-invariant kernel (invariant_attention.h) over the step: the AVX-512 or AVX2
// build's primitives where the CPU has them (the same bits), else the portable ones.
inline void InvariantAttention(const Args& a, int64_t S, int64_t num_kv_heads) {
#ifdef FDX_X86_BUILDS
  if (a.head_dim % 32 == 0 && CpuHasAvx512()) return inv::Avx512Attention(a, S, num_kv_heads, omp_get_max_threads());
  if (a.head_dim % 32 == 0 && CpuHasAvx2()) return inv::Avx2Attention(a, S, num_kv_heads, omp_get_max_threads());
#endif
  return inv::Kernel<inv::PortableOps>::Run(a, S, num_kv_heads, omp_get_max_threads());
}

// The default mode's attention is the batch-invariant kernel too:
// - where the CPU runs its AVX-512 primitives (head_dim % 32 == 0), at every step: there it
//   takes 0.65-0.89x the CPU time of the kernels below (scripts/bench_attention.py, 1 and 2
//   threads, 9 / 3 heads of 64 and 32 / 8 of 128, Zen 5: batch-1 decode at 256 and 1024
//   keys, 9 query tokens at 1024, 32 decode rows, 4 x 9 tokens, 512-token prefills);
// - elsewhere, in a step of one sequence bringing at most kInvariantStepRows query tokens (a
//   batch-1 decode row, a speculative step's k + 1 verified rows).
// Either way a verified row has the bits its decode row would have had, so greedy speculation
// at batch 1 gives the tokens decoding gives (issue 37).
constexpr int64_t kInvariantStepRows = 16;  // = ATTENTION_INVARIANT_STEP_ROWS (ops/cpp.py)

inline bool InvariantStep(const Args& a, int64_t S) {
  if (a.invariant || (S == 1 && a.seq_info[1] <= kInvariantStepRows)) return true;
#ifdef FDX_X86_BUILDS
  return a.head_dim % 32 == 0 && CpuHasAvx512();
#else
  return false;
#endif
}

// Runs every (sequence, kv head, query tile) item of a batch of S sequences: the invariant
// kernel where InvariantStep says so, else by the AVX2 build where the CPU has it (and the
// build exists: x86 without FDX_NO_X86), else portable. (Before the invariant kernel's AVX-512
// primitives an AVX-512 build handed its AttendTile to the AVX2 build for the tiles of several
// query tokens; such a CPU now runs the invariant kernel wherever the AVX2 build would run.)
// a.force_default (tests only) skips InvariantStep, and with kPortable the AVX2 build too.
inline void PagedAttention(const Args& a, int64_t S, int64_t num_kv_heads) {
  if (a.force_default == ForceDefault::kNo ? InvariantStep(a, S) : a.invariant)
    return InvariantAttention(a, S, num_kv_heads);
#ifdef FDX_X86_BUILDS
  if (a.force_default != ForceDefault::kPortable && CpuHasAvx2() && Avx2PagedAttention(a, S, num_kv_heads)) return;
#endif
  RunItems(a, S, num_kv_heads, AttendTileDispatch);
}

}  // namespace fdx
