"""Quantized weights: the group-quantized kernels (4 and 8 bits, scales and offsets per group;
AVX-512, AVX2 or the plain loop, whichever this CPU built) against dequantize-then-matmul in
float32; per-channel int8 quantized at load; GGUF's block formats repacked value for value
(against the gguf package's own dequantization) and models computed from a GGUF file's blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from radixserve.kernels import cpu_ops, quant_ops
from radixserve.kernels.quant_ops import QuantTensor, pack_int4, unpack_int4
from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.models import gguf_weights
from radixserve.workers.models.linear import FusedLinear, Linear
from radixserve.workers.models.loader import load_model
from radixserve.workers.models.parallel_layers import VocabParallelEmbedding
from radixserve.workers.models.quant_weight import QuantWeight
from tests.model_driver import ModelDriver
from tests.tiny_models import make_tiny_checkpoint, make_tiny_gguf, random_blocks

native = pytest.mark.skipif(cpu_ops.native_ops() is None, reason="CPU extension not built")


def random_quant(
    n: int, k: int, bits: int, group: int, offset: bool, seed: int = 0, half: bool = False
) -> QuantTensor:
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    # Values a float16 holds, as every format's scales are (float16 fields, or their products with
    # small integers): scale * q is then exact, and any order of the dequantization's two roundings
    # (fused multiply-add or not) gives the same weight.
    scale = (torch.rand(n, groups, generator=g) * 0.1 + 0.01).half().float()
    off = ((torch.rand(n, groups, generator=g) - 0.5) * 0.4).half().float() if offset else None
    if half:
        scale, off = scale.half(), None if off is None else off.half()
    if bits == 4:
        q = pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
    else:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return QuantTensor(q, scale, off, group, bits)


def _reference(x: torch.Tensor, qt: QuantTensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ quant_ops.dequantize_torch(qt).T  # dequantize, then matmul in float32
    return y if bias is None else y + bias


# ------------------------------------------------------------------ the format and the kernels


def test_int4_packing_is_blocks_of_32_low_then_high_nibbles():
    values = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    packed = pack_int4(values)
    assert packed.shape == (1, 32)
    # byte t of block b: element 32b + t (low nibble), element 32b + t + 16 (high nibble)
    assert int(packed[0, 0]) == int(values[0, 0]) | int(values[0, 16]) << 4
    assert int(packed[0, 17]) == int(values[0, 33]) | int(values[0, 49]) << 4
    assert torch.equal(unpack_int4(packed), values)
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.full((1, 32), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="blocks of 32"):
        pack_int4(torch.zeros(1, 16, dtype=torch.uint8))


def test_quant_tensor_validates_its_layout():
    q = torch.zeros(4, 32, dtype=torch.uint8)
    QuantTensor(q, torch.ones(4, 2), None, 32, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantTensor(q, torch.ones(4, 4), None, 16, 4)
    with pytest.raises(ValueError, match=r"scale must be \[4, 2\]"):
        QuantTensor(q, torch.ones(4, 3), None, 32, 4)
    with pytest.raises(ValueError, match="float32 or float16"):
        QuantTensor(q, torch.ones(4, 2, dtype=torch.bfloat16), None, 32, 4)
    with pytest.raises(ValueError, match="offset must be"):
        QuantTensor(q, torch.ones(4, 2), torch.ones(4, 2, dtype=torch.float16), 32, 4)
    with pytest.raises(ValueError, match="int8"):
        QuantTensor(q, torch.ones(4, 2), None, 32, 8)


def test_int8_quantizer_values_are_round_to_nearest_of_the_row_scale():
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [-3.0, 1.5, 0.7, 2.999]])
    qt = quant_ops.quantize_int8(w)
    assert qt.scale[:, 0].tolist() == pytest.approx([1.0 / 127, 1.0, 3.0 / 127], rel=1e-7)
    assert (qt.bits, qt.group, qt.offset) == (8, 4, None)
    assert qt.qweight.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0], [-127, 64, 30, 127]]
    err = (quant_ops.dequantize_torch(qt) - w).abs()
    assert bool((err <= qt.scale / 2 + 1e-7).all())
    bf = torch.randn(5, 7).to(torch.bfloat16)  # bf16 weights quantize from their float values
    a, b = quant_ops.quantize_int8(bf), quant_ops.quantize_int8(bf.float())
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scale, b.scale)


LAYOUTS = [  # bits, K, group, offset, float16 scales: GGUF's 32 and 16, AWQ's 128, per-channel
    (4, 256, 32, True, False),
    (4, 256, 32, True, True),
    (4, 256, 128, True, True),
    (4, 64, 32, False, False),
    (8, 256, 32, False, True),
    (8, 96, 16, True, False),
    (8, 576, 576, False, False),
    (8, 37, 37, False, False),  # tails of the 16-wide loops
    (8, 8, 8, True, True),
]


@native
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 17])
def test_fused_kernel_equals_dequantize_then_matmul(layout, rows):
    bits, k, group, offset, half = layout
    qt = random_quant(45, k, bits, group, offset, seed=rows, half=half)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(45) if rows % 2 else None
    y = cpu_ops.native_ops().quant_linear(x, qt.qweight, qt.scale, qt.offset, group, bits, bias)
    assert y.dtype == torch.float32 and y.shape == (rows, 45)
    ref = _reference(x, qt, bias)
    # float32 summation orders differ: a few ulps of the sum of k products
    atol = 4e-6 * k**0.5 * float(ref.abs().max().clamp(min=1)) ** 0.5
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=atol)
    assert torch.equal(qt.dequantize(), quant_ops.dequantize_torch(qt))  # the native dequantization
    rows_idx = torch.tensor([3, 0, 44, 3])
    assert torch.equal(qt.dequantize(rows=rows_idx), quant_ops.dequantize_torch(qt)[rows_idx])


@native
def test_fused_kernel_takes_bf16_activations_and_rounds_once():
    qt = random_quant(64, 128, 4, 32, True, seed=1)
    x = torch.randn(3, 128).to(torch.bfloat16)
    y = cpu_ops.native_ops().quant_linear(x, qt.qweight, qt.scale, qt.offset, 32, 4, None)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, _reference(x, qt, None).to(torch.bfloat16), rtol=0, atol=0.02)
    assert torch.equal(qt.dequantize(torch.bfloat16), quant_ops.dequantize_torch(qt).to(torch.bfloat16))


BF16_LAYOUTS = [  # 4-bit K, group, offset, float16 scales: whole chunks of four blocks and tails
    (576, 32, True, True),  # the default model's Q4_1: 4.5 chunks a row
    (512, 32, True, False),
    (160, 32, False, True),
    (256, 128, True, True),  # AWQ / GPTQ groups: one scale over four blocks
    (384, 64, False, False),
]


@native
@pytest.mark.parametrize("layout", BF16_LAYOUTS, ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9])
def test_bf16_activations_on_4_bit_weights_round_the_exact_sum_once(layout, rows):
    """bf16 rows of x against 4-bit weights (the bf16 dot-product path where the CPU has it, the
    float path elsewhere): the exact products' sum, rounded to bf16 once, up to float32 rounding
    of the sum, so within an ulp of the float64 reference."""
    k, group, offset, half = layout
    qt = random_quant(70, k, 4, group, offset, seed=rows, half=half)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + rows)).to(torch.bfloat16)
    bias = torch.randn(70) if rows % 2 else None
    y = cpu_ops.native_ops().quant_linear(x, qt.qweight, qt.scale, qt.offset, group, 4, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 70)
    ref = x.double() @ quant_ops.dequantize_torch(qt).double().T + (0 if bias is None else bias.double())
    ulp = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp(min=1e-30))) - 7)
    assert bool(((y.double() - ref).abs() <= ulp + 1e-6 * k).all())


@native
def test_fused_kernel_rejects_bad_operands():
    qt = random_quant(4, 32, 8, 16, False)
    ops = cpu_ops.native_ops()
    with pytest.raises(RuntimeError, match="disagree on K"):
        ops.quant_linear(torch.randn(1, 31), qt.qweight, qt.scale, None, 16, 8, None)
    with pytest.raises(RuntimeError, match="int8"):
        ops.quant_linear(torch.randn(1, 32), qt.qweight.float(), qt.scale, None, 16, 8, None)
    with pytest.raises(RuntimeError, match="scale"):
        ops.quant_linear(torch.randn(1, 32), qt.qweight, qt.scale[:3], None, 16, 8, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.quant_linear(
            torch.randn(1, 32), qt.qweight[:, :16].contiguous().view(torch.uint8), qt.scale, None, 16, 4, None
        )
    with pytest.raises(RuntimeError, match="out of range"):
        ops.quant_dequantize(qt.qweight, qt.scale, None, 16, 8, torch.tensor([4]), torch.float32)


@pytest.mark.parametrize("bits", [4, 8])
def test_dispatch_either_side_of_the_crossover_equals_the_reference(bits):
    below = quant_ops.DEQUANT_ROWS[bits]
    qt = random_quant(33, 64, bits, 32, True, seed=bits)
    bias = torch.randn(33)
    for rows in (1, below - 1, below, 40):
        x = torch.randn(2, rows, 64)  # leading dims are flattened and restored
        y = qt.linear(x, bias)
        assert y.shape == (2, rows, 33)
        ref = _reference(x.reshape(-1, 64), qt, bias).view(2, rows, 33)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_a_quantized_linear_computes_through_its_weight_parts():
    torch.manual_seed(0)
    layer = FusedLinear(64, [(0, 32), (0, 16), (0, 16)], bias=True, dtype=torch.float32)
    parts = [
        random_quant(32, 64, 4, 32, True, 1),
        random_quant(16, 64, 4, 32, True, 2),
        random_quant(16, 64, 8, 16, False, 3),
    ]
    bias = torch.randn(64)
    for i, p in enumerate(parts):
        layer.load_checkpoint("weight", quant_ops.dequantize_torch(p), part=i)
    quantized = QuantWeight(parts, bias)
    assert len(quantized.parts) == 2 and quantized.bounds == [0, 48, 64]  # q and k joined, v apart
    assert torch.equal(quantized.dequantize(), layer.weight.detach())
    layer.quantize_(quantized)
    assert layer.weight is None and layer.bias is None and not layer.pack_(None)
    x = torch.randn(3, 64)
    ref = x @ quantized.dequantize().T + bias
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="quantized"):
        layer.load_checkpoint("weight", torch.zeros(32, 64), part=0)


# ------------------------------------------------------------------ int8 at load


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("int8"), "llama", attention_bias=True)


PROMPTS = [[1, 5, 9, 200, 31], [7, 7, 300], [2] * 11]


def test_int8_model_equals_the_model_with_dequantized_weights(tiny_llama):
    quant = load_model(tiny_llama, "float32", quantization="int8")
    ref = load_model(tiny_llama, "float32")
    qlayers = {n: m for n, m in quant.model.named_modules() if isinstance(m, Linear)}
    assert qlayers and all(m.quantized is not None for m in qlayers.values())
    for name, module in ref.model.named_modules():
        if isinstance(module, Linear):
            module.weight.data.copy_(qlayers[name].quantized.dequantize())
    table = quant.model.model.embed_tokens.quantized  # one scale per token's row
    assert table is not None and (table.bits, table.group) == (8, quant.config.hidden_size)
    ref.model.model.embed_tokens.weight.data.copy_(table.dequantize())
    qd, rd = ModelDriver(quant.model, quant.config), ModelDriver(ref.model, ref.config)
    for p in PROMPTS:
        torch.testing.assert_close(qd.logits_of(p), rd.logits_of(p), rtol=1e-4, atol=1e-4)
    assert qd.greedy(PROMPTS, 8) == rd.greedy(PROMPTS, 8)


def test_bad_quantization_settings_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        load_model(tiny_llama, "float32", quantization="int4")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(tiny_llama, "float32", quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="fp4")
    with pytest.raises(ValueError, match="not fp8 ones"):
        EngineConfig(quantization="fp8", quantized_activations="int8")
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(quantization="gguf", deterministic=True)


def test_the_engine_serves_int8_weights_as_the_loaded_model_computes_them(tiny_llama):
    _engine_matches_loaded(tiny_llama, "int8")


def _engine_matches_loaded(model_path: str, quantization: str) -> None:
    from radixserve.workers import Engine
    from tests.engine_utils import assert_kv_invariant

    loaded = load_model(model_path, "float32", quantization=quantization)
    expected = ModelDriver(loaded.model, loaded.config).greedy(PROMPTS, 8)
    engine = Engine(model_path, dtype="float32", quantization=quantization, max_total_tokens=2048)
    try:
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        got = engine.generate(input_ids=PROMPTS, sampling_params=params)
        assert [o["output_ids"] for o in got] == expected
        assert_kv_invariant(engine)
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ GGUF's blocks


GGUF_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_blocks_repack_to_the_gguf_packages_values(type_name):
    import gguf
    from gguf.quants import dequantize

    raw = random_blocks(type_name, 6, 512, seed=len(type_name))
    qtype = gguf.GGMLQuantizationType[type_name]
    expected = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    qt = gguf_weights.decode_blocks(int(qtype), torch.from_numpy(raw), 512)
    assert torch.equal(quant_ops.dequantize_torch(qt), expected)
    assert torch.equal(qt.dequantize(), expected)
    assert qt.bits == (4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8)
    # the file's float16 scales stay float16; a K-quant's products of two scales need float32
    assert qt.scale.dtype == (torch.float32 if type_name.endswith("_K") else torch.float16)
    per_weight = {4: 0.5, 8: 1.0}[qt.bits] + (
        2 if qt.offset is not None else 1
    ) * qt.scale.element_size() / qt.group
    assert qt.nbytes == pytest.approx(expected.numel() * per_weight)


def test_llama_rows_undo_llama_cpps_interleave():
    from tests.tiny_models import _llama_cpp_permute

    w = torch.arange(24 * 3, dtype=torch.float32).reshape(24, 3)
    stored = _llama_cpp_permute(w, 3)
    assert torch.equal(stored[gguf_weights.llama_rows(24, 3)], w)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny llama in a GGUF mix (K-quants need rows of 256): q/k Q4_K, v Q6_K, o Q5_0, gate
    Q4_1, up Q5_K, down Q8_0, the tied embedding Q4_0, norms F32."""
    root = tmp_path_factory.mktemp("gguf")
    hf = make_tiny_checkpoint(
        root,
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    types = {
        "attn_q": "Q4_K",
        "attn_k": "Q4_K",
        "attn_v": "Q6_K",
        "attn_output": "Q5_0",
        "ffn_gate": "Q4_1",
        "ffn_up": "Q5_K",
        "ffn_down": "Q8_0",
        "token_embd": "Q4_0",
    }
    return make_tiny_gguf(root, hf, quant_types=types)


def test_the_tensor_index_finds_what_ggufs_own_reader_finds(tiny_gguf, tmp_path):
    import gguf
    import numpy as np

    from radixserve.workers.models.loader import default_gguf_path

    for path in (default_gguf_path(), Path(tiny_gguf)):
        reader = gguf.GGUFReader(str(path))
        meta, tensors = gguf_weights.tensor_index(path)
        assert meta["general.architecture"] == reader.fields["general.architecture"].contents()
        data = np.memmap(path, dtype=np.uint8, mode="r")
        assert [t.name for t in tensors] == [t.name for t in reader.tensors]
        for ours, theirs in zip(tensors, reader.tensors):
            assert ours.type_id == int(theirs.tensor_type) and ours.dims == tuple(map(int, theirs.shape))
            assert (ours.offset, ours.nbytes) == (theirs.data_offset, theirs.n_bytes)
            assert np.array_equal(
                data[ours.offset : ours.offset + ours.nbytes], theirs.data.reshape(-1).view(np.uint8)
            )
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_weights.tensor_index(Path(__file__))
    big_endian = tmp_path / "big-endian.gguf"
    big_endian.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + bytes(16))
    with pytest.raises(ValueError, match="version 50331648 is not read"):
        gguf_weights.tensor_index(big_endian)


