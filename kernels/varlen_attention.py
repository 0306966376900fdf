"""Prefill attention over a cached prefix through library kernels: flash-attn's varlen kernel where
it is installed (CUDA, fp16/bf16), torch SDPA per sequence otherwise.

Both read the pool through a gather of each sequence's slots into contiguous K/V, so they cost
one extra copy of the batch's KV per layer; in exchange they need no kernel of ours. flash-attn
aligns its causal mask to the bottom-right corner when a sequence has more keys than queries,
which is the prefix-then-new-tokens layout of the pool.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F


@functools.cache
def _flash_attn() -> Any | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # not installed, or built for another torch / CUDA
        return None
    return flash_attn_varlen_func


def flash_attn_available() -> bool:
    return _flash_attn() is not None


def _flash_fits(q: torch.Tensor, k_buf: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k_buf.dtype == q.dtype


def extend_attention_varlen(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: list[int],
    extend_lens: list[int],
    *,
    use_flash: bool | None = None,
) -> torch.Tensor:
    """Same contract as the Triton `extend_attention`, with host-side lengths: q [T, H, D], the new
    tokens of sequence i are the next extend_lens[i] rows, its KV is at slots
    kv_indices[i, :seq_lens[i]] (new tokens' K/V already stored). Returns [T, H, D] in q's dtype.

    use_flash: None picks flash-attn when it is installed and fits (CUDA, fp16/bf16 q equal to the
    pool's dtype); True requires it (RuntimeError otherwise); False always uses SDPA.
    """
    if len(seq_lens) != len(extend_lens) or sum(extend_lens) != q.shape[0]:
        raise ValueError(
            f"{len(seq_lens)} sequences of {extend_lens} new tokens do not match {q.shape[0]} queries"
        )
    if any(e > s for s, e in zip(seq_lens, extend_lens)):
        raise ValueError(f"a sequence has more new tokens than tokens: {extend_lens} vs {seq_lens}")
    fits = flash_attn_available() and _flash_fits(q, k_buf)
    if use_flash and not fits:
        raise RuntimeError(
            "flash-attn varlen needs the flash_attn package and CUDA fp16/bf16 tensors of one dtype; "
            f"got flash_attn {'installed' if flash_attn_available() else 'missing'}, "
            f"q {q.dtype} on {q.device}, pool {k_buf.dtype}"
        )
    if q.shape[0] == 0:
        return torch.empty_like(q)
    slots = torch.cat([kv_indices[i, :n] for i, n in enumerate(seq_lens)])
    keys, values = k_buf.index_select(0, slots), v_buf.index_select(0, slots)
    if fits and use_flash is not False:
        return _flash(q, keys, values, seq_lens, extend_lens)
    return _sdpa(q, keys.to(q.dtype), values.to(q.dtype), seq_lens, extend_lens)


def _flash(q, keys, values, seq_lens: list[int], extend_lens: list[int]) -> torch.Tensor:
    def offsets(lengths: list[int]) -> torch.Tensor:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return torch.tensor(cu, dtype=torch.int32, device=q.device)

    flash_attn_varlen_func = _flash_attn()
    assert flash_attn_varlen_func is not None  # checked by the caller
    return flash_attn_varlen_func(
        q,
        keys,
        values,
        cu_seqlens_q=offsets(extend_lens),
        cu_seqlens_k=offsets(seq_lens),
        max_seqlen_q=max(extend_lens),
        max_seqlen_k=max(seq_lens),
        softmax_scale=1.0 / math.sqrt(q.shape[-1]),
        causal=True,
    )


def _sdpa(q, keys, values, seq_lens: list[int], extend_lens: list[int]) -> torch.Tensor:
    out = torch.empty_like(q)
    q_start = k_start = 0
    for seq_len, extend_len in zip(seq_lens, extend_lens):
        prefix = seq_len - extend_len
        if extend_len == 0:
            k_start += seq_len
            continue
        queries = q[q_start : q_start + extend_len].transpose(0, 1).unsqueeze(0)  # [1, H, E, D]
        k = keys[k_start : k_start + seq_len].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        v = values[k_start : k_start + seq_len].transpose(0, 1).unsqueeze(0)
        if prefix == 0:  # plain causal lets SDPA pick its flash kernel
            o = F.scaled_dot_product_attention(queries, k, v, is_causal=True, enable_gqa=True)
        else:
            query_pos = prefix + torch.arange(extend_len, device=q.device).unsqueeze(1)
            mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= query_pos
            o = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, enable_gqa=True)
        out[q_start : q_start + extend_len] = o.squeeze(0).transpose(0, 1)
        q_start += extend_len
        k_start += seq_len
    return out
