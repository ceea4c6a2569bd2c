// Paged attention kernel core, free of Paddle (bound in paged_attention.cc).
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


namespace fdx {

constexpr int64_t kQueryTile = 16;          // query tokens per prefill work item
constexpr int64_t kPartKeys = 64;           // keys per part: a row's keys are cut at multiples of this
constexpr int64_t kMinParallelWork = 4096;  // key x query-row products below which one thread is faster

struct Args {
  const float* q;    // [N, H, D]
  const float* k;    // [KVH * num_slots, D]
  const float* v;    // [KVH * num_slots, D]
  float* out;        // [num_out_tokens, H, D]
  const int32_t* seq_info;
  const int32_t* tables;
  int64_t table_width, num_heads, group, head_dim, block_size, num_slots;
  float scale;
};

struct Scratch {
  std::vector<float> q, p, state;
  std::vector<int64_t> keys, ends;
};

// The calling thread's scratch, kept across calls: no allocation per call once grown.
inline Scratch& ThreadScratch() {
  thread_local Scratch w;
  return w;
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

inline void PrefetchRow(const float* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(row + d);
}

// --- one reduction order for a query row (issue 40 item 4) ------------------------------------
// A query row (one token, one query head) at position pos sees keys [0, pos]. They are cut
// into parts of kPartKeys keys at fixed key indices (part p: [p * kPartKeys, ...)). For
// each part, in key order: the scores q.k (a multiply-add chain over the head dimension
// in W lanes, the lanes summed by a fixed tree: ScoresOf4), their maximum, exp(score - maximum),
// the exps summed in W lanes (a fixed tree), and P.V (a multiply-add chain over the keys
// for each element). The parts are merged in order, part 0 first (online softmax:
// m' = max(m, m_p), l = l e^(m - m') + l_p e^(m_p - m'), o likewise), and the row is o / l.
// A decode row, a prefill tile's row, a resumed request's recomputed row: the same
// operations in the same order whatever shares the batch, the work items or the threads.
// The parts also spread one decode row's keys over the threads (a part a work item).

template <int W>
struct Lanes {
  typedef float T __attribute__((vector_size(4 * W), aligned(4), may_alias));
};

template <int W>
inline typename Lanes<W>::T LoadW(const float* p) {
  return *reinterpret_cast<const typename Lanes<W>::T*>(p);
}

template <int W>
inline void StoreW(float* p, typename Lanes<W>::T v) {
  *reinterpret_cast<typename Lanes<W>::T*>(p) = v;
}

// The lanes of v summed pairwise: (0 + W/2, 1 + W/2 + 1, ...), then halves again, to lane 0.
template <int W>
inline float LaneSum(typename Lanes<W>::T v) {
  float s[W];
  for (int i = 0; i < W; ++i) s[i] = v[i];
  for (int h = W / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) s[i] = s[i] + s[i + h];
  return s[0];
}

template <int W, int64_t kD>
inline float RowDot(const float* q, const float* k, int64_t D) {
  using V = typename Lanes<W>::T;
  const int64_t n = kD > 0 ? kD : D;
  V acc = LoadW<W>(q) * LoadW<W>(k);
  for (int64_t d = W; d < n; d += W) acc = acc + LoadW<W>(q + d) * LoadW<W>(k + d);
  return LaneSum<W>(acc);
}

// q . k for four keys k[0..3] (8 lanes: a multiply-add chain over the head dimension in
// lane d % 8), each key's lanes summed as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)):
// the shuffles and adds of two rounds of AVX's hadd, written with vector extensions,
// each output one fixed add of two fixed inputs (a key's score does not depend on the
// other three).
template <int64_t kD>
inline void ScoresOf4(const float* q, const float* const* k, int64_t D, float* out) {
  using V = Lanes<8>::T;
  typedef int I8 __attribute__((vector_size(32)));
  const int64_t n = kD > 0 ? kD : D;
  V acc[4];
  const V q0 = LoadW<8>(q);
  for (int u = 0; u < 4; ++u) acc[u] = q0 * LoadW<8>(k[u]);
  for (int64_t d = 8; d < n; d += 8) {
    const V qd = LoadW<8>(q + d);
    for (int u = 0; u < 4; ++u) acc[u] = acc[u] + qd * LoadW<8>(k[u] + d);
  }
  const I8 even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
  const V h01 = __builtin_shuffle(acc[0], acc[1], even) + __builtin_shuffle(acc[0], acc[1], odd);
  const V h23 = __builtin_shuffle(acc[2], acc[3], even) + __builtin_shuffle(acc[2], acc[3], odd);
  const V h = __builtin_shuffle(h01, h23, even) + __builtin_shuffle(h01, h23, odd);
  for (int u = 0; u < 4; ++u) out[u] = h[u] + h[u + 4];
}

// Part [k0, k0 + nk) of the keys for n query rows of one kv head: row i (scaled query
// qs + i * D) sees the first len[i] of them (0 < len[i] <= nk). keys[j]: key k0 + j's row
// within the head. Writes row i's maximum mx[i], sum of exps sum[i] and unnormalized
// P.V acc + i * D. p: [n, kPartKeys] scratch.
template <int W, int64_t kD>
void PartRows(const float* kbase, const float* vbase, const int64_t* keys, int64_t nk, int64_t D,
              const float* qs, const int64_t* len, int64_t n, float* mx, float* sum, float* acc, float* p) {
  using V = typename Lanes<W>::T;
  if constexpr (kD > 0) D = kD;
  if constexpr (W == 8) {  // scores, four keys at a time (ScoresOf4), each row over the keys it sees
    for (int64_t j = 0; j < nk; ++j) PrefetchRow(kbase + keys[j] * D, D);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < len[i]; j += 4) {
        const float* kr[4];
        for (int u = 0; u < 4; ++u) kr[u] = kbase + keys[std::min(j + u, len[i] - 1)] * D;
        float got[4];
        ScoresOf4<kD>(qs + i * D, kr, D, got);
        for (int u = 0; u < 4 && j + u < len[i]; ++u) p[i * kPartKeys + j + u] = got[u];
      }
  } else {
    for (int64_t j = 0; j < nk; ++j) {  // scores, a key at a time for all the rows that see it
      const float* kr = kbase + keys[j] * D;
      for (int64_t i = 0; i < n; ++i)
        if (j < len[i]) p[i * kPartKeys + j] = RowDot<W, kD>(qs + i * D, kr, D);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    float* row = p + i * kPartKeys;
    const int64_t m = len[i];
    float top = row[0];
#pragma omp simd reduction(max : top)
    for (int64_t j = 1; j < m; ++j) top = std::max(top, row[j]);
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) row[j] = ExpNonPositive(row[j] - top);
    const int64_t padded = (m + W - 1) / W * W;
    for (int64_t j = m; j < padded; ++j) row[j] = 0.f;
    V lanes = LoadW<W>(row);
    for (int64_t j = W; j < padded; j += W) lanes = lanes + LoadW<W>(row + j);
    mx[i] = top;
    sum[i] = LaneSum<W>(lanes);
    for (int64_t j = m; j < nk; ++j) row[j] = 0.f;  // P.V runs a row group over its longest row's keys: + 0 * v
  }
  // P.V: columns in blocks of up to 4 vectors, rows in groups of up to 3 (accumulators in registers)
  constexpr int kC = 4, kR = 3;
  for (int64_t c = 0; c < D; c += kC * W) {
    const int nc = static_cast<int>(std::min<int64_t>(kC, (D - c) / W));
    for (int64_t i0 = 0; i0 < n; i0 += kR) {
      const int nr = static_cast<int>(std::min<int64_t>(kR, n - i0));
      int64_t reach = 0;
      for (int r = 0; r < nr; ++r) reach = std::max(reach, len[i0 + r]);
      V a[kR][kC] = {};
      for (int64_t j = 0; j < reach; ++j) {
        const float* vr = vbase + keys[j] * D + c;
        V vv[kC];
        for (int u = 0; u < nc; ++u) vv[u] = LoadW<W>(vr + u * W);
        for (int r = 0; r < nr; ++r) {
          const float e = p[(i0 + r) * kPartKeys + j];
          for (int u = 0; u < nc; ++u) a[r][u] = a[r][u] + e * vv[u];
        }
      }
      for (int r = 0; r < nr; ++r)
        for (int u = 0; u < nc; ++u) StoreW<W>(acc + (i0 + r) * D + c + u * W, a[r][u]);
    }
  }
}

// Merges a part (pm, ps, pacc) into a row's state (m, l, o[D]); first: the state becomes the part.
inline void MergePart(float* m, float* l, float* o, float pm, float ps, const float* pacc, int64_t D, bool first) {
  if (first) {
    *m = pm;
    *l = ps;
    std::memcpy(o, pacc, D * sizeof(float));
    return;
  }
  const float top = std::max(*m, pm);
  const float a = ExpNonPositive(*m - top), b = ExpNonPositive(pm - top);
  *m = top;
  *l = *l * a + ps * b;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) o[d] = o[d] * a + pacc[d] * b;
}

