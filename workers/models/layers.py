"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, the gated activation.

Everything runs in the model dtype except the reductions of RMSNorm (float32, as the reference
implementations do). The elementwise work goes through kernels.cpu_ops (fused C++ where built).
The projections are in linear.py, their tensor-parallel shards in parallel_layers.py.
"""

from __future__ import annotations

import math

import torch
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

    def cos_sin(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions, none above the host-side `max_position` (so that nothing is read back
        from a device) -> contiguous cos, sin of shape [T, head_dim // 2]."""
        if max_position >= self.cos.shape[0]:
            raise ValueError(f"position {max_position} is beyond the context length {self.cos.shape[0]}")
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


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    return cpu_ops.silu_mul(gate_up)
