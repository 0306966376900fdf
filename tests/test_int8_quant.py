"""Weight-only int8: the quantizer's exact values, the fused kernel (AVX-512, AVX2 or the plain
loop, whichever this CPU built) and the dequantize-then-GEMM path against dequantize-then-matmul
in float32, and a loaded model whose projections are int8."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels import cpu_ops, int8_ops
from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.models.int8_weight import Int8Weight
from radixserve.workers.models.linear import Linear
from radixserve.workers.models.loader import load_model
from tests.model_driver import ModelDriver
from tests.tiny_models import make_tiny_checkpoint

native = pytest.mark.skipif(cpu_ops.native_ops() is None, reason="CPU extension not built")


def test_quantizer_values_are_round_to_nearest_of_the_row_scale():
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [-3.0, 1.5, 0.7, 2.999]])
    wq, scale = int8_ops.quantize_int8(w)
    assert scale.tolist() == pytest.approx([1.0 / 127, 1.0, 3.0 / 127], rel=1e-7)
    assert wq.dtype == torch.int8
    assert wq.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0], [-127, 64, 30, 127]]
    err = (int8_ops.dequantize_int8(wq, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())


def test_bf16_weights_quantize_from_their_float_values():
    w = torch.randn(5, 7).to(torch.bfloat16)
    wq, scale = int8_ops.quantize_int8(w)
    ref_q, ref_s = int8_ops.quantize_int8(w.float())
    assert torch.equal(wq, ref_q) and torch.equal(scale, ref_s)


def _reference(x, wq, scale, bias):  # dequantize, then matmul in float32
    y = x.float() @ int8_ops.dequantize_int8(wq, scale).T
    return y if bias is None else y + bias


@native
@pytest.mark.parametrize("rows", [1, 2, 9, 17])
@pytest.mark.parametrize("k", [576, 37, 8])  # tails of the 16/32-wide loops, and none
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_kernel_equals_dequantize_then_matmul(rows, k, with_bias):
    torch.manual_seed(rows * 100 + k)
    wq, scale = int8_ops.quantize_int8(torch.randn(45, k))
    x = torch.randn(rows, k)
    bias = torch.randn(45) if with_bias else None
    y = cpu_ops.native_ops().int8_linear(x, wq, scale, bias)
    assert y.dtype == torch.float32 and y.shape == (rows, 45)
    # Float32 summation orders differ: a few ulps of the sum of k products of size ~1.
    atol = 4e-6 * k**0.5
    torch.testing.assert_close(y, _reference(x, wq, scale, bias), rtol=1e-5, atol=atol)
    torch.testing.assert_close(y, int8_ops.int8_linear_torch(x, wq, scale, bias), rtol=1e-5, atol=atol)


@native
def test_fused_kernel_takes_bf16_activations_and_rounds_once():
    torch.manual_seed(1)
    wq, scale = int8_ops.quantize_int8(torch.randn(64, 96))
    x = torch.randn(3, 96).to(torch.bfloat16)
    y = cpu_ops.native_ops().int8_linear(x, wq, scale, None)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, _reference(x, wq, scale, None).to(torch.bfloat16), rtol=0, atol=0.02)


@native
def test_fused_kernel_rejects_bad_operands():
    wq, scale = int8_ops.quantize_int8(torch.randn(4, 8))
    ops = cpu_ops.native_ops()
    with pytest.raises(RuntimeError, match="disagree on K"):
        ops.int8_linear(torch.randn(1, 9), wq, scale, None)
    with pytest.raises(RuntimeError, match="int8"):
        ops.int8_linear(torch.randn(1, 8), wq.float(), scale, None)
    with pytest.raises(RuntimeError, match="scale"):
        ops.int8_linear(torch.randn(1, 8), wq, scale[:3], None)


@pytest.mark.parametrize("rows", [1, int8_ops.INT8_DEQUANT_ROWS - 1, int8_ops.INT8_DEQUANT_ROWS, 40])
def test_dispatch_either_side_of_the_crossover_equals_the_reference(rows):
    torch.manual_seed(rows)
    wq, scale = int8_ops.quantize_int8(torch.randn(33, 64))
    x = torch.randn(2, rows, 64)  # leading dims are flattened and restored
    bias = torch.randn(33)
    y = int8_ops.int8_linear(x, wq, scale, bias)
    assert y.shape == (2, rows, 33)
    ref = _reference(x.reshape(-1, 64), wq, scale, bias).view(2, rows, 33)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_a_quantized_linear_computes_through_its_int8_weight():
    torch.manual_seed(0)
    layer = Linear(16, 8, bias=True, dtype=torch.float32)
    layer.load_checkpoint("weight", torch.randn(8, 16))
    layer.load_checkpoint("bias", torch.randn(8))
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.quantize_(Int8Weight.quantize(w, b))
    assert layer.weight is None and layer.bias is None and not layer.pack_(None)
    x = torch.randn(3, 16)
    wq, scale = int8_ops.quantize_int8(w)
    torch.testing.assert_close(layer(x), _reference(x, wq, scale, b), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="quantized"):
        layer.load_checkpoint("weight", w)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("int8"), "llama", attention_bias=True)


def test_int8_model_equals_the_model_with_dequantized_weights(tiny_llama):
    quant = load_model(tiny_llama, "float32", quantization="int8")
    ref = load_model(tiny_llama, "float32")
    qlayers = {n: m for n, m in quant.model.named_modules() if isinstance(m, Linear)}
    assert qlayers and all(m.quantized is not None for m in qlayers.values())
    for name, module in ref.model.named_modules():
        if isinstance(module, Linear):
            q = qlayers[name].quantized
            module.weight.data.copy_(q.dequantized())
    prompts = [[1, 5, 9, 200, 31], [7, 7, 300], [2] * 11]
    qd, rd = ModelDriver(quant.model, quant.config), ModelDriver(ref.model, ref.config)
    for p in prompts:
        torch.testing.assert_close(qd.logits_of(p), rd.logits_of(p), rtol=1e-4, atol=1e-4)
    assert qd.greedy(prompts, 8) == rd.greedy(prompts, 8)


def test_bad_quantization_settings_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        load_model(tiny_llama, "float32", quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match="tp_size 1"):
        EngineConfig(quantization="int8", tp_size=2)


def test_the_engine_serves_int8_weights_as_the_loaded_model_computes_them(tiny_llama):
    from radixserve.workers import Engine
    from tests.engine_utils import assert_kv_invariant

    prompts = [[1, 5, 9, 200, 31], [7, 7, 300], [2] * 11]
    loaded = load_model(tiny_llama, "float32", quantization="int8")
    expected = ModelDriver(loaded.model, loaded.config).greedy(prompts, 8)
    engine = Engine(tiny_llama, dtype="float32", quantization="int8", max_total_tokens=2048)
    try:
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        got = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in got] == expected
        assert_kv_invariant(engine)
    finally:
        engine.shutdown()
