"""Prompt logprobs, computed in the prefill's own forward: the extra logits rows a step returns for
the sequences that asked for them, and the logprobs those rows give.

A step's logits are its B sampled rows (one per sequence, as always) followed by these rows, one
per prompt position p of `Req.input_logprob_span`; the logits at p give the logprob of prompt
token p + 1. A step with no such sequence has no such row and costs nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixserve.workers.executor.plan import BatchKind, ScheduledBatch
from radixserve.workers.protocol import TokenLogprob
from radixserve.workers.sampling.sampler import MIN_LOGPROB

if TYPE_CHECKING:
    from radixserve.workers.engine.request import Req


@dataclass
class InputLogprobRows:
    """Which of a step's token rows give prompt logprobs, and of which tokens."""

    token_rows: list[int] = field(default_factory=list)  # rows of the step's tokens, in order
    targets: list[int] = field(default_factory=list)  # the prompt token each row predicts
    # Per sequence, in row order: (sequence, first position, rows, alternatives wanted)
    spans: list[tuple[Req, int, int, int]] = field(default_factory=list)

    @classmethod
    def from_plan(cls, plan: ScheduledBatch) -> InputLogprobRows | None:
        """The rows of `plan`, or None when no sequence in it wants any."""
        if plan.kind is not BatchKind.PREFILL or not plan.input_logprob_rows:
            return None
        out = cls()
        offset = 0
        for req, start, n in zip(plan.reqs, plan.starts, plan.extend_lens):
            lo, hi = req.input_logprob_span(start, start + n)
            if hi > lo:
                out.token_rows.extend(range(offset + lo - start, offset + hi - start))
                out.targets.extend(req.origin_input_ids[lo + 1 : hi + 1])
                out.spans.append((req, lo, hi - lo, req.params.top_logprobs))
            offset += n
        return out if out.spans else None

    def compute(self, logits: torch.Tensor) -> list[tuple[Req, int, list[TokenLogprob]]]:
        """From these rows' logits (the model's own distribution, in float32): per sequence, its
        first position and the logprobs of the prompt tokens after it (read back to the host)."""
        rows = logits.float().nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
        lp = rows.log_softmax(-1).nan_to_num(nan=MIN_LOGPROB).clamp(min=MIN_LOGPROB)
        targets = torch.tensor(self.targets, dtype=torch.int64, device=lp.device)
        chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
        k = max(top for _, _, _, top in self.spans)
        top_v: list[list[float]] = []
        top_i: list[list[int]] = []
        if k:
            best_v, best_i = lp.topk(k, -1)
            top_v, top_i = best_v.tolist(), best_i.tolist()
        out = []
        row = 0
        for req, first, count, top in self.spans:
            values = [
                TokenLogprob(
                    self.targets[j],
                    chosen[j],
                    list(zip(top_i[j][:top], top_v[j][:top])) if top else [],
                )
                for j in range(row, row + count)
            ]
            out.append((req, first, values))
            row += count
        return out
