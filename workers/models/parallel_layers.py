"""Tensor-parallel layers: each rank holds a slice of the checkpoint's weights (the layout is
workers/distributed/parallel.py's) and the forward issues the collectives that make the slices one.

- Column-parallel projections (q/k/v, gate/up, the LM head) are a Linear or FusedLinear holding a
  range of the checkpoint's output rows; their outputs stay split (heads, intermediate features).
- RowParallelLinear (o_proj, down_proj) holds the matching input columns; its partial outputs are
  summed by one all-reduce, the bias added on rank 0 only.
- VocabParallelEmbedding holds a block of vocabulary rows: a token outside it looks up zeros, and
  one all-reduce gives every rank every token's row.
- ParallelLMHead computes its block's logits; one all-gather gives every rank all of them.

A group of one runs the same code with every collective a no-op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels.fp8_ops import Fp8Tensor
from radixserve.kernels.quant_ops import QuantTensor, StripTensor
from radixserve.workers.distributed.group import CommGroup
from radixserve.workers.distributed.parallel import padded_range
from radixserve.workers.models.linear import Linear, Range, narrow


class RowParallelLinear(Linear):
    """Input features `cols` of the checkpoint's [out, in] weight; the output summed over `group`
    when `reduce` (else the caller sums several such partials with one all-reduce).

    Of the ranks whose partials are summed, one holds the bias (`holds_bias`, default: group rank
    0), so that it is added once.
    """

    def __init__(
        self,
        cols: Range,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        group: CommGroup,
        reduce: bool = True,
        holds_bias: bool | None = None,
        device=None,
    ):
        self.holds_bias = group.rank == 0 if holds_bias is None else holds_bias
        super().__init__(cols[1] - cols[0], out_features, bias and self.holds_bias, dtype, device, cols=cols)
        self.group, self.reduce = group, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.group.all_reduce(y) if self.reduce else y

    def load_checkpoint(self, kind: str, tensor: torch.Tensor, part: int | None = None) -> None:
        if kind == "bias" and not self.holds_bias:
            return
        super().load_checkpoint(kind, tensor, part)


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the [vocab, hidden] embedding, padded to an equal block on every rank."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, group: CommGroup):
        super().__init__()
        self.group = group
        self.lo, self.hi, block = padded_range(vocab_size, group.world_size, group.rank)
        self.weight = nn.Parameter(torch.empty(block, hidden_size, dtype=dtype), requires_grad=False)
        self.dtype = dtype
        self.quantized: QuantTensor | StripTensor | Fp8Tensor | None = None  # once quantize_ replaced it

    def quantize_(self, weight: QuantTensor | StripTensor | Fp8Tensor) -> None:
        """Look rows up in `weight` (the loaded table, quantized) from now on; the plain table is
        released."""
        if self.group.world_size != 1:
            raise ValueError("a quantized embedding runs at tp_size 1")
        self.quantized = weight
        self.weight = None  # type: ignore[assignment]
        for name in [n for n in self._buffers if n.startswith("q")]:
            del self._buffers[name]
        for i, t in enumerate(weight.tensors()):
            self.register_buffer(f"q{i}", t, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            rows = self.quantized.dequantize(self.dtype, ids.reshape(-1))
            return rows.view(*ids.shape, rows.shape[-1])
        if self.group.world_size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.lo) & (ids < self.hi)
        rows = F.embedding(torch.where(inside, ids - self.lo, 0), self.weight)
        rows.masked_fill_(~inside.unsqueeze(-1), 0)
        return self.group.all_reduce(rows)

    def load_checkpoint(self, kind: str, tensor: torch.Tensor, part: int | None = None) -> None:
        rows = narrow(tensor, 0, (self.lo, self.hi))
        if kind != "weight" or rows.shape[1:] != self.weight.shape[1:]:
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not fit an embedding")
        with torch.no_grad():
            self.weight[: rows.shape[0]].copy_(rows)
            self.weight[rows.shape[0] :].zero_()


class ParallelLMHead(Linear):
    """Logits for vocabulary rows [lo, hi) of this rank, gathered into [..., vocab] on every rank.

    Tied to the embedding (`tie_`), it multiplies by the embedding's own block: the two share the
    vocabulary split. Padding rows are zero and their logits are cut off after the gather.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, group: CommGroup, tied: bool, device=None
    ):
        lo, hi, block = padded_range(vocab_size, group.world_size, group.rank)
        super().__init__(hidden_size, block, False, dtype, device, rows=(lo, hi), pad_rows=True)
        self.group, self.vocab_size = group, vocab_size
        if tied:  # never materialized: tie_ brings the embedding's
            self.weight = None  # type: ignore[assignment]

    def tie_(self, embedding: VocabParallelEmbedding) -> None:
        """Use the embedding's weight (after the model is materialized: `to_empty` unties)."""
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if self.group.world_size == 1:
            return logits[..., : self.vocab_size]
        return self.group.all_gather(logits, dim=-1)[..., : self.vocab_size]
