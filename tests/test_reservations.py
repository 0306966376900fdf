"""WaitingReservations: the decode engine's reservations that wait for room, without an engine:
the order they are tried in, their last try when the wait runs out, aborts and shutdown."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from radixserve.workers.engine.commands import ReserveRequest
from radixserve.workers.engine.request import Req
from radixserve.workers.engine.reservations import WaitingReservations
from radixserve.workers.protocol import EngineError, QueueFull, SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def command(rid: str, wait_s: float) -> ReserveRequest:
    done: Future = Future()
    done.set_running_or_notify_cancel()  # as the engine thread takes it up
    return ReserveRequest([Req(rid, 0, [1, 2, 3], SamplingParams())], False, done, wait_s)


class Room:
    """An `Attempt` over a count of free slots: each reservation takes `size[rid]`."""

    def __init__(self, free: int, size: dict[str, int]):
        self.free, self.size, self.tried = free, size, []

    def __call__(self, cmd: ReserveRequest, last: bool) -> bool:
        rid = cmd.reqs[0].rid
        self.tried.append((rid, last))
        if self.size[rid] <= self.free:
            self.free -= self.size[rid]
            cmd.done.set_result([rid])
            return True
        if last:
            cmd.done.set_exception(QueueFull("no room"))
        return last


def test_waiting_reservations_are_tried_in_order_and_a_large_one_is_not_overtaken():
    clock = Clock()
    waiting = WaitingReservations(clock)
    big, small = command("big", 10), command("small", 10)
    waiting.add(big)
    waiting.add(small)
    room = Room(free=3, size={"big": 5, "small": 2})
    waiting.retry(room)
    assert room.tried == [("big", False)] and len(waiting) == 2  # small would fit: it waits its turn
    room.free = 6
    waiting.retry(room)
    assert room.tried[1:] == [("big", False), ("small", False)]
    assert big.done.result() == ["big"] and not small.done.done() and len(waiting) == 1
    room.free = 2
    waiting.retry(room)
    assert small.done.result() == ["small"] and len(waiting) == 0


def test_a_wait_that_ran_out_has_its_last_try_wherever_it_stands():
    clock = Clock()
    waiting = WaitingReservations(clock)
    head, short, late = command("head", 10), command("short", 1), command("late", 1)
    for c in (head, short, late):
        waiting.add(c)
    room = Room(free=1, size={"head": 5, "short": 1, "late": 3})
    clock.now += 1.0  # `short` and `late` waited their second
    waiting.retry(room)
    assert room.tried == [("head", False), ("short", True), ("late", True)]
    assert short.done.result() == ["short"]
    with pytest.raises(QueueFull, match="no room"):
        late.done.result()
    assert not head.done.done() and len(waiting) == 1
    clock.now += 9.0
    waiting.retry(room)
    with pytest.raises(QueueFull):
        head.done.result()
    assert len(waiting) == 0


def test_an_aborted_or_stopped_engines_waiting_reservations_are_refused():
    waiting = WaitingReservations(Clock())
    a, b = command("a", 10), command("b", 10)
    waiting.add(a)
    waiting.add(b)
    assert waiting.drop("a", EngineError("aborted")) and not waiting.drop("a", EngineError("again"))
    with pytest.raises(EngineError, match="aborted"):
        a.done.result()
    assert len(waiting) == 1
    waiting.fail_all(EngineError("engine shut down"))
    with pytest.raises(EngineError, match="shut down"):
        b.done.result()
    assert len(waiting) == 0
