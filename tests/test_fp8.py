"""fp8 (e4m3) weights (kernels/fp8_ops.py): quantized at load, and read from fp8 checkpoints
(quant_method fp8 and compressed-tensors float-quantized, per tensor or per channel), which the
tests write themselves with a small reference quantizer. On this CPU the weight is cast for a dense
matmul (exact for the weight); the `_scaled_mm` form the GPU path computes is checked against
torch's own CPU `_scaled_mm`, and on a GPU in tests/test_device_path.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from radixserve.kernels.fp8_ops import FP8, FP8_MAX, Fp8Tensor, fp8_reference_linear, quantize_fp8
from radixserve.workers.models import packed_checkpoints as pc
from radixserve.workers.models.linear import Linear
from radixserve.workers.models.loader import load_model
from radixserve.workers.models.quant_weight import QuantWeight, quantize_fp8_, weight_nbytes
from tests.model_driver import ModelDriver
from tests.test_packed_checkpoints import PROJECTIONS, write_checkpoints
from tests.tiny_models import make_tiny_checkpoint


def weight(n=64, k=96, seed=0) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[3] = 0  # an all-zero row
    w[5] *= 1e-6  # a row of tiny values (its scale is tiny too)
    return w


def test_quantize_fp8_rounds_each_weight_to_the_nearest_e4m3_of_its_row():
    w = weight()
    qt = quantize_fp8(w)
    amax = w.abs().amax(1)
    assert torch.equal(qt.scale, torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))
    assert qt.qweight.dtype == FP8 and qt.nbytes == 64 * 96 + 64 * 4
    deq = qt.dequantize()
    assert torch.equal(deq[3], torch.zeros(96))
    # e4m3: 3 mantissa bits, so a normal value is off by at most 2^-4 of itself; below 2^-6 the
    # step is 2^-9 (of the row's scale), half of it at most.
    bound = 2**-4 * w.abs() + 2**-10 * qt.scale[:, None]
    assert bool(((deq - w).abs() <= bound).all())
    # nearest: no other e4m3 value of the row is closer
    assert torch.equal(qt.qweight.float(), (w / qt.scale[:, None]).to(FP8).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_cpu_the_weight_is_cast_and_multiplied_densely(dtype):
    qt = quantize_fp8(weight())
    x = torch.randn(2, 5, 96).to(dtype)
    bias = torch.randn(64)
    y = qt.linear(x, bias)
    assert y.shape == (2, 5, 64) and y.dtype == dtype
    ref = F.linear(x.reshape(-1, 96), qt.dequantize(dtype), bias.to(dtype)).view(2, 5, 64)
    assert torch.equal(y, ref)
    assert torch.equal(qt.dequantize(dtype), (qt.qweight.float() * qt.scale[:, None]).to(dtype))
    with pytest.raises(ValueError, match="int8 activations"):
        qt.linear(x, int8_activations=True)


def test_slices_joins_and_row_lookups_keep_the_values():
    qt = quantize_fp8(weight())
    full = qt.dequantize()
    part = qt.narrow((8, 40), (16, 80))
    assert torch.equal(part.dequantize(), full[8:40, 16:80])
    assert torch.equal(qt.narrow(None, None).dequantize(), full)
    other = quantize_fp8(weight(n=32, seed=1))
    joined = Fp8Tensor.cat([qt, other])
    assert torch.equal(joined.dequantize(), torch.cat([full, other.dequantize()]))
    assert not qt.same_layout(quantize_fp8(weight(k=64)))
    rows = torch.tensor([5, 0, 63, 5])
    assert torch.equal(qt.dequantize(torch.bfloat16, rows), qt.dequantize(torch.bfloat16)[rows])
    assert qt.to("cpu") is qt
    assert not qt.per_tensor and Fp8Tensor(qt.qweight, torch.full((64,), 0.5)).per_tensor
    with pytest.raises(ValueError, match="scale"):
        Fp8Tensor(qt.qweight, qt.scale[:10])
    with pytest.raises(ValueError, match="2-D"):
        Fp8Tensor(qt.qweight.float(), qt.scale)


@pytest.mark.parametrize("rowwise", [True, False], ids=["rowwise", "tensorwise"])
def test_the_scaled_mm_reference_is_what_torch_computes(rowwise):
    """fp8_reference_linear (what the GPU path is checked against) equals torch._scaled_mm on
    the same e4m3 operands and scales, run here by torch's CPU implementation."""
    qt = quantize_fp8(weight(n=64, k=128))
    if not rowwise:
        qt = Fp8Tensor(qt.qweight, qt.scale[:1].expand(64).contiguous())
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(3)) * 3
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True) if rowwise else xf.abs().amax().reshape(1, 1)
    sx = amax / FP8_MAX
    xq = (xf / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    y = torch._scaled_mm(
        xq,
        qt.qweight.t(),
        scale_a=sx if rowwise else sx.reshape(()),
        scale_b=qt.scale[None, :] if rowwise else qt.scale[:1].reshape(()),
        out_dtype=torch.float32,
    )
    ref = fp8_reference_linear(x, qt, rowwise)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    # and both are close to the float product (the activations' rounding is the difference)
    exact = x @ qt.dequantize().T
    assert (ref - exact).norm() / exact.norm() < 0.05


def test_a_quant_weight_joins_fp8_parts_and_refuses_int8_activations():
    parts = [quantize_fp8(weight(n=n, seed=n)) for n in (64, 16, 16)]
    qw = QuantWeight(parts, torch.randn(96))
    assert len(qw.parts) == 1 and qw.out_features == 96  # q, k, v: one matmul
    x = torch.randn(3, 96)
    dense = torch.cat([p.dequantize() for p in parts])
    torch.testing.assert_close(qw(x), F.linear(x, dense, qw.bias_f32), rtol=0, atol=0)
    with pytest.raises(ValueError, match="not fp8"):
        qw.int8_activations = True
    assert qw.use_strips_(True) is False  # the strip kernels take integer weights only


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("fp8"), "llama", hidden_size=256, intermediate_size=512, attention_bias=True
    )


