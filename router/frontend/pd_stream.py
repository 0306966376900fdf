"""PDStream: one request served by prefill/decode disaggregation, as one stream of chunks.

The ingress asks a decode replica (chosen by load) to reserve KV slots; its `KVReservation`
carries one ticket per sequence, which go with the request to a prefill replica (chosen by the
cache-aware policy over the prefill pool).

A decode replica without room answers at once, with its stats: they go into the decode pool's
routing state, so the next try goes to a replica with room where there is one; that try, and any
after it, waits on its replica for room (up to what is left of `reserve_wait_s` in all). Only
then is the request refused (QueueFull: a 503 with Retry-After). From the reservation to the
first token (the prefill may queue behind others) the request's id is in `held`, whose
reservations the ingress renews on the decode replicas (`Ingress.renew_leases`): the lease there
bounds only how long a reservation outlives a prefill side that went silent. The prefill replica computes the prompt and streams
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

Each replica's call is a `ReplicaCall` (router/frontend/replica_call.py), which decodes its
events; this module composes them and decides what a failure means.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

from ray.serve.handle import DeploymentHandle

from radixserve.router.frontend.metrics import RequestTimer
from radixserve.router.frontend.replica_call import ReplicaCall
from radixserve.router.routing.routing_state import RoutingState
from radixserve.workers.protocol import (
    EngineError,
    GenerateRequest,
    InvalidRequest,
    KVTicket,
    OutputChunk,
    QueueFull,
    TransferFailed,
    attempt_rid,
)

logger = logging.getLogger(__name__)

RECOMPUTE_TAG = "recompute"  # the engine-side id of a continuation: attempt_rid(rid, RECOMPUTE_TAG)
RESERVE_ATTEMPTS = 3  # decode replicas asked for room, within `reserve_wait_s`


class PDStream:
    def __init__(
        self,
        req: GenerateRequest,
        prefill: DeploymentHandle,
        decode: DeploymentHandle,
        timer: RequestTimer,
        on_failure: str,
        reserve_wait_s: float = 0.0,
        decode_routing: RoutingState | None = None,
        held: set[str] | None = None,
    ):
        """`decode_routing`: the decode pool's routing state, which a refusal's stats correct;
        `held`: the ids whose reservations the ingress renews (this one's while its prefill is
        on its way)."""
        self.req = req
        self.rid = req.rid
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.timer = timer
        self.on_failure = on_failure
        self.reserve_wait_s = reserve_wait_s
        self.decode_routing = decode_routing
        self.held = held if held is not None else set()
        self.done = False
        self.first: OutputChunk | None = None
        self.prefill: ReplicaCall | None = None
        self.decode: ReplicaCall | None = None
        self.recompute: ReplicaCall | None = None
        self.sent: dict[int, list[int]] = {}  # tokens that went out, per sequence
        self.ended: set[int] = set()  # sequences whose final chunk went out

    async def open(self) -> None:
        """Reserve on a decode replica, start the prefill; returns once the first output is
        there. Raises a replica's refusal (InvalidRequest / QueueFull) before any output."""
        try:
            tickets = await self._reserve()
            self.held.add(self.rid)
            preq = dataclasses.replace(self.req, kv_tickets=tickets)
            self.prefill = ReplicaCall(self.prefill_pool, "generate", preq, timer=self.timer)
            self.first = await self.prefill.admit()
        except BaseException:
            self.cancel()
            raise
        finally:
            # The prefill is done (its transfer's own deadline runs on the decode side now) or
            # failed: no renewals.
            self.held.discard(self.rid)

    async def _reserve(self) -> list[KVTicket]:
        """The tickets of a decode replica's reservation; QueueFull once RESERVE_ATTEMPTS
        replicas, or `reserve_wait_s`, ran out (module docstring)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.reserve_wait_s
        wait = 0.0  # the first replica answers at once: its stats may have been stale
        for attempt in range(1, RESERVE_ATTEMPTS + 1):
            self.decode = ReplicaCall(
                self.decode_pool, "reserve", self._decode_request(), wait, timer=self.timer
            )
            try:
                reservation = await self.decode.reservation()
            except QueueFull as e:
                if e.report is not None and self.decode_routing is not None:
                    routing = self.decode_routing
                    routing.apply_report(e.report, None, routing.sync_point())
                wait = until - loop.time()
                if wait <= 0 or attempt == RESERVE_ATTEMPTS:
                    raise
                continue
            return reservation.tickets
        raise AssertionError("unreachable")

    def _decode_request(self) -> GenerateRequest:
        """The request as the decode side takes it: the prompt's logprobs are the prefill side's
        (asking there too would only shorten the decode replica's prefix match)."""
        p = self.req.sampling_params
        if p.logprob_start_len < 0:
            return self.req
        return dataclasses.replace(self.req, sampling_params=dataclasses.replace(p, logprob_start_len=-1))

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
                input_logprobs=chunk.input_logprobs,  # the prompt is computed on this side
            )
            ended += chunk.finished
            if ended == self.req.sampling_params.n:
                # Every sequence's part is here: the end of the prefill call itself is not waited
                # for (it may come late from a replica busy with a long forward).
                break
            chunk = await self.prefill.next()

    async def _decode_part(self) -> AsyncIterator[OutputChunk]:
        assert self.decode is not None
        try:
            while (chunk := await self.decode.next()) is not None:
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
        self.recompute = call = ReplicaCall(pool, "generate", cont, timer=self.timer)
        if self.done:  # cancelled meanwhile
            call.cancel()
            raise EngineError(f"request {self.rid}: cancelled")
        await call.accepted()
        while (chunk := await call.next()) is not None:
            chunk.rid, chunk.index = self.rid, todo[chunk.index]
            yield chunk

    def cancel(self) -> None:
        if self.done:
            return
        self.done = True
        for call in (self.decode, self.prefill, self.recompute):
            if call is not None:
                call.cancel()
