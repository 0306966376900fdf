"""Scripted engine replicas for the router's unit tests: a deployment handle whose streaming
calls answer from a script of what a replica sends (protocol events in their wire form), and
the helpers that write those events."""

from __future__ import annotations

import asyncio
from typing import Any

from ray.serve.handle import DeploymentResponseGenerator

from radixserve.workers.protocol import (
    Accepted,
    Failure,
    KVEndpoint,
    KVReservation,
    KVTicket,
    OutputChunk,
    encode_event,
)

TICKET = KVTicket("t", KVEndpoint("gloo", "d", "h:1"), (1, 2, 3))


class ScriptedCall(DeploymentResponseGenerator):
    """A streaming call that yields `items` (an exception is raised in its place)."""

    def __init__(self, items: list[Any]):  # no Serve machinery behind it
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        while self.items and callable(self.items[0]):  # a probe of the caller's state meanwhile
            self.items.pop(0)()
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedPool:
    """A deployment handle whose calls answer from a script, per method, in order."""

    def __init__(self, **scripts: list[list[Any]]):
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.calls: list[tuple[str, dict]] = []
        self.args: list[tuple] = []  # each call's arguments after the request
        self.streams: list[ScriptedCall] = []

    def options(self, **_: Any) -> ScriptedPool:
        return self

    def __getattr__(self, method: str):
        pool = self

        class Method:
            def remote(self, request: dict, *args: Any) -> ScriptedCall:
                pool.calls.append((method, request))
                pool.args.append(args)
                call = ScriptedCall(pool.scripts[method].pop(0))
                pool.streams.append(call)
                return call

        return Method()


def chunk(index=0, ids=(), text="", finished=False, **kw) -> dict:
    return encode_event(
        OutputChunk(rid="r", index=index, token_ids=list(ids), text=text, finished=finished, **kw)
    )


def accepted() -> dict:
    return encode_event(Accepted("r"))


def reserved(*tickets: KVTicket) -> dict:
    return encode_event(KVReservation("r", list(tickets)))


def failure(error: Exception) -> dict:
    return encode_event(Failure(error))
