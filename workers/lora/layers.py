"""Batched LoRA deltas: every adapter of a batch in two GEMMs per projection.

Each adapted projection holds the adapters of the batch slots (`max_loras_per_batch` of them) in
one stacked buffer, each zero-padded to the maximum rank R:

    A  [S, in, P, R]      (P fused parts: q/k/v, gate/up; one otherwise)
    B  [S, R, out_p]      per part

Three forms, chosen once per batch (LoRABatch.of), the same arithmetic:

- one adapter for every token: its own blocks, `x @ A[s]^T`, then `xa_p @ B_p[s]` per part;
- segmented (SGMV's shape; prefill): the batch's runs of tokens of one adapter (a request's
  prompt chunk) each take their adapter's blocks on their own rows, in place; used when the runs
  are long enough (MIN_RUN_TOKENS on average) to keep the calls few for the rows they cover;
- gathered (decode, one token per request): the batch's rows are gathered once per
  projection into [hi, G, in] (slot by slot, G = the most rows one slot has, padded with a zero
  row), one batched GEMM shrinks them by each slot's A, one batched GEMM per part expands them by
  each slot's B, and one index_add puts every row's delta back: a handful of calls however many
  adapters the batch mixes, and no row computed with another's adapter. On CPU, where the
  extension is built, one fused call does the same (kernels/csrc/lora.h: each row streams its
  adapter's A and B, sums in float32), at half the gathered torch calls' time or less.

Tokens of the base model have no slot: no run, no gathered row. On CUDA the Triton kernels of
kernels/triton_ops/lora.py take every form's place: each token reads its own adapter's blocks
(BGMV's shape), in two launches plus one per part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.kernels import cpu_ops
from radixserve.workers.lora.adapter import ModuleLoRA
from radixserve.workers.models.linear import FusedLinear, Linear

# Segmented form when the runs of one adapter's tokens average at least this many tokens.
MIN_RUN_TOKENS = 16


@dataclass
class LoRABatch:
    """The adapter slots of one forward's tokens, built once and read by every projection."""

    hi: int  # slots [0, hi) are used
    token_slots: list[int]  # each token's slot, -1 for the base model (what the TP wire sends)
    single: int | None = None  # every token uses this slot
    runs: list[tuple[int, int, int]] | None = None  # segmented: (slot, first row, end row)
    # gathered: rows by slot, [hi * G] indices into x with a zero row appended (index T: padding),
    # and where each gathered row's delta goes (padding to row 0: its delta is zero).
    gather: torch.Tensor | None = None
    scatter: torch.Tensor | None = None
    group: int = 0  # G
    # On CUDA: token_slots as a device tensor, for the Triton kernel (kernels/triton_ops/lora.py),
    # which reads each token's adapter itself whatever the batch mixes.
    device_slots: torch.Tensor | None = None
    # Gathered on CPU: token_slots as a tensor, for the fused kernel (kernels/csrc/lora.h).
    slots_cpu: torch.Tensor | None = None

    @classmethod
    def of(cls, token_slots: list[int], dtype: torch.dtype, device: torch.device) -> LoRABatch | None:
        """`token_slots[t]`: the slot of token t, -1 for the base model; None when none has one."""
        used = {s for s in token_slots if s >= 0}
        if not used:
            return None
        hi = max(used) + 1
        if device.type == "cuda":
            slots = torch.tensor(token_slots, dtype=torch.int32, device=device)
            return cls(hi, token_slots, device_slots=slots)
        if len(used) == 1 and min(token_slots) >= 0:
            return cls(hi, token_slots, single=token_slots[0])
        runs: list[tuple[int, int, int]] = []
        for t, s in enumerate(token_slots):
            if s < 0:
                continue
            if runs and runs[-1][0] == s and runs[-1][2] == t:
                runs[-1] = (s, runs[-1][1], t + 1)
            else:
                runs.append((s, t, t + 1))
        if sum(e - b for _, b, e in runs) >= MIN_RUN_TOKENS * len(runs):
            return cls(hi, token_slots, runs=runs)
        rows: list[list[int]] = [[] for _ in range(hi)]
        for t, s in enumerate(token_slots):
            if s >= 0:
                rows[s].append(t)
        group = max(len(r) for r in rows)
        pad = len(token_slots)
        gather = [t for r in rows for t in r + [pad] * (group - len(r))]
        scatter = [0 if t == pad else t for t in gather]
        return cls(
            hi,
            token_slots,
            slots_cpu=torch.tensor(token_slots, dtype=torch.int64) if device.type == "cpu" else None,
            gather=torch.tensor(gather, dtype=torch.int64, device=device),
            scatter=torch.tensor(scatter, dtype=torch.int64, device=device),
            group=group,
        )


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
        self._offsets = [lo for lo, _ in self.outs]
        self.ctx, self.slots, self.rank = ctx, slots, rank
        parts = len(self.outs)
        self.A = torch.zeros(slots, linear.in_features, parts, rank, dtype=dtype, device=device)
        self.B = [torch.zeros(slots, rank, hi - lo, dtype=dtype, device=device) for lo, hi in self.outs]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.A, *self.B])

    def set_slot(self, slot: int, weights: ModuleLoRA | None) -> None:
        """Copy an adapter's weights of this projection into `slot` (zeros where it has none)."""
        self.A[slot].zero_()
        for b in self.B:
            b[slot].zero_()
        if weights is None:
            return
        for part, (a, b) in weights.parts.items():
            p = 0 if part is None else part
            r = a.shape[0]
            self.A[slot, :, p, :r].copy_(a.T)
            self.B[p][slot, :r].copy_(b.T)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the LoRA delta of x under the current batch's adapters (in place)."""
        batch = self.ctx.batch
        if batch is None:
            return
        parts, r = len(self.outs), self.rank
        if batch.device_slots is not None:
            from radixserve.kernels.triton_ops.lora import lora_add

            lora_add(x, y, self.A, self.B, self.outs, batch.device_slots)
            return
        if batch.single is not None:
            self._add_one(x, y, batch.single)
            return
        if batch.runs is not None:
            for s, b, e in batch.runs:
                self._add_one(x[b:e], y[b:e], s)
            return
        n, g = batch.hi, batch.group
        assert batch.gather is not None and batch.scatter is not None
        if batch.slots_cpu is not None and cpu_ops.lora_bgmv_(
            x, y, self.A.view(self.slots, -1, parts * r), self.B, self._offsets, batch.slots_cpu
        ):
            return
        xg = torch.cat([x, x.new_zeros(1, x.shape[1])])[batch.gather].view(n, g, -1)
        xa = torch.bmm(xg, self.A[:n].view(n, -1, parts * r))  # [n, G, P*R]
        deltas = [torch.bmm(xa[:, :, p * r : (p + 1) * r], self.B[p][:n]) for p in range(parts)]
        delta = deltas[0] if parts == 1 else torch.cat(deltas, dim=2)  # [n, G, out]
        y.index_add_(0, batch.scatter, delta.view(n * g, -1))

    def _add_one(self, x: torch.Tensor, y: torch.Tensor, s: int) -> None:
        """y += the delta of the adapter in slot `s` for every row of x."""
        r = self.rank
        xa = x @ self.A[s].view(-1, len(self.outs) * r)
        for p, (lo, hi) in enumerate(self.outs):
            y[:, lo:hi].addmm_(xa[:, p * r : (p + 1) * r], self.B[p][s])
