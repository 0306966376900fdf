"""The scheduler's plan for one step: which sequences run, and which positions each computes.

The scheduler (engine/scheduler.py) returns it; only the executor turns it into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.workers.batch_kind import BatchKind

if TYPE_CHECKING:
    from radixserve.workers.engine.request import Req

__all__ = ["BatchKind", "ScheduledBatch"]


@dataclass
class ScheduledBatch:
    """A plan: for each request, compute positions [start, start + extend_len)."""

    kind: BatchKind
    reqs: list[Req]
    starts: list[int]
    extend_lens: list[int]
    # Requests whose last computed position this step is the last of their sequence: a token is
    # sampled for them. The others are mid-way through a chunked prefill.
    sample_mask: list[bool] = field(default_factory=list)
    # Positions whose logits are also returned for prompt logprobs (Req.input_logprob_span).
    input_logprob_rows: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)
