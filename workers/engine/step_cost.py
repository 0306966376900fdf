"""What a step costs, learned from the steps run: the prefill budget of a mixed step.

A mixed step (enable_mixed_chunk) carries every running decode and a chunk of prefill tokens. The
decodes' next tokens wait for the whole step, so the prefill tokens it carries set their
inter-token latency. The budget keeps a mixed step of d decodes near `ratio` times the time of a
decode step of d:

    step(rows) = base + rows * per_row          (rows: the step's tokens, decodes and prefill)
    prefill tokens = (ratio - 1) * step(d) / per_row

`base` is what every forward pays whatever its rows (reading the weights, the per-step host
work), `per_row` what each token adds (its GEMM rows, its attention). Both are moving averages
of the steps timed (forward plus sampling): decode steps of a few rows refine `base`, steps of
more rows `per_row` (as a ratio of two averages, time past `base` over rows, so that one odd step
does not swing it). Attention makes a row dearer as contexts grow; the averages follow the workload.
"""

from __future__ import annotations

from radixserve.workers.executor.plan import BatchKind, ScheduledBatch

# Weight of the newest observation in the moving averages.
EWMA = 0.2
# Decode steps of at most this many rows refine `base`; steps of more rows `per_row`.
SMALL_STEP_ROWS = 16
# Fewest prefill tokens a mixed step carries, whatever the times say: below this the prompts
# waiting behind running decodes would advance by too little per step to be worth a forward.
MIN_MIXED_TOKENS = 32
# A step's time past `base` counts as at least this share of the step (timer noise can make a
# step look free, which would make the next budget unbounded).
MIN_ROWS_SHARE = 0.05


class StepCost:
    def __init__(self, ratio: float):
        self.ratio = ratio  # <= 1: no adaptation, a mixed step takes the configured budget
        self.base_s: float | None = None
        self._extra_s = 0.0  # average time past `base`, over the larger steps
        self._rows = 0.0  # average rows of those steps

    @property
    def per_row_s(self) -> float | None:
        return self._extra_s / self._rows if self._rows else None

    def decode_s(self, decodes: int) -> float | None:
        """The estimated time of a decode step of `decodes` sequences."""
        per_row = self.per_row_s
        if self.base_s is None or per_row is None:
            return None
        return self.base_s + decodes * per_row

    def observe(self, plan: ScheduledBatch, seconds: float) -> None:
        """A step's forward and sampling took `seconds`."""
        rows = plan.num_tokens
        if seconds <= 0 or rows <= 0:
            return
        per_row = self.per_row_s
        if rows <= SMALL_STEP_ROWS:
            if plan.kind is not BatchKind.DECODE:
                return  # a short prompt: its first step pays one-time costs that are not `base`
            base = seconds - rows * per_row if per_row is not None else seconds
            self.base_s = _avg(self.base_s, max(base, MIN_ROWS_SHARE * seconds))
            return
        extra = max(seconds - (self.base_s or 0.0), MIN_ROWS_SHARE * seconds)
        if per_row is None:
            self._extra_s, self._rows = extra, float(rows)
        else:
            self._extra_s = _avg(self._extra_s, extra)
            self._rows = _avg(self._rows, float(rows))

    def mixed_budget(self, decodes: int, cap: int) -> int:
        """Prefill tokens for a step that carries `decodes` decodes, at most `cap`."""
        per_row = self.per_row_s
        if self.ratio <= 1 or per_row is None:
            return cap  # not adapting, or no larger step timed yet (nothing to go by)
        decode = self.decode_s(decodes)
        if decode is None:
            return min(MIN_MIXED_TOKENS, cap)  # no small step timed yet: keep it small
        tokens = int((self.ratio - 1) * decode / per_row)
        return max(min(tokens, cap), min(MIN_MIXED_TOKENS, cap))


def _avg(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new
