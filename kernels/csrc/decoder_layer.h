#pragma once

// One dense decoder layer (Llama family: fused qkv, neox rotary, GQA, gated SiLU MLP, RMSNorm, no
// biases) of a decode step as one native call, for layers whose projections run the packed bf16
// GEMM. The layer's dozen ops then follow each other without a return to Python in between: on the
// default model a batch-1 decode step spent ~3 of its ~7 ms outside the kernels. The ops are the
// very functions the Python path calls, with the same arguments, so the results are bitwise its own.

#include "attention.h"
#include "elementwise.h"
#include "gemm.h"

namespace radixserve {

// residual += delta (when delta is given; layer 0 has none), x = input_norm(residual), the
// attention block (its output added to residual in place), then the MLP, whose output it returns.
inline torch::Tensor decoder_layer_decode(const c10::optional<torch::Tensor>& delta, torch::Tensor& residual,
                                          const torch::Tensor& input_norm, const torch::Tensor& post_norm,
                                          double eps, const torch::Tensor& qkv_w, const torch::Tensor& o_w,
                                          const torch::Tensor& gate_up_w, int64_t gate_up_n, const torch::Tensor& down_w,
                                          const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& k_buf,
                                          torch::Tensor& v_buf, const torch::Tensor& out_slots,
                                          const torch::Tensor& kv_indices, const torch::Tensor& seq_lens,
                                          int64_t heads, int64_t kv_heads, int64_t head_dim) {
  const c10::optional<torch::Tensor> no_bias;
  const int64_t tokens = residual.size(0), hidden = residual.size(1);
  const int64_t qkv_n = (heads + 2 * kv_heads) * head_dim;
  const torch::Tensor x = delta.has_value() ? add_rms_norm_(residual, *delta, input_norm, eps)
                                            : rms_norm(residual, input_norm, eps);
  torch::Tensor qkv = packed_linear(x, qkv_w, qkv_n, no_bias, false).view({tokens, heads + 2 * kv_heads, head_dim});
  torch::Tensor qk = qkv.narrow(1, 0, heads + kv_heads);
  rotary_(qk, cos, sin);
  store_kv_(qkv.narrow(1, heads, kv_heads), qkv.narrow(1, heads + kv_heads, kv_heads), k_buf, v_buf, out_slots);
  const torch::Tensor attn = decode_attention(qkv.narrow(1, 0, heads), k_buf, v_buf, kv_indices, seq_lens,
                                              1.0 / std::sqrt(static_cast<double>(head_dim)));
  const torch::Tensor o = packed_linear(attn.view({tokens, heads * head_dim}), o_w, hidden, no_bias, false);
  const torch::Tensor h = add_rms_norm_(residual, o, post_norm, eps);
  const torch::Tensor gate_up = packed_linear(h, gate_up_w, gate_up_n, no_bias, false);
  return packed_linear(silu_mul(gate_up), down_w, hidden, no_bias, false);
}

}  // namespace radixserve
