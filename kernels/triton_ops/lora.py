"""Batched LoRA deltas on the GPU, token by token (the BGMV shape of Punica / S-LoRA): each token
reads its own adapter's A and B from the stacked slot buffers, whatever the batch mixes.

    lora_add(x, y, A, Bs, outs, token_slots)    # y[t, lo_p:hi_p] += x[t] @ A[s] [.., p] @ Bs[p][s]

Layouts (workers/lora/layers.py's buffers): A [S, in, P, R], Bs[p] [S, R, out_p], `outs` the
[lo, hi) columns of part p in y, `token_slots` [T] int (-1: the base model, no delta). The shrink
kernel writes xa [T, P * R] in float32; the expand kernel adds each part's block times its B into
y's columns. Compiled for GPU tensors, interpreted for CPU tensors (tests): common.py says how.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import SUM, DualKernel, next_pow2


def _shrink(
    x_ptr,
    a_ptr,
    slots_ptr,
    out_ptr,
    K,
    N,
    stride_x,
    stride_as,
    stride_ak,
    stride_o,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    s = tl.load(slots_ptr + t)
    acc = tl.full([BLOCK_N], 0.0, tl.float32)
    if s >= 0:
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            xv = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
            av = tl.load(
                a_ptr + s * stride_as + k[:, None] * stride_ak + n[None, :],
                mask=k_ok[:, None] & n_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.reduce(xv[:, None] * av, 0, SUM)
    tl.store(out_ptr + t * stride_o + n, acc, mask=n_ok)


def _expand(
    xa_ptr,
    b_ptr,
    slots_ptr,
    y_ptr,
    R,
    N,
    stride_xa,
    stride_bs,
    stride_br,
    stride_y,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    s = tl.load(slots_ptr + t)
    if s >= 0:
        r = tl.arange(0, BLOCK_R)
        r_ok = r < R
        xv = tl.load(xa_ptr + t * stride_xa + r, mask=r_ok, other=0.0)
        bv = tl.load(
            b_ptr + s * stride_bs + r[:, None] * stride_br + n[None, :],
            mask=r_ok[:, None] & n_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        delta = tl.reduce(xv[:, None] * bv, 0, SUM)
        yv = tl.load(y_ptr + t * stride_y + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_y + n, (yv + delta).to(y_ptr.dtype.element_ty), mask=n_ok)


_SHRINK = DualKernel(_shrink)
_EXPAND = DualKernel(_expand)


def lora_add(
    x: torch.Tensor,
    y: torch.Tensor,
    A: torch.Tensor,
    Bs: list[torch.Tensor],
    outs: list[tuple[int, int]],
    token_slots: torch.Tensor,
) -> None:
    """y += each token's LoRA delta, in place (see the module's docstring for the layouts)."""
    tokens, k = x.shape
    slots, k_a, parts, rank = A.shape
    if k_a != k or len(Bs) != parts or len(outs) != parts or token_slots.shape != (tokens,):
        raise ValueError(
            f"lora_add: x {tuple(x.shape)}, A {tuple(A.shape)}, {len(Bs)} B parts, {len(outs)} outputs, "
            f"token_slots {tuple(token_slots.shape)} do not fit together"
        )
    if tokens == 0:
        return
    x, a = x.contiguous(), A.view(slots, k, parts * rank)
    width = parts * rank
    xa = torch.empty(tokens, width, dtype=torch.float32, device=x.device)
    block_n = min(next_pow2(width), 64)
    _SHRINK.on(x)[(tokens, triton.cdiv(width, block_n))](
        x, a, token_slots, xa, k, width, x.stride(0), a.stride(0), a.stride(1), xa.stride(0),
        BLOCK_K=min(next_pow2(k), 128), BLOCK_N=block_n,
    )  # fmt: skip
    for p, (lo, hi) in enumerate(outs):
        b, out = Bs[p], y[:, lo:hi]
        block_n = min(next_pow2(hi - lo), 128)
        _EXPAND.on(x)[(tokens, triton.cdiv(hi - lo, block_n))](
            xa[:, p * rank :], b, token_slots, out, rank, hi - lo, xa.stride(0), b.stride(0), b.stride(1),
            out.stride(0), BLOCK_R=next_pow2(rank), BLOCK_N=block_n,
        )  # fmt: skip
