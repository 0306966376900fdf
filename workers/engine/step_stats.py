"""Per-step timings (scheduling vs forward vs sampling), kept for metrics and benchmarks."""

from __future__ import annotations

from collections import deque
from typing import Any

WINDOW = 512  # recent steps averaged in `summary`


class StepStats:
    def __init__(self) -> None:
        self.recent: deque[tuple[str, int, int, float, float, float]] = deque(maxlen=WINDOW)
        self.totals = {"steps": 0, "schedule_s": 0.0, "forward_s": 0.0, "sample_s": 0.0}

    def record(self, kind: str, num_reqs: int, num_tokens: int, schedule: float, forward: float,
               sample: float) -> None:
        self.recent.append((kind, num_reqs, num_tokens, schedule, forward, sample))
        t = self.totals
        t["steps"] += 1
        t["schedule_s"] += schedule
        t["forward_s"] += forward
        t["sample_s"] += sample

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"step_{k}": round(v, 6) if isinstance(v, float) else v
                               for k, v in self.totals.items()}
        for kind in ("prefill", "decode"):
            rows = [r for r in self.recent if r[0] == kind]
            if not rows:
                continue
            n = len(rows)
            out[f"{kind}_batch_size_avg"] = round(sum(r[1] for r in rows) / n, 2)
            out[f"{kind}_forward_ms_avg"] = round(1000 * sum(r[4] for r in rows) / n, 3)
            out[f"{kind}_schedule_ms_avg"] = round(1000 * sum(r[3] for r in rows) / n, 3)
            out[f"{kind}_sample_ms_avg"] = round(1000 * sum(r[5] for r in rows) / n, 3)
        return out
