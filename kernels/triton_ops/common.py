"""What the Triton attention kernels share: how a kernel runs on each device, the pool layout they
accept, and how their dots run.

A kernel body runs compiled for GPU tensors and in Triton's interpreter for CPU tensors, in the
same process and whatever imported triton first (TRITON_INTERPRET is read once, when
triton.language is imported, which a test cannot control). That holds because the bodies call
only triton.language builtins, which the interpreter patches for the length of one launch and
then restores: no jit-decorated helpers (an interpreted body cannot call a compiled one), so
row maxima and sums are `tl.reduce` with the standard combine functions (`MAX`, `SUM`), which is
what `tl.max` / `tl.sum` expand to and what the interpreter recognises and runs in numpy.

The interpreter does no arithmetic on bfloat16 or fp8 (numpy has none): the bodies convert every
load to float32 before use and, interpreted, keep their `tl.dot` operands float32 (`DOT_F32`);
float32 dots ask for "ieee" precision so that neither a GPU nor the interpreter rounds them to
tf32. Compiled, the dots run in q's dtype, an fp8 pool's tiles widened to it after the load.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

MAX = tl.standard._elementwise_max
SUM = tl.standard._sum_combine
# Smallest M, N and K that `tl.dot` accepts when compiled for a GPU.
MIN_DOT = 16


class DualKernel:
    """`kernel.on(tensor)[grid](...)`: compiled (triton.jit) for GPU tensors, interpreted for CPU
    tensors (slow: for tests and debugging)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._compiled = triton.jit(fn)
        self._interpreted = InterpretedFunction(fn)

    def on(self, tensor: torch.Tensor) -> Any:
        return self._interpreted if tensor.device.type == "cpu" else self._compiled


def next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def dot_flags(dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Constexprs telling a kernel in which dtype and precision to run its `tl.dot`s."""
    dot_f32 = device.type == "cpu" or dtype == torch.float32
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
    if k_buf.dtype != v_buf.dtype or k_buf.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"the k/v buffers hold q's dtype {q.dtype} or float8_e4m3fn, not {k_buf.dtype}")
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
