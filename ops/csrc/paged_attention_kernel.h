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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace fdx {

constexpr int64_t kQueryTile = 16;          // query tokens per item (bounds the score buffer)
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
  std::vector<float> q, scores, acc, inv_sum;
};

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

inline void Prefetch(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(row + i);
}

// exp(x) for x <= 0 (softmax after subtracting the row max), vectorizable;
// relative error < 3e-7, and 0 below -87.
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

// Calls fn(j, row) for keys j in [0, num_keys) in block order, row being the
// key's cache row (offset by head); prefetches the next block meanwhile.
template <typename Fn>
inline void ForEachKey(const int32_t* table, int64_t head_row, int64_t bs, int64_t num_keys,
                       const float* cache, int64_t D, Fn&& fn) {
  for (int64_t j0 = 0; j0 < num_keys; j0 += bs) {
    const float* block = cache + (head_row + static_cast<int64_t>(table[j0 / bs]) * bs) * D;
    const bool has_next = j0 + bs < num_keys;
    const float* next = has_next ? cache + (head_row + static_cast<int64_t>(table[j0 / bs + 1]) * bs) * D : block;
    const int64_t jn = std::min(bs, num_keys - j0);
    for (int64_t jj = 0; jj < jn; ++jj) {
      if (has_next) Prefetch(next + jj * D, D);
      fn(j0 + jj, block + jj * D);
    }
  }
}

// One tile of query tokens [t0, t0 + tq) of sequence s against kv head h.
// kD > 0 fixes head_dim at compile time (fully unrolled row loops).
template <int64_t kD>
void AttendTile(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, Scratch& w) {
  const int64_t D = kD > 0 ? kD : a.head_dim;
  const int32_t* info = a.seq_info + s * 4;
  const int64_t q_start = info[0], ctx = info[2], out_start = info[3];
  const int32_t* table = a.tables + s * a.table_width;
  const int64_t G = a.group, H = a.num_heads, bs = a.block_size;
  const int64_t rows = tq * G;             // row r = t * G + g
  const int64_t num_keys = ctx + t0 + tq;  // keys the tile's last token sees
  const int64_t first_pos = ctx + t0;      // position of the tile's first token
  const int64_t head_row = h * a.num_slots;

  w.q.resize(rows * D);
  float* qs = w.q.data();
  for (int64_t t = 0; t < tq; ++t) {
    const float* src = a.q + ((q_start + t0 + t) * H + h * G) * D;
    for (int64_t i = 0; i < G * D; ++i) qs[t * G * D + i] = src[i] * a.scale;
  }
  w.scores.resize(rows * num_keys);
  float* scores = w.scores.data();

  // scores[r, j] = q_r . k_j for the keys row r's token may see (j <= its position).
  ForEachKey(table, head_row, bs, num_keys, a.k, D, [&](int64_t j, const float* kr) {
    for (int64_t r = std::max<int64_t>(0, j - first_pos) * G; r < rows; ++r)
      scores[r * num_keys + j] = Dot(qs + r * D, kr, D);
  });

  // Unnormalized softmax in place; 1 / sum kept per row.
  w.inv_sum.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * num_keys;
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
    w.inv_sum[r] = 1.f / sum;
  }

  // acc[r] = sum_j p[r, j] * v_j
  w.acc.assign(rows * D, 0.f);
  float* acc = w.acc.data();
  ForEachKey(table, head_row, bs, num_keys, a.v, D, [&](int64_t j, const float* vr) {
    for (int64_t r = std::max<int64_t>(0, j - first_pos) * G; r < rows; ++r)
      Axpy(scores[r * num_keys + j], vr, acc + r * D, D);
  });

  for (int64_t t = 0; t < tq; ++t) {
    float* dst = a.out + ((out_start + t0 + t) * H + h * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      const float inv = w.inv_sum[r];
      for (int64_t i = 0; i < D; ++i) dst[g * D + i] = acc[r * D + i] * inv;
    }
  }
}

inline void AttendTileDispatch(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, Scratch& w) {
  switch (a.head_dim) {
    case 64: return AttendTile<64>(a, s, h, t0, tq, w);
    case 128: return AttendTile<128>(a, s, h, t0, tq, w);
    default: return AttendTile<0>(a, s, h, t0, tq, w);
  }
}

// Runs every (sequence, kv head, query tile) item of a batch of S sequences.
inline void PagedAttention(const Args& a, int64_t S, int64_t num_kv_heads) {
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

#pragma omp parallel if (n > 1 && work >= kMinParallelWork)
  {
    Scratch w;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) AttendTileDispatch(a, items[i].s, items[i].h, items[i].t0, items[i].tq, w);
  }
}

}  // namespace fdx
