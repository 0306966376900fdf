"""Paged decode attention in two stages (flash-decoding): split each sequence's KV into chunks that
run in parallel, then merge the chunks' partial results with their log-sum-exps.

One query token per sequence leaves a batch of a few long sequences with too little parallelism
if one program walks a whole sequence; splitting the KV axis gives every SM work, and the merge
is exact (each split keeps its running max and sum). A program serves up to BLOCK_H query heads
of one KV group, so each K/V row is read once per group rather than once per query head.
"""

from __future__ import annotations

import functools
import math

import torch
import triton.language as tl

from .common import MAX, MIN_DOT, SUM, DualKernel, check_pool, dot_flags, next_pow2

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 64  # fewer keys per split than this costs more in the merge than it saves
MAX_SPLITS = 16


def _split_kernel(
    Q,
    K,
    V,
    KV_INDICES,
    SEQ_LENS,
    MID_O,
    MID_LSE,
    qk_scale,
    v_scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ib,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_CHUNKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    batch = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_CHUNKS
    local = (tl.program_id(1) % HEAD_CHUNKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = local < GROUP
    heads = kv_head * GROUP + local
    split = tl.program_id(2)
    dims = tl.arange(0, HEAD_DIM)

    q = tl.load(
        Q + batch * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None], other=0.0
    )
    q = q.to(tl.float32)
    if not DOT_F32:
        q = q.to(Q.dtype.element_ty)
    seq_len = tl.load(SEQ_LENS + batch).to(tl.int32)
    split_len = (seq_len + NUM_SPLITS - 1) // NUM_SPLITS
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, HEAD_DIM], 0.0, tl.float32)
    for n in range(start, end, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        slots = tl.load(KV_INDICES + batch * stride_ib + cols, mask=col_ok, other=0).to(tl.int64)
        k = tl.load(
            K + slots[:, None] * stride_kn + kv_head * stride_kh + dims[None, :],
            mask=col_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            V + slots[:, None] * stride_vn + kv_head * stride_vh + dims[None, :],
            mask=col_ok[:, None],
            other=0.0,
        )
        # An fp8 pool's tiles widen to q's dtype (a no-op for a pool in q's dtype).
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(Q.dtype.element_ty)
            v = v.to(Q.dtype.element_ty)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM)
        if not DOT_F32:
            p = p.to(Q.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    # An empty split (a sequence shorter than NUM_SPLITS keys) leaves zeros and a -inf weight.
    has_keys = l_i > 0
    out = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    o_ptrs = MID_O + batch * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :]
    tl.store(o_ptrs, out, mask=head_ok[:, None])
    tl.store(MID_LSE + batch * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


def _merge_kernel(
    MID_O,
    MID_LSE,
    OUT,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
):
    batch = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_POW2)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM)
    lse = tl.load(MID_LSE + batch * stride_lb + head * stride_lh + splits, mask=split_ok, other=float("-inf"))
    top = tl.reduce(lse, 0, MAX)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    o_ptrs = MID_O + batch * stride_mb + head * stride_mh + splits[:, None] * stride_ms + dims[None, :]
    parts = tl.load(o_ptrs, mask=split_ok[:, None], other=0.0)
    total = tl.reduce(weight, 0, SUM)
    out = tl.reduce(weight[:, None] * parts, 0, SUM) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + batch * stride_ob + head * stride_oh + dims, out.to(OUT.dtype.element_ty))


_SPLIT = DualKernel(_split_kernel)
_MERGE = DualKernel(_merge_kernel)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_tiles(group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_N): the query heads of a KV group a program serves (at least the 16 rows
    `tl.dot` needs; larger groups take several programs) and the keys per step."""
    return max(MIN_DOT, min(64, next_pow2(group))), 64 if head_dim <= 64 else 32


def pick_num_splits(batch: int, head_programs: int, max_len: int, device: torch.device) -> int:
    """A power of two (bounding the number of compiled variants) that spreads the programs over the
    GPU's SMs about twice, without splits shorter than MIN_SPLIT_TOKENS. Shapes only, no sync."""
    by_length = max(1, max_len // MIN_SPLIT_TOKENS)
    by_occupancy = (
        max(1, 2 * _sm_count(device) // max(1, batch * head_programs)) if device.type == "cuda" else 4
    )
    wanted = min(MAX_SPLITS, by_length, by_occupancy)
    return 1 << (wanted.bit_length() - 1)


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D] in q's dtype: sequence b attends to slots kv_indices[b, :seq_lens[b]]
    of k_buf/v_buf [S, KVH, D] (H a multiple of KVH; D a power of two >= 16), scale 1/sqrt(D),
    float32 softmax and accumulation. Every seq_lens[b] must be >= 1; entries of kv_indices past
    seq_lens[b] are never read. CPU tensors run in Triton's interpreter (slow: for tests).

    The buffers hold q's dtype, or fp8 (an fp8 KV cache) holding K / k_scale and V / v_scale:
    tiles widen to q's dtype as they load and the scales apply to the scores and the output."""
    check_pool(q, k_buf, v_buf, kv_indices)
    if seq_lens.shape != (q.shape[0],) or kv_indices.shape[0] != q.shape[0]:
        raise ValueError(f"batch of {q.shape[0]} queries needs seq_lens [B] and kv_indices [B, L]")
    batch, heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_h, default_n = decode_tiles(group, head_dim)
    block_n = block_n or default_n
    head_chunks = -(-group // block_h)
    if num_splits is None:
        num_splits = pick_num_splits(batch, kv_heads * head_chunks, kv_indices.shape[1], q.device)
    mid_o = torch.empty((batch, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
    _SPLIT.on(q)[(batch, kv_heads * head_chunks, num_splits)](
        q, k_buf, v_buf, kv_indices, seq_lens, mid_o, mid_lse,
        LOG2E / math.sqrt(head_dim) * k_scale, v_scale,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        kv_indices.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_CHUNKS=head_chunks, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, **dot_flags(q.dtype, q.device),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    _MERGE.on(q)[(batch, heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, SPLITS_POW2=next_pow2(num_splits),
        num_warps=4,
    )  # fmt: skip
    return out
