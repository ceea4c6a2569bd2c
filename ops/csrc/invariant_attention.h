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
// A part's rows (the tile's tokens from the first that sees the part's first key, each
// token's G query heads) go to Ops::ScoresRows and Ops::PvRows together, which take them in
// groups of their own choosing (3 rows for the AVX2 and portable primitives; the AVX-512 ones
// transpose the part's K once from 6 rows and take P.V 6 rows at once); a group runs to its
// last row's key count, its earlier rows' extra scores dropped and their exps 0 (P.V adds
// 0 v_j: the same bits). Every primitive computes each row's and each key's value by the
// order above whatever the group, so the grouping is free to follow the row count.
//
// The template takes an Ops struct with the primitives (portable here; AVX2 + FMA in
// isa_avx2.cc, AVX-512 F in isa_avx512.cc, the AVX2 order in wider registers: the same bits);
// a build's every row goes through the same Ops functions, so within one build the order is
// one. Include after paged_attention_kernel.h's Args and Scratch.
#pragma once

namespace fdx::inv {

constexpr int64_t kPartKeys = 64;  // keys per part: a row's keys are cut at multiples of this
constexpr int64_t kMaxRows = 3;    // rows per Scores / Pv call of the AVX2 and portable primitives

// A part's rows (ScoresRows, PvRows) in groups of kMaxRows rows for Ops whose Scores and Pv
// take up to kMaxRows rows (PortableOps, Avx2Ops): a group runs to its last row's len keys
// (rows of two tokens in one group: the earlier one's extra scores are dropped, and its P.V
// adds 0 v_j for them, which leaves every sum's bits as they were).
template <class Ops>
struct InThrees {
  // p[i * ldp + j] = q_i . k_j for rows i < R (stride D) and keys j < len[i] (k: pointers up to
  // len[R - 1] rounded up to 4).
  static void ScoresRows(int64_t R, const float* q, int64_t D, const float* const* k, const int64_t* len, float* p,
                         int64_t ldp, Scratch&) {
    for (int64_t r = 0; r < R; r += kMaxRows) {
      const int n = static_cast<int>(std::min<int64_t>(kMaxRows, R - r));
      for (int64_t j = 0; j < len[r + n - 1]; j += 4) Ops::Scores(n, q + r * D, D, k + j, p + r * ldp + j, ldp);
    }
  }
  // acc[i * D + d] = sum_j p[i * ldp + j] v_j[d] for rows i < R over each group's last len.
  static void PvRows(int64_t R, const float* p, int64_t ldp, const float* vbase, const int64_t* keys,
                     const int64_t* len, int64_t D, float* acc, Scratch&) {
    for (int64_t r = 0; r < R; r += kMaxRows) {
      const int n = static_cast<int>(std::min<int64_t>(kMaxRows, R - r));
      Ops::Pv(n, p + r * ldp, ldp, vbase, keys, len[r + n - 1], D, acc + r * D);
    }
  }
};

// The portable primitives (any head_dim); the same contract as the AVX2 ones.
struct PortableOps : InThrees<PortableOps> {
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
    const int64_t r0 = t_first * G, R = tq * G - r0;  // rows [r0, tq * G) see key k0
    w.keys.resize(2 * kPartKeys + R);  // this part's keys, the next part's, each row's len
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
    int64_t* len = keys + 2 * kPartKeys;  // row r0 + i sees len[i] keys of the part (nondecreasing in i)
    for (int64_t i = 0; i < R; ++i) len[i] = std::min(nk, first_pos + (r0 + i) / G + 1 - k0);
    const float* kr[kPartKeys];  // each key's K row; past nk, up to a multiple of 16, the last one
    for (int64_t j = 0; j < kPartKeys; ++j) kr[j] = kbase + keys[std::min(j, nk - 1)] * D;
    w.p.resize(R * kPartKeys);
    float* p = w.p.data();
    Ops::ScoresRows(R, qs + r0 * D, D, kr, len, p, kPartKeys, w);
    for (int64_t i = 0; i < R; ++i) {
      float* row = p + i * kPartKeys;
      Ops::ExpSum(row, len[i], pm + i, pl + i);
      for (int64_t j = len[i]; j < nk; ++j) row[j] = 0.f;  // a P.V group runs to its last row's len: + 0 v_j
    }
    Ops::PvRows(R, p, kPartKeys, vbase, keys, len, D, pacc, w);
    return r0;
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
