"""The packed bf16 GEMM below a row-count crossover, torch's matmul above it: the crossover rule,
the probe, the per-layer dispatch, and what each choice holds in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_ops, gemm_crossover
from radixserve.kernels.gemm_crossover import choose_crossover, packed_crossover, probe
from radixserve.workers.models import loader
from radixserve.workers.models.linear import Linear
from radixserve.workers.models.loader import build_model, iter_checkpoint, load_model
from tests.tiny_models import make_tiny_checkpoint

torch.set_num_threads(1)

needs_gemm = pytest.mark.skipif(
    not cpu_ops.gemm_available(torch.bfloat16), reason="no AVX512-BF16 packed GEMM here"
)


def test_crossover_is_the_smallest_count_from_which_torch_wins_throughout():
    # rows -> (packed s, torch s)
    assert choose_crossover({1024: (10.0, 5.0), 512: (5.0, 4.0), 256: (2.0, 2.5)}) == 512
    assert choose_crossover({1024: (10.0, 5.0), 512: (5.0, 5.1), 256: (2.0, 1.0)}) == 1024  # not throughout
    assert choose_crossover({1024: (10.0, 9.5)}) is None  # within the 10% margin: packed holds
    assert choose_crossover({1024: (10.0, 9.0), 64: (1.0, 0.5)}, margin=0.0) == 64
    assert choose_crossover({}) is None


def test_probe_walks_down_and_stops_where_the_packed_kernel_holds():
    asked: list[int] = []

    def timer(rows: int) -> tuple[float, float]:
        asked.append(rows)
        return (1.0, 0.5) if rows >= 512 else (1.0, 2.0)

    assert probe(timer) == 512
    assert asked == [512, 256]
    asked.clear()
    assert probe(timer, rows_desc=(2048, 1024, 512, 256, 128)) == 512
    assert asked == [2048, 1024, 512, 256]
    asked.clear()
    assert probe(lambda rows: asked.append(rows) or (1.0, 2.0)) is None
    assert asked == [512]


def test_the_environment_pins_the_crossover(monkeypatch):
    monkeypatch.setenv(gemm_crossover.ENV_OVERRIDE, "none")
    assert packed_crossover([(64, 64)]) is None
    monkeypatch.setenv(gemm_crossover.ENV_OVERRIDE, "300")
    assert packed_crossover([(64, 64)]) == 300
    monkeypatch.setenv(gemm_crossover.ENV_OVERRIDE, "-3")
    with pytest.raises(ValueError, match="must be 'none' or a positive row count, got '-3'"):
        packed_crossover([(64, 64)])


@needs_gemm
def test_measured_crossover_is_a_probed_count_and_measured_once(monkeypatch):
    monkeypatch.delenv(gemm_crossover.ENV_OVERRIDE, raising=False)
    first = packed_crossover([(128, 256), (256, 128)])
    assert first is None or first in gemm_crossover.PROBE_ROWS
    info = gemm_crossover._measured.cache_info()
    assert packed_crossover([(256, 128), (128, 256), (128, 256)]) == first  # same shape set, cached
    assert gemm_crossover._measured.cache_info().hits == info.hits + 1


def _layer(bias: bool) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 96, generator=gen).to(torch.bfloat16)
    b = torch.randn(200, generator=gen).to(torch.bfloat16) if bias else None
    layer = Linear(96, 200, bias, torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w)
        if b is not None:
            layer.bias.copy_(b)
    return layer, w, b


@needs_gemm
@pytest.mark.parametrize("bias", [False, True])
def test_rows_below_the_crossover_run_packed_and_above_run_torch(bias):
    layer, w, b = _layer(bias)
    assert layer.pack_(crossover=64)
    assert (layer.uses_packed(63), layer.uses_packed(64)) == (True, False)
    assert torch.equal(layer.weight, w)  # both copies kept
    native = cpu_ops.native_ops()
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 63, 64, 300):
        x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
        expected = (
            native.packed_linear(x, layer.packed_weight, 200, None if b is None else b.float())
            if rows < 64
            else F.linear(x, w, b)
        )
        assert torch.equal(layer(x), expected)  # exactly the chosen path's result
        reference = F.linear(x.float(), w.float(), None if b is None else b.float())
        torch.testing.assert_close(layer(x).float(), reference, atol=0.05, rtol=2**-6)


@needs_gemm
def test_without_a_crossover_only_the_packed_copy_is_kept():
    layer, w, _ = _layer(bias=False)
    layer.pack_(crossover=None)
    assert layer.weight is None and layer.uses_packed(1 << 20)
    assert sum(p.numel() for p in layer.parameters()) == 208 * 96  # 200 rows padded to 13 strips
    x = torch.randn(300, 96, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    assert torch.equal(layer(x), cpu_ops.native_ops().packed_linear(x, layer.packed_weight, 200, None))
    assert torch.equal(layer(x.view(3, 100, 96)), layer(x).view(3, 100, 200))  # any leading dims
    with pytest.raises(RuntimeError, match="already packed"):
        layer.pack_(None)


@needs_gemm
@pytest.mark.parametrize("crossover", [None, 64])
def test_tied_lm_head_multiplies_by_the_embedding_itself(tmp_path, crossover):
    path = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    config = loader.read_config(Path(path), torch.bfloat16)
    model = build_model(config)
    model.load_weights(iter_checkpoint(Path(path)))
    embedding = model.model.embed_tokens.weight
    plain_params = sum(p.numel() for p in model.parameters())
    assert model.pack_weights(crossover)
    if crossover is None:
        # Every projection's packed copy replaced its plain one (all sizes are whole strips here);
        # only the LM head's packed vocabulary is extra, as the embedding lookup needs the plain one.
        assert model.lm_head.weight is None
        assert sum(p.numel() for p in model.parameters()) == plain_params + embedding.numel()
    else:
        assert model.lm_head.weight is embedding  # no second plain copy of the vocabulary
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        packed = sum(m.packed_weight.numel() for m in linears)
        assert sum(p.numel() for p in model.parameters()) == plain_params + packed


@needs_gemm
def test_plain_copies_are_kept_only_within_the_memory_budget(tmp_path, monkeypatch):
    path = make_tiny_checkpoint(tmp_path, "qwen2")
    monkeypatch.setenv(gemm_crossover.ENV_OVERRIDE, "128")
    kept = load_model(path, dtype="bfloat16").model
    assert kept.model.layers[0].mlp.down_proj.packed_below == 128
    assert kept.model.layers[0].mlp.down_proj.weight is not None
    monkeypatch.setattr(loader, "DUAL_WEIGHTS_MAX_MEMORY", 1e-12)
    dropped = load_model(path, dtype="bfloat16").model
    assert dropped.model.layers[0].mlp.down_proj.weight is None
    assert all(m.weight is None for m in dropped.modules() if isinstance(m, Linear))
