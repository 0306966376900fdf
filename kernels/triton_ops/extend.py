"""Paged prefill attention over a cached prefix (flash-attention style, online softmax).

A program owns BLOCK_M new tokens of one sequence and one query head. It walks the sequence's
slots in kv_indices order up to its last token: the prefix and the new tokens before its block
are visible to every row, the keys inside its block through the causal mask. The new tokens'
K/V are read from the pool like the prefix's (the caller stored them first), so one loop serves
both and a sequence's pages need not be contiguous.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import MAX, SUM, DualKernel, check_pool, dot_flags

LOG2E = 1.4426950408889634


def _extend_kernel(
    Q,
    K,
    V,
    OUT,
    KV_INDICES,
    SEQ_LENS,
    CU_EXTEND,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_ib,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    first_row = tl.load(CU_EXTEND + seq).to(tl.int32)
    extend_len = tl.load(CU_EXTEND + seq + 1).to(tl.int32) - first_row
    seq_len = tl.load(SEQ_LENS + seq).to(tl.int32)
    prefix_len = seq_len - extend_len
    block_start = tl.program_id(2) * BLOCK_M
    rows = block_start + tl.arange(0, BLOCK_M)
    row_ok = rows < extend_len
    query_pos = prefix_len + rows
    dims = tl.arange(0, HEAD_DIM)

    q_ptrs = Q + (first_row + rows)[:, None].to(tl.int64) * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if not DOT_F32:
        q = q.to(Q.dtype.element_ty)
    # Blocks past this sequence's new tokens (the grid covers the longest one) read nothing.
    key_end = tl.where(block_start < extend_len, tl.minimum(prefix_len + block_start + BLOCK_M, seq_len), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
    for n in range(0, key_end, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        col_ok = cols < key_end
        slots = tl.load(KV_INDICES + seq * stride_ib + cols, mask=col_ok, other=0).to(tl.int64)
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
        # Key 0 is visible to every row, so each row's running max is finite from the first block.
        visible = col_ok[None, :] & (cols[None, :] <= query_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM)
        if not DOT_F32:
            p = p.to(Q.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    o_ptrs = OUT + (first_row + rows)[:, None].to(tl.int64) * stride_ot + head * stride_oh + dims[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


_EXTEND = DualKernel(_extend_kernel)


def extend_tiles(head_dim: int, on_gpu: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): large tiles for the GPU's tensor cores; the interpreter pays
    per operation, not per element, so its tiles are large too but smaller than a GPU's."""
    if not on_gpu:
        return 32, 32, 4
    if head_dim <= 64:
        return 128, 64, 4
    return 128, 64, 8


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_extend: torch.Tensor,
    max_extend_len: int,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of the T new tokens of B sequences over their whole KV, in the pool.

    q [T, H, D]; the new tokens of sequence i are rows [cu_extend[i], cu_extend[i+1]) and its KV
    (prefix, then the new tokens, whose K/V must already be stored) sits at slots
    kv_indices[i, :seq_lens[i]] of k_buf/v_buf [S, KVH, D]. The j-th new token sees keys
    0..seq_lens[i]-extend_len+j. `max_extend_len` (>= every sequence's new-token count, a host
    int so that no sync is needed) sizes the grid. Returns [T, H, D] in q's dtype; float32 softmax.
    The buffers hold q's dtype or fp8 with scales, as for decode_attention.
    """
    check_pool(q, k_buf, v_buf, kv_indices)
    batch = kv_indices.shape[0]
    if seq_lens.shape != (batch,) or cu_extend.shape != (batch + 1,):
        raise ValueError(f"{batch} sequences need seq_lens [B] and cu_extend [B + 1]")
    heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    if batch == 0 or max_extend_len <= 0 or q.shape[0] == 0:
        return out
    default_m, default_n, num_warps = extend_tiles(head_dim, q.device.type != "cpu")
    block_m, block_n = block_m or default_m, block_n or default_n
    grid = (batch, heads, triton.cdiv(max_extend_len, block_m))
    _EXTEND.on(q)[grid](
        q, k_buf, v_buf, out, kv_indices, seq_lens, cu_extend,
        LOG2E / math.sqrt(head_dim) * k_scale, v_scale,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1), kv_indices.stride(0),
        GROUP=heads // k_buf.shape[1], HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        **dot_flags(q.dtype, q.device), num_warps=num_warps, num_stages=2,
    )  # fmt: skip
    return out
