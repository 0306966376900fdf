#pragma once

// Decode attention for bf16 K/V on AVX512-BF16 CPUs: one (sequence, kv head) item, the same math
// as decode_item in attention.h (float32 scores, softmax and accumulation), vectorized by hand.
// The generic loop spends most of its time on one horizontal sum per (key, head); here a key's
// q.k products come from `vdpbf16ps` on the raw bf16 rows and four keys are summed together, and
// the P.V accumulators of all G heads of the group stay in registers.

#include "common.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace radixserve {
namespace {

// [sum(a), sum(b), sum(c), sum(d)]
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d.
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // Per lane: [a, b, c, d] partial sums.
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

inline __m512 load_bf16x16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <int D>
inline __m512 qk_partial(const uint16_t* k, const __m512bh* qv) {
  __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int c = 0; c < D / 32; ++c)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(k + 32 * c), qv[c]);
  return acc;
}

// Keys ahead of the one in use whose rows are prefetched: the slots are scattered over the pool,
// which the hardware prefetchers cannot follow. Into L2: into L1 (_MM_HINT_T0), L1's few miss
// buffers bound the rows in flight. A step's attention over 8 unrelated 767-key contexts (30
// layers' pools, 141 MB) took 8.6-9.0 ms with 16 keys ahead into L1, 6.2-6.3 with 16 into L2 and
// 4.5-4.8 with 48-96 into L2; at 4000 keys 46-49 ms against 25-27.
constexpr int64_t kPrefetchKeys = 64;

inline void prefetch_row(const uint16_t* buf, int64_t slot, int64_t row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(buf + slot * row);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, kStreamPrefetch);
}

// Scores of the G query heads of each of M sequences against keys [l0, l1), each key row read once
// for all of them: sc[m][g * lens[m] + l] = scale * q_{m,g} . k_l. Keys go in blocks of four from
// l0 while a whole block fits before l1, the rest one at a time; a key's score depends on which of
// the two it took, so a range that continues another starts at a multiple of four from 0 (the
// blocks of the whole range [0, len) are then the same).
template <int D, int G, int M>
inline void qk_scores(const uint16_t* const* q, int64_t q_stride_h, const uint16_t* k_buf, const int64_t* slots,
                      int64_t l0, int64_t l1, int64_t row, float scale, float* const* sc, const int64_t* lens) {
  constexpr int C = D / 32;
  __m512bh qv[M][G][C];
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) qv[m][g][c] = (__m512bh)_mm512_loadu_si512(q[m] + g * q_stride_h + 32 * c);
  const __m128 s4 = _mm_set1_ps(scale);
  int64_t l = l0;
  for (; l + 4 <= l1; l += 4) {
    for (int64_t a = l + kPrefetchKeys; a < std::min(l + kPrefetchKeys + 4, l1); ++a)
      prefetch_row(k_buf, slots[a], row, 2 * D);
    const uint16_t* k0 = k_buf + slots[l] * row;
    const uint16_t* k1 = k_buf + slots[l + 1] * row;
    const uint16_t* k2 = k_buf + slots[l + 2] * row;
    const uint16_t* k3 = k_buf + slots[l + 3] * row;
#pragma GCC unroll 2
    for (int m = 0; m < M; ++m)
      for (int g = 0; g < G; ++g) {
        const __m128 s = sum4(qk_partial<D>(k0, qv[m][g]), qk_partial<D>(k1, qv[m][g]),
                              qk_partial<D>(k2, qv[m][g]), qk_partial<D>(k3, qv[m][g]));
        _mm_storeu_ps(sc[m] + g * lens[m] + l, _mm_mul_ps(s, s4));
      }
  }
  for (; l < l1; ++l)
    for (int m = 0; m < M; ++m)
      for (int g = 0; g < G; ++g)
        sc[m][g * lens[m] + l] = _mm512_reduce_add_ps(qk_partial<D>(k_buf + slots[l] * row, qv[m][g])) * scale;
}

// Each of the G rows of `len` scores made its softmax's numerators (exp of score - max), in place;
// inv_sum[g] = 1 / their sum.
template <int G>
inline void softmax_rows(float* sc, int64_t len, float* inv_sum) {
  for (int g = 0; g < G; ++g) {
    float* sg = sc + g * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < len; ++l) m = std::max(m, sg[l]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t l = 0; l < len; ++l) {
      sg[l] = exp_any(sg[l] - m);
      total += sg[l];
    }
    inv_sum[g] = 1.f / total;
  }
}

// out[g * D ...] = acc[g] * inv_sum[g] in bf16, for the G heads of an item.
template <int D, int G>
inline void store_rows_bf16(const __m512 (&acc)[G][D / 16], const float* inv_sum, uint16_t* out) {
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
#pragma GCC unroll 8
    for (int c = 0; c < D / 16; ++c) {
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * D + 16 * c), (__m256i)r);
    }
  }
}

// acc[m][g] += p[m][g][l] * v_l for keys [l0, l1) in order, each value row read once for all M x G
// heads (p: the rows of softmax numerators, as sc in qk_scores).
template <int D, int G, int M>
inline void pv_accumulate(const uint16_t* v_buf, const int64_t* slots, int64_t l0, int64_t l1, int64_t row,
                          float* const* sc, const int64_t* lens, __m512 (&acc)[M][G][D / 16]) {
  constexpr int NV = D / 16;  // float32 vectors per head row
  for (int64_t l = l0; l < l1; ++l) {
    if (l + kPrefetchKeys < l1) prefetch_row(v_buf, slots[l + kPrefetchKeys], row, 2 * D);
    const uint16_t* vr = v_buf + slots[l] * row;
    __m512 v[NV];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) v[c] = load_bf16x16(vr + 16 * c);
#pragma GCC unroll 2
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(sc[m][g * lens[m] + l]);
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) acc[m][g][c] = _mm512_fmadd_ps(p, v[c], acc[m][g][c]);
      }
  }
}

