#pragma once

// Group-quantized weights, computed without a dequantized copy in memory:
//   W[n, c] = scale[n, g] * q[n, c] + offset[n, g],   g = c / group,
//   y[M, N] = x[M, K] @ W^T (+ bias[N]),
// with q either 4-bit (unsigned 0..15, two to a byte) or 8-bit (signed), scale / offset float32
// or float16 [N, K / group] (offset optional: zero; float16 where the values fit it exactly, as
// GGUF's own float16 scales do). Every weight format served (per-channel int8, GGUF's
// Q4_0/Q4_1/Q5_x/Q8_0/Q4_K/Q5_K/Q6_K, AWQ / GPTQ int4) is repacked into one of these two at load.
//
// 4-bit rows are blocks of 32 elements in 16 bytes: byte t of a block holds element t in its low
// nibble and element t + 16 in its high nibble (GGUF's Q4_0 order). A 4-bit group is a multiple of
// 32 elements; an 8-bit group may be anything (its vector loop is 16 wide, with a scalar tail).
//
// Few rows of x (decode): each weight row is read once from memory and widened to float32 in
// registers. One row: y = sum_g scale_g * (x_g . q_g) + sum_g offset_g * sum(x_g), so the inner loop
// is one FMA per weight, the scale applied once per group. Several rows: a tile of weight rows is
// dequantized once and dotted with every row of x (`dot_4x2`). AVX-512 or AVX2 where the CPU has it, a
// plain loop the compiler vectorizes as it can elsewhere. bf16 rows of x against 4-bit weights take
// bf16 dot products instead where the CPU has AVX512-BF16 (`rows_4bit_bf16`). Many rows (prefill)
// dequantize the whole weight (`quant_dequantize`) for torch's GEMM: kernels/quant_ops.py picks by
// the row count. A bf16 model on an AVX512-BF16 CPU keeps its projections in strips instead
// (quant_strips.h), faster from one row of x up (with AVX-512 VNNI for int8 activations too); this
// layout then serves int8 activations without VNNI, layouts the strips do not take, and float32
// models.

#include "common.h"

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace radixserve {
namespace quant_detail {

struct QuantView {
  int64_t bits, n, k, group, groups;
  const uint8_t* q;
  const void* scale;
  const void* offset;  // nullptr: zero
  bool half;           // scale and offset are float16 (else float32)

  int64_t row_bytes() const { return bits == 4 ? k / 2 : k; }
  const uint8_t* row(int64_t j) const { return q + j * row_bytes(); }

  // Row j's scales (and offsets, if any) as float32 into sc[groups] (of[groups]).
  void row_scales(int64_t j, float* sc, float* of) const {
    copy_row(scale, j, sc);
    if (offset && of) copy_row(offset, j, of);
  }

 private:
  void copy_row(const void* src, int64_t j, float* dst) const {
    if (half) {
      const at::Half* p = static_cast<const at::Half*>(src) + j * groups;
      int64_t g = 0;
#if defined(__F16C__)
      for (; g + 8 <= groups; g += 8)
        _mm256_storeu_ps(dst + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + g))));
#endif
      for (; g < groups; ++g) dst[g] = static_cast<float>(p[g]);
    } else {
      const float* p = static_cast<const float*>(src) + j * groups;
      std::copy(p, p + groups, dst);
    }
  }
};

inline QuantView view_of(const torch::Tensor& q, const torch::Tensor& scale, const c10::optional<torch::Tensor>& offset,
                         int64_t group, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "qweight must be contiguous [N, K / (8 / bits)]");
  TORCH_CHECK(q.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "qweight must be ",
              bits == 4 ? "uint8 (two 4-bit values a byte)" : "int8");
  const int64_t n = q.size(0), k = bits == 4 ? q.size(1) * 2 : q.size(1);
  TORCH_CHECK(group > 0 && k % group == 0, "group must divide K");
  TORCH_CHECK(bits == 8 || group % 32 == 0, "a 4-bit group is a multiple of 32");
  const int64_t groups = k / group;
  const bool half = scale.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scale.scalar_type() == at::kFloat) && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == n && scale.size(1) == groups,
              "scale must be float32 or float16 [N, K / group]");
  const void* off = nullptr;
  if (offset.has_value()) {
    TORCH_CHECK(offset->scalar_type() == scale.scalar_type() && offset->is_contiguous() &&
                    offset->sizes() == scale.sizes(),
                "offset must be [N, K / group] of scale's dtype");
    off = offset->data_ptr();
  }
  return {bits, n, k, group, groups, static_cast<const uint8_t*>(q.data_ptr()), scale.data_ptr(), off, half};
}

