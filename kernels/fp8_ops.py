"""fp8 (e4m3) weights with a float32 scale per output channel, and the matmul over them.

    W[n, k] = scale[n] * float(q[n, k])        q: float8_e4m3fn [N, K], scale: float32 [N]

A checkpoint's per-tensor scale is the same value in every row. On a GPU with fp8 tensor cores
(compute capability 8.9 and up) `linear` runs `torch._scaled_mm`: x is rounded to e4m3 with a
scale of its own (per row where the GPU takes row-wise scales, 9.0 and up; per tensor otherwise,
where the weight's scale must then be one value too) and the product is scaled back in the
GEMM's epilogue, as vLLM and SGLang compute fp8 checkpoints. Elsewhere (the CPU, older GPUs,
shapes cuBLAS does not take) the weight is cast to x's dtype and multiplied densely: exact for
the weight (every e4m3 value is a bfloat16 one), and half the weight memory of bf16 at rest,
but without a speed-up. On the CPU int8 (quant_ops) has kernels and is the faster 8-bit format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# cuBLASLt's fp8 GEMM takes K and N in multiples of 16.
_SCALED_MM_ALIGN = 16


@dataclass(frozen=True)
class Fp8Tensor:
    qweight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]
    per_tensor: bool = field(init=False)  # one scale for all rows

    def __post_init__(self) -> None:
        if self.qweight.dim() != 2 or self.qweight.dtype != FP8:
            raise ValueError(f"an fp8 weight must be a 2-D {FP8} tensor, got {self.qweight.dtype}")
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (self.n,):
            raise ValueError(
                f"an fp8 weight's scale must be float32 [{self.n}], got {list(self.scale.shape)}"
            )
        object.__setattr__(self, "per_tensor", bool((self.scale == self.scale[:1]).all()))

    @property
    def n(self) -> int:
        return self.qweight.shape[0]

    @property
    def k(self) -> int:
        return self.qweight.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scale]

    def same_layout(self, other: object) -> bool:
        """Whether rows of `other` can sit under rows of this one (`cat`)."""
        return isinstance(other, Fp8Tensor) and other.k == self.k

    @staticmethod
    def cat(parts: Sequence[Fp8Tensor]) -> Fp8Tensor:
        """One weight whose rows are the parts' rows in order."""
        if not all(parts[0].same_layout(p) for p in parts):
            raise ValueError("only fp8 weights of one K are joined")
        return Fp8Tensor(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]))

    def to(self, device: torch.device | str) -> Fp8Tensor:
        if self.qweight.device == torch.device(device):
            return self
        return Fp8Tensor(self.qweight.to(device), self.scale.to(device))

    def narrow(self, rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> Fp8Tensor:
        """Output rows [lo, hi) and input features [lo, hi): a tensor-parallel rank's slice (a
        row's scale covers all its columns, so any slice is exact)."""
        q, s = self.qweight, self.scale
        if rows is not None:
            q, s = q[rows[0] : rows[1]], s[rows[0] : rows[1]]
        if cols is not None:
            q = q[:, cols[0] : cols[1]]
        return Fp8Tensor(q.contiguous(), s.contiguous())

    def dequantize(
        self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """W (or its rows `rows`) as a dense tensor of `dtype`, through float32: the same values a
        checkpoint's weight times its scale give."""
        q, s = (self.qweight, self.scale) if rows is None else (self.qweight[rows], self.scale[rows])
        return (q.float() * s[:, None]).to(dtype)

    def linear(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        dequant_rows: int | None = None,
        int8_activations: bool = False,
    ) -> torch.Tensor:
        """x [..., K] @ W^T (+ bias float32 [N]) -> [..., N] in x's dtype."""
        if int8_activations:
            raise ValueError("int8 activations multiply integer weights, not fp8 ones")
        x2 = x.reshape(-1, x.shape[-1])
        mode = scaled_mm_mode(x2, self)
        if mode is not None:
            y = _scaled_mm(x2, self, rowwise=mode == "row")
            if bias is not None:
                y = y + bias.to(y.dtype)
        else:
            b = None if bias is None else bias.to(x.dtype)
            y = F.linear(x2, self.dequantize(x.dtype), b)
        return y.view(*x.shape[:-1], self.n)


def scaled_mm_mode(x: torch.Tensor, w: Fp8Tensor) -> str | None:
    """How `torch._scaled_mm` takes x [M, K] @ w: "row" (per-row scales for x, per-channel for
    w), "tensor" (one scale each), or None where it does not run (not a GPU with fp8 tensor
    cores, a dtype or shape cuBLAS does not take, per-channel scales without row-wise support)."""
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    if w.k % _SCALED_MM_ALIGN or w.n % _SCALED_MM_ALIGN:
        return None
    major, minor = torch.cuda.get_device_capability(x.device)
    if (major, minor) < (8, 9):
        return None
    if major >= 9 and x.dtype == torch.bfloat16:
        return "row"
    return "tensor" if w.per_tensor else None


def _scaled_mm(x: torch.Tensor, w: Fp8Tensor, rowwise: bool) -> torch.Tensor:
    xf = x.float()
    if rowwise:
        amax = xf.abs().amax(dim=1, keepdim=True)
        scale_b = w.scale[None, :]
    else:
        amax = xf.abs().amax().reshape(1, 1)
        scale_b = w.scale[:1].reshape(())
    sx = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    xq = (xf / sx).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    scale_a = sx if rowwise else sx.reshape(())
    return torch._scaled_mm(xq, w.qweight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)


def quantize_fp8(w: torch.Tensor) -> Fp8Tensor:
    """Per-output-channel e4m3 of W [N, K] (any float dtype): scale[n] = max|W[n, :]| / 448 (1 for
    an all-zero row), q = W / scale rounded to the nearest e4m3."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Tensor(q.contiguous(), scale.contiguous())


def fp8_reference_linear(x: torch.Tensor, w: Fp8Tensor, rowwise: bool) -> torch.Tensor:
    """What `_scaled_mm` computes, in float32 on any device: x rounded to e4m3 with its scale(s),
    times the weight's e4m3 values, both scales applied to the float32 product (for tests and
    the GPU check)."""
    xf = x.reshape(-1, x.shape[-1]).float()
    amax = xf.abs().amax(dim=1, keepdim=True) if rowwise else xf.abs().amax().reshape(1, 1)
    sx = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    xq = (xf / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
    sw = w.scale if rowwise else w.scale[:1].expand(w.n)
    return (xq @ w.qweight.float().t()) * sx * sw[None, :]