def test_quantization_fp8_quantizes_every_projection_and_halves_the_weights(tiny):
    """`quantize_fp8_` on a loaded model (what --quantization fp8 does on a GPU; the CPU engine
    refuses it, as it has no fp8 kernel): every projection and the tied embedding table, one
    copy, the model's outputs those of its dequantized weights."""
    ref = load_model(tiny, "float32")
    model = load_model(tiny, "float32")
    before = weight_nbytes(model.model)
    assert quantize_fp8_(model.model) > 0
    linears = [m for m in model.model.modules() if isinstance(m, Linear)]
    assert all(isinstance(m.quantized, QuantWeight) for m in linears)
    assert all(isinstance(p, Fp8Tensor) for m in linears for p in m.quantized.parts)
    after = weight_nbytes(model.model)
    assert after < 0.3 * before  # float32 -> 1 byte a weight (+ a float32 scale a row)
    prompts = [[1, 5, 9, 200, 31], [7, 7, 300]]
    qd, rd = ModelDriver(model.model, model.config), ModelDriver(ref.model, ref.config)
    for p in prompts:
        got, want = qd.logits_of(p), rd.logits_of(p)
        assert (got - want).norm() / want.norm() < 0.1
    with pytest.raises(ValueError, match="on the CPU, int8"):
        load_model(tiny, "float32", quantization="fp8")


# The KV cache scales the checkpoints carry, per layer: (K's, V's).
KV_SCALES = ([0.0625, 0.125], [0.03125, 0.046875])  # exact in float32


