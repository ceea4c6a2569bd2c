// Batch-invariant paged attention (issue 40 item 4; backend.batch_invariant): a query
// row's bits do not depend on what else is in the step, on the work item it falls in,
// the thread that runs it, or whether it is a decode row, a prefill tile's row or a
// resumed request's recomputed row.
//
// One reduction order for a row (one token, one query head) at position pos, which
// sees keys [0, pos]: they are cut into parts of kPartKeys keys at fixed absolute key
// indices (part p: keys [p * kPartKeys, (p + 1) * kPartKeys)). For each part, in key
// order:
//   - score_j = q . k_j * scale: Ops::Scores (the AVX2 build: products in 8 lanes, lane
//     d % 8, a multiply-add chain over the head dimension, the lanes summed
//     ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)); each key's score depends on that key
//     alone, however many keys and rows a call computes);
//   - m = the part's maximum score (exact), e_j = exp(score_j - m), l = sum of e_j in 8
//     lanes (key j in lane j % 8) by the same tree;
//   - acc = sum_j e_j v_j, a multiply-add chain over the part's keys in order.
// The parts are merged in order, part 0 first (m' = max(m, m_p), a = exp(m - m'),
// b = exp(m_p - m'), l = l a + l_p b, o = o a + acc_p b), and the row is o / l.
//
// Work items: a prefill tile (up to kQueryTile tokens of one sequence, one kv head) runs
// its parts in order; a decode row runs them in order in one item, or, when there are
// fewer (sequence, kv head) items than twice the threads (batch 1), each part is an item
// of its own and the parts are merged in order after (flash-decoding without a
// batch-dependent split). Same operations either way.
//
// The template takes an Ops struct with the primitives (portable here; AVX2 + FMA in
// isa_avx2.cc); a build's every row goes through the same Ops functions, so within one
// build the order is one. Include after paged_attention_kernel.h's Args and Scratch.
#pragma once

namespace fdx::inv {

constexpr int64_t kPartKeys = 64;  // keys per part: a row's keys are cut at multiples of this
constexpr int64_t kMaxRows = 3;    // rows per score / P.V call (one token's query heads, in threes)

// The portable primitives (any head_dim); the same contract as the AVX2 ones.
struct PortableOps {
  // out[r * ld + u] = (q_r . k_u) for R rows q (stride D) and 4 keys k[0..3].
  static void Scores(int R, const float* q, int64_t D, const float* const* k, float* out, int64_t ld) {
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) {
        float l[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        const float* qr = q + r * D;
        for (int64_t d = 0; d < D; ++d) l[d % 8] = Fma(qr[d], k[u][d], l[d % 8]);
        out[r * ld + u] = Tree(l);
      }
  }
  // In place: row[0, n) -> exp(row - max), returns (max, sum); row[n, kPartKeys) untouched.
  static void ExpSum(float* row, int64_t n, float* mx, float* sum) {
    float m = row[0];
    for (int64_t j = 1; j < n; ++j) m = std::max(m, row[j]);
    float l[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t j = 0; j < n; ++j) {
      row[j] = Exp(row[j] - m);
      l[j % 8] = l[j % 8] + row[j];
    }
    *mx = m;
    *sum = Tree(l);
  }
  // acc[r * D + d] = sum_j p[r * ldp + j] * v_j[d] over n keys (rows vbase + keys[j] * D).
  static void Pv(int R, const float* p, int64_t ldp, const float* vbase, const int64_t* keys, int64_t n, int64_t D,
                 float* acc) {
    for (int r = 0; r < R; ++r) {
      float* o = acc + r * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        const float e = p[r * ldp + j];
        const float* v = vbase + keys[j] * D;
        for (int64_t d = 0; d < D; ++d) o[d] = Fma(e, v[d], o[d]);
      }
    }
  }
  // o = o * a + acc * b (a = exp(m - m'), b = exp(m_p - m')); then the row's m, l.
  static void Merge(float* m, float* l, float* o, float pm, float pl, const float* pacc, int64_t D) {
    const float top = std::max(*m, pm);
    const float a = Exp(*m - top), b = Exp(pm - top);
    *m = top;
    *l = Fma(*l, a, pl * b);
    for (int64_t d = 0; d < D; ++d) o[d] = Fma(o[d], a, pacc[d] * b);
  }
  static void Finish(const float* o, float l, int64_t D, float* dst) {
    const float inv = 1.f / l;
    for (int64_t d = 0; d < D; ++d) dst[d] = o[d] * inv;
  }
  // Written so that no compiler flag changes them: fmaf where the build has FMA (a
  // fused multiply-add), else a product then a sum, in both cases one fixed operation.
  static float Fma(float a, float b, float c) {
#ifdef __FMA__
    return __builtin_fmaf(a, b, c);
#else
    volatile float p = a * b;  // no contraction: the product rounded, then the sum
    return p + c;
#endif
  }
  static float Tree(const float* l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }
  static float Exp(float x) { return ExpNonPositive(x); }
};

