"""The int8 KV cache (kv_cache_dtype int8, kernels/csrc/kv_int8.h): rows of int8 values with a
float32 scale each, stored bitwise as the torch reference quantizes them; the decode and extend
kernels against torch attention over the dequantized rows; the host tier and the pool's sizing;
the engine on the default model against its bf16 cache; and the configurations it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.kernels import cpu_ops
from radixserve.workers import Engine
from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.mem_cache.host_tier import HostTier
from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.models.attention import pool_values
from tests.engine_utils import assert_kv_invariant, mean_logprob_gap, tp_runs
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    not cpu_ops.kv_int8_available(64, 3), reason="the int8 KV kernels need AVX512-BF16 (and the extension)"
)


def randn(*shape, seed=0, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_a_row_holds_its_values_and_their_scale():
    x = randn(5, 3, 64) * 4
    x[2, 1] = 0
    rows = cpu_ops.kv_int8_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 68)
    scale = x.float().abs().amax(-1, keepdim=True) / 127
    assert torch.equal(rows[..., 64:].contiguous().view(torch.float32), scale)
    assert int(rows[..., :64].abs().max()) == 127
    back = cpu_ops.kv_int8_values(rows)
    assert torch.equal(back[2, 1], torch.zeros(64))
    assert bool(((back - x.float()).abs() <= scale / 2 * (1 + 1e-6)).all())  # round to nearest


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_stores_what_the_reference_quantizes(dtype):
    k, v = randn(37, 3, 64, seed=1, dtype=dtype), randn(37, 3, 64, seed=2, dtype=dtype)
    k[4] = 0
    pool = KVPool(1, 3, 64, 64, dtype=torch.int8)
    slots = torch.randperm(63, generator=torch.Generator().manual_seed(3))[:37] + 1
    assert cpu_ops.store_kv_(k, v, pool.k_buffers[0], pool.v_buffers[0], slots)
    assert torch.equal(pool.k_buffers[0][slots], cpu_ops.kv_int8_rows(k))
    assert torch.equal(pool.v_buffers[0][slots], cpu_ops.kv_int8_rows(v))


def int8_pool(slots: int, heads: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        cpu_ops.kv_int8_rows(randn(slots, heads, dim, seed=seed)),
        cpu_ops.kv_int8_rows(randn(slots, heads, dim, seed=seed + 1)),
    )


@pytest.mark.parametrize(("dim", "group"), [(64, 1), (64, 3), (64, 8), (128, 4)])
def test_decode_attention_over_an_int8_pool(dim, group):
    kv_heads, batch = 2, 5
    k_buf, v_buf = int8_pool(300, kv_heads, dim, seed=dim + group)
    q = randn(batch, kv_heads * group, dim, seed=7)
    lens = torch.tensor([1, 3, 4, 77, 250])
    gen = torch.Generator().manual_seed(8)
    idx = torch.zeros(batch, 250, dtype=torch.int64)
    for b in range(batch):
        idx[b, : lens[b]] = torch.randperm(299, generator=gen)[: lens[b]] + 1
    out = cpu_ops.decode_attention(q, k_buf, v_buf, idx, lens)
    assert out.dtype == torch.bfloat16
    ref = cpu_ops.decode_attention_torch(q, k_buf, v_buf, idx, lens)  # over the dequantized rows
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.01, atol=0.01)
    with pytest.raises(RuntimeError, match="fixed-order"):
        cpu_ops.decode_attention(q, k_buf, v_buf, idx, lens, fixed_order=True)


@pytest.mark.parametrize("dim", [64, 128])
def test_extend_attention_over_an_int8_pool(dim):
    """Chunks with and without a cached prefix; bf16 products, as the bf16 pool's kernel."""
    kv_heads, group = 2, 3
    k_buf, v_buf = int8_pool(200, kv_heads, dim, seed=dim)
    seq, new = [70, 5, 33], [10, 5, 33]
    cu = torch.tensor([0, 10, 15, 48])
    idx = torch.zeros(3, 70, dtype=torch.int64)
    perm = torch.randperm(199, generator=torch.Generator().manual_seed(4)) + 1
    at = 0
    for i, n in enumerate(seq):
        idx[i, :n] = perm[at : at + n]
        at += n
    q = randn(48, kv_heads * group, dim, seed=5)
    out = cpu_ops.extend_attention_native(q, k_buf, v_buf, idx, torch.tensor(seq), cu, bf16_products=True)
    assert out is not None
    for i, (n, e) in enumerate(zip(seq, new)):
        keys = pool_values(k_buf, idx[i, :n]).repeat_interleave(group, 1)
        values = pool_values(v_buf, idx[i, :n]).repeat_interleave(group, 1)
        queries = q[cu[i] : cu[i + 1]].float()
        scores = torch.einsum("ehd,lhd->hel", queries, keys) / math.sqrt(dim)
        causal = torch.arange(n)[None] > (n - e + torch.arange(e))[:, None]
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        ref = torch.einsum("hel,lhd->ehd", probs, values)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]].float(), ref, rtol=0.02, atol=0.02)


