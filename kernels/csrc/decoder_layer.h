#pragma once

// The dense decoder layers (Llama family: fused qkv, neox rotary, GQA, gated SiLU MLP, RMSNorm, no
// biases) of a decode step as native calls, for layers whose projections run the packed bf16 GEMM
// or a quantized kernel. The layers' ops then follow each other without a return to Python in
// between (on the default model a batch-1 decode step spent ~3 of its ~7 ms outside the kernels),
// and the GIL is released once for all of them. The ops are the very functions the Python path
// calls, with the same arguments, so the results are bitwise its own.

#include "attention.h"
#include "elementwise.h"
#include "gemm.h"
#include "quant_gemm.h"
#include "quant_strips.h"

namespace radixserve {

// One projection as Linear runs it for a decode step: the packed bf16 GEMM, or the quantized
// kernel over one group-quantized weight (QuantTensor's fields; `int8_x`: the integer path), or
// over one in strips (StripTensor's fields, `strips`).
struct DecodeLinear {
  torch::Tensor weight;  // packed bf16, or the quantized integers (in rows or strips)
  int64_t n = 0;
  c10::optional<torch::Tensor> scale, offset;  // set for a quantized weight
  int64_t group = 0, bits = 0;
  bool int8_x = false, strips = false;

  torch::Tensor operator()(const torch::Tensor& x) const {
    const c10::optional<torch::Tensor> no_bias;
    if (!scale.has_value()) return packed_linear(x, weight, n, no_bias, false);
    if (strips) return quant_strip_linear(x, weight, *scale, offset, n, group, bits, no_bias, int8_x);
    return quant_linear(x, weight, *scale, offset, group, bits, no_bias, int8_x);
  }
};

struct DecodeLayer {
  torch::Tensor input_norm, post_norm;
  double eps = 0.0;
  DecodeLinear qkv, o, gate_up, down;
};

// residual += delta (when delta is given; layer 0 has none), x = input_norm(residual), the
// attention block (its output added to residual in place), then the MLP, whose output it returns.
inline torch::Tensor decoder_layer_decode(const DecodeLayer& l, const c10::optional<torch::Tensor>& delta,
                                          torch::Tensor& residual, const torch::Tensor& cos, const torch::Tensor& sin,
                                          const torch::Tensor& k_buf, const torch::Tensor& v_buf, const torch::Tensor& out_slots,
                                          const torch::Tensor& kv_indices, const torch::Tensor& seq_lens, int64_t heads,
                                          int64_t kv_heads, int64_t head_dim) {
  const int64_t tokens = residual.size(0);
  const torch::Tensor x = delta.has_value() ? add_rms_norm_(residual, *delta, l.input_norm, l.eps)
                                            : rms_norm(residual, l.input_norm, l.eps);
  torch::Tensor qkv = l.qkv(x).view({tokens, heads + 2 * kv_heads, head_dim});
  torch::Tensor qk = qkv.narrow(1, 0, heads + kv_heads);
  rotary_(qk, cos, sin);
  store_kv_(qkv.narrow(1, heads, kv_heads), qkv.narrow(1, heads + kv_heads, kv_heads), k_buf, v_buf, out_slots);
  const torch::Tensor attn = decode_attention(qkv.narrow(1, 0, heads), k_buf, v_buf, kv_indices, seq_lens,
                                              1.0 / std::sqrt(static_cast<double>(head_dim)));
  const torch::Tensor o = l.o(attn.view({tokens, heads * head_dim}));
  const torch::Tensor h = add_rms_norm_(residual, o, l.post_norm, l.eps);
  return l.down(silu_mul(l.gate_up(h)));
}

// A model's layers, built once; `run` computes layers [first, last) of a decode step.
struct DecodeStack {
  std::vector<DecodeLayer> layers;
  int64_t heads, kv_heads, head_dim;

  torch::Tensor run(int64_t first, int64_t last, c10::optional<torch::Tensor> delta, torch::Tensor residual,
                    const torch::Tensor& cos, const torch::Tensor& sin, const std::vector<torch::Tensor>& k_bufs,
                    const std::vector<torch::Tensor>& v_bufs, const torch::Tensor& out_slots, const torch::Tensor& kv_indices,
                    const torch::Tensor& seq_lens) const {
    TORCH_CHECK(0 <= first && first < last && last <= static_cast<int64_t>(layers.size()), "bad layer range");
    TORCH_CHECK(k_bufs.size() == layers.size() && v_bufs.size() == layers.size(), "one K and V buffer a layer");
    for (int64_t i = first; i < last; ++i)
      delta = decoder_layer_decode(layers[i], delta, residual, cos, sin, k_bufs[i], v_bufs[i], out_slots, kv_indices,
                                   seq_lens, heads, kv_heads, head_dim);
    return *delta;
  }
};

}  // namespace radixserve
