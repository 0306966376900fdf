"""PDStream: one request served by prefill/decode disaggregation, as one stream of chunks.

The ingress asks a decode replica (chosen by load) to reserve KV slots; its `KVReservation`
carries one ticket per sequence, which go with the request to a prefill replica (chosen by the
cache-aware policy over the prefill pool). The prefill replica computes the prompt and streams
each sequence's first token at once (the time to first token), then sends the KV to the decode
replica, which streams the rest. The client sees one stream: the prefill replica's chunks lose
their end-of-sequence marks, and the decode replica's final chunks carry the finish and usage.

Failures: a prefill side that fails before its first output is retried like a unified request
(the decode reservation is cancelled first). Once a first token went out, a decode side that
fails (its replica lost, or the KV never arrived: `TransferFailed`) ends the request with an
error under `pd_on_failure = "error"`; under "recompute" its unfinished sequences are resumed
on one engine replica from the tokens the client has (`GenerateRequest.output_prefix`: the engine
computes prompt + those tokens and replays them through the grammar, penalties and stop strings),
asking only for the rest.
Cancelling the stream (a client that went away) cancels both replicas' calls, which abort the
request on each side and free its KV.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from radixserve.router.frontend.metrics import RequestTimer
from radixserve.workers.protocol import (
    EngineError,
    GenerateRequest,
    InvalidRequest,
    KVReservation,
    OutputChunk,
    QueueFull,
    TransferFailed,
    attempt_rid,
    decode_error,
)

if TYPE_CHECKING:
    from radixserve.router.frontend.ingress import ReplicaStream

logger = logging.getLogger(__name__)

RECOMPUTE_TAG = "recompute"  # the engine-side id of a continuation: attempt_rid(rid, RECOMPUTE_TAG)


class PDStream:
    def __init__(
        self,
        req: GenerateRequest,
        prefill: DeploymentHandle,
        decode: DeploymentHandle,
        timer: RequestTimer,
        on_failure: str,
    ):
        self.req = req
        self.rid = req.rid
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.timer = timer
        self.on_failure = on_failure
        self.done = False
        self.first: OutputChunk | None = None
        self.prefill: ReplicaStream | None = None
        self.decode: DeploymentResponseGenerator | None = None
        self.recompute: ReplicaStream | None = None
        self.decode_done = False
        self.sent: dict[int, list[int]] = {}  # tokens that went out, per sequence
        self.ended: set[int] = set()  # sequences whose final chunk went out

    async def open(self) -> None:
        """Reserve on a decode replica, start the prefill; returns once the first output is
        there. Raises a replica's refusal (InvalidRequest / QueueFull) before any output."""
        from radixserve.router.frontend.ingress import ReplicaStream

        try:
            gen = self.decode_pool.options(stream=True).reserve.remote(self.req.to_dict())
            assert isinstance(gen, DeploymentResponseGenerator)
            self.decode = gen
            reservation = await self._decode_next()
            if reservation is None or not KVReservation.is_one(reservation):
                raise RuntimeError("the decode replica answered without a KV reservation")
            tickets = KVReservation.from_dict(reservation).tickets
            preq = dataclasses.replace(self.req, kv_tickets=tickets)
            pgen = self.prefill_pool.options(stream=True).generate.remote(preq.to_dict())
            assert isinstance(pgen, DeploymentResponseGenerator)
            self.prefill = ReplicaStream(pgen, self.rid, self.timer)
            if await self.prefill.next() is None:  # the acceptance (an empty chunk)
                raise RuntimeError("the prefill replica closed the stream without output")
            self.timer.admitted()
            self.first = await self.prefill.next()
        except BaseException:
            self.cancel()
            raise

    async def _decode_next(self) -> dict[str, Any] | None:
        assert self.decode is not None
        try:
            d = await self.decode.__anext__()
        except StopAsyncIteration:
            self.decode_done = True
            return None
        except BaseException:
            self.decode_done = True
            raise
        if "error" in d:
            self.decode_done = True
            raise decode_error(d)
        return d

    async def __aiter__(self) -> AsyncIterator[OutputChunk]:
        try:
            async for chunk in self._prefill_part():
                yield chunk
            async for chunk in self._decode_part():
                yield chunk
            self.timer.finished()
        finally:
            self.cancel()

    async def _prefill_part(self) -> AsyncIterator[OutputChunk]:
        """Each sequence's first token; the prefill replica's end marks are not the client's."""
        assert self.prefill is not None
        chunk, ended = self.first, 0
        while chunk is not None:
            self.sent.setdefault(chunk.index, []).extend(chunk.token_ids)
            yield OutputChunk(
                rid=chunk.rid,
                index=chunk.index,
                token_ids=chunk.token_ids,
                text=chunk.text,
                logprobs=chunk.logprobs,
            )
            ended += chunk.finished
            if ended == self.req.sampling_params.n:
                # Every sequence's part is here: the end of the prefill call itself is not waited
                # for (it may come late from a replica busy with a long forward).
                break
            chunk = await self.prefill.next()

    async def _decode_part(self) -> AsyncIterator[OutputChunk]:
        try:
            while (d := await self._decode_next()) is not None:
                chunk = OutputChunk.from_dict(d)
                self.timer.tokens(len(chunk.token_ids))
                self.sent.setdefault(chunk.index, []).extend(chunk.token_ids)
                if chunk.finished:
                    self.ended.add(chunk.index)
                yield chunk
        except (InvalidRequest, QueueFull):
            raise
        except TransferFailed as e:
            async for chunk in self._after_failure(e, self.decode_pool):
                yield chunk
        except EngineError:
            raise
        except Exception as e:  # the decode replica (or its node) is gone
            async for chunk in self._after_failure(e, self.prefill_pool):
                yield chunk

    async def _after_failure(self, error: Exception, pool: DeploymentHandle) -> AsyncIterator[OutputChunk]:
        if self.done:  # cancelled (the client went away): its own cancel ended the decode call
            raise error
        why = (
            f"request {self.rid}: the decode side failed after the prefill ({type(error).__name__}: {error})"
        )
        if self.on_failure != "recompute":
            raise EngineError(why)
        logger.warning("%s; recomputing the rest on one replica", why)
        async for chunk in self._recompute(pool):
            yield chunk

    async def _recompute(self, pool: DeploymentHandle) -> AsyncIterator[OutputChunk]:
        """The unfinished sequences, resumed on one replica of `pool` from what their client has;
        the replica numbers them 0..k-1, which map back to their indices here."""
        from radixserve.router.frontend.ingress import ReplicaStream

        p = self.req.sampling_params
        todo = [i for i in range(p.n) if i not in self.ended]
        if not todo:
            return
        cont = dataclasses.replace(
            self.req,
            # With a seed, the generators start over (draws made elsewhere cannot be replayed).
            sampling_params=dataclasses.replace(p, n=len(todo)),
            rid=attempt_rid(self.rid, RECOMPUTE_TAG),
            kv_tickets=None,
            output_prefix=[self.sent.get(i, []) for i in todo],
        )
        gen = pool.options(stream=True).generate.remote(cont.to_dict())
        assert isinstance(gen, DeploymentResponseGenerator)
        self.recompute = stream = ReplicaStream(gen, self.rid, self.timer)
        if self.done:  # cancelled meanwhile
            stream.cancel()
            raise EngineError(f"request {self.rid}: cancelled")
        if await stream.next() is None:
            raise EngineError(f"request {self.rid}: the recompute closed without output")
        while (chunk := await stream.next()) is not None:
            chunk.rid, chunk.index = self.rid, todo[chunk.index]
            yield chunk

    def cancel(self) -> None:
        if self.done:
            return
        self.done = True
        for s in (self.prefill, self.recompute):
            if s is not None:
                s.cancel()
        if self.decode is not None and not self.decode_done:
            self.decode.cancel()
