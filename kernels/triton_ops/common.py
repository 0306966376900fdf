"""What the Triton attention kernels share: the pool layout they accept and how their dots run.

Without a GPU the kernels run in Triton's interpreter, which must be chosen before triton is first
imported (TRITON_INTERPRET=1): triton.language's own helpers (tl.max, tl.sum, ...) are compiled or
interpreted once, at that import. The interpreter does no arithmetic on bfloat16 (numpy has
none), so the kernels convert every load to float32 before use and, interpreted, keep their
`tl.dot` operands float32 (`DOT_F32`); float32 dots ask for "ieee" precision so that neither a
GPU nor the interpreter rounds them to tf32.
"""

from __future__ import annotations

from typing import Any

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Smallest M, N and K that `tl.dot` accepts when compiled for a GPU.
MIN_DOT = 16


def interpreting() -> bool:
    """Whether triton.language was imported for the interpreter (TRITON_INTERPRET=1 back then)."""
    return isinstance(tl.max, InterpretedFunction)


def next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def dot_flags(dtype: torch.dtype) -> dict[str, Any]:
    """Constexprs telling a kernel in which dtype and precision to run its `tl.dot`s."""
    dot_f32 = interpreting() or dtype == torch.float32
    return {"DOT_F32": dot_f32, "PRECISION": "ieee" if dot_f32 else "tf32"}


def check_pool(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor) -> None:
    """The layout and placement both attention kernels rely on; raises ValueError otherwise."""
    if q.dim() != 3 or k_buf.dim() != 3 or v_buf.shape != k_buf.shape:
        raise ValueError(
            f"expected q [*, H, D] and k/v buffers [S, KVH, D]; got {tuple(q.shape)}, {tuple(k_buf.shape)}"
        )
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_buf.shape[1]
    if k_buf.shape[2] != head_dim or heads % kv_heads:
        raise ValueError(
            f"{heads} query heads of dim {head_dim} cannot attend to {kv_heads} KV heads of dim {k_buf.shape[2]}"
        )
    if head_dim < MIN_DOT or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= {MIN_DOT}; got {head_dim}")
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the k/v buffers must be contiguous in their last dimension")
    if kv_indices.dim() != 2 or kv_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"kv_indices must be a [B, max_len] integer tensor; got {tuple(kv_indices.shape)} {kv_indices.dtype}"
        )
    devices = {t.device for t in (q, k_buf, v_buf, kv_indices)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def check_runnable(q: torch.Tensor) -> None:
    """Raises RuntimeError where the kernels cannot run on q's device in this process."""
    if q.device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "Triton kernels on CPU tensors run only in Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported"
        )