inline void Finish(const float* o, float l, int64_t D, float* dst) {
  const float inv = 1.f / l;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) dst[d] = o[d] * inv;
}

// keys[j]: the row of key k0 + j of sequence s within its head's rows of the cache.
inline void KeyRows(const Args& a, int64_t s, int64_t k0, int64_t n, int64_t* keys) {
  const int32_t* table = a.tables + s * a.table_width;
  const int64_t bs = a.block_size;
  for (int64_t j = 0, block = k0 / bs, offset = k0 % bs; j < n; ++j) {
    keys[j] = static_cast<int64_t>(table[block]) * bs + offset;
    if (++offset == bs) offset = 0, ++block;
  }
}

// Tokens [t0, t0 + tq) of the sequence whose first query row is q_start, kv head h's G
// query heads, scaled: row r = t * G + g.
inline void ScaledRows(const Args& a, int64_t q_start, int64_t h, int64_t t0, int64_t tq, float* qs) {
  const int64_t G = a.group, D = a.head_dim;
  for (int64_t t = 0; t < tq; ++t) {
    const float* src = a.q + ((q_start + t0 + t) * a.num_heads + h * G) * D;
    for (int64_t i = 0; i < G * D; ++i) qs[t * G * D + i] = src[i] * a.scale;
  }
}

