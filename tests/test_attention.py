"""Attention backends over the paged KV pool: the CPU backend against the float32 reference,
and the reference against plain dense causal attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_ops
from radixserve.workers.batch_kind import BatchKind
from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.models.attention import (
    CpuBackend,
    TorchBackend,
    TorchReferenceBackend,
    TritonBackend,
    backend_name,
    get_backend,
)
from tests.model_driver import make_batch

torch.set_num_threads(1)


def _scatter_slots(pool: KVPool, lengths: list[int], gen: torch.Generator) -> list[list[int]]:
    """Slots for each sequence, shuffled so that a sequence's KV is not contiguous in the pool."""
    slots = [pool.alloc(n) for n in lengths]
    flat = [s for ss in slots for s in ss]
    order = torch.randperm(len(flat), generator=gen).tolist()
    shuffled = [flat[i] for i in order]
    out, start = [], 0
    for n in lengths:
        out.append(shuffled[start : start + n])
        start += n
    return out


def _run(backend, kind, prefix_lens, extend_lens, heads, kv_heads, dtype, seed=0, head_dim=32):
    """Fill the prefixes' KV with random values, run one layer of `backend`, return (out, pool)."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(2, kv_heads, head_dim, 1024, dtype=dtype)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    slots = _scatter_slots(pool, [p + e for p, e in zip(prefix_lens, extend_lens)], gen)
    batch = make_batch(kind, [[0] * e for e in extend_lens], prefix_lens, slots)
    tokens = sum(extend_lens)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    backend.prepare(batch)
    out = backend.forward(q, k, v, 1, batch, pool)
    return out, pool, batch, (q, k, v)


CASES = {
    "extend_no_prefix_ragged": (BatchKind.PREFILL, [0, 0, 0], [5, 1, 17]),
    "extend_with_prefixes": (BatchKind.PREFILL, [7, 0, 30], [4, 9, 1]),
    "extend_single_long": (BatchKind.PREFILL, [100], [60]),
    "extend_many_blocks": (BatchKind.PREFILL, [0, 45], [130, 70]),
    "decode_ragged": (BatchKind.DECODE, [3, 40, 0, 12], [1, 1, 1, 1]),
    "decode_equal": (BatchKind.DECODE, [20, 20], [1, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 32), (4, 1, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ops", ["native", "torch"])
def test_cpu_backend_matches_reference(case, heads, kv_heads, head_dim, dtype, ops, monkeypatch):
    if ops == "native" and cpu_ops.native_ops() is None:
        pytest.skip("C++ extension not built")
    if ops == "torch":  # the fallbacks: torch decode, SDPA extend
        monkeypatch.setattr(cpu_ops, "native_ops", lambda: None)
    kind, prefix_lens, extend_lens = CASES[case]
    ours, *_ = _run(CpuBackend(), kind, prefix_lens, extend_lens, heads, kv_heads, dtype, head_dim=head_dim)
    ref, *_ = _run(
        TorchReferenceBackend(), kind, prefix_lens, extend_lens, heads, kv_heads, dtype, head_dim=head_dim
    )
    assert ours.shape == ref.shape == (sum(extend_lens), heads, head_dim)
    assert ours.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 1, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_device_backends_match_reference(case, heads, kv_heads, head_dim, dtype, name):
    """The GPU backends as the engine calls them (Triton interpreted here, on CPU tensors)."""
    backend = {"torch": TorchBackend, "triton": TritonBackend}[name]()
    kind, prefix_lens, extend_lens = CASES[case]
    ours, *_ = _run(backend, kind, prefix_lens, extend_lens, heads, kv_heads, dtype, head_dim=head_dim)
    ref, *_ = _run(
        TorchReferenceBackend(), kind, prefix_lens, extend_lens, heads, kv_heads, dtype, head_dim=head_dim
    )
    assert ours.shape == ref.shape and ours.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "backend",
    [CpuBackend(), TorchReferenceBackend(), TorchBackend(), TritonBackend()],
    ids=["cpu", "ref", "torch", "triton"],
)
def test_new_kv_written_to_out_slots_of_the_layer(backend):
    out, pool, batch, (_, k, v) = _run(backend, BatchKind.PREFILL, [3, 0], [2, 4], 4, 2, torch.float32)
    torch.testing.assert_close(pool.k_buffers[1][batch.out_slots], k, atol=0, rtol=0)
    torch.testing.assert_close(pool.v_buffers[1][batch.out_slots], v, atol=0, rtol=0)


def test_reference_equals_dense_causal_attention():
    """A prefix-free sequence attends exactly like SDPA with is_causal and repeated kv heads."""
    heads, kv_heads, n = 6, 2, 11
    out, _, _, (q, k, v) = _run(
        TorchReferenceBackend(), BatchKind.PREFILL, [0], [n], heads, kv_heads, torch.float32
    )
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
        v.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_decode_is_softmax_over_the_whole_sequence():
    heads, kv_heads, prefix = 2, 1, 9
    out, pool, batch, (q, _, _) = _run(
        TorchReferenceBackend(), BatchKind.DECODE, [prefix], [1], heads, kv_heads, torch.float32
    )
    slots = batch.kv_indices[0, : prefix + 1]
    keys, values = pool.k_buffers[1][slots][:, 0], pool.v_buffers[1][slots][:, 0]
    for h in range(heads):
        weights = torch.softmax(keys @ q[0, h] / math.sqrt(32), dim=0)
        torch.testing.assert_close(out[0, h], weights @ values, atol=1e-5, rtol=1e-5)


def test_get_backend():
    assert isinstance(get_backend("auto"), CpuBackend)
    assert isinstance(get_backend("torch_ref"), TorchReferenceBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'flashinfer'"):
        get_backend("flashinfer")


def test_backend_choice_per_device():
    """auto: the fused CPU kernels on CPU, Triton on CUDA unless the head_dim does not suit it."""
    assert backend_name("auto", "cpu", 64) == "cpu"
    assert backend_name("auto", "cuda", 64) == "triton"
    assert backend_name("auto", "cuda", 80) == "torch"
    assert backend_name("torch", "cuda", 80) == "torch"
    with pytest.raises(ValueError, match="runs on CPU only"):
        backend_name("cpu", "cuda", 64)
    with pytest.raises(ValueError, match="power-of-two head_dim >= 16, not 80"):
        backend_name("triton", "cpu", 80)