def test_a_gguf_model_computes_from_its_blocks_as_the_dequantized_model(tiny_gguf):
    quant = load_model(tiny_gguf, "float32", quantization="gguf")
    ref = load_model(tiny_gguf, "float32")
    modules = dict(quant.model.named_modules())
    assert isinstance(modules["model.embed_tokens"], VocabParallelEmbedding)
    assert modules["model.embed_tokens"].quantized is not None and quant.model.lm_head.quantized is not None
    linears = [m for m in modules.values() if isinstance(m, Linear)]
    assert all(m.quantized is not None for m in linears)
    qkv = modules["model.layers.0.self_attn.qkv_proj"].quantized
    assert [p.bits for p in qkv.parts] == [4, 8]  # Q4_K q+k joined, Q6_K v apart
    qd, rd = ModelDriver(quant.model, quant.config), ModelDriver(ref.model, ref.config)
    for p in PROMPTS:
        torch.testing.assert_close(qd.logits_of(p), rd.logits_of(p), rtol=1e-4, atol=1e-4)
    assert qd.greedy(PROMPTS, 8) == rd.greedy(PROMPTS, 8)
    held = sum(t.numel() * t.element_size() for t in quant.model.buffers()) + sum(
        p.numel() * p.element_size() for p in quant.model.parameters()
    )
    dense = sum(p.numel() * p.element_size() for p in ref.model.parameters())
    assert held < 0.35 * dense


