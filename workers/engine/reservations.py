"""WaitingReservations: PD reservations (decode role) that found no room, waiting for some.
Engine thread only.

A decode replica without the rows or KV slots for a reservation does not refuse it at once when
its caller allows a wait (`ReserveRequest.wait_s`): the reservation waits here and is tried again
at every step boundary, where finished sequences have given their slots back and the radix cache
may evict, until it fits or its wait runs out (then it is refused: QueueFull). Waiting
reservations are tried in arrival order, and the first that still does not fit ends the round:
a large reservation is not overtaken for ever by a stream of small ones. One whose wait ran out
has its last try wherever it stands.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.workers.engine.commands import ReserveRequest


@dataclass
class _Waiting:
    cmd: ReserveRequest
    until: float  # on the engine's monotonic clock


# attempt(cmd, last): reserve now and answer `cmd.done` -> True; no room yet -> False (only when
# not `last`: a last attempt always answers).
Attempt = Callable[[ReserveRequest, bool], bool]


class WaitingReservations:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._queue: deque[_Waiting] = deque()
        self._clock = clock

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, cmd: ReserveRequest) -> None:
        """`cmd` waits from now for at most its `wait_s`."""
        self._queue.append(_Waiting(cmd, self._clock() + cmd.wait_s))

    def retry(self, attempt: Attempt) -> None:
        """At a step boundary: try the waiting reservations again (see the module docstring)."""
        now = self._clock()
        blocked = False
        # Each one leaves the queue before its attempt answers its caller (who may look at once).
        queue, self._queue = self._queue, deque()
        for w in queue:
            last = now >= w.until
            if (blocked and not last) or not attempt(w.cmd, last):
                self._queue.append(w)
                blocked = True

    def drop(self, rid: str, error: BaseException) -> bool:
        """Refuse the waiting reservation of request `rid` (aborted) with `error`."""
        gone = [w for w in self._queue if w.cmd.reqs[0].rid == rid]
        if not gone:
            return False
        self._queue = deque(w for w in self._queue if w.cmd.reqs[0].rid != rid)
        for w in gone:
            w.cmd.done.set_exception(error)
        return True

    def fail_all(self, error: BaseException) -> None:
        queue, self._queue = self._queue, deque()
        for w in queue:
            w.cmd.done.set_exception(error)
