"""Per-step timings, kept for metrics and benchmarks.

Per step: `schedule` is host time on the critical path (step-boundary housekeeping, scheduling,
building tensors, token-level updates), `forward` and `sample` the model and the sampler, `text`
the text-level work (detokenization, stop strings, chunks, delivery) and `hidden` how much of that
text work ran while a forward was in flight (overlap mode; 0 otherwise). Host time not hidden is
`schedule + text - hidden`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

WINDOW = 512  # recent steps averaged in `summary`
_FIELDS = ("schedule", "forward", "sample", "text", "hidden")


class StepStats:
    def __init__(self) -> None:
        # (kind, num_reqs, num_tokens, schedule, forward, sample, text, hidden)
        self.recent: deque[tuple] = deque(maxlen=WINDOW)
        self.totals: dict[str, Any] = {"steps": 0, **{f"{k}_s": 0.0 for k in _FIELDS}}

    def record(
        self,
        kind: str,
        num_reqs: int,
        num_tokens: int,
        schedule: float,
        forward: float,
        sample: float,
        text: float = 0.0,
        hidden: float = 0.0,
    ) -> None:
        self.recent.append((kind, num_reqs, num_tokens, schedule, forward, sample, text, hidden))
        t = self.totals
        t["steps"] += 1
        for k, v in zip(_FIELDS, (schedule, forward, sample, text, hidden)):
            t[f"{k}_s"] += v

    def record_idle(self, schedule: float, text: float) -> None:
        """Host work of a loop turn that launched no forward (the last step's text, housekeeping)."""
        self.totals["schedule_s"] += schedule
        self.totals["text_s"] += text

    def summary(self) -> dict[str, Any]:
        """Read from other threads while the engine records: `recent` is copied in one step (a
        deque iterated while another thread appends to it raises)."""
        recent = list(self.recent)
        t = self.totals
        out: dict[str, Any] = {f"step_{k}": round(v, 6) if isinstance(v, float) else v for k, v in t.items()}
        host = t["schedule_s"] + t["text_s"]
        out["step_host_hidden_fraction"] = round(t["hidden_s"] / host, 4) if host else 0.0
        for kind in ("prefill", "decode"):
            rows = [r for r in recent if r[0] == kind]
            if not rows:
                continue
            n = len(rows)
            out[f"{kind}_batch_size_avg"] = round(sum(r[1] for r in rows) / n, 2)
            for i, k in enumerate(_FIELDS, start=3):
                out[f"{kind}_{k}_ms_avg"] = round(1000 * sum(r[i] for r in rows) / n, 3)
        return out
