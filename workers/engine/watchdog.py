"""Names the request whose work holds the engine thread (`StepWatchdog`).

Every call into work that a request's own input shapes (its grammar's bitmask and jump-forward,
its stop strings and detokenization, its sampling parameters) has a bound where it is enforced:
forced_text.MAX_JUMP_BYTES, detokenizer.MAX_HELD_TOKENS, protocol.MAX_STOP_CHARS and
MAX_LOGIT_BIAS, the grammar limits of constrained/parser.py and the compile workers' timeout.
The watchdog is the backstop for a bound that is missing or too loose: the engine thread marks what
it is doing and for which requests; a thread of the watchdog logs, once per mark, a mark older
than `deadline_s` (the engine thread is still inside it), and the engine thread logs a finished
mark that took longer than `slow_s`. Either log line names the request(s) and the work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

logger = logging.getLogger("radixserve.engine")

DEFAULT_DEADLINE_S = 10.0
DEFAULT_SLOW_S = 0.5


class StepWatchdog:
    """`enter(what, rids)` ... `leave()` around each piece of the engine thread's work. Marks are
    written by the engine thread only and read whole by the watchdog thread (one attribute)."""

    def __init__(self, deadline_s: float = DEFAULT_DEADLINE_S, slow_s: float = DEFAULT_SLOW_S):
        self.deadline_s = deadline_s
        self.slow_s = slow_s
        self.stalls_total = 0  # marks that outlived the deadline
        self.slow_total = 0  # marks that took longer than slow_s
        self.last_stall: tuple[str, tuple[str, ...]] | None = None  # (what, rids) last logged
        self._mark: tuple[str, tuple[str, ...], float, bool] | None = None
        self._reported: tuple[str, tuple[str, ...], float, bool] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="radixserve-watchdog", daemon=True)
        self._thread.start()

    def enter(self, what: str, rids: Sequence[str], warn_slow: bool = True) -> None:
        """Mark the start of `what` for `rids`. `warn_slow=False` for work whose size the engine's
        own limits set (a forward of at most max_prefill_tokens): only a stall is logged."""
        self._mark = (what, tuple(rids), time.monotonic(), warn_slow)

    def leave(self) -> None:
        mark, self._mark = self._mark, None
        if mark is None:
            return
        took = time.monotonic() - mark[2]
        if mark[3] and took > self.slow_s:
            self.slow_total += 1
            logger.warning("%s took %.2f s of the engine thread (%s)", mark[0], took, _names(mark[1]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        period = min(1.0, self.deadline_s / 4)
        while not self._stop.wait(period):
            mark = self._mark
            if mark is None or mark is self._reported or time.monotonic() - mark[2] < self.deadline_s:
                continue
            self._reported = mark
            self.last_stall = mark[:2]
            self.stalls_total += 1
            logger.error(
                "the engine thread has been in %s for over %.1f s (%s): every other request waits",
                mark[0],
                self.deadline_s,
                _names(mark[1]),
            )


def _names(rids: tuple[str, ...]) -> str:
    shown = ", ".join(rids[:8])
    more = f" and {len(rids) - 8} more" if len(rids) > 8 else ""
    return f"request {shown}{more}" if len(rids) == 1 else f"requests {shown}{more}"
