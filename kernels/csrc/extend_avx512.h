#pragma once

// Extend (prefill) attention for bf16 K/V on AVX512-BF16 CPUs, with the products in bf16
// dot-product instructions (vdpbf16ps: each float32 lane adds the products of one pair of bf16
// elements). The scores, the online softmax and the output accumulate in float32; the softmax
// weights are rounded to bf16 for the P.V products, as flash-attention kernels do on bf16 matrix
// units. Twice the products per instruction of extend_attention's float32 FMAs, and K/V stay 2 bytes
// a value. extend_attention (float32 throughout) remains the batch-invariant path.
//
// Each (sequence, kv head)'s keys are packed once per call in blocks of 32 keys:
//   K block [D/2][32] words: word (p, j) = key j's elements 2p, 2p+1, so that a score row is
//     sum over p of (q's pair p, broadcast) . (that word of 16 keys), 16 keys a vector;
//   V block [16][D] words:   word (jp, d) = element d of keys 2jp and 2jp+1, so that an output row
//     is sum over jp of (the weights of keys 2jp, 2jp+1, broadcast) . (that word of 16 dims).
// Keys past the sequence are zeros. Query blocks of 32 tokens x G heads walk the key blocks up to
// their causal limit, R rows at a time sharing every K and V load.

#include "common.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace radixserve {
namespace {

constexpr int64_t kXKB = 32;  // keys per block
constexpr int64_t kXQB = 32;  // query tokens per work item

// exp_any (common.h) on 16 lanes: the same clamp and polynomial, the power of two by scalef.
inline __m512 exp512(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f)),
                                 _mm512_set1_ps(1.4426950408889634f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(0.00021871254533521088f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0012382410007126033f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.00968618798764167f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05547891082457537f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402310974359102f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931468375864389f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000000061639827f));
  return _mm512_scalef_ps(p, whole);
}

// The rows a pack reads, as bf16 words: a bf16 pool's as they are; an int8 pool's (kv_int8.h: D
// int8 values and their float32 scale) each value times its row's scale, rounded to bf16.
struct Bf16Rows {
  const uint16_t *k, *v;
  int64_t row;
  struct Row {
    const uint16_t *k, *v;
    uint32_t key_pair(int p) const { return reinterpret_cast<const uint32_t*>(k)[p]; }
    uint16_t value(int d) const { return v[d]; }
  };
  Row at(int64_t slot) const { return {k + slot * row, v + slot * row}; }
};

template <int D>
struct Int8Rows {
  const int8_t *k, *v;
  int64_t row;
  struct Row {
    const int8_t *k, *v;
    float ks, vs;
    uint32_t key_pair(int p) const {
      return static_cast<uint32_t>(BF16::store(k[2 * p] * ks)) |
             (static_cast<uint32_t>(BF16::store(k[2 * p + 1] * ks)) << 16);
    }
    uint16_t value(int d) const { return BF16::store(v[d] * vs); }
  };
  Row at(int64_t slot) const {
    Row r{k + slot * row, v + slot * row, 0.f, 0.f};
    std::memcpy(&r.ks, r.k + D, sizeof(float));
    std::memcpy(&r.vs, r.v + D, sizeof(float));
    return r;
  }
};

// One sequence's keys and values of one head packed in blocks (the layouts above).
template <int D, typename Rows>
void pack_kv(const Rows& rows, const int64_t* slots, int64_t len, int64_t blocks, uint32_t* kp, uint32_t* vp) {
  constexpr int P = D / 2;
  for (int64_t b = 0; b < blocks; ++b) {
    uint32_t* kb = kp + b * P * kXKB;
    uint16_t* vb = reinterpret_cast<uint16_t*>(vp + b * (kXKB / 2) * D);
    for (int64_t j = 0; j < kXKB; ++j) {
      const int64_t l = b * kXKB + j;
      uint16_t* vw = vb + (j / 2) * 2 * D + (j & 1);
      if (l < len) {
        const auto r = rows.at(slots[l]);
        for (int p = 0; p < P; ++p) kb[p * kXKB + j] = r.key_pair(p);
        for (int d = 0; d < D; ++d) vw[2 * d] = r.value(d);
      } else {
        for (int p = 0; p < P; ++p) kb[p * kXKB + j] = 0;
        for (int d = 0; d < D; ++d) vw[2 * d] = 0;
      }
    }
  }
}

