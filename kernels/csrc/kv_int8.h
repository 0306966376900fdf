#pragma once

// An int8 KV cache. Each (token, kv head) row of the pool holds the head's D values rounded to
// int8 and, after them, the float32 scale they share (D + 4 bytes against bf16's 2 D):
//
//   scale = max |x_d| / 127,   q_d = round(x_d / scale) (0 for an all-zero row),   x_d ~ q_d * scale
//
// One row carries everything needed to read it, so whatever moves rows by slot (the host and disk
// tiers, PD transfers) moves the scales with them.
//   store_kv_int8_         a step's new K/V rows quantized into their slots
//   decode_attention_int8  one query per sequence (bf16 q): integer q.k products (each query head
//                          rounded to int16), a key's scale on its score; values widened to float32,
//                          a value's scale on its softmax weight
// Extend attention dequantizes each sequence's rows to bf16 as it packs them (extend_avx512.h,
// pack_kv_int8) and runs the bf16 kernel. The decode path reads 0.53x the bytes of bf16 rows at
// head size 64; decode attention is bound by those reads (load_tests/bench_kernels.py).

#include "common.h"
#include "decode_avx512.h"

namespace radixserve {
namespace {

constexpr int64_t kScaleBytes = sizeof(float);
// Keys ahead whose rows are prefetched (into L1: this kernel is bound by its arithmetic).
constexpr int64_t kInt8PrefetchKeys = 16;

template <typename E>
inline void quantize_row_int8(const typename E::T* x, int64_t dim, int8_t* dst) {
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(E::load(x[d])));
  const float scale = amax / 127.f;
  for (int64_t d = 0; d < dim; ++d) {
    const float v = scale > 0.f ? std::nearbyint(E::load(x[d]) / scale) : 0.f;
    dst[d] = static_cast<int8_t>(std::min(std::max(v, -127.f), 127.f));
  }
  std::memcpy(dst + dim, &scale, kScaleBytes);
}

#if defined(__AVX512BF16__)

inline __m512 load_i8x16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline float row_scale(const int8_t* row, int64_t dim) {
  float s;
  std::memcpy(&s, row + dim, kScaleBytes);
  return s;
}

// Lane sums of k . q for one key row of D int8 values and one query head held as int16 pairs
// (32 a vector): vpdpwssd where the CPU has AVX512-VNNI, else vpmaddwd and an add.
template <int D>
inline __m512i qk_partial_i16(const int8_t* k, const __m512i* qv) {
  __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int c = 0; c < D / 32; ++c) {
    const __m512i kv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + 32 * c)));
#if defined(__AVX512VNNI__)
    acc = _mm512_dpwssd_epi32(acc, kv, qv[c]);
#else
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(kv, qv[c]));
#endif
  }
  return acc;
}