// Row j of W as float32 into out[0, k).
inline void dequant_row(const QuantView& w, int64_t j, float* out, float* sc, float* of_buf) {
  const uint8_t* r = w.row(j);
  w.row_scales(j, sc, of_buf);
  const float* of = w.offset ? of_buf : nullptr;
  if (w.bits == 8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(r);
    for (int64_t g = 0; g < w.groups; ++g) {
      const float s = sc[g], o = of ? of[g] : 0.0f;
      const int8_t* qg = q + g * w.group;
      float* dst = out + g * w.group;
#pragma omp simd
      for (int64_t c = 0; c < w.group; ++c) dst[c] = s * static_cast<float>(qg[c]) + o;
    }
    return;
  }
#if defined(__AVX2__)
  // Written out: the compiler's vectorization of the loop below ran at half this speed (all of a
  // 3072 x 576 4-bit weight on 2 AVX2 cores: 230 vs 110 us), which cost quant_linear 5-18% at
  // 2-16 rows of x (the tile path) and the prefill path's dequantization twice its time.
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < w.k / 32; ++b) {
    const int64_t g = b * 32 / w.group;
    const __m256 s = _mm256_set1_ps(sc[g]), o = _mm256_set1_ps(of ? of[g] : 0.0f);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + b * 16));
    const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    float* dst = out + b * 32;
    const auto put = [&](float* at, __m128i bytes) {
      _mm256_storeu_ps(at, _mm256_add_ps(_mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))), o));
    };
    put(dst, lo);
    put(dst + 8, _mm_srli_si128(lo, 8));
    put(dst + 16, hi);
    put(dst + 24, _mm_srli_si128(hi, 8));
  }
#else
  for (int64_t b = 0; b < w.k / 32; ++b) {
    const int64_t g = b * 32 / w.group;
    const float s = sc[g], o = of ? of[g] : 0.0f;
    const uint8_t* src = r + b * 16;
    float* dst = out + b * 32;
#pragma omp simd
    for (int t = 0; t < 16; ++t) {
      dst[t] = s * static_cast<float>(src[t] & 15) + o;
      dst[t + 16] = s * static_cast<float>(src[t] >> 4) + o;
    }
  }
#endif
}

#if defined(__AVX2__)
inline float hsum256(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
#endif

// sum_g sc[g] * (x_g . q_g) over row j, sc its scales (the offsets' share is added by the caller).
inline float scaled_dot(const QuantView& w, int64_t j, const float* x, const float* sc) {
  const uint8_t* r = w.row(j);
  if (w.bits == 4) {
    const int64_t blocks = w.group / 32;
#if defined(__AVX512F__)
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < w.groups; ++g) {
      __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t e = (g * blocks + b) * 32;
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + e / 2));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
        p0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + e), lo, p0);
        p1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + e + 16), hi, p1);
      }
      acc = _mm512_fmadd_ps(_mm512_add_ps(p0, p1), _mm512_set1_ps(sc[g]), acc);
    }
    return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t g = 0; g < w.groups; ++g) {
      __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t e = (g * blocks + b) * 32;
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + e / 2));
        const __m128i lo = _mm_and_si128(v, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + e), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), p0);
        p1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + e + 8),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), p1);
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + e + 16), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), p0);
        p1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + e + 24),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), p1);
      }
      const __m256 s = _mm256_set1_ps(sc[g]);
      if (g & 1) {
        acc1 = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), s, acc1);
      } else {
        acc0 = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), s, acc0);
      }
    }
    return hsum256(_mm256_add_ps(acc0, acc1));
