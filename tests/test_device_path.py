"""The engine's GPU path, the parts of it that run on this CPU, and the rest where CUDA is visible.

Here, on CPU tensors:
- the Triton attention backend through the whole engine (its kernels interpreted): batched greedy
  output, a cached prompt, a json_schema request and an abort equal the fused CPU backend's;
- the torch backend (flash-attn varlen or SDPA, and batched-matmul decode) likewise, on a tiny
  model, and the Triton backend on every rank of a tp 2 engine;
- the decode graphs' static buffers and padding, run without graphs: equal output, every bucket
  replayed, the KV invariant kept although the padding rows write slot 0.

With CUDA (load_tests/gpu_check.sh runs this module on a GPU): the engine on the GPU equals
transformers in float32, CUDA graphs equal eager decode, the default model serves a json_schema
request and an abort in bf16, the pool is sized from the GPU's memory, fp8 weights compute with
torch._scaled_mm (where the GPU has fp8 tensor cores), an fp8 KV cache tracks the bf16 cache, and
with two GPUs a tp 2 engine over NCCL equals one GPU's. A test that needs more GPUs than the host
has skips, naming torch.cuda.device_count().

Every engine here names its device: a GPU host resolves "auto" to its GPU, where a reference on the
cpu attention backend cannot start.
"""

from __future__ import annotations

import os

import pytest
import torch

from radixserve.workers import Engine
from radixserve.workers.distributed import device
from radixserve.workers.executor.cuda_graphs import graph_buckets
from tests.engine_utils import assert_kv_invariant, hf_greedy
from tests.test_tp_engine import scenario
from tests.tiny_models import make_tiny_checkpoint

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = [
    "Hello there",
    "A somewhat longer prompt, of more tokens than a chunk of sixteen holds, to be chunked",
    "x",
    "Hello there, and more",  # shares a prefix with the first
]


# Set to 1 (load_tests/gpu_check.sh --dry-run does), "auto" resolves as on a host with one GPU: a
# test that leaves an engine's device to "auto" fails on this CPU as it would there (it asks for a
# GPU), and one that needs two GPUs skips as it would there.
AS_GPU_HOST = "GPU_CHECK_AS_GPU_HOST"


@pytest.fixture(autouse=True)
def _as_gpu_host(monkeypatch):
    if os.environ.get(AS_GPU_HOST) == "1":
        monkeypatch.setattr(device, "gpu_count", lambda: 1)


