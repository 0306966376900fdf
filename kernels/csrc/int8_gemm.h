#pragma once

// Weight-only int8 GEMM for the decode shape (few rows of x):
//   y[M, N] = (x[M, K] @ Wq[N, K]^T) * scale[N] (+ bias[N]),
// Wq int8 with one float32 scale per output row. Weights stay int8 in memory (a quarter of fp32's
// bytes, half of bf16's) and are widened to float32 in registers; x is read as float32 (bf16 x is
// widened once per call, it is small at these row counts). Each weight row is read once and dotted
// with every row of x while it sits in L1. AVX-512 where the CPU has it, AVX2 otherwise, and a
// plain loop that the compiler vectorizes as it can elsewhere.

#include "common.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace radixserve {
namespace int8_detail {

inline float dot(const float* x, const int8_t* w, int64_t k) {
  int64_t i = 0;
  float tail = 0.0f;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i))));
    const __m512 w1 =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i + 16))));
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), w0, a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), w1, a1);
  }
  tail = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(__AVX2__)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i));
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), w0, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), w1, a1);
  }
  const __m256 s = _mm256_add_ps(a0, a1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  tail = _mm_cvtss_f32(h);
#endif
  float rest = 0.0f;
#pragma omp simd reduction(+ : rest)
  for (int64_t j = i; j < k; ++j) rest += x[j] * static_cast<float>(w[j]);
  return tail + rest;
}

constexpr int64_t kTileRows = 8;

inline float dot_f32(const float* x, const float* w, int64_t k) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < k; ++j) acc += x[j] * w[j];
  return acc;
}

}  // namespace int8_detail

inline torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& wq, const torch::Tensor& scale,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(wq.dim() == 2 && wq.is_contiguous() && wq.scalar_type() == at::kChar, "weight must be contiguous int8 [N, K]");
  TORCH_CHECK(wq.size(1) == x.size(1), "x and weight disagree on K");
  const int64_t m = x.size(0), k = x.size(1), n = wq.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n, "scale must be float32 [N]");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, "bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  const torch::Tensor xf = x.to(at::kFloat).contiguous();
  torch::Tensor y = torch::empty({m, n}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = wq.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Grain: enough rows per task that a task reads a few KiB of weight.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1));
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    if (m == 1) {  // one row: widen in registers, each weight byte is used once anyway
      for (int64_t j = lo; j < hi; ++j) yp[j] = int8_detail::dot(xp, wp + j * k, k) * sp[j] + (b ? b[j] : 0.0f);
      return;
    }
    // Several rows: widen a tile of weight rows to float32 once (L1-resident), then dot every row
    // of x against it, so the int8 -> float conversion is paid once per weight, not once per row.
    std::vector<float> tile(static_cast<size_t>(int8_detail::kTileRows * k));
    for (int64_t j0 = lo; j0 < hi; j0 += int8_detail::kTileRows) {
      const int64_t rows = std::min<int64_t>(int8_detail::kTileRows, hi - j0);
      for (int64_t r = 0; r < rows; ++r) {
        const int8_t* src = wp + (j0 + r) * k;
        float* dst = tile.data() + r * k;
#pragma omp simd
        for (int64_t c = 0; c < k; ++c) dst[c] = static_cast<float>(src[c]);
      }
      for (int64_t i = 0; i < m; ++i)
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t j = j0 + r;
          yp[i * n + j] = int8_detail::dot_f32(xp + i * k, tile.data() + r * k, k) * sp[j] + (b ? b[j] : 0.0f);
        }
    }
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace radixserve
