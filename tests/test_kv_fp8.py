"""The fp8 KV cache (kv_cache_dtype fp8_e4m3): a pool of e4m3 values holding K / k_scale and
V / v_scale per layer (the checkpoint's scales, or 1.0), read by the Triton kernels, which widen
each tile to q's dtype and apply the scales. Triton runs interpreted on these CPU tensors; the
kernels against the torch reference, compiled too on a GPU, are in tests/test_triton_attention.py,
the engine on a GPU in tests/test_device_path.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.kernels.triton_ops import decode_attention
from radixserve.workers import Engine
from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.mem_cache.disk_tier import DiskTier
from radixserve.workers.mem_cache.host_tier import HostTier
from radixserve.workers.mem_cache.kv_pool import FP8, FP8_MAX, KVPool, fp8_rows, pool_dtype
from radixserve.workers.models.attention import TorchReferenceBackend, TritonBackend
from tests.engine_utils import assert_kv_invariant, mean_logprob_gap, tp_runs
from tests.model_driver import make_batch
from tests.test_attention import CASES, _scatter_slots
from tests.test_fp8 import KV_SCALES, fp8_checkpoint, tiny  # noqa: F401 (a fixture)

torch.set_num_threads(1)


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_rows_are_scaled_saturated_and_rounded_to_nearest():
    x = torch.tensor([0.0, 1.0, -3.3, 1e-4, 50.0, -1e6, 2.0e3])
    got = fp8_rows(x, 0.5)
    assert got.dtype == FP8
    assert got.float().tolist()[:3] == [0.0, 2.0, -6.5]  # x / 0.5, the nearest e4m3
    assert got.float()[-2:].tolist() == [-FP8_MAX, FP8_MAX]  # saturated, never NaN
    assert torch.equal(got[:5], (x[:5] / 0.5).to(FP8).view(torch.uint8).view(FP8))


def test_a_pool_holds_twice_the_tokens_and_its_layer_scales():
    assert KVPool.bytes_per_token(30, 3, 64, FP8) * 2 == KVPool.bytes_per_token(30, 3, 64, torch.bfloat16)
    pool = KVPool(2, 3, 64, 32, dtype=FP8, kv_scales=([0.5, 2.0], [1.0, 0.25]))
    assert pool.k_buffers[0].dtype == FP8 and pool.k_buffers[0].shape == (33, 3, 64)
    assert (pool.k_scales, pool.v_scales) == ([0.5, 2.0], [1.0, 0.25])
    assert KVPool(2, 3, 64, 32, dtype=FP8).k_scales == [1.0, 1.0]
    with pytest.raises(ValueError, match="one K and one V scale for each of 2 layers"):
        KVPool(2, 3, 64, 32, dtype=FP8, kv_scales=([1.0], [1.0]))
    with pytest.raises(ValueError, match="for an fp8 pool"):
        KVPool(2, 3, 64, 32, dtype=torch.bfloat16, kv_scales=([0.5, 1.0], [1.0, 1.0]))


def test_the_kernels_refuse_a_pool_of_another_dtype():
    q = randn(1, 2, 64)
    with pytest.raises(ValueError, match="hold q's dtype"):
        decode_attention(q, torch.zeros(4, 1, 64, dtype=torch.int8), torch.zeros(4, 1, 64, dtype=torch.int8),
                         torch.ones(1, 2, dtype=torch.int64), torch.tensor([2]))  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_triton_backend_stores_and_reads_an_fp8_pool_as_the_reference_does(case):
    """One layer as the engine runs it: the new K/V stored divided by the layer's scales, then
    attended to with the cached prefix; the Triton kernels agree with the float32 reference."""
    kind, prefix_lens, extend_lens = CASES[case]
    outs = []
    for backend in (TritonBackend(), TorchReferenceBackend()):
        gen = torch.Generator().manual_seed(0)
        pool = KVPool(2, 2, 64, 1024, dtype=FP8, kv_scales=([1.0, 0.03], [1.0, 0.01]))
        for buf, s in zip(pool.k_buffers + pool.v_buffers, (1.0, 0.03, 1.0, 0.01)):
            buf.copy_(fp8_rows(torch.randn(buf.shape, generator=gen) * 2, s))
        slots = _scatter_slots(pool, [p + e for p, e in zip(prefix_lens, extend_lens)], gen)
        batch = make_batch(kind, [[0] * e for e in extend_lens], prefix_lens, slots)
        n = sum(extend_lens)
        q, k, v = (torch.randn(n, h, 64, generator=gen).bfloat16() for h in (6, 2, 2))
        backend.prepare(batch)
        outs.append(backend.forward(q, k, v, 1, batch, pool))
        assert torch.equal(
            pool.k_buffers[1][batch.out_slots].view(torch.uint8), fp8_rows(k, 0.03).view(torch.uint8)
        )
        assert torch.equal(
            pool.v_buffers[1][batch.out_slots].view(torch.uint8), fp8_rows(v, 0.01).view(torch.uint8)
        )
    assert outs[0].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=1e-2, rtol=1e-2)


def test_the_host_and_disk_tiers_keep_fp8_rows_byte_for_byte(tmp_path):
    pool = KVPool(2, 2, 64, 64, dtype=FP8, kv_scales=([0.5, 0.5], [0.5, 0.5]))
    for i, buf in enumerate(pool.k_buffers + pool.v_buffers):
        buf[1:].copy_(fp8_rows(randn(64, 2, 64, seed=i), 0.5))
    kept = [b[[5, 6, 7]].view(torch.uint8).clone() for b in pool.k_buffers + pool.v_buffers]
    tier = HostTier(pool, 16)
    assert tier.pool.dtype == FP8
    host = tier.write_back([5, 6, 7])
    disk = DiskTier(str(tmp_path), 1 << 20)
    key = disk.spill(pool, [5, 6, 7])
    for buf in pool.k_buffers + pool.v_buffers:
        buf[20:26].zero_()
    tier.load(host, [20, 21, 22])
    assert key is not None and disk.fetch(key, pool, [23, 24, 25])
    for buf, want in zip(pool.k_buffers + pool.v_buffers, kept):
        assert torch.equal(buf[20:23].view(torch.uint8), want)
        assert torch.equal(buf[23:26].view(torch.uint8), want)


def test_the_pool_dtype_and_the_configurations_it_refuses():
    assert pool_dtype("fp8_e4m3", torch.bfloat16, "triton", 64, 3) == FP8
    assert pool_dtype("fp8_e4m3", torch.float32, "torch_ref", 64, 3) == FP8
    for backend in ("cpu", "torch"):
        with pytest.raises(ValueError, match="triton attention backend"):
            pool_dtype("fp8_e4m3", torch.bfloat16, backend, 64, 3)
    EngineConfig(kv_cache_dtype="fp8_e4m3", device="cuda")  # auto = triton there
    EngineConfig(kv_cache_dtype="fp8_e4m3", attention_backend="triton")
    for kwargs in (
        {"attention_backend": "cpu"},
        {"attention_backend": "torch", "device": "cuda"},
        {"device": "cpu"},
        {"deterministic": True},
    ):
        with pytest.raises(ValueError, match="triton attention backend|deterministic"):
            EngineConfig(kv_cache_dtype="fp8_e4m3", **kwargs)


def test_pd_peers_name_the_fp8_cache_in_their_handshake():
    from radixserve.workers.disaggregation.spec import HandshakeMismatch, KVSpec, check_peer

    fp8, bf16 = (
        KVSpec.for_pool(KVPool(2, 3, 64, 16, dtype=d), "m", "fp", "gloo") for d in (FP8, torch.bfloat16)
    )
    assert fp8.dtype == "float8_e4m3fn"
    check_peer(fp8, fp8, "prefill", "decode")
    with pytest.raises(HandshakeMismatch, match="dtype: prefill has 'float8_e4m3fn', decode has 'bfloat16'"):
        check_peer(fp8, bf16, "prefill", "decode")


TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type made "
    "books cheaper and faster to produce than ever before. Within a few decades presses were at work"
)


def test_the_engine_runs_an_fp8_checkpoint_with_its_kv_scales(tiny, tmp_path):  # noqa: F811
    """An fp8 checkpoint's k_scale / v_scale become the pool's layer scales; the Triton kernels
    over the fp8 cache give the reference backend's output over the same cache, prefix reuse and
    the idle invariant as ever, in twice the tokens of the model dtype's pool."""
    qdir, _ = fp8_checkpoint(tiny, tmp_path, "fp8-tensor")
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "logprob_start_len": 0}
    runs = {}
    for backend, kv in (("triton", "fp8_e4m3"), ("torch_ref", "fp8_e4m3"), ("triton", "auto")):
        engine = Engine(
            model_path=qdir,
            dtype="float32",
            attention_backend=backend,
            kv_cache_dtype=kv,
            chunked_prefill_size=16,
            mem_fraction_static=0.05,
        )
        try:
            first = engine.generate(TEXT, params)
            again = engine.generate(TEXT, {k: v for k, v in params.items() if k != "logprob_start_len"})
            assert again["meta_info"]["cached_tokens"] > 20 and again["output_ids"] == first["output_ids"]
            assert_kv_invariant(engine)
            pool = engine.core.pool
            runs[(backend, kv)] = (first, pool.size, pool.k_scales, pool.v_scales)
        finally:
            engine.shutdown()
    got, size, k_scales, v_scales = runs[("triton", "fp8_e4m3")]
    ref, _, ref_k, ref_v = runs[("torch_ref", "fp8_e4m3")]
    plain, plain_size, plain_k, _ = runs[("triton", "auto")]
    assert (k_scales, v_scales) == (ref_k, ref_v) == KV_SCALES
    assert plain_k == [1.0, 1.0]  # a float32 pool stores values as they are
    assert size / plain_size == pytest.approx(4.0, rel=0.02)  # 1 byte against float32's 4
    assert got["output_ids"] == ref["output_ids"]
    lp = [[v for v, _, _ in r["meta_info"]["input_token_logprobs"][1:]] for r in (got, ref, plain)]
    assert max(abs(a - b) for a, b in zip(lp[0], lp[1])) < 1e-3
    # against the float32 cache: e4m3 keeps 3 mantissa bits, close but not equal
    assert sum(abs(a - b) for a, b in zip(lp[0], lp[2])) / len(lp[0]) < 0.05