#else
    float total = 0.0f;
    for (int64_t g = 0; g < w.groups; ++g) {
      float part = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t e = (g * blocks + b) * 32;
        const uint8_t* src = r + e / 2;
#pragma omp simd reduction(+ : part)
        for (int t = 0; t < 16; ++t)
          part += x[e + t] * static_cast<float>(src[t] & 15) + x[e + t + 16] * static_cast<float>(src[t] >> 4);
      }
      total += sc[g] * part;
    }
    return total;
#endif
  }
  const int8_t* q = reinterpret_cast<const int8_t*>(r);
  const int64_t body = w.group - w.group % 16;
  float total = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
#elif defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
#endif
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t lo = g * w.group;
#if defined(__AVX512F__)
    __m512 p = _mm512_setzero_ps();
    for (int64_t c = 0; c < body; c += 16) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + lo + c));
      p = _mm512_fmadd_ps(_mm512_loadu_ps(x + lo + c), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), p);
    }
    acc = _mm512_fmadd_ps(p, _mm512_set1_ps(sc[g]), acc);
#elif defined(__AVX2__)
    __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps();
    for (int64_t c = 0; c < body; c += 16) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + lo + c));
      p0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + lo + c), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), p0);
      p1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + lo + c + 8),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), p1);
    }
    acc = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), _mm256_set1_ps(sc[g]), acc);
#else
    float part = 0.0f;
#pragma omp simd reduction(+ : part)
    for (int64_t c = 0; c < body; ++c) part += x[lo + c] * static_cast<float>(q[lo + c]);
    total += sc[g] * part;
#endif
    if (body < w.group) {
      float tail = 0.0f;
      for (int64_t c = body; c < w.group; ++c) tail += x[lo + c] * static_cast<float>(q[lo + c]);
      total += sc[g] * tail;
    }
  }
#if defined(__AVX512F__)
  total += _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
  total += hsum256(acc);
#endif
  return total;
}

#if defined(__AVX2__)
#define RADIXSERVE_QUANT_INT8_X 1
// The integer path (llama.cpp's arithmetic): a row of x rounded to int8 per block of 32
// (x ~ xq * xs[b], xs = max|x_b| / 127), then each block of weights multiplied with it as
// integers (maddubs: unsigned x signed bytes into int16 pairs, madd into int32; with AVX-512 VNNI,
// vpdpbusd over two blocks at a time), scaled once per block by xs[b] * scale_g. About a third of
// the float path's instructions per weight; the activations' rounding is its only difference from
// it. Groups of a multiple of 32 only.
inline void quantize_row_i8(const float* x, int64_t k, int8_t* xq, float* xs) {
  for (int64_t b = 0; b < k / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.0f;
    for (int64_t c = 0; c < 32; ++c) amax = std::max(amax, std::fabs(xb[c]));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    xs[b] = d;
    for (int64_t c = 0; c < 32; ++c) xq[b * 32 + c] = static_cast<int8_t>(std::nearbyint(xb[c] * inv));
  }
}

