"""The Triton attention kernels and the varlen (flash-attn / SDPA) path against the torch references:
random pools with scattered slots, ragged batches, GQA ratios 1/3/4, prefixes of zero and
non-zero length. CPU tensors run in Triton's interpreter; with a GPU the same cases (and long
contexts) also run compiled on it, in the same process (load_tests/gpu_check.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from radixserve.kernels.cpu_ops import decode_attention_torch
from radixserve.kernels.triton_ops import common, decode_attention, extend_attention
from radixserve.kernels.varlen_attention import extend_attention_varlen, flash_attn_available
from radixserve.workers.batch_kind import BatchKind
from radixserve.workers.models.attention import TorchReferenceBackend
from tests.model_driver import make_batch

CUDA = torch.cuda.is_available()
SPARE_SLOTS = 100  # pool slots no sequence uses
GQA = [(4, 4), (6, 2), (8, 2)]  # query heads, KV heads: ratios 1, 3, 4
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 2e-2)}
# (prefix lens, new-token lens) on every device; long contexts only compiled (the interpreter
# would take minutes).
EXTEND_CASES = [([0, 0, 0], [5, 1, 40]), ([7, 0, 30], [4, 9, 1]), ([45], [37])]
LONG_EXTEND_CASES = [([0, 1000], [700, 300]), ([3000, 17], [1, 2000])]
DECODE_LENS = [[1, 37, 70, 5], [20, 20]]
LONG_DECODE_LENS = [[1, 4000, 777, 16384], [1024] * 64]


def _on_devices(cases: list, long_cases: list) -> list[tuple[str, object]]:
    params = [("cpu", case) for case in cases]
    if CUDA:
        params += [("cuda", case) for case in cases + long_cases]
    return params


def _tiles(device: str, **small: int) -> dict[str, int]:
    """Small tiles when interpreted: several blocks per sequence even at these lengths."""
    return small if device == "cpu" else {}


def _pool(seq_lens, kv_heads, head_dim, dtype, gen):
    num_slots = 1 + sum(seq_lens) + SPARE_SLOTS
    k_buf = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_buf = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    return k_buf, v_buf


def _slots(seq_lens, num_slots, gen):
    """Distinct slots for every position of every sequence, scattered over the pool (slot 0 is
    the padding slot, never allocated)."""
    flat = (torch.randperm(num_slots - 1, generator=gen)[: sum(seq_lens)] + 1).tolist()
    out, start = [], 0
    for n in seq_lens:
        out.append(flat[start : start + n])
        start += n
    return out


def _padded_with_garbage(kv_indices, seq_lens):
    """Padding entries set to an index no pool has, to show that the kernels never read them."""
    garbage = kv_indices.clone()
    for i, n in enumerate(seq_lens):
        garbage[i, n:] = -(10**9)
    return garbage


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


def _extend_reference(q, k_buf, v_buf, batch):
    """TorchReferenceBackend in float32 on float32 copies: no rounding of the reference's output."""
    pool = types.SimpleNamespace(
        k_buffers=[k_buf.float()], v_buffers=[v_buf.float()], k_scales=[1.0], v_scales=[1.0]
    )
    new_k, new_v = pool.k_buffers[0][batch.out_slots], pool.v_buffers[0][batch.out_slots]
    return TorchReferenceBackend().forward(q.float(), new_k, new_v, 0, batch, pool)


def _extend_inputs(prefix_lens, extend_lens, heads, kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_buf, v_buf = _pool(seq_lens, kv_heads, head_dim, dtype, gen)
    slots = _slots(seq_lens, k_buf.shape[0], gen)
    batch = make_batch(BatchKind.PREFILL, [[0] * e for e in extend_lens], prefix_lens, slots)
    q = torch.randn(sum(extend_lens), heads, head_dim, generator=gen).to(dtype)
    return q, k_buf, v_buf, batch


DEVICES = ["cpu", "cuda"] if CUDA else ["cpu"]


@pytest.mark.parametrize("device,case", _on_devices(EXTEND_CASES, LONG_EXTEND_CASES))
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_matches_reference(device, case, heads, kv_heads, dtype):
    prefix_lens, extend_lens = case
    q, k_buf, v_buf, batch = _extend_inputs(prefix_lens, extend_lens, heads, kv_heads, 64, dtype)
    ref = _extend_reference(q, k_buf, v_buf, batch)
    cu = torch.tensor(batch.cu_extend)
    kv_indices = _padded_with_garbage(batch.kv_indices, batch.seq_lens_list)
    args = _to(device, q, k_buf, v_buf, kv_indices, batch.seq_lens, cu)
    # A grid longer than the longest sequence's new tokens: the surplus blocks must write nothing.
    out = extend_attention(*args, max(extend_lens) + 20, **_tiles(device, block_m=16, block_n=16))
    assert out.shape == q.shape and out.dtype == dtype and out.device.type == device
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,head_dim", [(torch.float16, 128), (torch.bfloat16, 128), (torch.float32, 16)])
def test_extend_other_dtypes_and_head_dims_default_tiles(device, dtype, head_dim):
    q, k_buf, v_buf, batch = _extend_inputs([20, 0], [13, 50], 8, 2, head_dim, dtype, seed=1)
    ref = _extend_reference(q, k_buf, v_buf, batch)
    args = _to(device, q, k_buf, v_buf, batch.kv_indices, batch.seq_lens, torch.tensor(batch.cu_extend))
    out = extend_attention(*args, 50)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), ref, atol=atol, rtol=rtol)


