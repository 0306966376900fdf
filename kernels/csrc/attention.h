#pragma once

// Attention over the paged KV pool, float32 softmax and accumulation.
//   decode_attention  one query per sequence, parallel over (sequence, kv head); each K/V row is
//                     read once for all G query heads of its group.
//   extend_attention  causal prefill for a whole batch, flash-style blocks (see below).
//   extend_attention_bf16  the same with bf16 products (extend_avx512.h), where AVX512-BF16 is.

#include <algorithm>
#include <array>

#include "common.h"
#include "decode_avx512.h"
#include "extend_avx512.h"
#include "kv_int8.h"

namespace radixserve {
namespace {

// One (sequence, kv head) item of decode attention. DIM > 0 fixes the head size at compile time
// (fully unrolled inner loops, accumulators in registers); DIM == 0 reads it from `dim`.
template <typename E, int DIM>
void decode_item(const typename E::T* __restrict__ q, int64_t q_stride_h, const typename E::T* __restrict__ k_buf,
                 const typename E::T* __restrict__ v_buf, const int64_t* __restrict__ slots, int64_t len,
                 int64_t row, int64_t group, int64_t dim_rt, float scale, typename E::T* __restrict__ out,
                 std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& scores) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  qf.resize(group * dim);
  acc.assign(group * dim, 0.f);
  scores.resize(group * len);
  for (int64_t g = 0; g < group; ++g) {
    const typename E::T* qr = q + g * q_stride_h;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = E::load(qr[d]) * scale;
  }
  float* __restrict__ sc = scores.data();
  const float* __restrict__ qp = qf.data();
  for (int64_t l = 0; l < len; ++l) {
    const typename E::T* __restrict__ kr = k_buf + slots[l] * row;
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < dim; ++d) s += qp[g * dim + d] * E::load(kr[d]);
      sc[g * len + l] = s;
    }
  }
  std::vector<float> inv_sum(group);
  for (int64_t g = 0; g < group; ++g) {
    float* __restrict__ sg = sc + g * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < len; ++l) m = std::max(m, sg[l]);