// R query rows (pairs of bf16 as words, D/2 each) against one key block whose first visible[i]
// keys row i may see (at least one row sees one): online-softmax update of acc (R x D float32,
// unnormalized), mx and den.
template <int D, int R>
inline void block_rows_bf16(const uint32_t* const* qw, const uint32_t* kb, const uint32_t* vb, const int64_t* visible,
                            float scale, float* acc, float* mx, float* den) {
  constexpr int P = D / 2, NV = D / 16;
  __m512 s0[R], s1[R];
  for (int i = 0; i < R; ++i) s0[i] = s1[i] = _mm512_setzero_ps();
  for (int p = 0; p < P; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * kXKB);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + p * kXKB + 16);
    for (int i = 0; i < R; ++i) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[i][p]));
      s0[i] = _mm512_dpbf16_ps(s0[i], k0, qv);
      s1[i] = _mm512_dpbf16_ps(s1[i], k1, qv);
    }
  }
  alignas(64) uint32_t pw[R][16];
  float alpha[R];
  int64_t last = 0;
  const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int i = 0; i < R; ++i) {
    const int64_t vis = visible[i];
    last = std::max(last, vis);
    const __mmask16 m0 = vis >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << vis) - 1);
    const __mmask16 m1 = vis >= 32 ? 0xFFFF : vis <= 16 ? 0 : static_cast<__mmask16>((1u << (vis - 16)) - 1);
    const __m512 a = _mm512_mask_mul_ps(ninf, m0, s0[i], sc), b = _mm512_mask_mul_ps(ninf, m1, s1[i], sc);
    const float m = std::max(mx[i], _mm512_reduce_max_ps(_mm512_max_ps(a, b)));
    const __m512 mv = _mm512_set1_ps(m);
    const __m512 ea = _mm512_maskz_mov_ps(m0, exp512(_mm512_sub_ps(a, mv)));
    const __m512 eb = _mm512_maskz_mov_ps(m1, exp512(_mm512_sub_ps(b, mv)));
    alpha[i] = exp_any(mx[i] - m);
    den[i] = den[i] * alpha[i] + _mm512_reduce_add_ps(_mm512_add_ps(ea, eb));
    mx[i] = m;
    _mm512_store_si512(pw[i], (__m512i)_mm512_cvtne2ps_pbh(eb, ea));
  }
  __m512 o[R][NV];
  for (int i = 0; i < R; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[i]);
    for (int c = 0; c < NV; ++c) o[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + 16 * c), a);
  }
  const int64_t pairs = (last + 1) / 2;
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512bh v[NV];
    for (int c = 0; c < NV; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vb + jp * D + 16 * c);
    for (int i = 0; i < R; ++i) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[i][jp]));
      for (int c = 0; c < NV; ++c) o[i][c] = _mm512_dpbf16_ps(o[i][c], v[c], pv);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + i * D + 16 * c, o[i][c]);
}

template <int D>
using BlockRowsFn = void (*)(const uint32_t* const*, const uint32_t*, const uint32_t*, const int64_t*, float, float*,
                             float*, float*);

// Rows per call: enough independent accumulators to hide the instruction latency, few enough that
// the R x D/16 output vectors stay in the 32 vector registers.
template <int D>
constexpr int kRows = D == 64 ? 4 : 2;

