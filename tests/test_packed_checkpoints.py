"""AWQ, GPTQ and compressed-tensors checkpoints computed from their packed integers. The tests
write the checkpoints themselves: a small reference quantizer (round to nearest per group of 128
input features, asymmetric for AWQ / GPTQ, symmetric or not for compressed-tensors) packs each
projection in the format's own layout, and the dequantized weights are written as a plain
checkpoint beside it. Then: each format's tensors read back to the quantizer's values exactly, the
model computed from the integers matches the model (and transformers) on the dequantized weights,
and what is not read is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.kernels import quant_ops
from radixserve.workers.models import packed_checkpoints as pc
from radixserve.workers.models.linear import Linear
from radixserve.workers.models.loader import load_model
from tests.hf_reference import hf_greedy, load_hf
from tests.model_driver import ModelDriver
from tests.tiny_models import make_tiny_checkpoint

GROUP = 128
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(w: torch.Tensor, bits: int, symmetric: bool):
    """W [N, K] -> (q int [N, K], scale float16 [N, G], zero int [N, G]) with W ~ (q - zero) * scale:
    unsigned q in [0, 2^bits) with a zero point, or for symmetric the zero in the middle."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    top = (1 << bits) - 1
    if symmetric:
        scale = (g.abs().amax(-1) / (top // 2)).clamp(min=1e-4).half()
        zero = torch.full(scale.shape, (top + 1) // 2, dtype=torch.int32)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / top).clamp(min=1e-4).half()
        zero = torch.round(-lo / scale.float()).clamp(0, top).int()
    q = torch.round(g / scale.float()[..., None] + zero[..., None]).clamp(0, top).int().reshape(n, k)
    return q, scale, zero


def dequantized(q, scale, zero) -> torch.Tensor:
    n, k = q.shape
    return ((q.reshape(n, -1, GROUP) - zero[..., None]).float() * scale.float()[..., None]).reshape(n, k)


def pack_words(values: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """int [..., 8W] of 0..15 -> int32 [..., W]: value 8w + order[i] in nibble i."""
    v = values.reshape(*values.shape[:-1], -1, 8).long()
    if order is not None:
        v = v[..., order]
    words = sum(v[..., i] << (4 * i) for i in range(8))
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement of the top bit


def awq_tensors(q, scale, zero) -> dict[str, torch.Tensor]:
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    return {
        "qweight": pack_words(q.T, order),
        "qzeros": pack_words(zero.T, order),
        "scales": scale.T.contiguous(),
    }


def gptq_tensors(q, scale, zero) -> dict[str, torch.Tensor]:
    k = q.shape[1]
    return {
        "qweight": pack_words(q).T.contiguous(),  # [K/8, N]: 8 input rows a word
        "qzeros": pack_words(zero.T - 1),
        "scales": scale.T.contiguous(),
        "g_idx": (torch.arange(k) // GROUP).int(),
    }


def ct_tensors(q, scale, zero, bits: int, symmetric: bool) -> dict[str, torch.Tensor]:
    n, k = q.shape
    per_word = 32 // bits
    # The format stores signed values (and zero points) + mid: the quantizer's unsigned q and zero
    # are exactly that (symmetric: zero is mid itself, so no zero point is written).
    v = q.reshape(n, k // per_word, per_word).long()
    words = sum(v[..., i] << (bits * i) for i in range(per_word))
    out = {
        "weight_packed": (words - ((words >> 31) << 32)).to(torch.int32),
        "weight_scale": scale.contiguous(),
        "weight_shape": torch.tensor([n, k], dtype=torch.int32),
    }
    if not symmetric:
        z = zero.reshape(n // per_word, per_word, -1).long()  # packed along the output dimension
        zw = sum(z[:, i] << (bits * i) for i in range(per_word))
        out["weight_zero_point"] = (zw - ((zw >> 31) << 32)).to(torch.int32)
    return out


FORMATS = {
    "awq": (
        4,
        False,
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    ),
    "gptq": (
        4,
        False,
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False},
    ),
    "ct-int4-sym": (4, True, None),
    "ct-int4-asym": (4, False, None),
    "ct-int8-sym": (8, True, None),
}


def ct_config(bits: int, symmetric: bool) -> dict:
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "group",
        "group_size": GROUP,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}},
        "ignore": ["lm_head"],
    }


def write_checkpoints(
    hf_dir: str, out: Path, name: str, config: dict, quantize_projection
) -> tuple[str, str]:
    """(a quantized checkpoint, the plain checkpoint of its dequantized weights), both copies of
    `hf_dir` under `out`: each projection's weight becomes `quantize_projection(module, weight)`'s
    tensors (the format's own, by their full names) in the first and its dequantized weight in the
    second; `config` is the first's quantization_config."""
    qdir, ddir = out / f"{name}-q", out / f"{name}-dense"
    for d in (qdir, ddir):
        shutil.copytree(hf_dir, d)
    packed, dense = {}, {}
    for tensor_name, t in load_file(str(Path(hf_dir) / "model.safetensors")).items():
        module, _, kind = tensor_name.rpartition(".")
        if kind != "weight" or module.rpartition(".")[2] not in PROJECTIONS:
            packed[tensor_name] = dense[tensor_name] = t
            continue
        parts, dense[tensor_name] = quantize_projection(module, t)
        packed.update({k: v.contiguous() for k, v in parts.items()})
    save_file(packed, str(qdir / "model.safetensors"))
    save_file(dense, str(ddir / "model.safetensors"))
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = config
    (qdir / "config.json").write_text(json.dumps(cfg))
    return str(qdir), str(ddir)


def write_quantized(hf_dir: str, out: Path, fmt: str) -> tuple[str, str]:
    """(the quantized checkpoint, the plain checkpoint of its dequantized weights)."""
    bits, symmetric, config = FORMATS[fmt]

    def quantize_projection(module: str, t: torch.Tensor):
        q, scale, zero = quantize(t, bits, symmetric)
        if fmt == "awq":
            parts = awq_tensors(q, scale, zero)
        elif fmt == "gptq":
            parts = gptq_tensors(q, scale, zero)
        else:
            parts = ct_tensors(q, scale, zero, bits, symmetric)
        return {f"{module}.{k}": v for k, v in parts.items()}, dequantized(q, scale, zero)

    return write_checkpoints(hf_dir, out, fmt, config or ct_config(bits, symmetric), quantize_projection)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("packed"),
        "llama",
        hidden_size=256,
        intermediate_size=512,
        attention_bias=True,
    )


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_reads_back_the_quantizers_values(fmt):
    bits, symmetric, _ = FORMATS[fmt]
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(7))
    q, scale, zero = quantize(w, bits, symmetric)
    expected = dequantized(q, scale, zero)
    if fmt == "awq":
        qt = pc.awq_tensor(**awq_tensors(q, scale, zero))
    elif fmt == "gptq":
        t = gptq_tensors(q, scale, zero)
        qt = pc.gptq_tensor(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], v2=False)
    else:
        t = ct_tensors(q, scale, zero, bits, symmetric)
        qt = pc.compressed_tensor(
            t["weight_packed"], t["weight_scale"], t["weight_shape"], t.get("weight_zero_point"), None
        )
    assert (qt.bits, qt.group) == (bits, GROUP)
    assert torch.equal(quant_ops.dequantize_torch(qt), expected)
    assert torch.equal(qt.dequantize(), expected)
    x = torch.randn(3, 256)
    torch.testing.assert_close(qt.linear(x), x @ expected.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_packed_checkpoint_computes_as_its_dequantized_weights(fmt, tiny, tmp_path):
    qdir, ddir = write_quantized(tiny, tmp_path, fmt)
    quant = load_model(qdir, "float32")
    ref = load_model(ddir, "float32")
    linears = {n: m for n, m in quant.model.named_modules() if isinstance(m, Linear) and n != "lm_head"}
    assert linears and all(m.quantized is not None for m in linears.values())
    assert quant.model.lm_head.quantized is None  # not in the checkpoint's quantized set
    prompts = [[1, 5, 9, 200, 31], [7, 7, 300]]
    qd, rd = ModelDriver(quant.model, quant.config), ModelDriver(ref.model, ref.config)
    for p in prompts:
        torch.testing.assert_close(qd.logits_of(p), rd.logits_of(p), rtol=1e-4, atol=1e-4)
    ours = qd.greedy(prompts, 8)
    assert ours == rd.greedy(prompts, 8)
    if fmt in ("awq", "ct-int4-asym"):  # and transformers on the dequantized weights
        hf = load_hf(ddir)
        assert [hf_greedy(hf, p, 8) for p in prompts] == ours


def test_what_is_not_read_is_refused(tiny, tmp_path):
    qdir, _ = write_quantized(tiny, tmp_path, "gptq")
    with pytest.raises(ValueError, match="quantized already"):
        load_model(qdir, "float32", quantization="int8")
    cfg_path = Path(qdir) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for change, match in (
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
        ({"bits": 3}, "only 4-bit"),
    ):
        cfg_path.write_text(
            json.dumps({**cfg, "quantization_config": {**cfg["quantization_config"], **change}})
        )
        with pytest.raises(ValueError, match=match):
            load_model(qdir, "float32")
    # act order: a g_idx that is not in group order
    cfg_path.write_text(json.dumps(cfg))
    tensors = load_file(str(Path(qdir) / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("g_idx"))
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(Path(qdir) / "model.safetensors"))
    with pytest.raises(ValueError, match="act-order"):
        load_model(qdir, "float32")


def test_tensor_parallel_ranks_cut_an_awq_checkpoint_along_whole_groups(tiny, tmp_path):
    from radixserve.workers.distributed.launch import run_ranks
    from tests.tp_ranks import greedy_on_rank

    qdir, _ = write_quantized(tiny, tmp_path, "awq")
    prompts = [[1, 5, 9, 200, 31], [7, 7, 300]]
    single = load_model(qdir, "float32")
    driver = ModelDriver(single.model, single.config)
    ranks = run_ranks(greedy_on_rank, 2, qdir, 2, 1, prompts, 6)
    projections = sorted(
        n for n, m in single.model.named_modules() if isinstance(m, Linear) and n != "lm_head"
    )
    for r in ranks:  # o_proj / down_proj split their 256 / 512 input features at a group boundary
        assert r["quantized"] == projections
        torch.testing.assert_close(r["logits"], driver.logits_of(prompts[0]), rtol=1e-4, atol=1e-4)
        assert r["tokens"] == driver.greedy(prompts, 6)
