"""ReplicaCall, the one reader of a replica's stream at the ingress, against scripted replicas:
the events each call owes in order, what a refusal or a wrong event raises, the cancels, the
timer's counts, and a unified request through `Ingress.open`."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from radixserve.router.frontend.ingress import Ingress
from radixserve.router.frontend.metrics import Metrics
from radixserve.router.frontend.replica_call import ReplicaCall
from radixserve.workers.protocol import (
    EngineError,
    GenerateRequest,
    InvalidRequest,
    OutputChunk,
    ProtocolError,
    QueueFull,
    SamplingParams,
)
from tests.scripted_replicas import TICKET, ScriptedPool, accepted, chunk, failure, reserved

REQ = GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=4), rid="r", stream=True)


class Timer:
    """A RequestTimer that records what it was told."""

    def __init__(self) -> None:
        self.log: list[Any] = []

    def admitted(self) -> None:
        self.log.append("admitted")

    def tokens(self, count: int) -> None:
        self.log.append(count)

    def finished(self) -> None:
        self.log.append("finished")


def call(script: list[Any], method: str = "generate", *args: Any) -> tuple[ReplicaCall, ScriptedPool, Timer]:
    pool = ScriptedPool(**{method: [script]})
    timer = Timer()
    return ReplicaCall(pool, method, REQ, *args, timer=timer), pool, timer  # type: ignore[arg-type]


def test_a_generate_call_is_admitted_then_streams_its_chunks():
    c, pool, timer = call([accepted(), chunk(ids=[11], text="A"), chunk(ids=[12, 13], text="BC")])

    async def go():
        first = await c.admit()
        return first, [x async for x in c]

    first, out = asyncio.run(go())
    assert first == OutputChunk(rid="r", token_ids=[11], text="A")
    assert [x.token_ids for x in out] == [[11], [12, 13]]
    assert timer.log == ["admitted", 1, 2, "finished"]
    assert pool.calls == [("generate", REQ.to_dict())] and pool.args == [()]
    assert c.done and not pool.streams[0].cancelled  # the replica ended it: nothing to cancel


def test_a_refusal_before_output_is_raised_as_its_exception():
    c, pool, timer = call([failure(QueueFull("queue full"))])
    with pytest.raises(QueueFull, match="queue full"):
        asyncio.run(c.admit())
    assert c.done and timer.log == []
    c, _, _ = call([failure(InvalidRequest("bad regex", "regex"))])
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(c.admit())
    assert e.value.param == "regex"


def test_a_failure_after_output_ends_the_stream_with_its_error():
    c, pool, _ = call([accepted(), chunk(ids=[11]), failure(EngineError("step failed"))])

    async def go():
        await c.admit()
        return [x async for x in c]

    with pytest.raises(EngineError, match="step failed"):
        asyncio.run(go())
    assert c.done and not pool.streams[0].cancelled


def test_a_stream_closed_before_its_acceptance_is_an_engine_error():
    c, _, _ = call([])
    with pytest.raises(EngineError, match="request r: the replica closed its stream without an acceptance"):
        asyncio.run(c.admit())


@pytest.mark.parametrize(
    ("script", "method", "due"),
    [
        ([chunk(ids=[11])], "generate", "OutputChunk where an acceptance was due"),
        ([reserved(TICKET)], "generate", "KVReservation where an acceptance was due"),
        ([accepted()], "reserve", "Accepted where a KV reservation was due"),
        ([accepted(), accepted()], "generate", "Accepted where an output chunk was due"),
    ],
)
def test_an_event_out_of_order_is_a_protocol_error_and_cancels_the_call(script, method, due):
    c, pool, _ = call(script, method)

    async def go():
        if method == "reserve":
            await c.reservation()
        else:
            await c.admit()
            await c.next()

    with pytest.raises(ProtocolError, match=due):
        asyncio.run(go())
    if method == "generate" and len(script) == 1:
        assert pool.streams[0].cancelled  # admit cancels the call it gave up on


def test_a_message_without_a_type_tag_is_no_event():
    """The old untagged shapes (an empty chunk as the acceptance) are refused, not guessed at."""
    c, _, _ = call([OutputChunk(rid="r").to_dict()])
    with pytest.raises(ProtocolError, match="not a replica stream event"):
        asyncio.run(c.admit())


def test_a_reserve_call_answers_its_reservation_then_chunks():
    c, pool, timer = call([reserved(TICKET, TICKET), chunk(ids=[12])], "reserve", 2.5)

    async def go():
        return await c.reservation(), await c.next(), await c.next()

    reservation, second, end = asyncio.run(go())
    assert reservation.rid == "r" and reservation.tickets == [TICKET, TICKET]
    assert second is not None and second.token_ids == [12] and end is None
    assert pool.args == [(2.5,)] and timer.log == [1]


def test_cancel_cancels_an_open_call_once():
    c, pool, _ = call([accepted(), chunk(ids=[11]), chunk(ids=[12])])

    async def go():
        await c.admit()
        c.cancel()
        c.cancel()

    asyncio.run(go())
    assert c.done and pool.streams[0].cancelled


def test_a_unified_request_goes_to_the_engine_pool_through_one_call():
    pool = ScriptedPool(generate=[[accepted(), chunk(ids=[11], text="A"), chunk(ids=[12], text="B")]])
    ing = Ingress.__new__(Ingress)
    ing.replicas, ing.decode, ing.metrics = pool, None, Metrics("m")  # type: ignore[assignment]
    ing.config = SimpleNamespace()  # type: ignore[assignment]

    async def go():
        stream = await ing.open(REQ)
        return stream, [x async for x in stream]

    stream, out = asyncio.run(go())
    assert isinstance(stream, ReplicaCall)
    assert "".join(x.text for x in out) == "AB"
    assert [m for m, _ in pool.calls] == ["generate"] and pool.calls[0][1]["rid"] == "r"