// sum_b xs[b] * sc[b / per_group] * (xq_b . q_b) over the blocks of row `r` (AVX2).
inline float scaled_dot_i8_blocks(const QuantView& w, const uint8_t* r, const int8_t* xq, const float* xs,
                                  const float* sc) {
  const int64_t blocks = w.k / 32, per_group = w.group / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  if (w.bits == 4) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; ++b) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + b * 16));
      const __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
      const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), ones));
      const __m256 s = _mm256_set1_ps(xs[b] * sc[b / per_group]);
      if (b & 1) {
        acc1 = _mm256_fmadd_ps(p, s, acc1);
      } else {
        acc0 = _mm256_fmadd_ps(p, s, acc0);
      }
    }
  } else {  // signed x signed: |w| times x with w's sign (maddubs takes its first operand unsigned)
    const int8_t* q = reinterpret_cast<const int8_t*>(r);
    for (int64_t b = 0; b < blocks; ++b) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 32));
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
      const __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
      const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
      const __m256 s = _mm256_set1_ps(xs[b] * sc[b / per_group]);
      if (b & 1) {
        acc1 = _mm256_fmadd_ps(p, s, acc1);
      } else {
        acc0 = _mm256_fmadd_ps(p, s, acc0);
      }
    }
  }
  return hsum256(_mm256_add_ps(acc0, acc1));
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Two blocks at a time with AVX-512 VNNI (vpdpbusd: unsigned x signed bytes, four products a 32-bit
// lane, no intermediate saturation): lanes 0-7 sum block b, lanes 8-15 block b + 1, each half then
// scaled by its block's xs * scale. An odd last block goes through the AVX2 step below.
inline __m512 dot_i8_pairs(const QuantView& w, const uint8_t* r, int64_t pairs, const int8_t* xq, const float* xs,
                           const float* sc) {
  const int64_t per_group = w.group / 32;
  __m512 acc = _mm512_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t b = 2 * i;
    const __m512i xv = _mm512_loadu_si512(xq + b * 32);
    __m512i dot;
    if (w.bits == 4) {  // 32 bytes: two blocks, low nibbles elements 0-15, high 16-31
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + b * 16));
      const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // lo b, lo b+1, hi b, hi b+1
      u = _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0));
      dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xv);
    } else {  // signed weights: |w| against x with w's sign
      const __m512i wv = _mm512_loadu_si512(reinterpret_cast<const int8_t*>(r) + b * 32);
      const __m512i sx = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), xv);
      dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(wv), sx);
    }
    const __m512 s = _mm512_shuffle_f32x4(_mm512_set1_ps(xs[b] * sc[b / per_group]),
                                          _mm512_set1_ps(xs[b + 1] * sc[(b + 1) / per_group]), 0);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc);
  }
  return acc;
}
#endif

inline float scaled_dot_i8(const QuantView& w, int64_t j, const int8_t* xq, const float* xs, const float* sc) {
  const uint8_t* r = w.row(j);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t pairs = (w.k / 32) / 2;
  const float head = _mm512_reduce_add_ps(dot_i8_pairs(w, r, pairs, xq, xs, sc));
  if ((w.k / 32) % 2 == 0) return head;
  // the last block: the AVX2 step from its offset
  const int64_t last = 2 * pairs, skip = last * (w.bits == 4 ? 16 : 32);
  QuantView tail = w;
  tail.k = 32;
  tail.group = 32;
  const float one = sc[last / (w.group / 32)];
  return head + scaled_dot_i8_blocks(tail, r + skip, xq + last * 32, xs + last, &one);
#else
  return scaled_dot_i8_blocks(w, r, xq, xs, sc);
#endif
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RADIXSERVE_QUANT_BF16_X 1
// bf16 rows of x against 4-bit weights with bf16 dot products (vdpbf16ps), no widening to float:
// a byte pair (q, 0x43) is the bf16 number 128 + q, so unpacking the nibble bytes with 0x43 bytes
// (one in-lane shuffle per 32 weights) gives the weights as bf16 values 128 + q, exactly. Every
// product x * (128 + q) is exact in float32; the 128 * sum(x_b) * scale_b they add is taken off
// with the offsets' term: y = sum_b scale_b * (x_b . (128 + q_b)) + sum_b (offset_b - 128 scale_b)
// * sum(x_b) over the row's blocks b of 32. A 64-byte load is four blocks, one per 128-bit lane;
// x is permuted once per call into the order the unpacks produce. The output is rounded to bf16
// like the float path; the sums differ from it only in float32 rounding.
constexpr int64_t kBf16RowTile = 8;

// x row (bf16, k elements) into xp in `rows_4bit_bf16`'s order: per chunk of four blocks, four
// vectors of 32 values (elements 0-7, 8-15, 16-23, 24-31 of each block, a block a 128-bit lane);
// zeros past k.
inline void permute_x_bf16(const uint16_t* x, int64_t k, uint16_t* xp) {
  const int64_t blocks = k / 32, chunks = (blocks + 3) / 4;
  std::fill(xp, xp + chunks * 128, static_cast<uint16_t>(0));
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t part = 0; part < 4; ++part)
      std::copy(x + b * 32 + part * 8, x + b * 32 + part * 8 + 8, xp + (b / 4) * 128 + part * 32 + (b % 4) * 8);
}