def _needs_gpus(n: int) -> None:
    """Skip unless the host has `n` GPUs (as "auto" sees them) and torch can compute on them."""
    count = device.gpu_count()
    if count < n:
        pytest.skip(f"needs {n} CUDA GPU{'s' * (n > 1)}; torch.cuda.device_count() is {count}")
    if not torch.cuda.is_available():
        pytest.skip(f"{AS_GPU_HOST}=1 answers as a GPU host, but there is no GPU to compute on")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def _outputs(engine: Engine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outs = [o["output_ids"] for o in engine.generate(prompts, params)]
    assert_kv_invariant(engine)
    return outs


def _greedy(path, *, device: str, **kwargs) -> list[list[int]]:
    """Every engine here names its device: left at "auto", a reference on the cpu backend would
    land on the GPU of a GPU host and fail there."""
    engine = Engine(
        str(path), device=device, dtype="float32", max_total_tokens=2048, chunked_prefill_size=16, **kwargs
    )
    try:
        return _outputs(engine)
    finally:
        engine.shutdown()


def test_triton_backend_equals_the_cpu_backend(tmp_path):
    """Three query heads per KV head, as the default model has (its 30 layers would take a minute
    interpreted)."""
    path = make_tiny_checkpoint(
        tmp_path,
        "llama",
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    common = dict(device="cpu", dtype="float32", max_total_tokens=4096, chunked_prefill_size=16)
    results = {}
    for backend in ("cpu", "triton"):
        engine = Engine(path, attention_backend=backend, **common)
        try:
            assert engine.stats()["attention_backend"] == backend
            results[backend] = scenario(engine)
        finally:
            engine.shutdown()
    assert results["triton"] == results["cpu"]
    assert results["cpu"]["cached"] and results["cpu"]["abort"] == "abort"


def test_torch_backend_equals_the_cpu_backend(tiny):
    ours = _greedy(tiny, device="cpu", attention_backend="torch")
    assert ours == _greedy(tiny, device="cpu", attention_backend="cpu")


def test_tp2_on_the_triton_backend_equals_tp1(tiny):
    """Every rank builds the backend it is given: the followers attend with Triton too."""
    ref = _greedy(tiny, device="cpu", attention_backend="cpu")
    assert _greedy(tiny, device="cpu", attention_backend="triton", tp_size=2, num_threads=1) == ref


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_buffers_and_padding_without_graphs(tiny, backend):
    """Batches of 1-4 sequences through buckets 1, 2, 4: three sequences pad one row, which
    writes slot 0 and reads it; the output equals eager decode and the KV stays accounted for."""
    ref = _greedy(tiny, device="cpu", attention_backend=backend)
    engine = Engine(
        str(tiny),
        device="cpu",
        dtype="float32",
        max_total_tokens=2048,
        chunked_prefill_size=16,
        attention_backend=backend,
    )
    try:
        graphs = engine.core.runner.capture_decode_graphs(4, eager=True)
        assert graphs.buckets == [1, 2, 4]
        assert _outputs(engine) == ref
        assert _outputs(engine, PROMPTS[:3]) == ref[:3]  # 3 rows in bucket 4
        assert _outputs(engine, PROMPTS[:1]) == ref[:1]
        assert graphs.replayed >= 3 * (GREEDY["max_new_tokens"] - 1)
        assert engine.stats()["cuda_graph_replays"] == graphs.replayed
    finally:
        engine.shutdown()


def test_auto_is_the_gpu_where_torch_sees_one(monkeypatch, tiny):
    """Where a GPU is seen, an engine left at "auto" goes to it: one on the cpu attention backend
    does not start (here, without the GPU, it fails asking for it)."""
    monkeypatch.setattr(device, "gpu_count", lambda: 0)
    assert device.device_kind("auto") == "cpu"
    monkeypatch.setattr(device, "gpu_count", lambda: 1)
    assert device.device_kind("auto") == "cuda" and device.device_kind("cpu") == "cpu"
    if torch.cuda.is_available():
        error, text = ValueError, "the cpu attention backend runs on CPU only, not on cuda"
    else:
        error, text = RuntimeError, "--device cuda was asked for, but"
    with pytest.raises(error, match=text):
        Engine(str(tiny), attention_backend="cpu", dtype="float32", max_total_tokens=2048)


# On a GPU ---------------------------------------------------------------------------------------
def test_cuda_engine_equals_transformers_float32(tiny):
    _needs_gpus(1)
    engine = Engine(str(tiny), device="cuda", dtype="float32", max_total_tokens=2048, chunked_prefill_size=16)
    try:
        core = engine.core
        assert core.device.type == "cuda" and core.pool.k_buffers[0].is_cuda
        assert core.overlap and core.runner.graphs is not None  # the CUDA defaults
        assert engine.stats()["attention_backend"] == "triton" and engine.stats()["device"] == "cuda:0"
        prompt_ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        outs = [o["output_ids"] for o in engine.generate(input_ids=prompt_ids, sampling_params=GREEDY)]
        assert core.runner.graphs.replayed > 0
        assert_kv_invariant(engine)
    finally:
        engine.shutdown()
    assert outs == hf_greedy(str(tiny), prompt_ids, GREEDY["max_new_tokens"])


def test_cuda_graphs_equal_eager_decode():
    """The default model in bf16: 1, 3 and 5 concurrent sequences (padded buckets 1, 4, 8). The
    torch backend runs eagerly (its decode would gather the graph's whole width)."""
    _needs_gpus(1)
    torch_backend = Engine(device="cuda", attention_backend="torch", max_total_tokens=100_000)
    try:
        assert torch_backend.core.runner.graphs is None
    finally:
        torch_backend.shutdown()
    results = {}
    for graphs in (True, False):
        engine = Engine(device="cuda", disable_cuda_graph=not graphs, max_total_tokens=100_000)
        try:
            assert (engine.core.runner.graphs is not None) == graphs
            prompts = [*PROMPTS, "Once upon a time"]
            results[graphs] = [_outputs(engine, prompts[:n]) for n in (1, 3, 5)]
        finally:
            engine.shutdown()
    assert results[True] == results[False]


def test_cuda_default_model_serves_json_and_aborts():
    """The pool sized from the GPU's memory: 0.85 of it holds what is in use plus the KV."""
    _needs_gpus(1)
    free, total = torch.cuda.mem_get_info()
    engine = Engine(device="cuda", chunked_prefill_size=16)
    try:
        core = engine.core
        kv_bytes = sum(b.nbytes for b in core.pool.k_buffers + core.pool.v_buffers)
        assert kv_bytes <= 0.85 * total - (total - free)
        assert kv_bytes > 0.5 * free  # most of the free memory holds KV
        out = scenario(engine)
        assert out["cached"] and out["abort"] == "abort" and out["json_finish"] == "stop"
    finally:
        engine.shutdown()


def test_cuda_tp2_equals_tp1(tiny):
    """Rank r on GPU r, NCCL between the ranks: greedy output equals one GPU's."""
    _needs_gpus(2)
    ref = _greedy(tiny, device="cuda")
    assert _greedy(tiny, device="cuda", tp_size=2) == ref


def test_cuda_fp8_weights_compute_with_scaled_mm():
    """--quantization fp8 on a GPU with fp8 tensor cores: each projection runs torch._scaled_mm
    (row-wise scales from compute capability 9.0, one scale each on 8.9) within bf16 rounding of
    the e4m3 reference product; the default model so quantized tracks its bf16 logits and serves."""
    from radixserve.kernels.fp8_ops import Fp8Tensor, fp8_reference_linear, quantize_fp8, scaled_mm_mode
    from radixserve.workers.models.linear import Linear
    from radixserve.workers.models.quant_weight import weight_nbytes

    _needs_gpus(1)
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"no fp8 tensor cores: compute capability {torch.cuda.get_device_capability()}")
    qt = quantize_fp8(torch.randn(256, 512, device="cuda"))
    x = torch.randn(33, 512, device="cuda", dtype=torch.bfloat16)
    rowwise = scaled_mm_mode(x, qt) == "row"
    if not rowwise:
        qt = Fp8Tensor(qt.qweight, qt.scale[:1].expand(256).contiguous())
        assert scaled_mm_mode(x, qt) == "tensor"
    ref = fp8_reference_linear(x, qt, rowwise)
    assert (qt.linear(x).float() - ref).norm() / ref.norm() < 1e-2
    text = "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Rome is"
    params = {
        "max_new_tokens": GREEDY["max_new_tokens"],
        "temperature": 0,
        "ignore_eos": True,
        "logprob_start_len": 1,
    }
    runs = {}
    for quantization in ("none", "fp8"):
        engine = Engine(device="cuda", quantization=quantization, max_total_tokens=100_000)
        try:
            out = engine.generate(text, params)
            assert_kv_invariant(engine)
            linears = [m for m in engine.core.runner.model.modules() if isinstance(m, Linear)]
            parts = [p for m in linears if m.quantized is not None for p in m.quantized.parts]
            runs[quantization] = (out, parts, weight_nbytes(engine.core.runner.model))
        finally:
            engine.shutdown()
    (ref, none_parts, ref_bytes), (got, parts, got_bytes) = runs["none"], runs["fp8"]
    assert not none_parts and parts and all(isinstance(p, Fp8Tensor) for p in parts)
    assert got_bytes < 0.6 * ref_bytes
    assert len(got["output_ids"]) == GREEDY["max_new_tokens"]
    # the prompt's logprobs under fp8 weights and activations stay near bf16's
    lp = [[v for v, _, _ in r["meta_info"]["input_token_logprobs"]] for r in (ref, got)]
    assert len(lp[0]) == len(lp[1]) > 10
    assert sum(abs(a - b) for a, b in zip(*lp)) / len(lp[0]) < 0.25


def test_cuda_fp8_kv_cache_tracks_the_bf16_cache():
    """--kv-cache-dtype fp8_e4m3 on a GPU: the compiled Triton kernels read e4m3 tiles widened to
    bf16 (scale 1.0: the default model's checkpoint has no KV scales); CUDA graphs replay over
    it, the prompt's logprobs stay near the bf16 cache's and the idle invariant holds."""
    from radixserve.workers.mem_cache.kv_pool import FP8

    _needs_gpus(1)
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ValueError, match="compute capability 8.9"):
            Engine(device="cuda", kv_cache_dtype="fp8_e4m3", max_total_tokens=1000)
        pytest.skip(f"no e4m3 in Triton: compute capability {torch.cuda.get_device_capability()}")
    text = "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Rome is"
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "logprob_start_len": 1}
    runs = {}
    for kv in ("auto", "fp8_e4m3"):
        engine = Engine(device="cuda", kv_cache_dtype=kv, max_total_tokens=100_000)
        try:
            out = engine.generate(text, params)
            again = engine.generate(text, {k: v for k, v in params.items() if k != "logprob_start_len"})
            assert again["meta_info"]["cached_tokens"] > 10 and again["output_ids"] == out["output_ids"]
            assert_kv_invariant(engine)
            runs[kv] = (out, engine.core.pool.k_buffers[0].dtype)
        finally:
            engine.shutdown()
    (ref, ref_dtype), (got, dtype) = runs["auto"], runs["fp8_e4m3"]
    assert (ref_dtype, dtype) == (torch.bfloat16, FP8)
    lp = [[v for v, _, _ in r["meta_info"]["input_token_logprobs"]] for r in (ref, got)]
    assert len(lp[0]) == len(lp[1]) > 10
    assert sum(abs(a - b) for a, b in zip(*lp)) / len(lp[0]) < 0.1
