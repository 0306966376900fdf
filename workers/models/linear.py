"""The model's projections: Linear (with the packed CPU GEMM) and FusedLinear (q/k/v, gate/up).

q/k/v and gate/up are fused into one Linear each at load time, so a layer issues one GEMM where
Hugging Face issues three. Under tensor parallelism a layer holds a slice of the checkpoint's
weight (`rows` / `cols`, ranges of the checkpoint's output / input features) and
`load_checkpoint` cuts that slice from the full tensor, so a rank keeps only its shard.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import cpu_ops

Range = tuple[int, int]  # [lo, hi)


class Linear(nn.Module):
    """y = x @ W^T + b, W [out_features, in_features] as checkpoints store it.

    `pack_(crossover)` (after loading) adds a copy of W laid out for cpu_ops.packed_linear where
    that kernel exists (bf16 on AVX512-BF16 CPUs): 1.7-2.6x oneDNN at decode row counts, slower at
    prefill sizes. Inputs of fewer than `crossover` rows then take the packed kernel and larger ones
    torch's matmul on the plain W; with `crossover` None the plain W is dropped and the packed
    kernel takes every size, so the weight is held once. float32 rounding differs between the two
    paths only in summation order.

    rows / cols: the checkpoint rows (output features) / columns (input features) this layer holds;
    None = all. With pad_rows, out_features may exceed the rows held; the rest load as zeros.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device=None,
        *,
        rows: Range | None = None,
        cols: Range | None = None,
        pad_rows: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.rows, self.cols, self.pad_rows = rows, cols, pad_rows
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.packed_weight: Any = None  # nn.Parameter once packed
        self.bias_f32: torch.Tensor | None = None
        self.packed_below = 0  # rows < this run packed
        self._kernel: Any = None  # the extension's packed_linear, bound once packed

    @property
    def packed(self) -> bool:
        return self._kernel is not None

    def uses_packed(self, rows: int) -> bool:
        """Whether an input of `rows` rows runs the packed kernel (else torch's matmul)."""
        return rows < self.packed_below

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] < self.packed_below:
            return self._kernel(x, self.packed_weight, self.out_features, self.bias_f32)  # checks x itself
        if self.weight is None:  # packed copy only: any shape, any row count
            return cpu_ops.packed_linear(x, self.packed_weight, self.out_features, self.bias_f32)
        return F.linear(x, self.weight, self.bias)

    def load_checkpoint(self, kind: str, tensor: torch.Tensor, part: int | None = None) -> None:
        """Copy this layer's slice of a full checkpoint tensor (`kind` "weight" or "bias")."""
        if self.rows is not None:
            tensor = narrow(tensor, 0, self.rows)
        if self.cols is not None and kind == "weight":
            tensor = narrow(tensor, 1, self.cols)
        self._copy_into(kind, tensor, 0, self.out_features)

    def _copy_into(self, kind: str, tensor: torch.Tensor, lo: int, hi: int) -> None:
        if self.packed:
            raise RuntimeError("weights are loaded before the layer is packed")
        target = getattr(self, kind)
        if target is None:
            raise ValueError(f"checkpoint has a {kind} that this layer does not expect")
        target = target[lo:hi]
        n = tensor.shape[0]
        fits = n == target.shape[0] or (self.pad_rows and n <= target.shape[0])
        if not fits or tuple(tensor.shape[1:]) != tuple(target.shape[1:]):
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
        with torch.no_grad():
            target[:n].copy_(tensor)
            target[n:].zero_()

    def pack_(self, crossover: int | None = None) -> bool:
        """Add the packed copy if the kernel runs here (False, unchanged, otherwise).

        crossover: rows from which torch's matmul is faster (both copies kept), or None for the
        packed kernel at every size (the plain weight is released).
        """
        if self.packed:
            raise RuntimeError("layer is already packed")
        ops = cpu_ops.native_ops()
        if (
            ops is None
            or not cpu_ops.gemm_available(self.weight.dtype, self.weight.device)
            or self.in_features % 2
        ):
            return False
        self.packed_weight = nn.Parameter(cpu_ops.pack_linear_weight(self.weight.data), requires_grad=False)
        self.bias_f32 = None if self.bias is None else self.bias.float()
        self._kernel = ops.packed_linear
        self.packed_below = sys.maxsize if crossover is None else crossover
        if crossover is None:
            self.weight = None  # type: ignore[assignment]  # the packed copy serves every size
        return True


class FusedLinear(Linear):
    """One Linear whose output rows are the concatenation of several checkpoint Linears.

    `parts` are, in order (q, k, v or gate, up), the rows of each checkpoint part this layer holds:
    all of them, or a rank's slice under tensor parallelism. `load_checkpoint(kind, w, part=i)`
    copies that slice of checkpoint part i into its rows (before `pack_`).
    """

    def __init__(self, in_features: int, parts: Sequence[Range], bias: bool, dtype: torch.dtype, device=None):
        self.parts = list(parts)
        self.offsets = [0]
        for lo, hi in self.parts:
            self.offsets.append(self.offsets[-1] + hi - lo)
        super().__init__(in_features, self.offsets[-1], bias, dtype, device)

    @property
    def num_parts(self) -> int:
        return len(self.parts)

    def load_checkpoint(self, kind: str, tensor: torch.Tensor, part: int | None = None) -> None:
        if part is None:
            raise ValueError("a fused layer loads its checkpoint parts one by one")
        lo, hi = self.parts[part]
        self._copy_into(kind, narrow(tensor, 0, (lo, hi)), self.offsets[part], self.offsets[part + 1])


def narrow(tensor: torch.Tensor, dim: int, rng: Range) -> torch.Tensor:
    """tensor's [lo, hi) along dim, or a clear error where the checkpoint is smaller."""
    lo, hi = rng
    if tensor.dim() <= dim or tensor.shape[dim] < hi:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} has no [{lo}, {hi}) along dim {dim}")
    return tensor.narrow(dim, lo, hi - lo)


def linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device=None) -> Linear:
    return Linear(in_features, out_features, bias, dtype, device)


def whole(size: int) -> Range:
    """All `size` rows of a checkpoint part."""
    return (0, size)
