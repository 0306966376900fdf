// Shared pieces of the fused CPU kernels: float views of the storage dtypes, a vectorizable exp,
// and dtype dispatch. Reductions use `omp simd` so they vectorize without -ffast-math changing
// anything else.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "work_pool.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve {

#if defined(__AVX512F__)
// The hint of the streaming kernels' software prefetches (the decode GEMM, decode attention, the
// quantized strips): into L2. Into L1 (_MM_HINT_T0), L1's few miss buffers bound the lines in
// flight. An enum in GCC's headers, an int in clang's.
constexpr auto kStreamPrefetch = _MM_HINT_T1;
#endif

// Element access as float. The bf16 conversions are the bit operations torch uses (round to
// nearest even), written so that `omp simd` loops vectorize them.
struct F32 {
  using T = float;
  static inline float load(float v) { return v; }
  static inline float store(float v) { return v; }
};
struct BF16 {
  using T = uint16_t;
  static inline float load(uint16_t v) { return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16); }
  static inline uint16_t store(float v) {
    uint32_t u = __builtin_bit_cast(uint32_t, v);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};

// exp(x) as 2^(x log2 e) with a degree-6 polynomial for the fraction: relative error ~1e-7,
// like expf, but vectorizable unlike the libm call. Clamped to float's finite range.
inline float exp_any(float x) {
  const float t = std::min(std::max(x, -87.0f), 88.0f) * 1.4426950408889634f;
  const float whole = std::floor(t);
  const float f = t - whole;
  float p = 0.00021871254533521088f;
  p = p * f + 0.0012382410007126033f;
  p = p * f + 0.00968618798764167f;
  p = p * f + 0.05547891082457537f;
  p = p * f + 0.2402310974359102f;
  p = p * f + 0.6931468375864389f;
  p = p * f + 1.0000000061639827f;
  const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

// The work items of an extend attention call, (sequence, kv head, first token) per `block`
// tokens, costliest first (later blocks see more keys): parallel_for hands chunks out in order,
// so the cheap items are what is left to even out the threads at the end.
inline std::vector<std::array<int64_t, 3>> extend_items(int64_t batch, int64_t kv_heads, const int64_t* cu,
                                                        const int64_t* seq_lens, int64_t block) {
  std::vector<std::array<int64_t, 3>> items;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t kh = 0; kh < kv_heads; ++kh)
      for (int64_t t = cu[b]; t < cu[b + 1]; t += block) items.push_back({b, kh, t});
  auto cost = [&](const std::array<int64_t, 3>& it) { return seq_lens[it[0]] - (cu[it[0] + 1] - it[2]); };
  std::stable_sort(items.begin(), items.end(), [&](const auto& a, const auto& b) { return cost(a) > cost(b); });
  return items;
}

// Calls fn(E{}) with E the element view matching the tensor's dtype (float32 or bfloat16).
template <typename Fn>
void dispatch(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kFloat) {
    fn(F32{});
  } else if (dtype == at::kBFloat16) {
    fn(BF16{});
  } else {
    TORCH_CHECK(false, "radixserve cpu ops support float32 and bfloat16, got ", dtype);
  }
}

template <typename E>
typename E::T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<typename E::T*>(t.data_ptr());
}

inline void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "expected a 2-D row-major tensor");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), "weight must be [dim]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "weight and input dtypes differ");
}

}  // namespace radixserve
