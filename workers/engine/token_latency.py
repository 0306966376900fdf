"""TokenLatency: the time to first token and the inter-token latency this engine's sequences
see, over the last WINDOW_S seconds. Engine thread only; `means` feeds `EngineLoad.ttft_s` and
`EngineLoad.itl_s`, which the autoscaling policies of cluster/autoscaling.py scale on.

The time to first token of a sequence runs from its arrival at this engine (`Req.arrival`: queued,
waiting for a grammar, prefilled) to its first sampled token (a PD decode replica, whose sequences
get their first token from the prefill replica, has none); its inter-token latency is the time
between two of its tokens, each interval one sample (a batch of 32 decoding sequences adds 32
samples per step). A window without samples (an idle replica) reports 0: no latency to scale on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from radixserve.workers.engine.request import Req

WINDOW_S = 30.0


class _Window:
    """Sums of samples per moment, with running totals; old moments leave as time passes."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.parts: deque[tuple[float, float, int]] = deque()  # (when, sum, count)
        self.total, self.count = 0.0, 0

    def add(self, now: float, total: float, count: int) -> None:
        if count:
            self.parts.append((now, total, count))
            self.total += total
            self.count += count

    def mean(self, now: float) -> float:
        while self.parts and self.parts[0][0] <= now - self.window_s:
            _, total, count = self.parts.popleft()
            self.total -= total
            self.count -= count
        if not self.count:
            self.total = 0.0  # no float residue left behind by the subtractions
            return 0.0
        return max(self.total / self.count, 0.0)


class TokenLatency:
    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.ttft = _Window(window_s)
        self.itl = _Window(window_s)

    def on_tokens(self, reqs: Iterable[Req]) -> None:
        """After a step appended one token to each of `reqs`."""
        now = self.clock()
        ttft, firsts, itl, intervals = 0.0, 0, 0.0, 0
        for req in reqs:
            if req.last_token_at is None:  # its first token (or first tokens: jump-forward)
                ttft, firsts = ttft + (now - req.arrival), firsts + 1
            else:
                itl, intervals = itl + (now - req.last_token_at), intervals + 1
            req.last_token_at = now
        self.ttft.add(now, ttft, firsts)
        self.itl.add(now, itl, intervals)

    def on_first_token(self, req: Req) -> None:
        """A sequence whose first token came from elsewhere (PD: the prefill replica) starts
        decoding here now: its next token's interval counts from here."""
        req.last_token_at = self.clock()

    def means(self) -> dict[str, float]:
        """The `EngineLoad` latency fields: mean seconds over the window (0 without samples)."""
        now = self.clock()
        return {"ttft_s": round(self.ttft.mean(now), 6), "itl_s": round(self.itl.mean(now), 6)}