def test_the_engine_serves_a_gguf_model_from_its_blocks(tiny_gguf):
    _engine_matches_loaded(tiny_gguf, "gguf")


def test_the_default_model_from_its_q4_1_blocks_agrees_with_the_dequantized_model():
    quant = load_model(None, "float32", quantization="gguf")
    ref = load_model(None, "float32")
    linears = [m for m in quant.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 30 * 4 + 1 and all(m.quantized is not None for m in linears)
    assert quant.model.model.embed_tokens.quantized.bits == 8  # the file's Q8_0 embedding
    qd, rd = ModelDriver(quant.model, quant.config), ModelDriver(ref.model, ref.config)
    prompt = quant.tokenizer("The capital of France is")["input_ids"]
    torch.testing.assert_close(qd.logits_of(prompt), rd.logits_of(prompt), rtol=1e-3, atol=1e-3)
    assert qd.greedy([prompt], 8) == rd.greedy([prompt], 8)


def test_tensor_parallel_ranks_cut_the_gguf_blocks_along_whole_groups(tiny_gguf):
    from radixserve.workers.distributed.launch import run_ranks
    from tests.tp_ranks import greedy_on_rank

    prompts = [[1, 5, 9, 200, 31], [7, 7, 300]]
    single = load_model(tiny_gguf, "float32", quantization="gguf")
    driver = ModelDriver(single.model, single.config)
    ranks = run_ranks(greedy_on_rank, 2, tiny_gguf, 2, 1, prompts, 6, "float32", "gguf")
    every = sorted(n for n, m in single.model.named_modules() if isinstance(m, Linear))
    for r in ranks:  # every projection and the LM head compute from the rank's slice of the blocks
        assert r["quantized"] == every
        torch.testing.assert_close(r["logits"], driver.logits_of(prompts[0]), rtol=1e-4, atol=1e-4)
        assert r["tokens"] == driver.greedy(prompts, 6)


def test_auto_computes_a_gguf_model_from_its_blocks_unless_a_dtype_is_asked_for(tiny_llama, tiny_gguf):
    from radixserve.workers.models.loader import resolve_quantization

    assert resolve_quantization("auto", None, None) == "gguf"  # the embedded default
    assert resolve_quantization("auto", tiny_gguf, "auto") == "gguf"
    assert resolve_quantization("auto", tiny_gguf, "float32") == "none"  # the dequantized path
    assert resolve_quantization("auto", tiny_gguf, None, deterministic=True) == "none"
    assert resolve_quantization("auto", tiny_gguf, None, device="cuda") == "none"
    assert resolve_quantization("auto", tiny_llama, None) == "none"
    assert resolve_quantization("int8", tiny_llama, None) == "int8"
    assert EngineConfig().quantization == "auto"


# ------------------------------------------------------------------ int8 activations

int8_x = pytest.mark.skipif(
    cpu_ops.native_ops() is None or not cpu_ops.native_ops().quant_int8_x_available(),
    reason="the integer kernel needs the CPU extension on an AVX2 CPU",
)


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the integer path rounds it: int8 per block of 32, scale d = max|x| / 127,
    q = round(x * (1 / d)) in float32 (to even at halves)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, 1.0), 0.0)
    return (torch.round(blocks * inv) * scale).reshape(x.shape)


