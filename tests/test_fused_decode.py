"""Decode steps with the decoder layers in one native call give bitwise the modules' logits (packed
bf16 weights, and the default model's GGUF blocks in bf16 (in strips) and float32, with float and
int8 activations in each), and the fused path stays off wherever it would not run the modules' own kernels."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels import cpu_ops, quant_ops
from radixserve.workers.batch_kind import BatchKind
from radixserve.workers.models.fused_decode import FusedDecode
from radixserve.workers.models.loader import load_model
from radixserve.workers.models.quant_weight import QuantWeight
from tests.model_driver import ModelDriver, make_batch

needs_gemm = pytest.mark.skipif(
    not cpu_ops.gemm_available(torch.bfloat16), reason="the packed bf16 GEMM needs AVX512-BF16"
)
needs_native = pytest.mark.skipif(cpu_ops.native_ops() is None, reason="C++ extension not built")
FORMS = {
    "packed bf16": dict(dtype="bfloat16"),
    "gguf bf16": dict(dtype="bfloat16", quantization="gguf"),
    "gguf float32": dict(dtype="float32", quantization="gguf"),
    "gguf int8 activations": dict(dtype="float32", quantization="gguf", quantized_activations="int8"),
    "gguf bf16 int8 activations": dict(dtype="bfloat16", quantization="gguf", quantized_activations="int8"),
}
needs_strips_int8 = pytest.mark.skipif(
    not quant_ops.strips_int8_available(), reason="int8 activations on strips need AVX-512 VNNI"
)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("packed bf16", marks=needs_gemm),
        pytest.param("gguf bf16", marks=needs_native),
        pytest.param("gguf float32", marks=needs_native),
        pytest.param("gguf int8 activations", marks=needs_native),
        pytest.param("gguf bf16 int8 activations", marks=needs_strips_int8),
    ],
)
def loaded(request):
    return load_model(None, **FORMS[request.param])


def set_fused(model, on: bool) -> None:
    model.fused_decode, model._fused_checked = (FusedDecode.build(model) if on else None), True


def test_decode_steps_equal_the_modules_bit_for_bit(loaded):
    model, driver = loaded.model, ModelDriver(loaded.model, loaded.config)
    prompts = [list(range(1000, 1000 + n)) for n in (3, 40, 17, 90, 1)]
    slots = [driver.pool.alloc(len(p) + 4) for p in prompts]
    set_fused(model, False)
    out = model(make_batch(BatchKind.PREFILL, prompts, [0] * len(prompts), slots), driver.pool)
    tokens = out.argmax(-1).tolist()
    set_fused(model, True)
    assert model.fused_decode is not None
    for step in range(3):
        lens = [len(p) + step for p in prompts]
        batch = make_batch(BatchKind.DECODE, [[t] for t in tokens], lens, slots)
        assert model.fused_decode.usable(batch, driver.pool)
        fused = model(batch, driver.pool)
        k_fused = driver.pool.k_buffers[7][batch.out_slots].clone()
        set_fused(model, False)  # the same step again through the modules: it rewrites the same K/V
        modules = model(make_batch(BatchKind.DECODE, [[t] for t in tokens], lens, slots), driver.pool)
        assert torch.equal(driver.pool.k_buffers[7][batch.out_slots], k_fused)
        set_fused(model, True)
        assert torch.equal(fused, modules)
        tokens = fused.argmax(-1).tolist()
    # Prefill steps keep the modules (their projections go to torch's GEMM past the crossover).
    prefill = make_batch(BatchKind.PREFILL, [[5, 6]], [0], [driver.pool.alloc(2)])
    assert not model.fused_decode.usable(prefill, driver.pool)


def test_greedy_output_is_the_modules(loaded):
    model, driver = loaded.model, ModelDriver(loaded.model, loaded.config)
    prompts = [list(range(2000, 2000 + n)) for n in (12, 30)]
    set_fused(model, True)
    fused = driver.greedy(prompts, 12)
    set_fused(model, False)
    assert driver.greedy(prompts, 12) == fused


def test_layer_by_layer_reports_equal_one_call(loaded):
    """With a layer_done hook (layer-by-layer KV transfer) the layers run one call each, and each
    is reported in order; the logits are the one-call path's."""
    model, driver = loaded.model, ModelDriver(loaded.model, loaded.config)
    prompts = [list(range(3000, 3000 + n)) for n in (9, 21)]
    slots = [driver.pool.alloc(len(p) + 1) for p in prompts]
    set_fused(model, True)
    tokens = model(make_batch(BatchKind.PREFILL, prompts, [0, 0], slots), driver.pool).argmax(-1).tolist()
    lens = [len(p) for p in prompts]
    whole = model(make_batch(BatchKind.DECODE, [[t] for t in tokens], lens, slots), driver.pool)
    batch = make_batch(BatchKind.DECODE, [[t] for t in tokens], lens, slots)
    done: list[int] = []
    batch.layer_done = done.append
    assert torch.equal(model(batch, driver.pool), whole)
    assert done == list(range(len(model.model.layers)))


@needs_gemm
def test_not_where_the_modules_run_other_kernels():
    # Batch-invariant mode: fixed-order GEMMs and attention.
    assert FusedDecode.build(load_model(None, dtype="bfloat16", deterministic=True).model) is None
    # float32 weights: no packed GEMM.
    assert FusedDecode.build(load_model(None, dtype="float32").model) is None


@pytest.mark.skipif(not quant_ops.strips_available(), reason="strips need AVX512-BF16 kernels")
def test_a_bf16_gguf_model_decodes_through_its_strips():
    model = load_model(None, dtype="bfloat16", quantization="gguf").model
    parts = [p for m in model.modules() if isinstance(m, QuantWeight) for p in m.parts]
    assert parts and all(isinstance(p, quant_ops.StripTensor) for p in parts)
    fused = FusedDecode.build(model)
    # below the strips' dequantize crossover, where the modules run the strip kernel too
    assert fused is not None and fused.max_rows == quant_ops.STRIP_DEQUANT_ROWS
