"""Weight-only int8: symmetric per-output-channel quantization and the matmul over it.

A weight W [N, K] becomes Wq int8 [N, K] and scale float32 [N] with
scale[n] = max|W[n, :]| / 127 (1 for an all-zero row) and Wq = round(W / scale) clamped to
[-127, 127]: W ~= Wq * scale[:, None]. `int8_linear` computes x @ (Wq * scale)^T (+ bias) as
(x @ Wq^T) * scale in float32 and rounds once to x's dtype.

Few rows (decode) run csrc/int8_gemm.h, which keeps the weight int8 in memory and widens it in
registers. From INT8_DEQUANT_ROWS rows up the weight is dequantized to x's dtype and fed to
torch's GEMM, which is faster there because its blocking reuses each weight tile across many rows
(the per-call dequantization costs N*K, amortized over the rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_ops

# Rows from which dequantize + torch GEMM beats the fused kernel (load_tests/bench_quant.py
# --crossover measures it; 2-core AVX2 host, SmolLM2-135M shapes, float32 activations).
INT8_DEQUANT_ROWS = 16
_FUSED_DTYPES = (torch.float32, torch.bfloat16)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (Wq int8 [N, K], scale float32 [N])."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    wq = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return wq.contiguous(), scale.contiguous()


def dequantize_int8(
    wq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return (wq.float() * scale[:, None]).to(dtype)


def int8_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    dequant_rows: int = INT8_DEQUANT_ROWS,
) -> torch.Tensor:
    """x [..., K] -> [..., N]; bias float32 [N] or None. Rows < dequant_rows run the fused kernel
    where the extension is built, else the dequantized weight through torch."""
    x2 = x.reshape(-1, x.shape[-1])
    n = wq.shape[0]
    ops = cpu_ops.native_ops()
    fused = ops is not None and x2.device.type == "cpu" and x.dtype in _FUSED_DTYPES
    if fused and x2.shape[0] < dequant_rows:
        y = ops.int8_linear(x2, wq, scale, bias)
    else:
        y = F.linear(x2, dequantize_int8(wq, scale, x.dtype), None if bias is None else bias.to(x.dtype))
    return y.view(*x.shape[:-1], n)


def int8_linear_torch(
    x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The fused kernel's arithmetic in torch: (x @ Wq^T) * scale (+ bias) in float32."""
    y = (x.float() @ wq.float().T) * scale
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)