@int8_x
@pytest.mark.parametrize(
    "layout",
    [
        (4, 256, 32, True, True),
        (4, 256, 128, True, False),
        (4, 160, 32, True, True),  # an odd number of blocks (two at a time with AVX-512 VNNI)
        (8, 256, 32, False, True),
        (8, 128, 128, True, False),
        (8, 96, 32, False, False),
    ],
)
@pytest.mark.parametrize("rows", [1, 5, 17, 40])
def test_int8_activations_multiply_the_rounded_rows_exactly(layout, rows):
    bits, k, group, offset, half = layout
    qt = random_quant(40, k, bits, group, offset, seed=rows + bits, half=half)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(40)
    y = cpu_ops.native_ops().quant_linear_int8_x(x, qt.qweight, qt.scale, qt.offset, group, bits, bias)
    scaled = QuantTensor(qt.qweight, qt.scale, None, group, bits)  # scale * q
    if (
        rows < quant_ops.INT8_ACTIVATION_ROWS
    ):  # integers: the rounded rows times scale * q, plus the offsets' exact share
        ref = _int8_rows(x) @ quant_ops.dequantize_torch(scaled).T + bias
        if offset:
            ref += x @ (quant_ops.dequantize_torch(qt) - quant_ops.dequantize_torch(scaled)).T
    else:  # from INT8_ACTIVATION_ROWS rows on, the float path
        ref = _reference(x, qt, bias)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