def _decode_inputs(seq_lens, heads, kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_buf, v_buf = _pool(seq_lens, kv_heads, head_dim, dtype, gen)
    slots = _slots(seq_lens, k_buf.shape[0], gen)
    batch = make_batch(BatchKind.DECODE, [[0]] * len(seq_lens), [n - 1 for n in seq_lens], slots)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(dtype)
    return q, k_buf, v_buf, batch.kv_indices, batch.seq_lens


@pytest.mark.parametrize("device,seq_lens", _on_devices(DECODE_LENS, LONG_DECODE_LENS))
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference(device, seq_lens, heads, kv_heads, dtype):
    q, k_buf, v_buf, kv_indices, lens = _decode_inputs(seq_lens, heads, kv_heads, 64, dtype)
    ref = decode_attention_torch(q.float(), k_buf.float(), v_buf.float(), kv_indices, lens)
    garbage = _padded_with_garbage(kv_indices, seq_lens)
    # Three splits: the length-1 sequence leaves two of them empty, which the merge must ignore.
    out = decode_attention(
        *_to(device, q, k_buf, v_buf, garbage, lens), **_tiles(device, num_splits=3, block_n=16)
    )
    assert out.shape == q.shape and out.dtype == dtype and out.device.type == device
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), ref, atol=atol, rtol=rtol)


FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.05, 0.02  # an fp8 pool's layer scales: K / 0.05 and V / 0.02 are stored


def _needs_fp8(device: str) -> None:
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(
            f"Triton's e4m3 needs compute capability 8.9; this GPU: {torch.cuda.get_device_capability()}"
        )


def _fp8(k_buf, v_buf):
    """An fp8 pool of the same K/V (scaled up to span e4m3's range), and the values it holds."""
    k8, v8 = (k_buf.float() * 4 / K_SCALE).to(FP8), (v_buf.float() * 2 / V_SCALE).to(FP8)
    return (k8, v8), (k8.float() * K_SCALE, v8.float() * V_SCALE)


