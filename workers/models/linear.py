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

    `pack_(None, fixed_order=True)` binds the kernel's fixed-order variant instead: every output
    element sums over K in one order whatever the row count, so a row's result is bitwise the same
    alone or beside any other rows (the default variant's order follows its row tile). On AMX CPUs
    that variant runs on tiles, at torch's speed for prefill sizes. Deterministic engines pack
    every projection that way (`pack_batch_invariant`).

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
        self.fixed_order = False
        self._kernel: Any = None  # the extension's packed_linear, bound once packed
        self.quantized: nn.Module | None = None  # computes the forward in place of W once quantized
        # Adds the LoRA deltas of the running batch's adapters to the output (workers/lora/).
        self.lora: Any = None

    @property
    def packed(self) -> bool:
        return self._kernel is not None

    def uses_packed(self, rows: int) -> bool:
        """Whether an input of `rows` rows runs the packed kernel (else torch's matmul)."""
        return rows < self.packed_below

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        if self.lora is not None:
            self.lora.add_(x, y)
        return y

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x)
        if x.dim() == 2 and x.shape[0] < self.packed_below:
            return self._kernel(x, self.packed_weight, self.out_features, self.bias_f32)  # checks x itself
        if self.weight is None:  # packed copy only: any shape, any row count
            return cpu_ops.packed_linear(
                x, self.packed_weight, self.out_features, self.bias_f32, self.fixed_order
            )
        return F.linear(x, self.weight, self.bias)

    def load_checkpoint(self, kind: str, tensor: torch.Tensor, part: int | None = None) -> None:
        """Copy this layer's slice of a full checkpoint tensor (`kind` "weight" or "bias")."""
        if self.rows is not None:
            tensor = narrow(tensor, 0, self.rows)
        if self.cols is not None and kind == "weight":
            tensor = narrow(tensor, 1, self.cols)
        self._copy_into(kind, tensor, 0, self.out_features)

    def _copy_into(self, kind: str, tensor: torch.Tensor, lo: int, hi: int) -> None:
        if self.packed or self.quantized is not None:
            raise RuntimeError("weights are loaded before the layer is packed or quantized")
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

    def pack_(self, crossover: int | None = None, fixed_order: bool = False) -> bool:
        """Add the packed copy if the kernel runs here (False, unchanged, otherwise).

        crossover: rows from which torch's matmul is faster (both copies kept), or None for the
        packed kernel at every size (the plain weight is released). fixed_order: the kernel's
        row-count-independent variant (only with crossover None: torch's matmul has no such order).
        """
        if self.packed:
            raise RuntimeError("layer is already packed")
        if self.quantized is not None:
            return False  # the quantized weight has kernels of its own
        if fixed_order and crossover is not None:
            raise ValueError("a fixed-order layer runs the packed kernel at every size (crossover None)")
        ops = cpu_ops.native_ops()
        if (
            ops is None
            or not cpu_ops.gemm_available(self.weight.dtype, self.weight.device)
            or self.in_features % 2
        ):
            return False
        self.packed_weight = nn.Parameter(cpu_ops.pack_linear_weight(self.weight.data), requires_grad=False)
        self.bias_f32 = None if self.bias is None else self.bias.float()
        self.fixed_order = fixed_order
        self._kernel = ops.packed_linear_fixed if fixed_order else ops.packed_linear
        self.packed_below = sys.maxsize if crossover is None else crossover
        if crossover is None:
            self.weight = None  # type: ignore[assignment]  # the packed copy serves every size
        return True

    def quantize_(self, quantized: nn.Module) -> None:
        """Compute through `quantized` (built from this layer's loaded weight and bias) from now
        on; the plain weight is released."""
        if self.packed:
            raise RuntimeError("a packed layer is not quantized")
        self.quantized = quantized
        self.weight = None  # type: ignore[assignment]
        self.bias = None


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


def pack_batch_invariant(model: nn.Module) -> None:
    """Pack every projection of `model` (after loading) with the fixed-order kernel at every row
    count, so that no projection's output row depends on the other rows of its batch. Raises
    ValueError where a projection cannot run that kernel (it needs bfloat16 weights with an even
    in_features on a CPU with AVX512-BF16, and the CPU extension)."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and not module.pack_(None, fixed_order=True):
            weight = module.packed_weight if module.weight is None else module.weight
            raise ValueError(
                f"deterministic mode needs the fixed-order bf16 GEMM for every projection, and {name} "
                f"({weight.dtype} on {weight.device}, in_features {module.in_features}) cannot run it: "
                "it runs bfloat16 weights (dtype auto or bfloat16) on a CPU with AVX512-BF16"
            )


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