@int8_x
def test_int8_activations_are_served_as_the_loaded_model_computes_them(tiny_gguf):
    from radixserve.workers import Engine

    loaded = load_model(tiny_gguf, "float32", quantization="gguf", quantized_activations="int8")
    projections = [m.quantized for m in loaded.model.modules() if isinstance(m, Linear)]
    assert projections and all(q.int8_activations for q in projections)
    expected = ModelDriver(loaded.model, loaded.config).greedy(PROMPTS, 8)
    # float32 activations as the loaded model's (the default dtype is bfloat16 on AVX512-BF16 CPUs)
    engine = Engine(
        tiny_gguf, dtype="float32", quantization="gguf", quantized_activations="int8", max_total_tokens=2048
    )
    try:
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        assert [
            o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=params)
        ] == expected
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="has none"):
        load_model(tiny_gguf, "float32", quantized_activations="int8")
    with pytest.raises(ValueError, match="quantized_activations must be one of"):
        EngineConfig(quantized_activations="fp8")


# ------------------------------------------------------------------ strips (bf16 activations)

strips = pytest.mark.skipif(not quant_ops.strips_available(), reason="strips need AVX512-BF16 kernels")

STRIP_LAYOUTS = [  # bits, N, K, group, offset, float16 scales
    (4, 45, 576, 32, True, True),  # the default model's Q4_1 (N not a multiple of 16)
    (4, 64, 256, 128, True, False),  # AWQ / GPTQ groups
    (4, 17, 64, 32, False, True),
    (8, 45, 576, 32, False, True),  # Q8_0
    (8, 33, 96, 16, True, False),  # Q6_K's groups of 16, with an offset (Q5_K)
    (8, 20, 160, 160, False, False),  # per-channel int8
]


