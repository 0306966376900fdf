"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, fused projections.

Everything runs in the model dtype except the reductions of RMSNorm (float32, as the reference
implementations do). The elementwise work goes through kernels.cpu_ops (fused C++ where built).
q/k/v and gate/up are fused into one Linear each at load time, so a layer issues one GEMM where
Hugging Face issues three.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import cpu_ops
from radixserve.workers.models.config import RopeConfig


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim, computed in float32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """residual += delta (in place), then return the normalized residual."""
        return cpu_ops.add_rms_norm_(residual, delta, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) with a precomputed cos/sin table.

    The table holds every position up to `max_positions` in the model dtype, so a forward pass
    costs one gather per batch (`cos_sin`) and one in-place op per layer (`apply_`).
    """

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, dtype: torch.dtype, device=None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, rope)
        # Computed on the CPU even while the model is being built under torch.device("meta").
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        # Plain attributes, not buffers: they are derived, never loaded or saved.
        self.cos = freqs.cos().to(dtype=dtype, device=device)
        self.sin = freqs.sin().to(dtype=dtype, device=device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> contiguous cos, sin of shape [T, head_dim // 2]."""
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(
                f"position {int(positions.max())} is beyond the context length {self.cos.shape[0]}"
            )
        return self.cos[positions], self.sin[positions]

    @staticmethod
    def apply_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [T, heads, head_dim] in place (x may be a strided view of the qkv output)."""
        cpu_ops.rotary_(x, cos, sin)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies per rotary pair, with linear or Llama-3 frequency scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: wavelengths longer than the original context are stretched by `factor`,
    # shorter than original/high_freq_factor are kept, and the band between is interpolated.
    old_len = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    long_wavelen = old_len / rope.low_freq_factor
    short_wavelen = old_len / rope.high_freq_factor
    scaled = torch.where(wavelen > long_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(in_band, blended, scaled)


class Linear(nn.Module):
    """y = x @ W^T + b, W [out_features, in_features] as checkpoints store it.

    `pack_(crossover)` (after loading) adds a copy of W laid out for cpu_ops.packed_linear where
    that kernel exists (bf16 on AVX512-BF16 CPUs): 1.7-2.6x oneDNN at decode row counts, slower at
    prefill sizes. Inputs of fewer than `crossover` rows then take the packed kernel and larger ones
    torch's matmul on the plain W; with `crossover` None the plain W is dropped and the packed
    kernel takes every size, so the weight is held once. float32 rounding differs between the two
    paths only in summation order.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
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

    def pack_(self, crossover: int | None = None) -> bool:
        """Add the packed copy if the kernel runs here (False, unchanged, otherwise).

        crossover: rows from which torch's matmul is faster (both copies kept), or None for the
        packed kernel at every size (the plain weight is released).
        """
        if self.packed:
            raise RuntimeError("layer is already packed")
        if not cpu_ops.gemm_available(self.weight.dtype, self.weight.device) or self.in_features % 2:
            return False
        self.packed_weight = nn.Parameter(cpu_ops.pack_linear_weight(self.weight.data), requires_grad=False)
        self.bias_f32 = None if self.bias is None else self.bias.float()
        self._kernel = cpu_ops.native_ops().packed_linear
        self.packed_below = sys.maxsize if crossover is None else crossover
        if crossover is None:
            self.weight = None  # type: ignore[assignment]  # the packed copy serves every size
        return True


class FusedLinear(Linear):
    """One Linear whose output rows are the concatenation of several checkpoint Linears.

    `shard_sizes` are the output sizes of the parts in order (q, k, v or gate, up);
    `load_shard(i, w)` copies checkpoint part i into its rows (before `pack_`).
    """

    def __init__(
        self, in_features: int, shard_sizes: Sequence[int], bias: bool, dtype: torch.dtype, device=None
    ):
        self.shard_sizes = list(shard_sizes)
        self.offsets = [0]
        for n in self.shard_sizes:
            self.offsets.append(self.offsets[-1] + n)
        super().__init__(in_features, self.offsets[-1], bias, dtype, device)

    def load_shard(self, index: int, param_name: str, tensor: torch.Tensor) -> None:
        if self.packed:
            raise RuntimeError("weights are loaded before the layer is packed")
        target = self.weight if param_name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {param_name} that this layer does not expect")
        lo, hi = self.offsets[index], self.offsets[index + 1]
        if tuple(tensor.shape) != (hi - lo, *target.shape[1:]):
            raise ValueError(
                f"shard {index} {param_name}: shape {tuple(tensor.shape)} != {(hi - lo, *target.shape[1:])}"
            )
        with torch.no_grad():
            target[lo:hi].copy_(tensor)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    return cpu_ops.silu_mul(gate_up)


def linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device=None) -> Linear:
    return Linear(in_features, out_features, bias, dtype, device)
