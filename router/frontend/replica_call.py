"""ReplicaCall: one streaming call to an engine replica, as the ingress sees it.

A replica's stream (`EngineReplica.generate` / `reserve`) is a sequence of protocol events
(`workers/protocol.py`, `StreamEvent`): `Accepted` or a `KVReservation` first, then output chunks;
a `Failure` ends it at any point. This is the one place that decodes those events, checks their
order and turns a `Failure` into the exception it carries; its callers see typed values only.

The unified request is one call (`admit`, then iterate); a PD request composes calls: a
reservation on a decode replica, a prefill replica's call and, after a failure, a recompute
(router/frontend/pd_stream.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from radixserve.router.frontend.metrics import RequestTimer
from radixserve.workers.protocol import (
    Accepted,
    EngineError,
    Failure,
    GenerateRequest,
    KVReservation,
    OutputChunk,
    ProtocolError,
    StreamEvent,
    decode_event,
)


class ReplicaCall:
    """The events of one request's call to a replica. Cancelling the call aborts the request
    there (and frees its KV)."""

    def __init__(
        self, pool: DeploymentHandle, method: str, req: GenerateRequest, *args: Any, timer: RequestTimer
    ):
        """Call `method` ("generate" or "reserve") of a replica of `pool` with `req` and `args`;
        `timer` counts the chunks' tokens as they arrive."""
        gen = getattr(pool.options(stream=True), method).remote(req.to_dict(), *args)
        assert isinstance(gen, DeploymentResponseGenerator)  # a stream=True handle's call
        self.gen = gen
        self.rid = req.rid
        self.timer = timer
        self.done = False  # the replica ended the stream (or sent its Failure)
        self.first: OutputChunk | None = None  # set by `admit`: the first chunk, not yet iterated

    async def _event(self) -> StreamEvent | None:
        """The next event, None at the end of the stream; raises a Failure's error."""
        try:
            d = await self.gen.__anext__()
        except StopAsyncIteration:
            self.done = True
            return None
        event = decode_event(d)
        if isinstance(event, Failure):
            self.done = True
            raise event.error
        return event

    def _unexpected(self, event: StreamEvent | None, due: str) -> Exception:
        """The error for `event` where the stream owed `due`."""
        if event is None:
            return EngineError(f"request {self.rid}: the replica closed its stream without {due}")
        return ProtocolError(
            f"request {self.rid}: the replica sent {type(event).__name__} where {due} was due"
        )

    async def accepted(self) -> None:
        """Returns once the replica accepted the request (a `generate` call's first event);
        raises its refusal."""
        event = await self._event()
        if not isinstance(event, Accepted):
            raise self._unexpected(event, "an acceptance")

    async def reservation(self) -> KVReservation:
        """A `reserve` call's first event: the decode replica's reservation; raises its refusal."""
        event = await self._event()
        if not isinstance(event, KVReservation):
            raise self._unexpected(event, "a KV reservation")
        return event

    async def next(self) -> OutputChunk | None:
        """The next chunk, None at the end; raises a replica's refusal or failure."""
        event = await self._event()
        if event is None:
            return None
        if not isinstance(event, OutputChunk):
            raise self._unexpected(event, "an output chunk")
        self.timer.tokens(len(event.token_ids))
        return event

    async def admit(self) -> OutputChunk | None:
        """Wait for the acceptance, then the first chunk (kept in `first`, and returned). Raises
        a refusal before any output; the call is cancelled on any error."""
        try:
            await self.accepted()
            self.timer.admitted()
            self.first = await self.next()
        except BaseException:
            self.cancel()
            raise
        return self.first

    async def __aiter__(self) -> AsyncIterator[OutputChunk]:
        """The request's chunks from `first` on, as the client's stream (of a unified request)."""
        try:
            if self.first is not None:
                yield self.first
            while not self.done and (chunk := await self.next()) is not None:
                yield chunk
            self.timer.finished()
        finally:
            self.cancel()

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.gen.cancel()