def _ulp_close(y: torch.Tensor, ref: torch.Tensor, k: int) -> bool:
    """Within a bf16 ulp of the float64 reference (one rounding of a float32 sum)."""
    ulp = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp(min=1e-30))) - 7)
    return bool(((y.double() - ref).abs() <= ulp + 1e-6 * k).all())


@strips
@pytest.mark.parametrize("layout", STRIP_LAYOUTS, ids=lambda v: "-".join(map(str, v)))
def test_strips_hold_the_quant_tensor_exactly(layout):
    bits, n, k, group, offset, half = layout
    qt = random_quant(n, k, bits, group, offset, seed=n, half=half)
    st = quant_ops.StripTensor.pack(qt)
    assert (st.n, st.k, st.group, st.bits) == (n, k, group, bits)
    back = st.unpack()
    for a, b in zip(back.tensors(), qt.tensors()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    rows = torch.tensor([n - 1, 0, 7, 7])
    assert torch.equal(st.dequantize(rows=rows), qt.dequantize(rows=rows))
    for dtype in (torch.float32, torch.bfloat16):  # the native strip dequantization, bitwise
        assert torch.equal(st.dequantize(dtype), qt.dequantize(dtype))


def _strip_case(layout, rows: int):
    """A random weight of `layout` (STRIP_LAYOUTS) in strips, `rows` bf16 rows of x, a bias or None."""
    bits, n, k, group, offset, half = layout
    qt = random_quant(n, k, bits, group, offset, seed=rows, half=half)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7 + rows)).to(torch.bfloat16)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(rows)) if rows % 2 else None
    return qt, quant_ops.StripTensor.pack(qt), x, bias