template <int W, int64_t kD>
struct Attend {
  // Part p of sequence s's one (decode) row against kv head h: its G query heads' P.V
  // (G x D), then their G maxima and G sums, into out.
  static void DecodePart(const Args& a, int64_t s, int64_t h, int64_t p, Scratch& w, float* out) {
    const int64_t G = a.group, D = a.head_dim;
    const int32_t* info = a.seq_info + s * 4;
    const int64_t num_keys = info[2] + 1, k0 = p * kPartKeys, nk = std::min(kPartKeys, num_keys - k0);
    w.q.resize(G * D);
    w.p.resize(G * kPartKeys);
    w.keys.resize(kPartKeys);
    w.ends.assign(G, nk);
    ScaledRows(a, info[0], h, 0, 1, w.q.data());
    KeyRows(a, s, k0, nk, w.keys.data());
    PartRows<W, kD>(a.k + h * a.num_slots * D, a.v + h * a.num_slots * D, w.keys.data(), nk, D, w.q.data(),
                    w.ends.data(), G, out + G * D, out + G * D + G, out, w.p.data());
  }

  // Tokens [t0, t0 + tq) of sequence s against kv head h: every part in order, merged, written.
  static void Tile(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, Scratch& w) {
    const int64_t G = a.group, D = a.head_dim, rows = tq * G;
    const int32_t* info = a.seq_info + s * 4;
    const int64_t ctx = info[2], out_start = info[3];
    const int64_t num_keys = ctx + t0 + tq;  // keys the tile's last token sees
    w.q.resize(rows * D);
    w.p.resize(rows * kPartKeys);
    w.keys.resize(kPartKeys);
    w.ends.resize(rows);
    // a part's P.V, maxima and sums (rows * (D + 2)), then each row's state m, l, o (rows * (D + 2))
    w.state.resize(2 * rows * (D + 2));
    float* part = w.state.data();
    float* state = part + rows * (D + 2);
    ScaledRows(a, info[0], h, t0, tq, w.q.data());
    for (int64_t k0 = 0; k0 < num_keys; k0 += kPartKeys) {
      const int64_t nk = std::min(kPartKeys, num_keys - k0);
      const int64_t r0 = std::max<int64_t>(0, k0 - ctx - t0) * G, n = rows - r0;  // the rows that see key k0
      int64_t* len = w.ends.data();
      for (int64_t r = r0; r < rows; ++r) len[r - r0] = std::min(nk, ctx + t0 + r / G + 1 - k0);
      KeyRows(a, s, k0, nk, w.keys.data());
      float* mx = part + n * D;
      float* sum = mx + n;
      PartRows<W, kD>(a.k + h * a.num_slots * D, a.v + h * a.num_slots * D, w.keys.data(), nk, D,
                      w.q.data() + r0 * D, len, n, mx, sum, part, w.p.data());
      for (int64_t i = 0; i < n; ++i) {
        float* st = state + (r0 + i) * (D + 2);
        MergePart(st, st + 1, st + 2, mx[i], sum[i], part + i * D, D, k0 == 0);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* st = state + r * (D + 2);
      Finish(st + 2, st[1], D, a.out + ((out_start + t0 + r / G) * a.num_heads + h * G + r % G) * D);
    }
  }
};

template <int W, int64_t kD>
void RunAttention(const Args& a, int64_t S, int64_t num_kv_heads) {
  const int32_t* info = a.seq_info;
  const int64_t G = a.group, D = a.head_dim;
  struct Item {
    int64_t s, h, t0, tq, part, slot;  // slot >= 0: part `part` of a decode row, into the decode buffer
  };
  std::vector<Item> items;
  std::vector<int64_t> first_slot(S, 0);  // decode sequence s: slots first_slot[s] + h * parts + p
  int64_t work = 0, slots = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = info[s * 4 + 1], ctx = info[s * 4 + 2];
    work += (ctx + q_len) * q_len;
    first_slot[s] = slots;
    if (q_len == 1) {
      const int64_t parts = (ctx + kPartKeys) / kPartKeys;
      for (int64_t h = 0; h < num_kv_heads; ++h)
        for (int64_t p = 0; p < parts; ++p) items.push_back({s, h, 0, 1, p, slots++});
    } else {
      for (int64_t h = 0; h < num_kv_heads; ++h)
        for (int64_t t0 = 0; t0 < q_len; t0 += kQueryTile)
          items.push_back({s, h, t0, std::min(kQueryTile, q_len - t0), 0, -1});
    }
  }
  work *= G * num_kv_heads;
  const int64_t stride = G * (D + 2);
  thread_local std::vector<float> buf;  // the caller's: per decode part, G x D P.V, G maxima, G sums
  buf.resize(slots * stride);
  float* const parts_out = buf.data();
  const int64_t n = static_cast<int64_t>(items.size());
  // Longest items first, so that no thread is left with a long one at the end.
  auto cost = [info](const Item& it) {
    return it.slot >= 0 ? kPartKeys : (info[it.s * 4 + 2] + it.t0 + it.tq) * it.tq;
  };
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) { return cost(x) > cost(y); });
  // Dynamic scheduling by hand: only GOMP_parallel is needed, which Intel's
  // libiomp5 (MKL's runtime, shared with Paddle's GEMMs) provides too.
  std::atomic<int64_t> next{0};