// out[i] = x_i . W_r for one 4-bit weight row `r` of `blocks` blocks and MR rows of x (permuted,
// xps apart; xsb: each row's per-block sums, padded to whole chunks, xsbs apart). Per-block scales
// and offsets (offset may be null) as float16 (HALF) or float32, one per block.
template <int MR, bool HALF>
inline void rows_4bit_bf16(const uint8_t* r, int64_t blocks, const void* scale, const void* offset,
                           const uint16_t* xp, int64_t xps, const float* xsb, int64_t xsbs, float* out) {
  const int64_t chunks = (blocks + 3) / 4;
  const __m512i mask = _mm512_set1_epi8(0x0F), c43 = _mm512_set1_epi8(0x43);
  const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m128 minus128 = _mm_set1_ps(-128.0f);
  __m512 tot[MR];
  __m128 corr[MR];
  for (int i = 0; i < MR; ++i) tot[i] = _mm512_setzero_ps(), corr[i] = _mm_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t nb = std::min<int64_t>(4, blocks - 4 * c);
    const __mmask8 m4 = static_cast<__mmask8>((1u << nb) - 1);
    const __m512i v = nb == 4 ? _mm512_loadu_si512(r + c * 64)
                              : _mm512_maskz_loadu_epi8((1ull << (16 * nb)) - 1, r + c * 64);
    const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    const __m512bh wa = (__m512bh)_mm512_unpacklo_epi8(lo, c43), wb = (__m512bh)_mm512_unpackhi_epi8(lo, c43);
    const __m512bh wc = (__m512bh)_mm512_unpacklo_epi8(hi, c43), wd = (__m512bh)_mm512_unpackhi_epi8(hi, c43);
    __m128 sc4, of4 = _mm_setzero_ps();
    if constexpr (HALF) {
      sc4 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(m4, static_cast<const uint16_t*>(scale) + 4 * c));
      if (offset) of4 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(m4, static_cast<const uint16_t*>(offset) + 4 * c));
    } else {
      sc4 = _mm_maskz_loadu_ps(m4, static_cast<const float*>(scale) + 4 * c);
      if (offset) of4 = _mm_maskz_loadu_ps(m4, static_cast<const float*>(offset) + 4 * c);
    }
    const __m128 c4 = _mm_fmadd_ps(minus128, sc4, of4);
    const __m512 s = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(sc4));
    for (int i = 0; i < MR; ++i) {
      const uint16_t* x = xp + i * xps + c * 128;
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), wa, (__m512bh)_mm512_loadu_si512(x));
      a = _mm512_dpbf16_ps(a, wb, (__m512bh)_mm512_loadu_si512(x + 32));
      a = _mm512_dpbf16_ps(a, wc, (__m512bh)_mm512_loadu_si512(x + 64));
      a = _mm512_dpbf16_ps(a, wd, (__m512bh)_mm512_loadu_si512(x + 96));
      tot[i] = _mm512_fmadd_ps(a, s, tot[i]);
      corr[i] = _mm_fmadd_ps(c4, _mm_loadu_ps(xsb + i * xsbs + 4 * c), corr[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    __m128 h = _mm_add_ps(corr[i], _mm_movehl_ps(corr[i], corr[i]));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    out[i] = _mm512_reduce_add_ps(tot[i]) + _mm_cvtss_f32(h);
  }
}