#pragma omp simd
    for (int64_t l = 0; l < len; ++l) sg[l] = exp_any(sg[l] - m);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t l = 0; l < len; ++l) total += sg[l];
    inv_sum[g] = 1.f / total;
  }
  float* __restrict__ ap = acc.data();
  for (int64_t l = 0; l < len; ++l) {
    const typename E::T* __restrict__ vr = v_buf + slots[l] * row;
    for (int64_t g = 0; g < group; ++g) {
      const float p = sc[g * len + l];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ap[g * dim + d] += p * E::load(vr[d]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = E::store(ap[g * dim + d] * inv_sum[g]);
  }
}

// How a decode step's (sequence, kv head) items are grouped into the parallel loop's units: head by
// head, and within a head runs of sequences on one cached prefix (the same first KV slot; sorted
// by it), each run one unit, so that one core reads that prefix's K/V rows of the head from memory
// and its other sequences find them in the core's cache. A run is cut at `cap` sequences so that
// a large group still spreads over the cores. The grouping changes no item's result.
struct DecodeUnits {
  std::vector<int64_t> order;  // the sequences, by first slot
  std::vector<int64_t> runs;   // run r is order[runs[r], runs[r + 1])
  // shared[j], for j an even place in its run with a next one: how many first slots order[j] and
  // order[j + 1] have in common (the pair kernel's prefix); 0 elsewhere.
  std::vector<int64_t> shared;
};

inline DecodeUnits decode_units(const int64_t* kv_indices, int64_t width, const int64_t* seq_lens, int64_t batch,
                                int64_t kv_heads) {
  DecodeUnits u;
  u.order.resize(batch);
  auto first = [&](int64_t b) { return seq_lens[b] > 0 ? kv_indices[b * width] : -1 - b; };
  for (int64_t b = 0; b < batch; ++b) u.order[b] = b;
  std::stable_sort(u.order.begin(), u.order.end(), [&](int64_t a, int64_t b) { return first(a) < first(b); });
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t cap = std::max<int64_t>(2, batch * kv_heads / (4 * threads));
  u.runs.push_back(0);
  for (int64_t i = 1; i < batch; ++i)
    if (first(u.order[i]) != first(u.order[i - 1]) || i - u.runs.back() >= cap) u.runs.push_back(i);
  u.runs.push_back(batch);
  u.shared.assign(batch, 0);
  for (size_t r = 0; r + 1 < u.runs.size(); ++r)
    for (int64_t j = u.runs[r]; j + 1 < u.runs[r + 1]; j += 2) {
      const int64_t a = u.order[j], b = u.order[j + 1], n = std::min(seq_lens[a], seq_lens[b]);
      const int64_t* ra = kv_indices + a * width;
      u.shared[j] = std::mismatch(ra, ra + n, kv_indices + b * width).first - ra;
    }
  return u;
}

// Below this many common first slots two sequences of a run go one at a time.
constexpr int64_t kPairMinShared = 16;

template <typename E>
void decode_attention_impl(const typename E::T* q, int64_t q_stride_t, int64_t q_stride_h, const typename E::T* k_buf,
                           const typename E::T* v_buf, const int64_t* kv_indices, int64_t width,
                           const int64_t* seq_lens, typename E::T* out, int64_t batch, int64_t heads,
                           int64_t kv_heads, int64_t dim, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * dim;  // elements per slot in the K/V buffers
  const DecodeUnits units = decode_units(kv_indices, width, seq_lens, batch, kv_heads);
  const int64_t* ord = units.order.data();
  const int64_t* runs = units.runs.data();
  const int64_t nruns = static_cast<int64_t>(units.runs.size()) - 1;
  // Unit i: head i / nruns, run i % nruns.
  auto for_items = [=](int64_t begin, int64_t end, auto&& item) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t kh = i / nruns, r = i % nruns;
      for (int64_t j = runs[r]; j < runs[r + 1]; ++j) item(ord[j], kh);
    }
  };
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<E, BF16>) {
    if (const DecodeItemFn item_fn = decode_item_avx512_for(dim, group)) {
      const DecodePairFn pair_fn = decode_pair_avx512_for(dim, group);
      const int64_t* shared = units.shared.data();
      parallel_for(0, nruns * kv_heads, 1, [=](int64_t begin, int64_t end) {
        std::vector<float> scores;
        for (int64_t i = begin; i < end; ++i) {
          const int64_t kh = i / nruns, r = i % nruns;
          const uint16_t* kb = k_buf + kh * dim;
          const uint16_t* vb = v_buf + kh * dim;
          auto q_of = [&](int64_t b) { return q + b * q_stride_t + kh * group * q_stride_h; };
          auto out_of = [&](int64_t b) { return out + (b * heads + kh * group) * dim; };
          int64_t j = runs[r];
          // Sequences on one prefix two at a time (their prefix's K/V rows read once), where the
          // kernel exists and they share at least kPairMinShared keys.
          for (; pair_fn != nullptr && j + 1 < runs[r + 1] && shared[j] >= kPairMinShared; j += 2) {
            const int64_t a = ord[j], b = ord[j + 1];
            const uint16_t* qs[2] = {q_of(a), q_of(b)};
            const int64_t* slots[2] = {kv_indices + a * width, kv_indices + b * width};
            const int64_t lens[2] = {seq_lens[a], seq_lens[b]};
            uint16_t* outs[2] = {out_of(a), out_of(b)};
            pair_fn(qs, q_stride_h, kb, vb, slots, lens, shared[j], row, scale, outs, scores);
          }
          for (; j < runs[r + 1]; ++j) {
            const int64_t b = ord[j];
            item_fn(q_of(b), q_stride_h, kb, vb, kv_indices + b * width, seq_lens[b], row, scale, out_of(b), scores);
          }
        }
      });
      return;
    }
  }
#endif
  parallel_for(0, nruns * kv_heads, 1, [=](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores;
    for_items(begin, end, [&](int64_t b, int64_t kh) {
      const auto* qb = q + b * q_stride_t + kh * group * q_stride_h;
      auto* ob = out + (b * heads + kh * group) * dim;
      const int64_t* slots = kv_indices + b * width;
      const auto* kb = k_buf + kh * dim;
      const auto* vb = v_buf + kh * dim;
      if (dim == 64) {
        decode_item<E, 64>(qb, q_stride_h, kb, vb, slots, seq_lens[b], row, group, dim, scale, ob, qf, acc, scores);
      } else if (dim == 128) {
        decode_item<E, 128>(qb, q_stride_h, kb, vb, slots, seq_lens[b], row, group, dim, scale, ob, qf, acc, scores);
      } else {
        decode_item<E, 0>(qb, q_stride_h, kb, vb, slots, seq_lens[b], row, group, dim, scale, ob, qf, acc, scores);
      }
    });
  });
}