// One work item: tokens [first, first + ntok) of a sequence (token first at position `pos0`), the
// G query heads of one kv head, over that head's packed K/V.
template <int D>
void extend_item_bf16(const uint16_t* q, int64_t q_stride_t, int64_t q_stride_h, const uint32_t* kp,
                      const uint32_t* vp, int64_t pos0, int64_t first, int64_t ntok, int64_t group, float scale,
                      uint16_t* out, int64_t out_stride_t, std::vector<float>& acc, std::vector<float>& mx,
                      std::vector<float>& den) {
  constexpr int R = kRows<D>;
  static constexpr BlockRowsFn<D> fns[] = {&block_rows_bf16<D, 1>, &block_rows_bf16<D, 2>, &block_rows_bf16<D, 3>,
                                           &block_rows_bf16<D, 4>};
  constexpr int P = D / 2;
  const int64_t rows = ntok * group;  // row r = token r / group, head r % group
  acc.assign(rows * D, 0.f);
  mx.assign(rows, -std::numeric_limits<float>::infinity());
  den.assign(rows, 0.f);
  const int64_t kv_end = pos0 + ntok;  // keys the item's last token sees
  const uint32_t* qw[R];
  int64_t visible[R];
  for (int64_t kb = 0; kb * kXKB < kv_end; ++kb) {
    const int64_t k0 = kb * kXKB;
    const uint32_t* kblock = kp + kb * P * kXKB;
    const uint32_t* vblock = vp + kb * (kXKB / 2) * D;
    for (int64_t r = 0; r < rows; r += R) {
      const int n = static_cast<int>(std::min<int64_t>(R, rows - r));
      // Rows go by token, so the block's last row sees the most: nothing to do if it sees none.
      if (pos0 + (r + n - 1) / group < k0) continue;
      for (int i = 0; i < n; ++i) {
        const int64_t tok = (r + i) / group;
        visible[i] = std::clamp<int64_t>(pos0 + tok - k0 + 1, 0, kXKB);
        qw[i] = reinterpret_cast<const uint32_t*>(q + (first + tok) * q_stride_t + ((r + i) % group) * q_stride_h);
      }
      fns[n - 1](qw, kblock, vblock, visible, scale, acc.data() + r * D, mx.data() + r, den.data() + r);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* o = out + (first + r / group) * out_stride_t + (r % group) * D;
    const float inv = 1.f / den[r];
#pragma omp simd
    for (int d = 0; d < D; ++d) o[d] = BF16::store(acc[r * D + d] * inv);
  }
}

// I8: the pool holds int8 rows with their scales (kv_int8.h), dequantized as they are packed.
template <int D, bool I8>
void extend_attention_bf16_impl(const uint16_t* q, int64_t q_stride_t, int64_t q_stride_h, const void* k_buf,
                                const void* v_buf, const int64_t* kv_indices, int64_t width,
                                const int64_t* seq_lens, const int64_t* cu, int64_t batch, int64_t heads,
                                int64_t kv_heads, float scale, uint16_t* out) {
  const int64_t head_row = I8 ? D + static_cast<int64_t>(sizeof(float)) : D;  // elements of one head's row
  const int64_t group = heads / kv_heads, row = kv_heads * head_row;
  const int64_t words = (kXKB / 2) * D;  // per key block, in K and in V alike
  std::vector<int64_t> base(batch * kv_heads);
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      base[b * kv_heads + kh] = total;
      total += (seq_lens[b] + kXKB - 1) / kXKB * words;
    }
  std::vector<uint32_t> kp(total), vp(total);
  parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = it / kv_heads, kh = it % kv_heads;
      const int64_t blocks = (seq_lens[b] + kXKB - 1) / kXKB;
      const int64_t* slots = kv_indices + b * width;
      if constexpr (I8) {
        const Int8Rows<D> rows{static_cast<const int8_t*>(k_buf) + kh * head_row,
                               static_cast<const int8_t*>(v_buf) + kh * head_row, row};
        pack_kv<D>(rows, slots, seq_lens[b], blocks, kp.data() + base[it], vp.data() + base[it]);
      } else {
        const Bf16Rows rows{static_cast<const uint16_t*>(k_buf) + kh * D, static_cast<const uint16_t*>(v_buf) + kh * D,
                            row};
        pack_kv<D>(rows, slots, seq_lens[b], blocks, kp.data() + base[it], vp.data() + base[it]);
      }
    }
  });
  const auto items = extend_items(batch, kv_heads, cu, seq_lens, kXQB);
  parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc, mx, den;
    for (int64_t i = begin; i < end; ++i) {
      const auto [b, kh, t] = items[i];
      const int64_t ntok = std::min<int64_t>(kXQB, cu[b + 1] - t);
      const int64_t pos0 = seq_lens[b] - (cu[b + 1] - cu[b]) + (t - cu[b]);
      const int64_t it = b * kv_heads + kh;
      extend_item_bf16<D>(q + kh * group * q_stride_h, q_stride_t, q_stride_h, kp.data() + base[it],
                          vp.data() + base[it], pos0, t, ntok, group, scale, out + kh * group * D, heads * D, acc,
                          mx, den);
    }
  });
}

}  // namespace
}  // namespace radixserve
#endif