#pragma omp parallel if (n > 1 && work >= kMinParallelWork)
  {
    Scratch& w = ThreadScratch();
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      const Item& it = items[i];
      if (it.slot >= 0)
        Attend<W, kD>::DecodePart(a, it.s, it.h, it.part, w, parts_out + it.slot * stride);
      else
        Attend<W, kD>::Tile(a, it.s, it.h, it.t0, it.tq, w);
    }
  }
  if (slots == 0) return;
  // The decode rows: their parts merged in order, once every part is done.
  std::vector<float> o(D);
  for (int64_t s = 0; s < S; ++s) {
    if (info[s * 4 + 1] != 1) continue;
    const int64_t parts = (info[s * 4 + 2] + kPartKeys) / kPartKeys;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t g = 0; g < G; ++g) {
        float m = 0.f, l = 0.f;
        for (int64_t p = 0; p < parts; ++p) {
          const float* part = parts_out + (first_slot[s] + h * parts + p) * stride;
          MergePart(&m, &l, o.data(), part[G * D + g], part[G * D + G + g], part + g * D, D, p == 0);
        }
        Finish(o.data(), l, D, a.out + (info[s * 4 + 3] * a.num_heads + h * G + g) * D);
      }
  }
}

// Runs every (sequence, kv head, query tile or key part) item of a batch of S sequences.
inline void PagedAttention(const Args& a, int64_t S, int64_t num_kv_heads) {
  if (a.head_dim % 8 == 0) {
    if (a.head_dim == 64) return RunAttention<8, 64>(a, S, num_kv_heads);
    if (a.head_dim == 128) return RunAttention<8, 128>(a, S, num_kv_heads);
    return RunAttention<8, 0>(a, S, num_kv_heads);
  }
  RunAttention<1, 0>(a, S, num_kv_heads);
}

}  // namespace fdx