template <bool HALF>
inline void rows_4bit_bf16_any(int64_t rows, const uint8_t* r, int64_t blocks, const void* scale, const void* offset,
                               const uint16_t* xp, int64_t xps, const float* xsb, int64_t xsbs, float* out) {
  switch (rows) {
    case 8: return rows_4bit_bf16<8, HALF>(r, blocks, scale, offset, xp, xps, xsb, xsbs, out);
    case 7: return rows_4bit_bf16<7, HALF>(r, blocks, scale, offset, xp, xps, xsb, xsbs, out);
    case 6: return rows_4bit_bf16<6, HALF>(r, blocks, scale, offset, xp, xps, xsb, xsbs, out);
    case 5: return rows_4bit_bf16<5, HALF>(r, blocks, scale, offset, xp, xps, xsb, xsbs, out);
    case 4: return rows_4bit_bf16<4, HALF>(r, blocks, scale, offset, xp, xps, xsb, xsbs, out);
    case 3: return rows_4bit_bf16<3, HALF>(r, blocks, scale, offset, xp, xps, xsb, xsbs, out);
    case 2: return rows_4bit_bf16<2, HALF>(r, blocks, scale, offset, xp, xps, xsb, xsbs, out);
    default: return rows_4bit_bf16<1, HALF>(r, blocks, scale, offset, xp, xps, xsb, xsbs, out);
  }
}
#endif

// Several rows of x: kTileRows weight rows are dequantized (row-major, into L1/L2) once, then
// every pair of them is dotted with four rows of x at a time: per 8 columns, two weight loads and
// four x loads feed eight FMAs (eight vector accumulators, summed across lanes at the end).
constexpr int64_t kTileRows = 16;

inline void dot_4x2(const float* x, int64_t rows, int64_t k, const float* w0, const float* w1, float out[2][4]) {
  const float* x0 = x;
  const float* x1 = x + std::min<int64_t>(1, rows - 1) * k;
  const float* x2 = x + std::min<int64_t>(2, rows - 1) * k;
  const float* x3 = x + std::min<int64_t>(3, rows - 1) * k;
  float a00 = 0.0f, a01 = 0.0f, a02 = 0.0f, a03 = 0.0f, a10 = 0.0f, a11 = 0.0f, a12 = 0.0f, a13 = 0.0f;
#pragma omp simd reduction(+ : a00, a01, a02, a03, a10, a11, a12, a13)
  for (int64_t c = 0; c < k; ++c) {
    const float u = w0[c], v = w1[c];
    a00 += x0[c] * u;
    a01 += x1[c] * u;
    a02 += x2[c] * u;
    a03 += x3[c] * u;
    a10 += x0[c] * v;
    a11 += x1[c] * v;
    a12 += x2[c] * v;
    a13 += x3[c] * v;
  }
  out[0][0] = a00, out[0][1] = a01, out[0][2] = a02, out[0][3] = a03;
  out[1][0] = a10, out[1][1] = a11, out[1][2] = a12, out[1][3] = a13;
}

}  // namespace quant_detail

// y = x @ W^T (+ bias) for a group-quantized W (see the top of this file); float32 math, y in x's
// dtype (float32 or bfloat16).
// int8_x: fewer rows of x than kInt8Rows take the integer path (`scaled_dot_i8`, each weight row
// against every row of x while it is in L1) where this CPU has it and the group is a multiple of
// 32; every other case computes in float. From 4 rows the float tile path is faster (measured on
// 2 AVX2 cores, 3072 x 576 at 4 bits: 1 row 168 vs 240 us, 3 rows 398 vs 497, 4 rows 511 vs 477).
constexpr int64_t kInt8Rows = 4;

inline torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                                  const c10::optional<torch::Tensor>& offset, int64_t group, int64_t bits,
                                  const c10::optional<torch::Tensor>& bias, bool int8_x = false) {
  using namespace quant_detail;
  const QuantView w = view_of(q, scale, offset, group, bits);
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x.size(1) == w.k, "x and weight disagree on K");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.n,
                "bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  const int64_t m = x.size(0), k = w.k, n = w.n;
  const torch::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  // With offsets, sum(x_g) per row of x and group: the offsets' share of every output.
  std::vector<float> xsum;
#if defined(RADIXSERVE_QUANT_BF16_X)
  const bool bf16_x = x.scalar_type() == at::kBFloat16 && w.bits == 4 && !(int8_x && m < kInt8Rows);
#else
  const bool bf16_x = false;