// Extend (prefill) attention for a whole batch, reading K/V from the pool (the new tokens' K/V
// already written). Sequence b has its new tokens at q rows [cu[b], cu[b+1]) at positions
// prefix_b + j and attends causally over kv_indices[b, :seq_lens[b]]. Flash-style: K (transposed)
// and V of every (sequence, kv head) are converted to float32 once, then blocks of QB tokens x G
// heads run online softmax over key blocks of KB, skipping blocks beyond their causal limit.
constexpr int64_t kQB = 32;
constexpr int64_t kKB = 32;

struct KVScratch {
  std::vector<float> kt, v;      // per (b, kh): K as [D][Lpad], V as [Lpad][D]
  std::vector<int64_t> base, lpad;  // offset and padded length per (b, kh)
};

// One sequence's keys (transposed, [D][lp]) and values ([lp][D]) of one kv head as float32; the
// padding past `len` must already be zero.
template <typename E>
void convert_seq_head(const typename E::T* k_head, const typename E::T* v_head, const int64_t* slots, int64_t len,
                      int64_t row, int64_t dim, int64_t lp, float* kt, float* vv) {
  for (int64_t l = 0; l < len; ++l) {
    const typename E::T* kr = k_head + slots[l] * row;
    const typename E::T* vr = v_head + slots[l] * row;
    for (int64_t d = 0; d < dim; ++d) kt[d * lp + l] = E::load(kr[d]);
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) vv[l * dim + d] = E::load(vr[d]);
  }
}

template <typename E>
void convert_kv(const typename E::T* k_buf, const typename E::T* v_buf, const int64_t* kv_indices, int64_t width,
                const int64_t* seq_lens, int64_t batch, int64_t kv_heads, int64_t dim, KVScratch& sc) {
  const int64_t row = kv_heads * dim;
  sc.base.resize(batch * kv_heads);
  sc.lpad.resize(batch * kv_heads);
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      sc.base[b * kv_heads + kh] = total;
      sc.lpad[b * kv_heads + kh] = (seq_lens[b] + kKB - 1) / kKB * kKB;
      total += sc.lpad[b * kv_heads + kh] * dim;
    }
  }
  sc.kt.assign(total, 0.f);
  sc.v.assign(total, 0.f);
  parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, kh = item % kv_heads;
      convert_seq_head<E>(k_buf + kh * dim, v_buf + kh * dim, kv_indices + b * width, seq_lens[b], row, dim,
                          sc.lpad[item], sc.kt.data() + sc.base[item], sc.v.data() + sc.base[item]);
    }
  });
}

// Online-softmax update of R query rows against one key block whose first `visible[i]` keys row i
// may see. R rows share every K/V load (register blocking), which is what makes this fast.
template <int DIM, int R>
inline void attend_rows(const float* __restrict__ qf, float* __restrict__ acc, float* __restrict__ mx,
                        float* __restrict__ den, const float* __restrict__ kt, const float* __restrict__ vv,
                        int64_t lp, int64_t k0, const int64_t* visible, int64_t dim_rt) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  float s[R][kKB];
  for (int i = 0; i < R; ++i)
