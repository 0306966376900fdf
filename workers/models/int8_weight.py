"""Weight-only int8 for the model's projections: each Linear's weight quantized at load, per
output channel (kernels/int8_ops.py's scheme), computed by the int8 kernels.

Only the projections are quantized (q/k/v, o, gate/up, down); the embedding, a tied LM head and
the norms keep the model dtype. Under tensor parallelism each rank quantizes the slice it holds
(a row's scale is over the columns that rank holds).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.kernels import int8_ops

QUANTIZATIONS = ("none", "int8")


class Int8Weight(nn.Module):
    """y = x @ (Wq * scale)^T (+ bias): Wq int8 [N, K], scale float32 [N], bias float32 [N]."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias_f32 = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Weight:
        qweight, scale = int8_ops.quantize_int8(weight)
        return cls(qweight, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_ops.int8_linear(x, self.qweight, self.scale, self.bias_f32)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return int8_ops.dequantize_int8(self.qweight, self.scale, dtype)


def check_quantization(quantization: str, deterministic: bool = False) -> str:
    """The quantization name, or ValueError for one this build does not run."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
    if quantization != "none" and deterministic:
        raise ValueError(
            "deterministic mode runs the fixed-order bf16 GEMM and does not take quantized weights"
        )
    return quantization


def quantize_int8_(model: nn.Module) -> int:
    """Quantize every projection of a loaded `model` in place; returns how many."""
    from radixserve.workers.models.linear import Linear

    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.quantize_(Int8Weight.quantize(module.weight.data, module.bias))
            count += 1
    return count
