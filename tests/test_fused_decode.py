"""Decode steps with one native call per decoder layer give bitwise the modules' logits, and the
fused path stays off wherever it would not run the modules' own kernels."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels import cpu_ops
from radixserve.workers.batch_kind import BatchKind
from radixserve.workers.models.fused_decode import FusedDecode
from radixserve.workers.models.loader import load_model
from tests.model_driver import ModelDriver, make_batch

pytestmark = pytest.mark.skipif(
    not cpu_ops.gemm_available(torch.bfloat16), reason="the packed bf16 GEMM needs AVX512-BF16"
)


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype="bfloat16")


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


def test_not_where_the_modules_run_other_kernels():
    # Batch-invariant mode: fixed-order GEMMs and attention.
    assert FusedDecode.build(load_model(None, dtype="bfloat16", deterministic=True).model) is None
    # float32 weights: no packed GEMM.
    assert FusedDecode.build(load_model(None, dtype="float32").model) is None