#pragma omp simd
    for (int64_t j = 0; j < kKB; ++j) s[i][j] = 0.f;
  for (int64_t d = 0; d < dim; ++d) {
    const float* __restrict__ kd = kt + d * lp + k0;
    for (int i = 0; i < R; ++i) {
      const float qd = qf[i * dim + d];
#pragma omp simd
      for (int64_t j = 0; j < kKB; ++j) s[i][j] += qd * kd[j];
    }
  }
  float alpha[R];
  for (int i = 0; i < R; ++i) {
    float m = mx[i];
    for (int64_t j = 0; j < visible[i]; ++j) m = std::max(m, s[i][j]);
    alpha[i] = exp_any(mx[i] - m);
    float total = 0.f;
    const int64_t vis = visible[i];
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < kKB; ++j) {
      s[i][j] = j < vis ? exp_any(s[i][j] - m) : 0.f;
      total += s[i][j];
    }
    den[i] = den[i] * alpha[i] + total;
    mx[i] = m;
    float* __restrict__ ar = acc + i * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) ar[d] *= alpha[i];
  }
  int64_t last = 0;
  for (int i = 0; i < R; ++i) last = std::max(last, visible[i]);
  if constexpr (DIM > 0) {
    // Accumulate in d-chunks of 16 held in registers across the whole key block.
    constexpr int64_t C = 16;
    for (int64_t d0 = 0; d0 < DIM; d0 += C) {
      float a[R][C];
      for (int i = 0; i < R; ++i)
#pragma omp simd
        for (int64_t d = 0; d < C; ++d) a[i][d] = acc[i * DIM + d0 + d];
      for (int64_t j = 0; j < last; ++j) {
        const float* __restrict__ vj = vv + (k0 + j) * DIM + d0;
        for (int i = 0; i < R; ++i) {
          const float p = s[i][j];
#pragma omp simd
          for (int64_t d = 0; d < C; ++d) a[i][d] += p * vj[d];
        }
      }
      for (int i = 0; i < R; ++i)
#pragma omp simd
        for (int64_t d = 0; d < C; ++d) acc[i * DIM + d0 + d] = a[i][d];
    }
  } else {
    for (int64_t j = 0; j < last; ++j) {
      const float* __restrict__ vj = vv + (k0 + j) * dim;
      for (int i = 0; i < R; ++i) {
        const float p = s[i][j];
        float* __restrict__ ar = acc + i * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ar[d] += p * vj[d];
      }
    }
  }
}

template <typename E, int DIM>
void extend_block(const typename E::T* q, int64_t q_stride_t, int64_t q_stride_h, const float* __restrict__ kt,
                  const float* __restrict__ vv, int64_t lp, int64_t prefix, int64_t first, int64_t ntok,
                  int64_t group, int64_t dim_rt, float scale, typename E::T* out, int64_t out_stride_t,
                  std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& mx, std::vector<float>& den) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  const int64_t rows = ntok * group;  // row r = token r / group, head r % group
  qf.resize(rows * dim);
  acc.assign(rows * dim, 0.f);
  mx.assign(rows, -std::numeric_limits<float>::infinity());
  den.assign(rows, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const typename E::T* qr = q + (first + r / group) * q_stride_t + (r % group) * q_stride_h;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) qf[r * dim + d] = E::load(qr[d]) * scale;
  }
  const int64_t kv_end = prefix + ntok;  // keys visible to the block's last token
  constexpr int R = 8;
  int64_t visible[R];
  for (int64_t k0 = 0; k0 < kv_end; k0 += kKB) {
    int64_t r = 0;
    for (; r + R <= rows; r += R) {
      bool any = false;
      for (int i = 0; i < R; ++i) {
        visible[i] = std::max<int64_t>(0, std::min<int64_t>(kKB, prefix + (r + i) / group - k0 + 1));
        any |= visible[i] > 0;
      }
      if (any)
        attend_rows<DIM, R>(qf.data() + r * dim, acc.data() + r * dim, mx.data() + r, den.data() + r, kt, vv, lp,
                            k0, visible, dim);
    }
    for (; r < rows; ++r) {
      visible[0] = std::max<int64_t>(0, std::min<int64_t>(kKB, prefix + r / group - k0 + 1));
      if (visible[0] > 0)
        attend_rows<DIM, 1>(qf.data() + r * dim, acc.data() + r * dim, mx.data() + r, den.data() + r, kt, vv, lp,
                            k0, visible, dim);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    typename E::T* o = out + (first + r / group) * out_stride_t + (r % group) * dim;
    const float inv = 1.f / den[r];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) o[d] = E::store(acc[r * dim + d] * inv);
  }
}