#endif
  if (w.offset && !bf16_x) {
    xsum.resize(static_cast<size_t>(m * w.groups));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t g = 0; g < w.groups; ++g) {
        float s = 0.0f;
        const float* xg = xp + i * k + g * w.group;
#pragma omp simd reduction(+ : s)
        for (int64_t c = 0; c < w.group; ++c) s += xg[c];
        xsum[i * w.groups + g] = s;
      }
  }
  torch::Tensor y = torch::empty({m, n}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(w.row_bytes(), 1));
#if defined(RADIXSERVE_QUANT_BF16_X)
  if (bf16_x) {
    const int64_t blocks = k / 32, padded = (blocks + 3) / 4 * 4, xps = padded * 32;
    const torch::Tensor xc = x.contiguous();
    const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    std::vector<uint16_t> xperm(static_cast<size_t>(m * xps));
    std::vector<float> xsb(static_cast<size_t>(m * padded), 0.0f);  // per row and block: sum(x_b)
    for (int64_t i = 0; i < m; ++i) {
      permute_x_bf16(xb + i * k, k, xperm.data() + i * xps);
      for (int64_t blk = 0; blk < blocks; ++blk) {
        float t = 0.0f;
        const float* xs = xp + i * k + blk * 32;
#pragma omp simd reduction(+ : t)
        for (int64_t c = 0; c < 32; ++c) t += xs[c];
        xsb[i * padded + blk] = t;
      }
    }
    const int64_t per_group = w.group / 32;
    const size_t scale_bytes = w.half ? 2 : 4;
    parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
      // Groups of more than one block: each block's scale and offset spelled out per row (group
      // 32 reads the row's own scales and offsets).
      const size_t spelled = per_group > 1 ? static_cast<size_t>(padded) : 0;
      std::vector<float> sc(per_group > 1 ? static_cast<size_t>(w.groups) : 0), of(sc.size(), 0.0f);
      std::vector<float> bsc(spelled, 0.0f), bof(spelled, 0.0f);
      float dots[kBf16RowTile];
      for (int64_t j = lo; j < hi; ++j) {
        const void* srow = static_cast<const char*>(w.scale) + j * w.groups * scale_bytes;
        const void* orow = w.offset ? static_cast<const char*>(w.offset) + j * w.groups * scale_bytes : nullptr;
        if (per_group > 1) {
          w.row_scales(j, sc.data(), of.data());
          for (int64_t g = 0, blk = 0; g < w.groups; ++g)
            for (int64_t t = 0; t < per_group; ++t, ++blk) bsc[blk] = sc[g], bof[blk] = of[g];
        }
        for (int64_t i0 = 0; i0 < m; i0 += kBf16RowTile) {
          const int64_t rows = std::min(kBf16RowTile, m - i0);
          const uint16_t* xr = xperm.data() + i0 * xps;
          const float* sr = xsb.data() + i0 * padded;
          if (per_group > 1)
            rows_4bit_bf16_any<false>(rows, w.row(j), blocks, bsc.data(), bof.data(), xr, xps, sr, padded, dots);
          else if (w.half)
            rows_4bit_bf16_any<true>(rows, w.row(j), blocks, srow, orow, xr, xps, sr, padded, dots);
          else
            rows_4bit_bf16_any<false>(rows, w.row(j), blocks, srow, orow, xr, xps, sr, padded, dots);
          for (int64_t t = 0; t < rows; ++t) yp[(i0 + t) * n + j] = dots[t] + (b ? b[j] : 0.0f);
        }
      }
    });
    return y.to(x.scalar_type());
  }
#endif
#if defined(RADIXSERVE_QUANT_INT8_X)
  if (int8_x && m < kInt8Rows && w.group % 32 == 0) {
    std::vector<int8_t> xq(static_cast<size_t>(m * k));
    std::vector<float> xs(static_cast<size_t>(m * (k / 32)));
    for (int64_t i = 0; i < m; ++i) quantize_row_i8(xp + i * k, k, xq.data() + i * k, xs.data() + i * (k / 32));
    parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
      std::vector<float> sc(static_cast<size_t>(w.groups)), of(static_cast<size_t>(w.groups));
      for (int64_t j = lo; j < hi; ++j) {
        w.row_scales(j, sc.data(), of.data());
        for (int64_t i = 0; i < m; ++i) {
          float v = scaled_dot_i8(w, j, xq.data() + i * k, xs.data() + i * (k / 32), sc.data());
          if (w.offset) {
            const float* xg = xsum.data() + i * w.groups;
            for (int64_t g = 0; g < w.groups; ++g) v += of[g] * xg[g];
          }
          yp[i * n + j] = v + (b ? b[j] : 0.0f);
        }
      }
    });
    return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  }