// Rows of keys [k0, k0 + n) of sequence s within its head's rows of the cache.
inline void KeyRows(const Args& a, int64_t s, int64_t k0, int64_t n, int64_t* keys) {
  const int32_t* table = a.tables + s * a.table_width;
  const int64_t bs = a.block_size;
  for (int64_t j = 0, block = k0 / bs, offset = k0 % bs; j < n; ++j) {
    keys[j] = static_cast<int64_t>(table[block]) * bs + offset;
    if (++offset == bs) offset = 0, ++block;
  }
}

template <class Ops>
struct Kernel {
  // One part [k0, k0 + kPartKeys) for tokens [t0, t0 + tq) of sequence s, kv head h, whose
  // scaled queries are qs (row r = t * G + g): for each row that sees key k0, from row r0
  // (returned), its maximum pm[r - r0], sum pl[r - r0] and unnormalized P.V pacc + (r - r0) * D.
  // chained: the parts of these rows run in order in this call's thread (Tile), so each
  // part fetches the next one's K and V rows ahead while it computes.
  static int64_t Part(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, int64_t k0, const float* qs,
                      Scratch& w, float* pm, float* pl, float* pacc, bool chained) {
    const int64_t G = a.group, D = a.head_dim;
    const int64_t first_pos = a.seq_info[s * 4 + 2] + t0;  // the tile's first token's position
    const int64_t last = first_pos + tq - 1;
    const int64_t nk = std::min(kPartKeys, last + 1 - k0);  // keys of the part the last token sees
    const int64_t t_first = std::max<int64_t>(0, k0 - first_pos);
    const float* kbase = a.k + h * a.num_slots * D;
    const float* vbase = a.v + h * a.num_slots * D;
    w.keys.resize(2 * kPartKeys);
    int64_t* keys = w.keys.data();
    if (!chained || k0 == 0) {  // else the previous part of this decode row fetched them (below)
      KeyRows(a, s, k0, nk, keys);
      for (int64_t j = 0; j < nk; ++j) PrefetchRow(kbase + keys[j] * D, D), PrefetchRow(vbase + keys[j] * D, D);
    } else {
      std::memcpy(keys, keys + kPartKeys, nk * sizeof(int64_t));
    }
    if (chained && k0 + kPartKeys <= last) {  // the next part, fetched while this one computes
      int64_t* ahead = keys + kPartKeys;
      const int64_t na = std::min(kPartKeys, last + 1 - k0 - kPartKeys);
      KeyRows(a, s, k0 + kPartKeys, na, ahead);
      for (int64_t j = 0; j < na; ++j) PrefetchRow(kbase + ahead[j] * D, D), PrefetchRow(vbase + ahead[j] * D, D);
    }
    w.p.resize(tq * G * kPartKeys);
    float* p = w.p.data();
    for (int64_t t = t_first; t < tq; ++t) {
      const int64_t len = std::min(nk, first_pos + t + 1 - k0);  // keys of the part token t sees
      for (int64_t g0 = 0; g0 < G; g0 += kMaxRows) {
        const int R = static_cast<int>(std::min<int64_t>(kMaxRows, G - g0));
        const int64_t r = t * G + g0, i = r - t_first * G;
        for (int64_t j = 0; j < len; j += 4) {
          const float* kr[4];
          for (int u = 0; u < 4; ++u) kr[u] = kbase + keys[std::min(j + u, len - 1)] * D;
          Ops::Scores(R, qs + r * D, D, kr, p + i * kPartKeys + j, kPartKeys);
        }
        for (int rr = 0; rr < R; ++rr) Ops::ExpSum(p + (i + rr) * kPartKeys, len, pm + i + rr, pl + i + rr);
        Ops::Pv(R, p + i * kPartKeys, kPartKeys, vbase, keys, len, D, pacc + i * D);
      }
    }
    return t_first * G;
  }