def fp8_checkpoint(hf_dir: str, out: Path, style: str) -> tuple[str, str]:
    """(an fp8 checkpoint, the plain checkpoint of its dequantized weights). style: "fp8-tensor"
    (quant_method fp8, one scale per tensor, static input scales, KV cache scales as
    self_attn.k_scale / v_scale), "ct-channel" (compressed-tensors float-quantized, one scale per
    output channel, bf16 scales, KV cache scales as k_proj / v_proj.output_scale). The KV cache
    scales of layer i are KV_SCALES[0][i] (K) and KV_SCALES[1][i] (V)."""

    def quantize_projection(module: str, t: torch.Tensor):
        parts = {}
        attn, _, proj = module.rpartition(".")
        if proj in ("k_proj", "v_proj"):
            layer = int(attn.split(".")[-2])
            kv = KV_SCALES[proj == "v_proj"][layer]
            if style == "fp8-tensor":
                parts[f"{attn}.{proj[0]}_scale"] = torch.tensor(kv)
            else:
                parts[f"{module}.output_scale"] = torch.tensor([kv])
        if style == "fp8-tensor":
            scale = (t.float().abs().amax() / FP8_MAX).reshape(1)
            stored = scale
            parts[f"{module}.input_scale"] = torch.tensor([0.02])
        else:
            scale = (t.float().abs().amax(1, keepdim=True) / FP8_MAX).bfloat16().float()
            stored = scale.bfloat16()
        q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        parts[f"{module}.weight"], parts[f"{module}.weight_scale"] = q, stored
        return parts, q.float() * scale

    if style == "fp8-tensor":
        config = {"quant_method": "fp8", "activation_scheme": "static"}
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
        config = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}},
            "ignore": ["lm_head"],
        }
    return write_checkpoints(hf_dir, out, style, config, quantize_projection)


@pytest.mark.parametrize("style", ["fp8-tensor", "ct-channel"])
def test_an_fp8_checkpoint_reads_back_its_values(style, tiny, tmp_path):
    qdir, ddir = fp8_checkpoint(tiny, tmp_path, style)
    assert pc.checkpoint_method(Path(qdir))[0] == "fp8"
    reader = pc.PackedReader(*pc.checkpoint_method(Path(qdir)))
    dense = dict(reader.dense(load_file(str(Path(qdir) / "model.safetensors")).items()))
    expected = load_file(str(Path(ddir) / "model.safetensors"))
    assert not any(n.endswith("_scale") for n in dense)  # scales consumed, input scales dropped
    assert set(dense) == set(expected)
    for name, t in expected.items():
        assert torch.equal(dense[name], t), name
    assert len(reader.tensors) == 2 * len(PROJECTIONS)  # 2 layers
    scales = [qt.scale for qt in reader.tensors.values() if isinstance(qt, Fp8Tensor)]
    assert len(scales) == len(reader.tensors)
    assert all(s.unique().numel() == 1 for s in scales) == (style == "fp8-tensor")


@pytest.mark.parametrize("style", ["fp8-tensor", "ct-channel"])
def test_an_fp8_checkpoint_on_the_cpu_computes_as_its_dequantized_weights(style, tiny, tmp_path):
    """The CPU has no fp8 kernel: the checkpoint's values times their scales are the weights,
    computed as the plain checkpoint of those values is."""
    qdir, ddir = fp8_checkpoint(tiny, tmp_path, style)
    quant, ref = load_model(qdir, "float32"), load_model(ddir, "float32")
    assert all(m.quantized is None for m in quant.model.modules() if isinstance(m, Linear))  # widened at load
    prompts = [[1, 5, 9, 200, 31], [7, 7, 300]]
    qd, rd = ModelDriver(quant.model, quant.config), ModelDriver(ref.model, ref.config)
    for p in prompts:
        assert torch.equal(qd.logits_of(p), rd.logits_of(p))


def test_fp8_checkpoints_that_are_not_read_are_refused(tiny, tmp_path):
    qdir, _ = fp8_checkpoint(tiny, tmp_path, "ct-channel")
    cfg_path = Path(qdir) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["weights"]["strategy"] = "block"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="8-bit float weights by tensor or channel"):
        load_model(qdir, "float32")
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="block-wise"):
        load_model(qdir, "float32")
    with pytest.raises(ValueError, match="neither per tensor nor per row"):
        pc.fp8_tensor(quantize_fp8(weight()).qweight, torch.ones(3))