@strips
@pytest.mark.parametrize("layout", STRIP_LAYOUTS, ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
def test_the_strip_kernel_rounds_the_exact_sum_once(layout, rows):
    qt, st, x, bias = _strip_case(layout, rows)
    n, k = layout[1], layout[2]
    y = st.linear(x, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    ref = x.double() @ quant_ops.dequantize_torch(qt).double().T + (0 if bias is None else bias.double())
    assert _ulp_close(y, ref, k)


def quantize_like_q8(qt: QuantTensor) -> QuantTensor:
    return quant_ops.quantize_int8(qt.dequantize())


@strips
def test_a_row_through_the_strip_kernel_does_not_depend_on_the_rows_beside_it():
    qt = random_quant(40, 256, 4, 32, True, seed=3, half=True)
    for part in (quant_ops.StripTensor.pack(qt), quant_ops.StripTensor.pack(quantize_like_q8(qt))):
        x = torch.randn(21, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        whole = part.linear(x)
        for i in (0, 15, 16, 20):
            assert torch.equal(part.linear(x[i : i + 1]), whole[i : i + 1])


@strips
def test_strips_dequantize_for_the_gemm_from_their_crossover():
    qt = random_quant(48, 128, 4, 32, True, seed=5, half=True)
    st = quant_ops.StripTensor.pack(qt)
    rows = quant_ops.STRIP_DEQUANT_ROWS
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    bias = torch.randn(48)
    expected = torch.nn.functional.linear(x, qt.dequantize(torch.bfloat16), bias.to(torch.bfloat16))
    assert torch.equal(st.linear(x, bias), expected)
    below = st.linear(x[: rows - 1], bias)  # the strip kernel
    ref = x[: rows - 1].double() @ quant_ops.dequantize_torch(qt).double().T + bias.double()
    assert _ulp_close(below, ref, 128)
    # int8 activations are for the strip kernel's rows; prefill-sized inputs dequantize as above
    if quant_ops.strips_int8_available():
        assert torch.equal(st.linear(x, bias, int8_activations=True), expected)
    else:
        with pytest.raises(ValueError, match="int8"):
            st.linear(x[:2], int8_activations=True)


strips_int8 = pytest.mark.skipif(
    not quant_ops.strips_int8_available(), reason="int8 activations on strips need AVX-512 VNNI"
)


@strips_int8
@pytest.mark.parametrize("layout", STRIP_LAYOUTS, ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
def test_int8_activations_on_strips_multiply_the_rounded_rows_exactly(layout, rows):
    qt, st, x, bias = _strip_case(layout, rows)
    bits, n, k, group, offset, _ = layout
    y = st.linear(x, bias, int8_activations=True)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    if group % 32:  # blocks of 32 do not tile the group: bf16 rows, as without int8 activations
        assert torch.equal(y, st.linear(x, bias))
        return
    # the rounded rows times scale * q as integers, plus the offsets' share from x's exact sums:
    # one bf16 rounding of that sum, in float64
    scaled = quant_ops.dequantize_torch(QuantTensor(qt.qweight, qt.scale, None, group, bits)).double()
    ref = _int8_rows(x).double() @ scaled.T + (0 if bias is None else bias.double())
    if offset:
        ref += x.double() @ (quant_ops.dequantize_torch(qt).double() - scaled).T
    assert _ulp_close(y, ref, k)
    # and each row as if alone: the batch beside it changes nothing
    for i in (0, rows - 1):
        assert torch.equal(st.linear(x[i : i + 1], bias, int8_activations=True), y[i : i + 1])


@strips_int8
def test_int8_activations_on_a_bf16_gguf_model_are_served_from_strips_as_it_computes_them(tiny_gguf):
    from radixserve.workers import Engine

    loaded = load_model(tiny_gguf, "bfloat16", quantization="gguf", quantized_activations="int8")
    weights = [m.quantized for m in loaded.model.modules() if isinstance(m, Linear)]
    assert weights and all(q.int8_activations for q in weights)
    assert all(isinstance(p, quant_ops.StripTensor) for q in weights for p in q.parts)
    expected = ModelDriver(loaded.model, loaded.config).greedy(PROMPTS, 8)
    floats = load_model(tiny_gguf, "bfloat16", quantization="gguf")  # the rounding of x is there to see
    rounded = ModelDriver(loaded.model, loaded.config).logits_of(PROMPTS[0])
    assert not torch.equal(rounded, ModelDriver(floats.model, floats.config).logits_of(PROMPTS[0]))
    engine = Engine(
        tiny_gguf, dtype="bfloat16", quantization="gguf", quantized_activations="int8", max_total_tokens=2048
    )
    try:
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        got = engine.generate(input_ids=PROMPTS, sampling_params=params)
        assert [o["output_ids"] for o in got] == expected
    finally:
        engine.shutdown()


@strips
def test_only_layouts_the_strip_kernel_takes_are_packed():
    odd = random_quant(8, 37, 8, 37, False)  # an 8-bit group that is not a multiple of 16
    assert not quant_ops.StripTensor.fits(odd)
    with pytest.raises(ValueError, match="16"):
        quant_ops.StripTensor.pack(odd)
    weight = QuantWeight([odd], None)
    assert not weight.use_strips_(True) and weight.parts[0] is odd
    assert all(quant_ops.StripTensor.fits(random_quant(16, 64, b, g, False)) for b, g in ((4, 32), (8, 16)))


@strips
def test_int8_activations_keep_strips_only_where_vnni_multiplies_them():
    qt = random_quant(32, 128, 4, 32, True, seed=9, half=True)
    weight = QuantWeight([qt], None)
    assert weight.use_strips_(True) and isinstance(weight.parts[0], quant_ops.StripTensor)
    assert sorted(n for n, _ in weight.named_buffers()) == ["t0_0", "t0_1", "t0_2"]
    strip = weight.parts[0]
    weight.int8_activations = True
    part = weight.parts[0]
    if quant_ops.strips_int8_available():
        assert part is strip
    else:  # laid back in rows, exactly
        assert isinstance(part, QuantTensor) and all(
            torch.equal(a, b) for a, b in zip(part.tensors(), qt.tensors())
        )


@strips
def test_a_bf16_gguf_model_computes_from_strips_without_a_second_copy(tiny_gguf):
    from radixserve.workers.models.quant_weight import use_strips_, weight_nbytes

    quant = load_model(tiny_gguf, "bfloat16", quantization="gguf")
    rows = load_model(tiny_gguf, "bfloat16", quantization="gguf")
    for module in rows.model.modules():  # the same model with its weights back in rows
        if isinstance(module, QuantWeight):
            module.use_strips_(False)
    parts = [p for m in quant.model.modules() if isinstance(m, QuantWeight) for p in m.parts]
    assert parts and all(isinstance(p, quant_ops.StripTensor) for p in parts)
    # the tied LM head and the embedding share one table, in strips
    assert quant.model.model.embed_tokens.quantized is quant.model.lm_head.quantized.parts[0]
    padded = sum(16 * -(-p.n // 16) for p in parts) / sum(p.n for p in parts)  # rows padded to 16
    assert weight_nbytes(quant.model) <= weight_nbytes(rows.model) * padded
    assert use_strips_(quant.model) == 0  # nothing left to pack
    qd, rd = ModelDriver(quant.model, quant.config), ModelDriver(rows.model, rows.config)
    for p in PROMPTS:  # the row kernels' bf16 path against the strips: float32 sums in other orders
        torch.testing.assert_close(qd.logits_of(p), rd.logits_of(p), rtol=0.02, atol=0.02)