@pytest.mark.parametrize("device,seq_lens", _on_devices(DECODE_LENS, LONG_DECODE_LENS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_over_an_fp8_pool_equals_decode_over_the_values_it_holds(device, seq_lens, dtype):
    """kv_cache_dtype fp8_e4m3: e4m3 tiles widened to q's dtype as they load, the scales applied
    to the scores and the output."""
    _needs_fp8(device)
    q, k_buf, v_buf, kv_indices, lens = _decode_inputs(seq_lens, 6, 2, 64, dtype, seed=3)
    (k8, v8), (kd, vd) = _fp8(k_buf, v_buf)
    ref = decode_attention_torch(q.float(), kd, vd, kv_indices, lens)
    args = _to(device, q, k8, v8, _padded_with_garbage(kv_indices, seq_lens), lens)
    out = decode_attention(
        *args, k_scale=K_SCALE, v_scale=V_SCALE, **_tiles(device, num_splits=3, block_n=16)
    )
    assert out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("device,case", _on_devices(EXTEND_CASES, LONG_EXTEND_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_over_an_fp8_pool_equals_extend_over_the_values_it_holds(device, case, dtype):
    _needs_fp8(device)
    prefix_lens, extend_lens = case
    q, k_buf, v_buf, batch = _extend_inputs(prefix_lens, extend_lens, 6, 2, 64, dtype, seed=4)
    (k8, v8), (kd, vd) = _fp8(k_buf, v_buf)
    ref = _extend_reference(q, kd, vd, batch)
    args = _to(device, q, k8, v8, batch.kv_indices, batch.seq_lens, torch.tensor(batch.cu_extend))
    out = extend_attention(
        *args, max(extend_lens), k_scale=K_SCALE, v_scale=V_SCALE, **_tiles(device, block_m=16, block_n=16)
    )
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,head_dim,heads,kv_heads", [(torch.float16, 128, 8, 2), (torch.bfloat16, 64, 96, 1)]
)
def test_decode_default_splits_other_shapes(device, dtype, head_dim, heads, kv_heads):
    # 96 query heads on one KV head: two programs of up to 64 heads, the second one part masked.
    q, k_buf, v_buf, kv_indices, lens = _decode_inputs([130, 2, 64], heads, kv_heads, head_dim, dtype, seed=2)
    ref = decode_attention_torch(q.float(), k_buf.float(), v_buf.float(), kv_indices, lens)
    out = decode_attention(*_to(device, q, k_buf, v_buf, kv_indices, lens))
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), ref, atol=atol, rtol=rtol)


def test_splits_are_powers_of_two_bounded_by_length():
    cpu = torch.device("cpu")
    assert common.next_pow2(1) == 1 and common.next_pow2(5) == 8 and common.next_pow2(16) == 16
    from radixserve.kernels.triton_ops.decode import pick_num_splits

    assert [pick_num_splits(1, 8, n, cpu) for n in (1, 63, 64, 200, 300, 10_000)] == [1, 1, 1, 2, 4, 4]


def test_rejects_layouts_the_kernels_cannot_run():
    q = torch.zeros(2, 6, 64)
    k = torch.zeros(10, 4, 64)
    idx = torch.zeros(2, 3, dtype=torch.int64)
    lens = torch.ones(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="6 query heads of dim 64 cannot attend to 4 KV heads"):
        decode_attention(q, k, k, idx, lens)
    with pytest.raises(ValueError, match="head_dim must be a power of two >= 16; got 48"):
        decode_attention(torch.zeros(2, 4, 48), torch.zeros(10, 4, 48), torch.zeros(10, 4, 48), idx, lens)
    with pytest.raises(ValueError, match="kv_indices must be a \\[B, max_len\\] integer tensor"):
        decode_attention(
            torch.zeros(2, 4, 64), torch.zeros(10, 4, 64), torch.zeros(10, 4, 64), idx.float(), lens
        )
    with pytest.raises(ValueError, match="2 sequences need seq_lens \\[B\\] and cu_extend \\[B \\+ 1\\]"):
        extend_attention(torch.zeros(3, 4, 64), k, k, idx, lens, torch.tensor([0, 3]), 3)


# Triton reads TRITON_INTERPRET once, when triton.language is first imported: the kernels must
# run on CPU tensors either way, and after torch itself has imported triton (its flop counter does).
_FRESH_PROCESS = """
import torch
import torch.utils.flop_counter
from radixserve.kernels.cpu_ops import decode_attention_torch
from radixserve.kernels.triton_ops import decode_attention, extend_attention
g = torch.Generator().manual_seed(0)
k, v = torch.randn(50, 2, 32, generator=g), torch.randn(50, 2, 32, generator=g)
idx, lens, q = torch.randperm(50, generator=g)[:40].view(2, 20), torch.tensor([20, 20]), torch.randn(2, 4, 32, generator=g)
ref = decode_attention_torch(q, k, v, idx, lens)
torch.testing.assert_close(decode_attention(q, k, v, idx, lens), ref, atol=1e-5, rtol=1e-5)
last = extend_attention(q, k, v, idx, lens, torch.tensor([0, 1, 2]), 1)  # one new token each: decode
torch.testing.assert_close(last, ref, atol=1e-5, rtol=1e-5)
print("ok")
"""


@pytest.mark.parametrize("interpret_env", [None, "1"])
def test_kernels_run_on_cpu_whatever_imported_triton_first(interpret_env):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret_env is not None:
        env["TRITON_INTERPRET"] = interpret_env
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_sdpa_matches_reference(device, heads, kv_heads, dtype):
    prefix_lens, extend_lens = [7, 0, 30, 5], [4, 9, 1, 0]
    q, k_buf, v_buf, batch = _extend_inputs(prefix_lens, extend_lens, heads, kv_heads, 64, dtype)
    ref = _extend_reference(q, k_buf, v_buf, batch)
    args = _to(device, q, k_buf, v_buf, batch.kv_indices)
    out = extend_attention_varlen(*args, batch.seq_lens_list, extend_lens, use_flash=False)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_flash_when_available_else_a_clear_error(device):
    q, k_buf, v_buf, batch = _extend_inputs([20, 0], [13, 50], 8, 2, 128, torch.bfloat16, seed=3)
    args = _to(device, q, k_buf, v_buf, batch.kv_indices)
    if not (flash_attn_available() and device == "cuda"):
        with pytest.raises(RuntimeError, match="flash-attn varlen needs the flash_attn package"):
            extend_attention_varlen(*args, batch.seq_lens_list, batch.extend_lens_list, use_flash=True)
        return
    out = extend_attention_varlen(*args, batch.seq_lens_list, batch.extend_lens_list, use_flash=True)
    torch.testing.assert_close(
        out.cpu().float(), _extend_reference(q, k_buf, v_buf, batch), atol=1e-2, rtol=2e-2
    )


def test_varlen_rejects_mismatched_lengths():
    q = torch.zeros(5, 4, 64)
    k = torch.zeros(10, 4, 64)
    idx = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="2 sequences of \\[2, 2\\] new tokens do not match 5 queries"):
        extend_attention_varlen(q, k, k, idx, [3, 4], [2, 2])
    with pytest.raises(ValueError, match="more new tokens than tokens"):
        extend_attention_varlen(q, k, k, idx, [3, 1], [3, 2])