  // Tokens [t0, t0 + tq) of sequence s, kv head h, scaled into qs (row r = t * G + g).
  static void ScaledRows(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, float* qs) {
    const int64_t G = a.group, D = a.head_dim;
    const int64_t q_start = a.seq_info[s * 4];
    for (int64_t t = 0; t < tq; ++t) {
      const float* src = a.q + ((q_start + t0 + t) * a.num_heads + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qs[t * G * D + i] = src[i] * a.scale;
    }
  }

  // Every part of tokens [t0, t0 + tq), merged in order, written to out.
  static void Tile(const Args& a, int64_t s, int64_t h, int64_t t0, int64_t tq, Scratch& w) {
    const int64_t G = a.group, D = a.head_dim, rows = tq * G;
    const int64_t first_pos = a.seq_info[s * 4 + 2] + t0, out_start = a.seq_info[s * 4 + 3];
    const int64_t num_keys = first_pos + tq;
    w.q.resize(rows * D);
    ScaledRows(a, s, h, t0, tq, w.q.data());
    // the part's maxima, sums, P.V; then each row's state: maximum, sum, o
    w.state.resize(rows * (D + 2) + rows * (D + 2));
    float* pm = w.state.data();
    float* pl = pm + rows;
    float* pacc = pl + rows;
    float* sm = pacc + rows * D;
    float* sl = sm + rows;
    float* so = sl + rows;
    for (int64_t k0 = 0; k0 < num_keys; k0 += kPartKeys) {
      const int64_t r0 = Part(a, s, h, t0, tq, k0, w.q.data(), w, pm, pl, pacc, true);
      for (int64_t r = r0; r < rows; ++r) {
        const int64_t i = r - r0;
        if (k0 == 0) {
          sm[r] = pm[i];
          sl[r] = pl[i];
          std::memcpy(so + r * D, pacc + i * D, D * sizeof(float));
        } else {
          Ops::Merge(sm + r, sl + r, so + r * D, pm[i], pl[i], pacc + i * D, D);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      Ops::Finish(so + r * D, sl[r], D, a.out + ((out_start + t0 + r / G) * a.num_heads + h * G + r % G) * D);
  }

  // Part p of decode sequence s (one token), kv head h: G x D P.V, then G maxima, G sums.
  static void DecodePart(const Args& a, int64_t s, int64_t h, int64_t p, Scratch& w, float* out) {
    const int64_t G = a.group, D = a.head_dim;
    w.q.resize(G * D);
    ScaledRows(a, s, h, 0, 1, w.q.data());
    Part(a, s, h, 0, 1, p * kPartKeys, w.q.data(), w, out + G * D, out + G * D + G, out, false);
  }

  static void Run(const Args& a, int64_t S, int64_t KVH, int threads) {
    const int32_t* info = a.seq_info;
    const int64_t G = a.group, D = a.head_dim;
    struct Item {
      int64_t s, h, t0, tq, part, slot;  // slot >= 0: part `part` of a decode row, into the parts buffer
    };
    std::vector<Item> items;
    int64_t work = 0, decode_items = 0;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t q_len = info[s * 4 + 1];
      work += (info[s * 4 + 2] + q_len) * q_len;
      decode_items += q_len == 1 ? KVH : 0;
    }
    work *= G * KVH;
    // batch 1 and the like: too few items for the threads, so each decode part is an item
    const bool split = threads > 1 && decode_items < 2 * threads;
    std::vector<int64_t> first_slot(S, -1);
    int64_t slots = 0;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t q_len = info[s * 4 + 1], ctx = info[s * 4 + 2];
      if (q_len == 1 && split) {
        const int64_t parts = ctx / kPartKeys + 1;
        first_slot[s] = slots;
        for (int64_t h = 0; h < KVH; ++h)
          for (int64_t p = 0; p < parts; ++p) items.push_back({s, h, 0, 1, p, slots++});
      } else {
        for (int64_t h = 0; h < KVH; ++h)
          for (int64_t t0 = 0; t0 < q_len; t0 += kQueryTile)
            items.push_back({s, h, t0, std::min(kQueryTile, q_len - t0), 0, -1});
      }
    }
    auto cost = [info](const Item& it) {
      return it.slot >= 0 ? kPartKeys : (info[it.s * 4 + 2] + it.t0 + it.tq) * it.tq;
    };
    std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) { return cost(x) > cost(y); });
    const int64_t stride = G * (D + 2);
    thread_local std::vector<float> buf;  // the caller's: per decode part, G x D P.V, G maxima, G sums
    buf.resize(slots * stride);
    float* const parts_out = buf.data();
    const int64_t n = static_cast<int64_t>(items.size());
    std::atomic<int64_t> next{0};
#pragma omp parallel if (n > 1 && work >= kMinParallelWork) num_threads(threads)
    {
      Scratch& w = ThreadScratch();
      for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
           i = next.fetch_add(1, std::memory_order_relaxed)) {
        const Item& it = items[i];
        if (it.slot >= 0)
          DecodePart(a, it.s, it.h, it.part, w, parts_out + it.slot * stride);
        else
          Tile(a, it.s, it.h, it.t0, it.tq, w);
      }
    }
    if (slots == 0) return;
    std::vector<float> o(D);
    for (int64_t s = 0; s < S; ++s) {  // the split decode rows: their parts merged in order
      if (first_slot[s] < 0) continue;
      const int64_t parts = info[s * 4 + 2] / kPartKeys + 1;
      for (int64_t h = 0; h < KVH; ++h)
        for (int64_t g = 0; g < G; ++g) {
          const float* part = parts_out + (first_slot[s] + h * parts) * stride;
          float m = part[G * D + g], l = part[G * D + G + g];
          std::memcpy(o.data(), part + g * D, D * sizeof(float));
          for (int64_t p = 1; p < parts; ++p) {
            part += stride;
            Ops::Merge(&m, &l, o.data(), part[G * D + g], part[G * D + G + g], part + g * D, D);
          }
          Ops::Finish(o.data(), l, D, a.out + (info[s * 4 + 3] * a.num_heads + h * G + g) * D);
        }
    }
  }
};

}  // namespace fdx::inv
