#pragma once

// Batched LoRA deltas for the decode shape (few rows, each with its own adapter), fused:
//   y[t, lo_p : lo_p + n_p] += (x[t] @ A[s]) [p*R : (p+1)*R] @ B_p[s]     for s = slots[t] >= 0
// A [S, K, P*R], B_p [S, R, n_p] (workers/lora/layers.py's slot buffers), y updated in place.
// Each row is one task: its shrink streams its adapter's A once (row k of A is contiguous over
// P*R, so the inner loop vectorizes), its expand adds R scaled rows of B_p into a float32 row of
// deltas, which is added to y once. Rows of one adapter read the same A and B from cache.

#include "common.h"

namespace radixserve {

inline void lora_bgmv_(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& a,
                       const std::vector<torch::Tensor>& bs, const std::vector<int64_t>& offsets,
                       const torch::Tensor& slots) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, K]");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.size(0) == x.size(0), "y must be contiguous [T, N]");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.size(1) == x.size(1), "A must be contiguous [S, K, P*R]");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type(), "x, y and A dtypes differ");
  const int64_t parts = static_cast<int64_t>(bs.size());
  TORCH_CHECK(parts > 0 && static_cast<int64_t>(offsets.size()) == parts, "one column offset per B part");
  TORCH_CHECK(a.size(2) % parts == 0, "A's width is parts * rank");
  const int64_t t_rows = x.size(0), k = x.size(1), s_slots = a.size(0), width = a.size(2), rank = width / parts;
  const int64_t n = y.size(1);
  for (int64_t p = 0; p < parts; ++p) {
    const auto& b = bs[p];
    TORCH_CHECK(b.dim() == 3 && b.is_contiguous() && b.size(0) == s_slots && b.size(1) == rank,
                "each B part must be contiguous [S, R, n_p]");
    TORCH_CHECK(b.scalar_type() == x.scalar_type(), "B and x dtypes differ");
    TORCH_CHECK(offsets[p] >= 0 && offsets[p] + b.size(2) <= n, "a B part's columns lie outside y");
  }
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == t_rows && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "slots must be int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_rows; ++t) TORCH_CHECK(sp[t] < s_slots, "a token's slot is out of range");
  dispatch(x.scalar_type(), [&](auto e) {
    using E = decltype(e);
    const auto* xp = ptr<E>(x);
    auto* yp = ptr<E>(y);
    const auto* ap = ptr<E>(a);
    std::vector<const typename E::T*> bp(parts);
    std::vector<int64_t> widths(parts);
    for (int64_t p = 0; p < parts; ++p) {
      bp[p] = ptr<E>(bs[p]);
      widths[p] = bs[p].size(2);
    }
    parallel_for(0, t_rows, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> xa(static_cast<size_t>(width));
      std::vector<float> delta(static_cast<size_t>(n));
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t s = sp[t];
        if (s < 0) continue;
        std::fill(xa.begin(), xa.end(), 0.0f);
        const auto* as = ap + s * k * width;
        for (int64_t kk = 0; kk < k; ++kk) {
          const float xv = E::load(xp[t * k + kk]);
          const auto* row = as + kk * width;
          float* acc = xa.data();
#pragma omp simd
          for (int64_t w = 0; w < width; ++w) acc[w] += xv * E::load(row[w]);
        }
        std::fill(delta.begin(), delta.end(), 0.0f);
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t np = widths[p];
          const auto* bsp = bp[p] + s * rank * np;
          float* d = delta.data() + offsets[p];
          for (int64_t r = 0; r < rank; ++r) {
            const float c = xa[p * rank + r];
            if (c == 0.0f) continue;  // a rank the adapter does not have (zero padding)
            const auto* brow = bsp + r * np;
#pragma omp simd
            for (int64_t j = 0; j < np; ++j) d[j] += c * E::load(brow[j]);
          }
        }
        auto* yrow = yp + t * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) yrow[j] = E::store(E::load(yrow[j]) + delta[j]);
      }
    });
  });
}

}  // namespace radixserve