template <typename E>
void extend_attention_impl(const typename E::T* q, int64_t q_stride_t, int64_t q_stride_h, const typename E::T* k_buf,
                           const typename E::T* v_buf, const int64_t* kv_indices, int64_t width,
                           const int64_t* seq_lens, const int64_t* cu, int64_t batch, int64_t heads,
                           int64_t kv_heads, int64_t dim, float scale, typename E::T* out) {
  const int64_t group = heads / kv_heads;
  KVScratch sc;
  convert_kv<E>(k_buf, v_buf, kv_indices, width, seq_lens, batch, kv_heads, dim, sc);
  const auto items = extend_items(batch, kv_heads, cu, seq_lens, kQB);
  parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, mx, den;
    for (int64_t i = begin; i < end; ++i) {
      const auto [b, kh, t] = items[i];
      const int64_t ntok = std::min<int64_t>(kQB, cu[b + 1] - t);
      const int64_t prefix = seq_lens[b] - (cu[b + 1] - cu[b]) + (t - cu[b]);  // position of token t
      const int64_t it = b * kv_heads + kh;
      const auto* qb = q + kh * group * q_stride_h;
      auto* ob = out + kh * group * dim;
      const float* kt = sc.kt.data() + sc.base[it];
      const float* vv = sc.v.data() + sc.base[it];
      if (dim == 64) {
        extend_block<E, 64>(qb, q_stride_t, q_stride_h, kt, vv, sc.lpad[it], prefix, t, ntok, group, dim, scale, ob,
                            heads * dim, qf, acc, mx, den);
      } else if (dim == 128) {
        extend_block<E, 128>(qb, q_stride_t, q_stride_h, kt, vv, sc.lpad[it], prefix, t, ntok, group, dim, scale, ob,
                             heads * dim, qf, acc, mx, den);
      } else {
        extend_block<E, 0>(qb, q_stride_t, q_stride_h, kt, vv, sc.lpad[it], prefix, t, ntok, group, dim, scale, ob,
                           heads * dim, qf, acc, mx, den);
      }
    }
  });
}

// Decode through extend's arithmetic: a token's output is bitwise the one extend_block gives it
// at the same position, whatever the batch. The same steps in the same order: q scaled to float32,
// key blocks of kKB from position 0, each through attend_rows (the same code: per row it computes
// the same whatever R is), then acc / den. Only where K/V come from differs: each block is
// converted into an L1-sized scratch (K transposed, V as rows) as convert_kv lays them out, instead
// of the whole sequence at once, and the G query heads of a kv head share each block.
template <typename E, int DIM, int G>
void decode_fixed_item(const typename E::T* q, int64_t q_stride_h, const typename E::T* k_head,
                       const typename E::T* v_head, const int64_t* slots, int64_t len, int64_t row, int64_t dim_rt,
                       float scale, typename E::T* out, float* kt, float* vv) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  float qf[G * (DIM > 0 ? DIM : 256)];
  float acc[G * (DIM > 0 ? DIM : 256)];
  float mx[G], den[G];
  for (int g = 0; g < G; ++g) {
    const typename E::T* qr = q + g * q_stride_h;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = E::load(qr[d]) * scale;
    for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] = 0.f;
    mx[g] = -std::numeric_limits<float>::infinity();
    den[g] = 0.f;
  }
  int64_t visible[G];
  for (int64_t k0 = 0; k0 < len; k0 += kKB) {
    const int64_t nb = std::min<int64_t>(kKB, len - k0);
    for (int64_t j = 0; j < kKB; ++j) {
      if (j < nb) {
        const typename E::T* kr = k_head + slots[k0 + j] * row;
        const typename E::T* vr = v_head + slots[k0 + j] * row;
        for (int64_t d = 0; d < dim; ++d) kt[d * kKB + j] = E::load(kr[d]);
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) vv[j * dim + d] = E::load(vr[d]);
      } else {
        for (int64_t d = 0; d < dim; ++d) kt[d * kKB + j] = 0.f;
        for (int64_t d = 0; d < dim; ++d) vv[j * dim + d] = 0.f;
      }
    }
    for (int g = 0; g < G; ++g) visible[g] = nb;
    attend_rows<DIM, G>(qf, acc, mx, den, kt, vv, kKB, 0, visible, dim);
  }
  for (int g = 0; g < G; ++g) {
    typename E::T* o = out + g * dim;
    const float inv = 1.f / den[g];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) o[d] = E::store(acc[g * dim + d] * inv);
  }
}

template <typename E, int DIM>
using DecodeFixedFn = void (*)(const typename E::T*, int64_t, const typename E::T*, const typename E::T*,
                               const int64_t*, int64_t, int64_t, int64_t, float, typename E::T*, float*, float*);

