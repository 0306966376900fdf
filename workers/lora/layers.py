"""Batched LoRA deltas: every adapter of a batch in two GEMMs per projection.

Each adapted projection holds the adapters of the batch slots (`max_loras_per_batch` of them) in
one stacked buffer, each zero-padded to the maximum rank R:

    A  [S, P, R, in]      (P fused parts: q/k/v, gate/up; one otherwise)
    B  [out_p, S, R]      per part

A batch whose tokens use slots [0, hi) computes `xa = x @ A[:hi]^T` (one shrink GEMM for all its
adapters and parts), zeroes in each token's row the blocks of the slots it does not use (the
gathered form of BGMV: a token x slot mask built once per batch), and adds `xa_p @ B_p[:, :hi]^T`
into each part's output columns (one expand GEMM per part). The cost is that of one adapter of
rank hi * R, whatever the mix; a batch of one adapter skips the mask and takes its own blocks only.
Tokens of the base model have no slot: their mask row is zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.workers.lora.adapter import ModuleLoRA
from radixserve.workers.models.linear import FusedLinear, Linear


@dataclass
class LoRABatch:
    """The adapter slots of one forward's tokens, built once and read by every projection."""

    hi: int  # slots [0, hi) are used
    single: int | None  # every token uses this slot: no mask
    mask: torch.Tensor | None  # [T, hi, 1] in the model's dtype: 1 where the token uses the slot

    @classmethod
    def of(cls, token_slots: list[int], dtype: torch.dtype, device: torch.device) -> LoRABatch | None:
        """`token_slots[t]`: the slot of token t, -1 for the base model; None when none has one."""
        used = {s for s in token_slots if s >= 0}
        if not used:
            return None
        hi = max(used) + 1
        if len(used) == 1 and min(token_slots) >= 0:
            return cls(hi, token_slots[0], None)
        idx = torch.tensor(token_slots, dtype=torch.int64, device=device)
        mask = (idx.unsqueeze(1) == torch.arange(hi, device=device)).to(dtype).unsqueeze(-1)
        return cls(hi, None, mask)


class LoRAContext:
    """What the model's adapted projections read: the batch now running (None: no adapter)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRAProjection:
    """The slot buffers of one projection, and the delta it adds to the projection's output."""

    def __init__(self, linear: Linear, ctx: LoRAContext, slots: int, rank: int, dtype: torch.dtype, device):
        if isinstance(linear, FusedLinear):
            self.outs = [(linear.offsets[p], linear.offsets[p + 1]) for p in range(linear.num_parts)]
        else:
            self.outs = [(0, linear.out_features)]
        self.fused = isinstance(linear, FusedLinear)
        self.ctx, self.slots, self.rank = ctx, slots, rank
        parts = len(self.outs)
        self.A = torch.zeros(slots, parts, rank, linear.in_features, dtype=dtype, device=device)
        self.B = [torch.zeros(hi - lo, slots, rank, dtype=dtype, device=device) for lo, hi in self.outs]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.A, *self.B])

    def set_slot(self, slot: int, weights: ModuleLoRA | None) -> None:
        """Copy an adapter's weights of this projection into `slot` (zeros where it has none)."""
        self.A[slot].zero_()
        for b in self.B:
            b[:, slot].zero_()
        if weights is None:
            return
        for part, (a, b) in weights.parts.items():
            p = 0 if part is None else part
            r = a.shape[0]
            self.A[slot, p, :r].copy_(a)
            self.B[p][:, slot, :r].copy_(b)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the LoRA delta of x under the current batch's adapters (in place)."""
        batch = self.ctx.batch
        if batch is None:
            return
        tokens, parts, r = x.shape[0], len(self.outs), self.rank
        if batch.single is not None:
            s = batch.single
            xa = x @ self.A[s].view(parts * r, -1).T
            for p, (lo, hi) in enumerate(self.outs):
                y[:, lo:hi].addmm_(xa[:, p * r : (p + 1) * r], self.B[p][:, s].T)
            return
        n = batch.hi
        xa = (x @ self.A[:n].view(n * parts * r, -1).T).view(tokens, n, parts * r)
        assert batch.mask is not None
        xa = (xa * batch.mask).view(tokens, n, parts, r)
        for p, (lo, hi) in enumerate(self.outs):
            y[:, lo:hi].addmm_(xa[:, :, p].reshape(tokens, n * r), self.B[p][:, :n].reshape(hi - lo, n * r).T)
