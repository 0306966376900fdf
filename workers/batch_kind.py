"""BatchKind: what one step computes, as the scheduler plans it and the model runs it.

It sits below every layer of the workers and imports nothing, so that the torch-free scheduler
(engine/scheduler.py, through executor/plan.py) and the models' attention (models/, which import
nothing of the executor) name a batch's kind with the one enum.
"""

from __future__ import annotations

import enum


class BatchKind(enum.Enum):
    PREFILL = "prefill"  # new tokens after a (possibly empty) cached prefix, in one or more chunks
    DECODE = "decode"  # exactly one new token per sequence