def test_the_pool_and_the_host_tier_hold_int8_rows_with_their_scales():
    pool = KVPool(2, 3, 64, 100, dtype=torch.int8)
    assert pool.quantized and pool.k_buffers[0].shape == (101, 3, 68)
    per_token = KVPool.bytes_per_token(30, 3, 64, torch.int8)
    assert per_token == 2 * 30 * 3 * 68
    assert per_token / KVPool.bytes_per_token(30, 3, 64, torch.bfloat16) == pytest.approx(0.53, abs=0.01)
    for buf in pool.k_buffers + pool.v_buffers:
        buf[1:].copy_(cpu_ops.kv_int8_rows(randn(100, 3, 64, seed=buf.data_ptr() % 1000)))
    tier = HostTier(pool, 16)
    assert tier.pool.k_buffers[0].shape == (17, 3, 68) and tier.pool.dtype == torch.int8
    host = tier.write_back([5, 6, 7])
    kept = [b[[5, 6, 7]].clone() for b in pool.k_buffers + pool.v_buffers]
    for buf in pool.k_buffers + pool.v_buffers:
        buf[20:23].zero_()
    tier.load(host, [20, 21, 22])
    for buf, want in zip(pool.k_buffers + pool.v_buffers, kept):
        assert torch.equal(buf[20:23], want)
    assert tier.bytes_written == 3 * KVPool.bytes_per_token(2, 3, 64, torch.int8)


TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type made "
    "books cheaper and faster to produce than ever before. Within a few decades presses were at "
    "work in hundreds of European cities, and the spread of printed material changed how people "
    "learned, argued and worshipped. Scholars still debate how quickly literacy rose as a result"
)


def test_the_engine_on_an_int8_cache_tracks_its_bf16_cache():
    """The default model: the pool holds ~1.9x the tokens in the same memory; the prompt's
    logprobs stay near the bf16 cache's; prefix reuse, chunked prefill and the idle invariant as
    ever."""
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "logprob_start_len": 0}
    runs = {}
    for kv in ("auto", "int8"):
        engine = Engine(dtype="bfloat16", kv_cache_dtype=kv, chunked_prefill_size=32, mem_fraction_static=0.3)
        try:
            first = engine.generate(TEXT, params)
            plain = {k: v for k, v in params.items() if k != "logprob_start_len"}
            again = engine.generate(TEXT, plain)  # the prompt from the cache (no prompt logprobs)
            assert again["meta_info"]["cached_tokens"] > 50
            assert again["output_ids"] == first["output_ids"]
            assert_kv_invariant(engine)
            assert engine.stats()["kv_cache_dtype"] == ("int8" if kv == "int8" else "bfloat16")
            runs[kv] = (first, engine.core.pool.size, engine.core.pool.k_buffers[0].dtype)
        finally:
            engine.shutdown()
    (ref, ref_size, ref_dtype), (got, size, dtype) = runs["auto"], runs["int8"]
    assert (ref_dtype, dtype) == (torch.bfloat16, torch.int8)
    assert size / ref_size == pytest.approx(128 / 68, rel=0.02)
    lp = [[v for v, _, _ in r["meta_info"]["input_token_logprobs"][1:]] for r in (ref, got)]
    assert len(lp[0]) == len(lp[1]) > 50
    # per token within a tenth of a nat on average, and no drift in the total (the perplexity:
    # load_tests/bench_quant.py --quantization kv-int8 measures +0.1% over 4k tokens)
    assert sum(abs(a - b) for a, b in zip(*lp)) / len(lp[0]) < 0.1
    assert abs(sum(lp[0]) - sum(lp[1])) / len(lp[0]) < 0.03


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype must be one of"),
        ({"kv_cache_dtype": "int8", "deterministic": True}, "deterministic"),
        ({"kv_cache_dtype": "int8", "attention_backend": "triton"}, "cpu attention backend"),
        ({"kv_cache_dtype": "int8", "device": "cuda"}, "cpu attention backend"),
    ],
)
def test_configurations_it_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_a_float32_model_is_refused_at_start():
    with pytest.raises(ValueError, match="bfloat16 model"):
        Engine(dtype="float32", kv_cache_dtype="int8", max_total_tokens=512)


def test_pd_peers_name_the_int8_cache_in_their_handshake():
    """A transfer moves rows as bytes (their scales within them); a peer whose cache differs is
    refused at the handshake."""
    from radixserve.workers.disaggregation.spec import HandshakeMismatch, KVSpec, check_peer

    specs = {
        dtype: KVSpec.for_pool(KVPool(2, 3, 64, 16, dtype=dtype), "m", "fp", "gloo")
        for dtype in (torch.int8, torch.bfloat16)
    }
    assert specs[torch.int8].dtype == "int8"
    check_peer(specs[torch.int8], specs[torch.int8], "prefill", "decode")
    with pytest.raises(HandshakeMismatch, match="dtype: prefill has 'int8', decode has 'bfloat16'"):
        check_peer(specs[torch.int8], specs[torch.bfloat16], "prefill", "decode")


def test_tp2_ranks_each_hold_an_int8_cache(tmp_path):
    """Tensor parallel over an int8 cache (the followers build their pools from rank 0's published
    layout, dtype included): it serves, keeps the KV invariant, and tracks tp 1."""
    path = make_tiny_checkpoint(tmp_path, "llama", hidden_size=256, intermediate_size=512)
    runs = tp_runs(path, dtype="bfloat16", kv_cache_dtype="int8", num_threads=1)
    assert mean_logprob_gap(runs[1], runs[2]) < 0.05
    assert all(len(r["output_ids"]) == 6 for r in runs[2])