// One (sequence, kv head) item for G query heads of head size D over int8 rows of `row` bytes a
// slot; the same float32 softmax and accumulation as decode_item_avx512. The q.k products are
// integer: each query head is rounded to int16 with a scale of its own (max |q| / 32767, a
// relative error under 2e-5 of the head's largest element, far below its bf16 rounding), and the
// int8 keys are widened to int16 beside it, 32 products an instruction, exact in int32.
template <int D, int G>
void decode_item_int8(const uint16_t* q, int64_t q_stride_h, const int8_t* k_buf, const int8_t* v_buf,
                      const int64_t* slots, int64_t len, int64_t row, float scale, uint16_t* out,
                      std::vector<float>& scores) {
  constexpr int NV = D / 16;
  constexpr int64_t bytes = D + kScaleBytes;
  __m512i qv[G][D / 32];
  float q_scale[G];
  for (int g = 0; g < G; ++g) {
    alignas(64) int16_t qi[D];
    float amax = 0.f;
    for (int d = 0; d < D; ++d) amax = std::max(amax, std::fabs(BF16::load(q[g * q_stride_h + d])));
    const float sq = amax / 32767.f;
    for (int d = 0; d < D; ++d)
      qi[d] = sq > 0.f ? static_cast<int16_t>(std::nearbyint(BF16::load(q[g * q_stride_h + d]) / sq)) : 0;
    for (int c = 0; c < D / 32; ++c) qv[g][c] = _mm512_load_si512(qi + 32 * c);
    q_scale[g] = sq * scale;
  }
  scores.resize(G * len);
  float* sc = scores.data();
  int64_t l = 0;
  for (; l + 4 <= len; l += 4) {
    for (int64_t a = l + kInt8PrefetchKeys; a < std::min(l + kInt8PrefetchKeys + 4, len); ++a)
      _mm_prefetch(reinterpret_cast<const char*>(k_buf + slots[a] * row), _MM_HINT_T0);
    const int8_t* k0 = k_buf + slots[l] * row;
    const int8_t* k1 = k_buf + slots[l + 1] * row;
    const int8_t* k2 = k_buf + slots[l + 2] * row;
    const int8_t* k3 = k_buf + slots[l + 3] * row;
    const __m128 ks = _mm_set_ps(row_scale(k3, D), row_scale(k2, D), row_scale(k1, D), row_scale(k0, D));
    for (int g = 0; g < G; ++g) {
      const __m128 s = sum4(_mm512_cvtepi32_ps(qk_partial_i16<D>(k0, qv[g])),
                            _mm512_cvtepi32_ps(qk_partial_i16<D>(k1, qv[g])),
                            _mm512_cvtepi32_ps(qk_partial_i16<D>(k2, qv[g])),
                            _mm512_cvtepi32_ps(qk_partial_i16<D>(k3, qv[g])));
      _mm_storeu_ps(sc + g * len + l, _mm_mul_ps(_mm_mul_ps(s, ks), _mm_set1_ps(q_scale[g])));
    }
  }
  for (; l < len; ++l) {
    const int8_t* k = k_buf + slots[l] * row;
    for (int g = 0; g < G; ++g)
      sc[g * len + l] =
          static_cast<float>(_mm512_reduce_add_epi32(qk_partial_i16<D>(k, qv[g]))) * (row_scale(k, D) * q_scale[g]);
  }
  float inv_sum[G];
  softmax_rows<G>(sc, len, inv_sum);
  __m512 acc[G][NV];
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; ++i) {
    if (i + kInt8PrefetchKeys < len) {
      const char* p = reinterpret_cast<const char*>(v_buf + slots[i + kInt8PrefetchKeys] * row);
      for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    }
    const int8_t* vr = v_buf + slots[i] * row;
    const float vs = row_scale(vr, D);
    __m512 v[NV];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) v[c] = load_i8x16(vr + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(sc[g * len + i] * vs);
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
  store_rows_bf16<D, G>(acc, inv_sum, out);
}

using DecodeItemI8Fn = void (*)(const uint16_t*, int64_t, const int8_t*, const int8_t*, const int64_t*, int64_t,
                                int64_t, float, uint16_t*, std::vector<float>&);

inline DecodeItemI8Fn decode_item_int8_for(int64_t dim, int64_t group) {
  static constexpr DecodeItemI8Fn d64[] = {nullptr, &decode_item_int8<64, 1>, &decode_item_int8<64, 2>,
                                           &decode_item_int8<64, 3>, &decode_item_int8<64, 4>,
                                           &decode_item_int8<64, 5>, &decode_item_int8<64, 6>,
                                           &decode_item_int8<64, 7>, &decode_item_int8<64, 8>};
  static constexpr DecodeItemI8Fn d128[] = {nullptr, &decode_item_int8<128, 1>, &decode_item_int8<128, 2>,
                                            &decode_item_int8<128, 3>, &decode_item_int8<128, 4>};
  if (dim == 64 && group >= 1 && group <= 8) return d64[group];
  if (dim == 128 && group >= 1 && group <= 4) return d128[group];
  return nullptr;
}

#endif  // __AVX512BF16__

}  // namespace