template <typename E, int DIM, int... Gs>
constexpr std::array<DecodeFixedFn<E, DIM>, sizeof...(Gs)> decode_fixed_table(std::integer_sequence<int, Gs...>) {
  return {&decode_fixed_item<E, DIM, Gs + 1>...};
}

template <typename E, int DIM>
void decode_fixed_rows(const typename E::T* q, int64_t q_stride_t, int64_t q_stride_h, const typename E::T* k_buf,
                       const typename E::T* v_buf, const int64_t* kv_indices, int64_t width, const int64_t* seq_lens,
                       typename E::T* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, float scale) {
  static constexpr auto kFns = decode_fixed_table<E, DIM>(std::make_integer_sequence<int, 8>{});
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * dim;
  parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(kKB * dim), vv(kKB * dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, kh = item % kv_heads;
      const auto* qb = q + b * q_stride_t + kh * group * q_stride_h;
      auto* ob = out + (b * heads + kh * group) * dim;
      for (int64_t g0 = 0; g0 < group; g0 += 8) {  // groups above 8 in parts of 8
        const int64_t gn = std::min<int64_t>(8, group - g0);
        kFns[gn - 1](qb + g0 * q_stride_h, q_stride_h, k_buf + kh * dim, v_buf + kh * dim, kv_indices + b * width,
                     seq_lens[b], row, dim, scale, ob + g0 * dim, kt.data(), vv.data());
      }
    }
  });
}

template <typename E>
void decode_attention_fixed_impl(const typename E::T* q, int64_t q_stride_t, int64_t q_stride_h,
                                 const typename E::T* k_buf, const typename E::T* v_buf, const int64_t* kv_indices,
                                 int64_t width, const int64_t* seq_lens, typename E::T* out, int64_t batch,
                                 int64_t heads, int64_t kv_heads, int64_t dim, float scale) {
  TORCH_CHECK(dim <= 256, "fixed-order decode attention takes head sizes up to 256");
  if (dim == 64) {
    decode_fixed_rows<E, 64>(q, q_stride_t, q_stride_h, k_buf, v_buf, kv_indices, width, seq_lens, out, batch, heads,
                             kv_heads, dim, scale);
  } else if (dim == 128) {
    decode_fixed_rows<E, 128>(q, q_stride_t, q_stride_h, k_buf, v_buf, kv_indices, width, seq_lens, out, batch, heads,
                              kv_heads, dim, scale);
  } else {
    decode_fixed_rows<E, 0>(q, q_stride_t, q_stride_h, k_buf, v_buf, kv_indices, width, seq_lens, out, batch, heads,
                            kv_heads, dim, scale);
  }
}

}  // namespace

// Both decode entry points: the same checks and launch; `fixed` picks the key-block arithmetic of
// extend_attention (the batch-invariant variant) over the fused one.
inline torch::Tensor run_decode_attention(const torch::Tensor& q, const torch::Tensor& k_buf,
                                          const torch::Tensor& v_buf, const torch::Tensor& kv_indices,
                                          const torch::Tensor& seq_lens, double scale, bool fixed) {
  if (k_buf.scalar_type() == at::kChar) {
    TORCH_CHECK(!fixed, "the fixed-order (batch-invariant) decode attention takes no int8 pool");
    return decode_attention_int8(q, k_buf, v_buf, kv_indices, seq_lens, scale);
  }
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, D] with contiguous D");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.dim() == 3, "K/V buffers must be contiguous");
  TORCH_CHECK(k_buf.scalar_type() == q.scalar_type() && v_buf.scalar_type() == q.scalar_type(), "dtype mismatch");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indices.is_contiguous(), "kv_indices must be int64");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "seq_lens must be int64");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_buf.size(1);
  TORCH_CHECK(k_buf.size(2) == dim && heads % kv_heads == 0, "head shapes do not match");
  auto out = torch::empty({batch, heads, dim}, q.options());
  dispatch(q.scalar_type(), [&](auto e) {
    using E = decltype(e);
    auto impl = fixed ? decode_attention_fixed_impl<E> : decode_attention_impl<E>;
    impl(ptr<E>(q), q.stride(0), q.stride(1), ptr<E>(k_buf), ptr<E>(v_buf), kv_indices.data_ptr<int64_t>(),
         kv_indices.size(1), seq_lens.data_ptr<int64_t>(), ptr<E>(out), batch, heads, kv_heads, dim,
         static_cast<float>(scale));
  });
  return out;
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                               const torch::Tensor& kv_indices, const torch::Tensor& seq_lens, double scale) {
  return run_decode_attention(q, k_buf, v_buf, kv_indices, seq_lens, scale, false);
}