template <int D, int G, int M>
inline void zero_acc(__m512 (&acc)[M][G][D / 16]) {
#pragma GCC unroll 2
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
      for (int c = 0; c < D / 16; ++c) acc[m][g][c] = _mm512_setzero_ps();
}

// One (sequence, kv head) item for G query heads of head size D. q rows q + g * q_stride_h,
// output rows out + g * D.
template <int D, int G>
void decode_item_avx512(const uint16_t* q, int64_t q_stride_h, const uint16_t* k_buf, const uint16_t* v_buf,
                        const int64_t* slots, int64_t len, int64_t row, float scale, uint16_t* out,
                        std::vector<float>& scores) {
  scores.resize(G * len);
  float* sc = scores.data();
  float inv_sum[G];
  qk_scores<D, G, 1>(&q, q_stride_h, k_buf, slots, 0, len, row, scale, &sc, &len);
  softmax_rows<G>(sc, len, inv_sum);
  __m512 acc[1][G][D / 16];
  zero_acc<D, G, 1>(acc);
  pv_accumulate<D, G, 1>(v_buf, slots, 0, len, row, &sc, &len, acc);
  store_rows_bf16<D, G>(acc[0], inv_sum, out);
}

// Two sequences whose first `shared` slots are the same (a cached prefix), one kv head: their
// query heads take each of those keys' K and V rows from one read, as one item with 2G heads
// would; past them each goes on alone. Every output is the bits of decode_item_avx512 for its
// sequence: each score, softmax and sum runs in the same order over the same keys.
template <int D, int G>
void decode_pair_avx512(const uint16_t* const* q, int64_t q_stride_h, const uint16_t* k_buf, const uint16_t* v_buf,
                        const int64_t* const* slots, const int64_t* lens, int64_t shared, int64_t row, float scale,
                        uint16_t* const* out, std::vector<float>& scores) {
  scores.resize(G * (lens[0] + lens[1]));
  float* sc[2] = {scores.data(), scores.data() + G * lens[0]};
  const int64_t blocks = shared / 4 * 4;  // scores of whole blocks of four together (qk_scores)
  qk_scores<D, G, 2>(q, q_stride_h, k_buf, slots[0], 0, blocks, row, scale, sc, lens);
  float inv_sum[2][G];
  for (int m = 0; m < 2; ++m) {
    qk_scores<D, G, 1>(q + m, q_stride_h, k_buf, slots[m], blocks, lens[m], row, scale, sc + m, lens + m);
    softmax_rows<G>(sc[m], lens[m], inv_sum[m]);
  }
  __m512 acc[2][G][D / 16];
  zero_acc<D, G, 2>(acc);
  pv_accumulate<D, G, 2>(v_buf, slots[0], 0, shared, row, sc, lens, acc);
  for (int m = 0; m < 2; ++m) {
    __m512 own[1][G][D / 16];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < D / 16; ++c) own[0][g][c] = acc[m][g][c];
    pv_accumulate<D, G, 1>(v_buf, slots[m], shared, lens[m], row, sc + m, lens + m, own);
    store_rows_bf16<D, G>(own[0], inv_sum[m], out[m]);
  }
}

using DecodePairFn = void (*)(const uint16_t* const*, int64_t, const uint16_t*, const uint16_t*, const int64_t* const*,
                              const int64_t*, int64_t, int64_t, float, uint16_t* const*, std::vector<float>&);

// The pair kernel for (head size, group size) where both sequences' accumulators fit in registers
// (2 x G x D/16 <= 24 vectors), or nullptr.
inline DecodePairFn decode_pair_avx512_for(int64_t dim, int64_t group) {
  static constexpr DecodePairFn d64[] = {nullptr, &decode_pair_avx512<64, 1>, &decode_pair_avx512<64, 2>,
                                         &decode_pair_avx512<64, 3>};
  if (dim == 64 && group >= 1 && group <= 3) return d64[group];
  if (dim == 128 && group == 1) return &decode_pair_avx512<128, 1>;
  return nullptr;
}

using DecodeItemFn = void (*)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, const int64_t*, int64_t,
                              int64_t, float, uint16_t*, std::vector<float>&);

// The specialized item for (head size, group size), or nullptr where there is none.
inline DecodeItemFn decode_item_avx512_for(int64_t dim, int64_t group) {
  static constexpr DecodeItemFn d64[] = {nullptr, &decode_item_avx512<64, 1>, &decode_item_avx512<64, 2>,
                                         &decode_item_avx512<64, 3>, &decode_item_avx512<64, 4>,
                                         &decode_item_avx512<64, 5>, &decode_item_avx512<64, 6>,
                                         &decode_item_avx512<64, 7>, &decode_item_avx512<64, 8>};
  static constexpr DecodeItemFn d128[] = {nullptr, &decode_item_avx512<128, 1>, &decode_item_avx512<128, 2>,
                                          &decode_item_avx512<128, 3>, &decode_item_avx512<128, 4>,
                                          &decode_item_avx512<128, 5>, &decode_item_avx512<128, 6>,
                                          &decode_item_avx512<128, 7>, &decode_item_avx512<128, 8>};
  if (group < 1 || group > 8) return nullptr;
  if (dim == 64) return d64[group];
  if (dim == 128) return d128[group];
  return nullptr;
}

}  // namespace
}  // namespace radixserve
#endif
