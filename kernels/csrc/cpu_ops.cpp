// The fused CPU kernels as one Python extension, built by kernels/cpu_ops.py at first use.
// One translation unit on purpose: the torch headers cost ~40 s of compile time per unit.

#include <torch/extension.h>

#include "attention.h"
#include "decoder_layer.h"
#include "elementwise.h"
#include "gemm.h"
#include "lora.h"
#include "quant_gemm.h"
#include "quant_strips.h"

using namespace radixserve;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Release the GIL like torch ops do, so Python threads (e.g. the engine's output processing
  // overlapped with the forward) keep running while a kernel works.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (float32 math)", release());
  m.def("add_rms_norm_", &add_rms_norm_, "h += delta in place, then RMSNorm(h)", release());
  m.def("rotary_", &rotary_, "neox rotary in place on [T, heads, D]", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up over [T, 2I]", release());
  py::class_<DecodeLinear>(m, "DecodeLinear", "a projection as a decode step runs it")
      .def(py::init([](torch::Tensor w, int64_t n, c10::optional<torch::Tensor> scale,
                       c10::optional<torch::Tensor> offset, int64_t group, int64_t bits, bool int8_x, bool strips) {
             return DecodeLinear{std::move(w), n, std::move(scale), std::move(offset), group, bits, int8_x, strips};
           }),
           py::arg("weight"), py::arg("n"), py::arg("scale") = py::none(), py::arg("offset") = py::none(),
           py::arg("group") = 0, py::arg("bits") = 0, py::arg("int8_x") = false, py::arg("strips") = false);
  py::class_<DecodeLayer>(m, "DecodeLayer", "one dense decoder layer's weights")
      .def(py::init([](torch::Tensor input_norm, torch::Tensor post_norm, double eps, DecodeLinear qkv, DecodeLinear o,
                       DecodeLinear gate_up, DecodeLinear down) {
        return DecodeLayer{std::move(input_norm), std::move(post_norm), eps, std::move(qkv), std::move(o),
                           std::move(gate_up), std::move(down)};
      }));
  py::class_<DecodeStack>(m, "DecodeStack", "a model's decoder layers for decode steps, one native call")
      .def(py::init([](std::vector<DecodeLayer> layers, int64_t heads, int64_t kv_heads, int64_t head_dim) {
        return DecodeStack{std::move(layers), heads, kv_heads, head_dim};
      }))
      .def("run", &DecodeStack::run, "layers [first, last) of a decode step; returns the last MLP output",
           release());
  m.def("store_kv_", &store_kv_, "a step's new K/V rows into their pool slots (quantized into an int8 pool)",
        release());
  m.def("kv_int8_available", &kv_int8_available, "whether an int8 pool's kernels take (head size, group)");
  m.def("extend_attention", &extend_attention, "causal prefill attention over paged K/V, whole batch", release());
  m.def("extend_attention_bf16", &extend_attention_bf16,
        "extend_attention with bf16 products (float32 softmax and sums), AVX512-BF16 only", release());
  m.def("extend_bf16_available", &extend_bf16_available, "whether extend_attention_bf16 was built");
  m.def("gemm_available", &gemm_available, "whether packed_linear was built (AVX512-BF16)");
  m.def(
      "fixed_gemm_uses_amx",
      [] {
#if defined(RADIXSERVE_HAVE_AMX)
        return amx_usable();
#else
        return false;
#endif
      },
      "whether packed_linear_fixed runs on AMX tiles (else on AVX512-BF16 chains)");
  m.def(
      "packed_linear",
      [](const torch::Tensor& x, const torch::Tensor& wp, int64_t n, const c10::optional<torch::Tensor>& bias) {
        return packed_linear(x, wp, n, bias, false);
      },
      "bf16 x @ W^T (+ bias) with W packed by pack_linear_weight", release());
  m.def(
      "packed_linear_fixed",
      [](const torch::Tensor& x, const torch::Tensor& wp, int64_t n, const c10::optional<torch::Tensor>& bias) {
        return packed_linear(x, wp, n, bias, true);
      },
      "packed_linear with a K reduction order that does not depend on the row count", release());
  m.def(
      "packed_linear_fixed_chains",
      [](const torch::Tensor& x, const torch::Tensor& wp, int64_t n, const c10::optional<torch::Tensor>& bias) {
        return packed_linear(x, wp, n, bias, true, false);
      },
      "packed_linear_fixed on the AVX512-BF16 chains even where AMX is there", release());
  m.def(
      "quant_linear",
      [](const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
         const c10::optional<torch::Tensor>& offset, int64_t group, int64_t bits,
         const c10::optional<torch::Tensor>& bias) { return quant_linear(x, q, scale, offset, group, bits, bias); },
      "x @ W^T (+ bias), W group-quantized (4 or 8 bits), widened in registers", release());
  m.def(
      "quant_linear_int8_x",
      [](const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
         const c10::optional<torch::Tensor>& offset, int64_t group, int64_t bits,
         const c10::optional<torch::Tensor>& bias) {
        return quant_linear(x, q, scale, offset, group, bits, bias, true);
      },
      "quant_linear with decode rows of x rounded to int8 per block of 32 and multiplied as integers",
      release());
  m.def("quant_int8_x_available", [] {
#if defined(RADIXSERVE_QUANT_INT8_X)
    return true;
#else
    return false;
#endif
  }, "whether quant_linear_int8_x has its integer path here (AVX2)");
  m.def("quant_strip_pack", &quant_strip_pack, "a row-layout weight in strips of 16 rows: [data, scale(, offset)]",
        release());
  m.def("quant_strip_unpack", &quant_strip_unpack, "strips' integers (or some rows') back in the row layout",
        release());
  m.def("quant_strip_dequantize", &quant_strip_dequantize, "a weight in strips as a dense [N, K] tensor", release());
  m.def("quant_strips_available", &quant_strips_available, "whether quant_strip_linear was built (AVX512-BF16)");
  m.def("quant_strips_i8_available", &quant_strips_i8_available,
        "whether quant_strip_linear has its integer path for int8_x (AVX-512 VNNI)");
  m.def("quant_strip_linear", &quant_strip_linear, "bf16 x @ W^T (+ bias) for a weight in strips", py::arg("x"),
        py::arg("data"), py::arg("scale"), py::arg("offset"), py::arg("n"), py::arg("group"), py::arg("bits"),
        py::arg("bias"), py::arg("int8_x") = false, release());
  m.def("quant_dequantize", &quant_dequantize, "a group-quantized W (or some of its rows) as a dense tensor",
        release());
  m.def("lora_bgmv_", &lora_bgmv_, "y += each row's LoRA delta from its own adapter slot (decode rows)",
        release());
  m.def("decode_attention", &decode_attention, "one-query-per-sequence attention over paged K/V", release());
  m.def("decode_attention_fixed", &decode_attention_fixed,
        "decode attention with extend_attention's arithmetic (key blocks from position 0)", release());
}