torch::Tensor decode_attention_fixed(const torch::Tensor& q, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                                     const torch::Tensor& kv_indices, const torch::Tensor& seq_lens, double scale) {
  return run_decode_attention(q, k_buf, v_buf, kv_indices, seq_lens, scale, true);
}

torch::Tensor extend_attention(const torch::Tensor& q, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                               const torch::Tensor& kv_indices, const torch::Tensor& seq_lens, const torch::Tensor& cu,
                               double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with contiguous D");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.dim() == 3, "K/V buffers must be contiguous");
  TORCH_CHECK(k_buf.scalar_type() == q.scalar_type() && v_buf.scalar_type() == q.scalar_type(), "dtype mismatch");
  for (const auto* t : {&kv_indices, &seq_lens, &cu})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices must be contiguous int64");
  const int64_t batch = seq_lens.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_buf.size(1);
  TORCH_CHECK(cu.size(0) == batch + 1 && kv_indices.size(0) == batch, "batch sizes do not match");
  TORCH_CHECK(k_buf.size(2) == dim && heads % kv_heads == 0, "head shapes do not match");
  auto out = torch::empty({q.size(0), heads, dim}, q.options());
  dispatch(q.scalar_type(), [&](auto e) {
    using E = decltype(e);
    extend_attention_impl<E>(ptr<E>(q), q.stride(0), q.stride(1), ptr<E>(k_buf), ptr<E>(v_buf),
                             kv_indices.data_ptr<int64_t>(), kv_indices.size(1), seq_lens.data_ptr<int64_t>(),
                             cu.data_ptr<int64_t>(), batch, heads, kv_heads, dim, static_cast<float>(scale),
                             ptr<E>(out));
  });
  return out;
}

bool extend_bf16_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

torch::Tensor extend_attention_bf16(const torch::Tensor& q, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                                    const torch::Tensor& kv_indices, const torch::Tensor& seq_lens,
                                    const torch::Tensor& cu, double scale) {
  TORCH_CHECK(extend_bf16_available(), "extend_attention_bf16 needs a CPU with AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with contiguous D");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.dim() == 3, "K/V buffers must be contiguous");
  const bool i8 = k_buf.scalar_type() == at::kChar;  // an int8 pool (kv_int8.h)
  const auto kv_type = i8 ? at::kChar : at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_buf.scalar_type() == kv_type && v_buf.scalar_type() == kv_type,
              "extend_attention_bf16 takes bfloat16 q with a bfloat16 or int8 pool");
  for (const auto* t : {&kv_indices, &seq_lens, &cu})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices must be contiguous int64");
  const int64_t batch = seq_lens.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_buf.size(1);
  TORCH_CHECK(cu.size(0) == batch + 1 && kv_indices.size(0) == batch, "batch sizes do not match");
  TORCH_CHECK(k_buf.size(2) == dim + (i8 ? 4 : 0) && heads % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(dim == 64 || dim == 128, "extend_attention_bf16 takes head sizes 64 and 128");
  TORCH_CHECK(q.stride(1) % 2 == 0 && q.stride(0) % 2 == 0, "q rows must start on 4-byte boundaries");
  auto out = torch::empty({q.size(0), heads, dim}, q.options());
#if defined(__AVX512BF16__)
  auto run = dim == 64 ? (i8 ? extend_attention_bf16_impl<64, true> : extend_attention_bf16_impl<64, false>)
                       : (i8 ? extend_attention_bf16_impl<128, true> : extend_attention_bf16_impl<128, false>);
  run(ptr<BF16>(q), q.stride(0), q.stride(1), k_buf.data_ptr(), v_buf.data_ptr(), kv_indices.data_ptr<int64_t>(),
      kv_indices.size(1), seq_lens.data_ptr<int64_t>(), cu.data_ptr<int64_t>(), batch, heads, kv_heads,
      static_cast<float>(scale), ptr<BF16>(out));
#endif
  return out;
}

}  // namespace radixserve