def test_a_checkpoints_kv_scales_by_layer(tiny, tmp_path):  # noqa: F811
    from safetensors.torch import load_file

    from radixserve.workers.models import packed_checkpoints as pc

    for style in ("fp8-tensor", "ct-channel"):
        qdir, _ = fp8_checkpoint(tiny, tmp_path / style, style)
        reader = pc.PackedReader(*pc.checkpoint_method(Path(qdir)))
        dense = dict(reader.dense(load_file(str(Path(qdir) / "model.safetensors")).items()))
        assert not any("k_scale" in n or "output_scale" in n for n in dense)
        (k0, k1), (v0, v1) = KV_SCALES
        assert reader.kv_scales == {(0, "k"): k0, (1, "k"): k1, (0, "v"): v0, (1, "v"): v1}


def test_tp2_ranks_each_hold_an_fp8_cache_at_the_checkpoints_scales(tiny, tmp_path):  # noqa: F811
    """Tensor parallel over an fp8 cache (every rank builds its pool from the same checkpoint, its
    KV scales included, and attends over its own KV heads with the Triton kernels): it serves,
    keeps the KV invariant, gives tp 1's greedy tokens and tracks its logprobs."""
    qdir, _ = fp8_checkpoint(tiny, tmp_path, "fp8-tensor")
    runs = tp_runs(
        qdir, dtype="float32", attention_backend="triton", kv_cache_dtype="fp8_e4m3", num_threads=1
    )
    assert mean_logprob_gap(runs[1], runs[2]) < 0.01
    assert [r["output_ids"] for r in runs[2]] == [r["output_ids"] for r in runs[1]]
