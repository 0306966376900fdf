#pragma once

// Elementwise fused ops: each replaces a chain of small torch ops (one dispatch and one memory pass
// each) by one pass, rounding where the torch ops round.
//   rms_norm        y = bf16(x / rms(x)) * w       (float32 math, rounding where HF rounds)
//   add_rms_norm_   h += delta; y = rms_norm(h)    (the residual update fused in)
//   rotary_         neox rotary in place on the q|k heads of the fused qkv output
//   silu_mul        silu(gate) * up of the fused gate|up output
//   store_kv_       a step's new K and V rows copied into the pool's slots, both in one pass

#include "common.h"
#include "kv_int8.h"

namespace radixserve {
namespace {

template <typename E>
inline void normalize_row(const typename E::T* x, const typename E::T* w, typename E::T* o, int64_t dim, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < dim; ++i) ss += E::load(x[i]) * E::load(x[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
  // Round the normalized value to the model dtype before the weight, as Hugging Face does.
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) o[i] = E::store(E::load(E::store(E::load(x[i]) * inv)) * E::load(w[i]));
}

template <typename E>
void rms_norm_rows(const typename E::T* x, int64_t x_stride, const typename E::T* w, typename E::T* out,
                   int64_t rows, int64_t dim, float eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize_row<E>(x + r * x_stride, w, out + r * dim, dim, eps);
  });
}

template <typename E>
void add_rms_norm_rows(typename E::T* h, const typename E::T* delta, const typename E::T* w, typename E::T* out,
                       int64_t rows, int64_t dim, float eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      typename E::T* hr = h + r * dim;
      const typename E::T* dr = delta + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) hr[i] = E::store(E::load(hr[i]) + E::load(dr[i]));
      normalize_row<E>(hr, w, out + r * dim, dim, eps);
    }
  });
}


// Neox rotary in place on [T, heads, D] (any token/head strides, contiguous D), cos/sin [T, D/2].
// Products and the sum are rounded separately, as Hugging Face's x * cos + rotate_half(x) * sin.
template <typename E>
void rotary_impl(typename E::T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride_t, int64_t stride_h,
                 const typename E::T* cos, const typename E::T* sin) {
  const int64_t half = dim / 2;
  parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const typename E::T* c = cos + t * half;
      const typename E::T* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        typename E::T* xr = x + t * stride_t + h * stride_h;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = E::load(xr[i]), b = E::load(xr[i + half]);
          const float ci = E::load(c[i]), si = E::load(s[i]);
          xr[i] = E::store(E::load(E::store(a * ci)) - E::load(E::store(b * si)));
          xr[i + half] = E::store(E::load(E::store(b * ci)) + E::load(E::store(a * si)));
        }
      }
    }
  });
}

// [T, 2I] (gate | up) -> silu(gate) * up, each step rounded like the torch ops it replaces.
// Two passes over blocks of 256: with exp and the division in one loop GCC emits ~3x the divides.
template <typename E>
void silu_mul_impl(const typename E::T* x, typename E::T* out, int64_t tokens, int64_t inter) {
  parallel_for(0, tokens, 4, [=](int64_t begin, int64_t end) {
    float e[256];
    for (int64_t t = begin; t < end; ++t) {
      const typename E::T* __restrict__ gate = x + t * 2 * inter;
      const typename E::T* __restrict__ up = gate + inter;
      typename E::T* __restrict__ o = out + t * inter;
      for (int64_t s = 0; s < inter; s += 256) {
        const int64_t n = std::min<int64_t>(256, inter - s);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) e[i] = exp_any(-E::load(gate[s + i]));
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          const float g = E::load(gate[s + i]);
          const float act = E::load(E::store(g / (1.f + e[i])));
          o[s + i] = E::store(act * E::load(up[s + i]));
        }
      }
    }
  });
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, w);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x.scalar_type(), [&](auto e) {
    using E = decltype(e);
    rms_norm_rows<E>(ptr<E>(x), x.stride(0), ptr<E>(w), ptr<E>(out), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

torch::Tensor add_rms_norm_(torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& w, double eps) {
  check_rows(h, w);
  TORCH_CHECK(h.is_contiguous() && delta.is_contiguous() && delta.sizes() == h.sizes(), "h/delta must match");
  TORCH_CHECK(delta.scalar_type() == h.scalar_type(), "h and delta dtypes differ");
  auto out = torch::empty_like(h);
  dispatch(h.scalar_type(), [&](auto e) {
    using E = decltype(e);
    add_rms_norm_rows<E>(ptr<E>(h), ptr<E>(delta), ptr<E>(w), ptr<E>(out), h.size(0), h.size(1),
                         static_cast<float>(eps));
  });
  return out;
}


void rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be [T, heads, D], contiguous D");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2, "cos/sin must be contiguous [T, D/2]");
  TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(1) * 2 == x.size(2) && sin.sizes() == cos.sizes(), "cos/sin shape");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "dtype mismatch");
  dispatch(x.scalar_type(), [&](auto e) {
    using E = decltype(e);
    rotary_impl<E>(ptr<E>(x), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1), ptr<E>(cos), ptr<E>(sin));
  });
}

torch::Tensor silu_mul(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x must be contiguous [T, 2I]");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  dispatch(x.scalar_type(), [&](auto e) {
    using E = decltype(e);
    silu_mul_impl<E>(ptr<E>(x), ptr<E>(out), x.size(0), x.size(1) / 2);
  });
  return out;
}

// The new tokens' K and V ([T, heads, D] views of the fused qkv output: heads adjacent, D
// contiguous) into their pool slots ([slots, heads, D] each): one row copy per token and tensor
// where torch's index_copy_ walks a strided source element by element, twice per layer.
void store_kv_(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
               const torch::Tensor& slots) {
  if (k_buf.scalar_type() == at::kChar) return store_kv_int8_(k, v, k_buf, v_buf, slots);
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must be [T, heads, D] alike");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.sizes() == v_buf.sizes(), "pool buffers");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.size(1) == k.size(1) && k_buf.size(2) == k.size(2), "pool row shape");
  for (const auto* t : {&k, &v}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "k/v heads must be adjacent rows");
    TORCH_CHECK(t->scalar_type() == k_buf.scalar_type() && v_buf.scalar_type() == k_buf.scalar_type(), "dtypes");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0), "slots");
  const int64_t tokens = k.size(0), capacity = k_buf.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "slot out of range");
  const int64_t bytes = k.size(1) * k.size(2) * static_cast<int64_t>(k.element_size());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kb = static_cast<char*>(k_buf.data_ptr());
  char* vb = static_cast<char*>(v_buf.data_ptr());
  // A decode step's few rows in the calling thread; prefill chunks split over the team.
  parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kb + sp[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vb + sp[t] * bytes, vp + t * vs, bytes);
    }
  });
}

}  // namespace radixserve