// Whether the int8 pool's kernels were built (AVX512-BF16), and for which (head size, group).
inline bool kv_int8_available(int64_t dim, int64_t group) {
#if defined(__AVX512BF16__)
  return decode_item_int8_for(dim, group) != nullptr;
#else
  (void)dim;
  (void)group;
  return false;
#endif
}

inline void check_int8_pool(const torch::Tensor& k_buf, const torch::Tensor& v_buf, int64_t kv_heads, int64_t dim) {
  TORCH_CHECK(k_buf.scalar_type() == at::kChar && v_buf.scalar_type() == at::kChar, "int8 pool buffers");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.sizes() == v_buf.sizes(), "pool buffers");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.size(1) == kv_heads && k_buf.size(2) == dim + kScaleBytes,
              "an int8 pool row is [kv heads, head size + 4] bytes");
}

// k, v [T, kv heads, D] (float32 or bf16; heads adjacent) quantized into slots `slots` of the pool.
inline void store_kv_int8_(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& k_buf,
                           const torch::Tensor& v_buf, const torch::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type(), "k and v alike");
  for (const auto* t : {&k, &v}) TORCH_CHECK(t->stride(2) == 1, "k/v rows must be contiguous");
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2), capacity = k_buf.size(0);
  check_int8_pool(k_buf, v_buf, heads, dim);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens, "slots");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "slot out of range");
  const int64_t row = heads * (dim + kScaleBytes);
  int8_t* kb = k_buf.data_ptr<int8_t>();
  int8_t* vb = v_buf.data_ptr<int8_t>();
  dispatch(k.scalar_type(), [&](auto e) {
    using E = decltype(e);
    const auto* kp = ptr<E>(k);
    const auto* vp = ptr<E>(v);
    parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t at = sp[t] * row + h * (dim + kScaleBytes);
          quantize_row_int8<E>(kp + t * k.stride(0) + h * k.stride(1), dim, kb + at);
          quantize_row_int8<E>(vp + t * v.stride(0) + h * v.stride(1), dim, vb + at);
        }
    });
  });
}

// q [B, H, D] bf16: sequence b attends to slots kv_indices[b, :seq_lens[b]] of an int8 pool.
inline torch::Tensor decode_attention_int8(const torch::Tensor& q, const torch::Tensor& k_buf,
                                           const torch::Tensor& v_buf, const torch::Tensor& kv_indices,
                                           const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.scalar_type() == at::kBFloat16,
              "q must be bf16 [B, H, D] with contiguous D");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indices.is_contiguous(), "kv_indices must be int64");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "seq_lens must be int64");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_buf.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "head shapes do not match");
  check_int8_pool(k_buf, v_buf, kv_heads, dim);
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(kv_int8_available(dim, group), "no int8-pool decode kernel for head size ", dim, " and ", group,
              " query heads a KV head (needs AVX512-BF16; head size 64 with up to 8, 128 with up to 4)");
  auto out = torch::empty({batch, heads, dim}, q.options());
#if defined(__AVX512BF16__)
  const DecodeItemI8Fn item_fn = decode_item_int8_for(dim, group);
  const int64_t row = kv_heads * (dim + kScaleBytes), width = kv_indices.size(1);
  const int64_t qs_t = q.stride(0), qs_h = q.stride(1);
  const uint16_t* qp = ptr<BF16>(q);
  const int8_t* kb = k_buf.data_ptr<int8_t>();
  const int8_t* vb = v_buf.data_ptr<int8_t>();
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  uint16_t* op = ptr<BF16>(out);
  const float sc = static_cast<float>(scale);
  parallel_for(0, batch * kv_heads, 1, [=](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, kh = item % kv_heads;
      item_fn(qp + b * qs_t + kh * group * qs_h, qs_h, kb + kh * (dim + kScaleBytes),
              vb + kh * (dim + kScaleBytes), idx + b * width, lens[b], row, sc, op + (b * heads + kh * group) * dim,
              scores);
    }
  });
#endif
  return out;
}

}  // namespace radixserve