#endif
  parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> sc(static_cast<size_t>(w.groups)), of(static_cast<size_t>(w.groups));
    if (m == 1) {
      for (int64_t j = lo; j < hi; ++j) {
        w.row_scales(j, sc.data(), of.data());
        float v = scaled_dot(w, j, xp, sc.data());
        if (w.offset) {
          float o = 0.0f;
#pragma omp simd reduction(+ : o)
          for (int64_t g = 0; g < w.groups; ++g) o += of[g] * xsum[g];
          v += o;
        }
        yp[j] = v + (b ? b[j] : 0.0f);
      }
      return;
    }
    std::vector<float> tile(static_cast<size_t>(kTileRows * k));
    float out[2][4];
    for (int64_t j0 = lo; j0 < hi; j0 += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, hi - j0);
      for (int64_t r = 0; r < rows; ++r) dequant_row(w, j0 + r, tile.data() + r * k, sc.data(), of.data());
      for (int64_t r = 0; r < rows; r += 2) {
        const float* w0 = tile.data() + r * k;
        const float* w1 = r + 1 < rows ? w0 + k : w0;
        for (int64_t i = 0; i < m; i += 4) {
          const int64_t xr = std::min<int64_t>(4, m - i);
          dot_4x2(xp + i * k, xr, k, w0, w1, out);
          for (int64_t h = 0; h < 2 && r + h < rows; ++h) {
            const float bj = b ? b[j0 + r + h] : 0.0f;
            for (int64_t t = 0; t < xr; ++t) yp[(i + t) * n + j0 + r + h] = out[h][t] + bj;
          }
        }
      }
    }
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// W (or its rows `rows`, an int64 index) as a dense [N or len(rows), K] tensor of `dtype`
// (float32 or bfloat16): the prefill path's GEMM operand, and a quantized embedding's lookup.
inline torch::Tensor quant_dequantize(const torch::Tensor& q, const torch::Tensor& scale,
                                      const c10::optional<torch::Tensor>& offset, int64_t group, int64_t bits,
                                      const c10::optional<torch::Tensor>& rows, at::ScalarType dtype) {
  using namespace quant_detail;
  const QuantView w = view_of(q, scale, offset, group, bits);
  const int64_t* idx = nullptr;
  int64_t count = w.n;
  torch::Tensor rows_c;
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1, "rows must be int64 [R]");
    rows_c = rows->contiguous();
    idx = rows_c.data_ptr<int64_t>();
    count = rows_c.numel();
    for (int64_t i = 0; i < count; ++i) TORCH_CHECK(idx[i] >= 0 && idx[i] < w.n, "row index out of range");
  }
  torch::Tensor out = torch::empty({count, w.k}, q.options().dtype(dtype));
  const int64_t k = w.k;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(k, 1));
  dispatch(dtype, [&](auto e) {
    using E = decltype(e);
    auto* op = ptr<E>(out);
    parallel_for(0, count, grain, [&](int64_t lo, int64_t hi) {
      std::vector<float> buf(std::is_same_v<E, F32> ? 0 : static_cast<size_t>(k));
      std::vector<float> sc(static_cast<size_t>(w.groups)), of(static_cast<size_t>(w.groups));
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t j = idx ? idx[i] : i;
        if constexpr (std::is_same_v<E, F32>) {
          dequant_row(w, j, op + i * k, sc.data(), of.data());
        } else {
          dequant_row(w, j, buf.data(), sc.data(), of.data());
          auto* dst = op + i * k;
#pragma omp simd
          for (int64_t c = 0; c < k; ++c) dst[c] = E::store(buf[c]);
        }
      }
    });
  });
  return out;
}

}  // namespace radixserve
