"""KVHandoff: the engine's side of prefill/decode disaggregation. Engine thread only.

Decode role: `reserve` matches each sequence's prompt against this replica's radix cache (and
locks the hit), allocates slots for the rest and registers them with the KV transfer engine; the
tickets go back to the router, which hands them to a prefill replica. The sequence waits here,
out of the scheduler, until its KV arrived with the first token the prefill replica sampled;
`poll` then inserts the prompt into the radix tree and admits the sequence straight into the
running batch with that token as its first output (grammar, penalties, stop strings and counts
see it; the client got it from the prefill replica, so it is not sent again).

Prefill role: a sequence that carries a ticket is computed as any other and stops after its first
token (OutputProcessor), whose chunk goes out at once. Its transfer starts with the forward of
its last prefill chunk (`stream_layers`): what earlier chunks (or this replica's cache) hold goes
at once, and each layer of the last chunk as soon as the forward has written it, so the KV moves
while the later layers compute. `start_send` then closes the transfer with the first token, and
the sequence keeps its slots locked here until the send settled or its lease ran out. Its prompt
enters this replica's tree when the send settled (not while the pair may still read its slots:
the tree would free duplicates of slots it already holds).

Either way a transfer that does not settle within `kv_transfer_timeout_s` frees its slots.

At tp_size > 1 every rank moves its own heads, to the ranks of the peer replica that the plan of
executor/tp_kv.py names (rank r to rank r between equal degrees): the followers expect, send and
cancel on this rank's orders (`self.ranks`), and a sequence is admitted (decode) or its slots
released (prefill) only once every rank's part of its transfer has settled.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.workers.disaggregation import (
    KVTicket,
    KVTransferConfig,
    KVTransferEngine,
    KVTransferError,
    RecvHandle,
    SendHandle,
    create_kv_transfer_engine,
    layer_by_layer,
)
from radixserve.workers.engine.inflight import InflightRequests
from radixserve.workers.engine.output_processor import OutputProcessor
from radixserve.workers.engine.request import Req, ReqStatus
from radixserve.workers.engine.schedule_policy import match_key
from radixserve.workers.engine.scheduler import Scheduler
from radixserve.workers.executor.plan import BatchKind, ScheduledBatch
from radixserve.workers.executor.tp_kv import RECV, SEND, KVLayout, RankTransfers, RecvGroup, SendGroup
from radixserve.workers.protocol import QueueFull, TransferFailed

logger = logging.getLogger("radixserve.engine")

# A send outlives its own deadline (the transfer engine fails it then) by at most this before
# its slots are taken back regardless.
LEASE_GRACE_S = 5.0


@dataclass
class _Send:
    req: Req
    handle: SendHandle | SendGroup
    lease_end: float
    detached: bool = False  # out of the running batch: its slots are this table's to release


class KVHandoff:
    def __init__(
        self,
        role: str,
        kv_transfer: str,
        timeout_s: float,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        inflight: InflightRequests,
        served_model_name: str,
        fingerprint: str,
        layout: KVLayout,
        peer_tp_size: int = 0,
        ranks: RankTransfers | None = None,
    ):
        self.role = role
        self.timeout_s = timeout_s
        self.scheduler = scheduler
        self.cache = scheduler.cache
        self.pool = scheduler.pool
        self.outputs = outputs
        self.inflight = inflight
        self.replica_id = f"{role}-{uuid.uuid4().hex[:8]}"
        self.transfer: KVTransferEngine = create_kv_transfer_engine(
            kv_transfer,
            self.pool,
            self.replica_id,
            served_model_name,
            fingerprint,
            KVTransferConfig(transfer_timeout=timeout_s),
            layout.kv_heads,
        )
        self.layout = layout
        # decode: the prefill replicas' degree, which each rank plans its receives for
        self.sender_tp = peer_tp_size or layout.tp_size
        if role == "decode":
            layout.parts(self.sender_tp, layout.tp_size, sending=False)  # raises: no layout there
        self.receiving: dict[str, tuple[Req, RecvHandle | RecvGroup]] = {}  # decode: by sequence key
        self.landed: dict[str, tuple[Req, dict[str, Any]]] = {}  # decode: KV in, grammar pending
        self.sending: dict[str, _Send] = {}  # prefill: by sequence key
        # prefill: transfers begun with a last prefill chunk, until its first token closes them
        self.streaming: dict[str, tuple[Req, SendHandle | SendGroup]] = {}
        # tp_size > 1: the followers' part of each transfer. Prefill: the transfers they send, by
        # sequence key, from the batch that completes the prompt until this rank releases it.
        self.ranks = ranks
        self.rank_sends: dict[str, tuple[Req, str]] = {}
        self.num_layers = len(self.pool.k_buffers)
        self.counters = dict(
            pd_transfers_received_total=0,
            pd_transfers_sent_total=0,
            pd_transfers_failed_total=0,
        )

    def busy(self) -> bool:
        return bool(self.receiving or self.landed or self.sending or self.streaming or self.rank_sends)

    def detach(self, req: Req) -> bool:
        """A finished sequence leaves the running batch: True if its slots stay locked here for a
        send in progress (released when it settles), False if the scheduler releases them."""
        send = self.sending.get(req.key)
        if send is None:
            return False
        send.detached = True
        return True

    # Decode side -----------------------------------------------------------------------------
    def reserve(self, reqs: list[Req]) -> list[dict[str, Any]]:
        """Slots and a ticket for each sequence's prompt past the cached prefix; all or none
        (raises QueueFull when the rows or the KV pool cannot take them now)."""
        handles: list[RecvHandle | RecvGroup] = []
        try:
            for req in reqs:
                handles.append(self._reserve_one(req))
            if self.ranks is not None:  # the followers expect the same transfers, into the same slots
                self.ranks.expect(
                    [
                        {
                            "id": h.ticket.transfer_id,
                            "slots": list(h.ticket.dst_slots),
                            "held": h.ticket.held_tokens,
                            "timeout": self.timeout_s,
                        }
                        for h in handles
                    ]
                )
        except BaseException:
            refused = [e for e in (self.receiving.pop(r.key, None) for r in reqs) if e is not None]
            for _req, handle in refused:
                handle.cancel("reservation refused")
            self._cancel_ranks(RECV, [h.ticket.transfer_id for _r, h in refused], "reservation refused")
            for req, _handle in refused:
                self._free_reserved(req)
            raise
        endpoints = self.ranks.endpoints if self.ranks is not None else ()
        sender_tp = self.sender_tp if self.sender_tp != self.layout.tp_size else 0
        return [
            dataclasses.replace(h.ticket, rank_endpoints=endpoints, sender_tp_size=sender_tp).to_dict()
            for h in handles
        ]

    def _reserve_one(self, req: Req) -> RecvHandle | RecvGroup:
        row = self.scheduler.req_pool.alloc()
        if row is None:
            raise QueueFull("the decode replica has no room for another running sequence; retry later")
        match = self.cache.match_prefix(match_key(req), req.namespace)
        self.cache.lock(match.node)
        need = len(req.origin_input_ids) - len(match.slots)
        last = match.slots[-1] if match.slots else None
        slots = self.pool.alloc(need, last)
        if slots is None:
            self.cache.evict(need + self.pool.page_size - self.pool.available())
            slots = self.pool.alloc(need, last)
        if slots is None:
            self.cache.unlock(match.node)
            self.scheduler.req_pool.free(row)
            raise QueueFull("the decode replica's KV pool is full; retry later")
        req.row, req.table_len = row, 0
        req.kv_slots = list(match.slots) + list(slots)
        req.cache_len, req.last_node = len(match.slots), match.node
        transfer_id = f"{req.key}@{uuid.uuid4().hex[:12]}"
        try:
            handle = self.layout.expect(
                self.transfer, self.sender_tp, transfer_id, slots, len(match.slots), self.timeout_s
            )
        except BaseException:
            self._free_reserved(req)
            raise
        self.receiving[req.key] = (req, handle)
        return handle

    def _free_reserved(self, req: Req) -> None:
        """Give back a reservation whose KV never (fully) arrived: the cached prefix is unlocked,
        the slots past it are freed unread."""
        if req.row is None:
            return
        self.pool.free(req.kv_slots[req.cache_len :])
        self.cache.unlock(req.last_node)
        self.scheduler.req_pool.free(req.row)
        req.kv_slots, req.cache_len, req.last_node = [], 0, None
        req.row, req.table_len = None, 0
        req.status = ReqStatus.FINISHED

    def _poll_receiving(self, out: list) -> None:
        for key, (req, handle) in list(self.receiving.items()):
            transfer_id = handle.ticket.transfer_id
            if req.aborted:
                handle.cancel("the request ended")
            elif not handle.done():
                continue
            error = None if req.aborted else handle.future.exception()
            if self.ranks is not None and error is None and not req.aborted:
                ranks_error = self.ranks.settled(RECV, transfer_id)
                if ranks_error is None:
                    continue  # this rank's part is in, a follower's is not yet
                error = KVTransferError(ranks_error) if ranks_error else None
            elif self.ranks is not None:  # the followers' parts are not wanted any more
                self._cancel_ranks(RECV, [transfer_id], "the transfer failed on rank 0 or the request ended")
            del self.receiving[key]
            if req.aborted or error is not None:
                handle.cancel("the transfer failed")  # a group's other parts: no write after this
                self._free_reserved(req)
                if error is not None:
                    self.counters["pd_transfers_failed_total"] += 1
                    self.inflight.fail(req.rid, TransferFailed(f"KV transfer failed: {error}"), out)
                elif self.inflight.owes(req):
                    self.inflight.emit_final(req, out)
                continue
            self.counters["pd_transfers_received_total"] += 1
            self.landed[key] = (req, handle.future.result() or {})
        for key, (req, aux) in list(self.landed.items()):
            if req.aborted:
                del self.landed[key]
                self._free_reserved(req)
                if self.inflight.owes(req):
                    self.inflight.emit_final(req, out)
            elif req.params.grammar is None or req.grammar is not None:
                del self.landed[key]
                self._admit(req, aux, out)

    def _admit(self, req: Req, aux: dict[str, Any], out: list) -> None:
        """The KV is in: publish the prompt to the tree, then continue from the first token."""
        prefix = self.cache.cache_unfinished(req.origin_input_ids, req.kv_slots, req.last_node, req.namespace)
        req.kv_slots, req.last_node = list(prefix.slots), prefix.node
        req.cache_len = len(prefix.slots) - (len(prefix.slots) % self.pool.page_size)
        req.table_len = 0
        req.cached_tokens = int(aux.get("cached_tokens", req.cached_tokens or 0))
        req.status = ReqStatus.RUNNING
        self.scheduler.running.append(req)
        try:
            self.outputs.append_token(req, int(aux["token"]), None)
            self.outputs.detokenize(req)
            self.outputs.mark_sent(req)
        except Exception as exc:
            self.inflight.fail(
                req.rid, TransferFailed(f"continuing from the first token failed: {exc!r}"), out
            )
            return
        if req.finish_reason is not None:
            self.inflight.emit_final(req, out)

    def grammar_ready(self, req: Req) -> bool:
        """A compiled grammar came back for a sequence waiting here: True if it is ours (it is
        admitted once its KV is in as well), False if it belongs to the scheduler."""
        return req.key in self.receiving or req.key in self.landed

    # Prefill side ----------------------------------------------------------------------------
    def stream_layers(self, plan: ScheduledBatch, layerwise: bool = True) -> Callable[[int], None] | None:
        """Before a prefill forward: begin the transfer of every ticketed sequence whose prompt
        this step completes. The KV already in the pool (earlier chunks, this replica's cached
        prefix) is queued now; the returned callback (ForwardBatch.layer_done, called on the
        forward's thread) queues each layer of this chunk once the forward has written it. None
        if no sequence of the plan starts a transfer. Not `layerwise`: this rank sends each
        prompt whole once its first token is there (`start_send`).

        At tp_size > 1 the followers are ordered to do the same with their own heads, with this
        batch (whether or not layerwise)."""
        if plan.kind is not BatchKind.PREFILL:
            return None
        completing = []
        for req, start, n in zip(plan.reqs, plan.starts, plan.extend_lens):
            ticket: KVTicket | None = req.kv_ticket
            end = len(req.origin_input_ids)
            if ticket is None or req.output_ids or start + n != end:
                continue
            if req.key in self.streaming or req.key in self.rank_sends:
                continue
            completing.append((req, start, max(start, ticket.held_tokens) - ticket.held_tokens))
        if self.ranks is not None:
            self._order_rank_sends(completing, layerwise)
        if not layerwise:
            return None
        started: list[tuple[SendHandle | SendGroup, int]] = []
        for req, _start, first in completing:
            ticket = req.kv_ticket
            end = len(req.origin_input_ids)
            held = ticket.held_tokens
            handle = None
            try:
                handle = self.layout.send(self.transfer, ticket, req.kv_slots[held:end], self.timeout_s)
                if first > 0:
                    handle.send_layers(0, self.num_layers, 0, first)
            except Exception:
                if handle is not None:
                    handle.cancel("queueing the cached prefix failed")
                # start_send tries again once the first token is there, the whole prompt at once.
                logger.exception("request %s: starting the KV transfer failed", req.rid)
                continue
            req.kv_streaming = True  # the scheduler leaves its prompt out of the tree until then
            self.streaming[req.key] = (req, handle)
            if first < handle.num_tokens:
                started.append((handle, first))
        return layer_by_layer(started)  # a send that fails there fails on the decode side: recomputed

    def _order_rank_sends(self, completing: list[tuple[Req, int, int]], layerwise: bool) -> None:
        assert self.ranks is not None
        items: list[dict[str, Any]] = []
        for req, _start, first in completing:
            ticket: KVTicket = req.kv_ticket
            items.append(
                {
                    "id": ticket.transfer_id,
                    "ticket": ticket.to_dict(),
                    "slots": req.kv_slots[ticket.held_tokens : len(req.origin_input_ids)],
                    "first": first,
                    "layerwise": layerwise,
                    "timeout": self.timeout_s,
                }
            )
        if not items:
            return
        try:
            self.ranks.send(items)
        except KVTransferError:
            # A follower could not take the order: the decode side fails these transfers at its
            # deadline (or the router cancels them) and the request is recomputed there.
            logger.exception("ordering the followers' KV sends failed")
            self._cancel_ranks(SEND, [i["id"] for i in items], "a rank could not start its part")
            return
        for req, _start, _first in completing:
            self.rank_sends[req.key] = (req, req.kv_ticket.transfer_id)
            # The followers read these slots until their sends settle: the prompt enters the tree
            # (which may free duplicates of slots it holds) only after that.
            req.kv_streaming = True

    def _poll_streaming(self) -> None:
        """Transfers begun for sequences that ended (aborted, failed) before their first token."""
        for key, (req, handle) in list(self.streaming.items()):
            if req.aborted or req.error is not None or req.finished:
                del self.streaming[key]
                handle.cancel("the request ended before its first token")
        for key, (req, transfer_id) in list(self.rank_sends.items()):
            if key not in self.sending and (req.aborted or req.error is not None or req.finished):
                del self.rank_sends[key]
                self._cancel_ranks(SEND, [transfer_id], "the request ended before its first token")

    def start_send(self, req: Req) -> None:
        """Close the transfer of a sequence that just sampled its first token (begun by
        `stream_layers`; else queue all of it now)."""
        ticket: KVTicket = req.kv_ticket
        end = len(req.origin_input_ids)
        src = req.kv_slots[ticket.held_tokens : end]
        streamed = self.streaming.pop(req.key, None)
        handle = streamed[1] if streamed is not None else None
        try:
            if handle is None:
                handle = self.layout.send(self.transfer, ticket, src, self.timeout_s)
                handle.send_all()
            handle.finish({"token": req.output_ids[0], "cached_tokens": req.cached_tokens or 0})
        except Exception:
            if handle is not None:  # no part reads the slots once this returns
                handle.cancel("closing the transfer failed")
            # The decode side fails the request at its deadline (or when the router cancels it).
            logger.exception("request %s: starting the KV transfer failed", req.rid)
            self.counters["pd_transfers_failed_total"] += 1
            self._drop_rank_send(req.key, "rank 0 could not send its part")
            return
        self.sending[req.key] = _Send(req, handle, time.monotonic() + self.timeout_s + LEASE_GRACE_S)

    def _poll_sending(self) -> None:
        now = time.monotonic()
        for key, send in list(self.sending.items()):
            req, handle = send.req, send.handle
            if not send.detached:
                continue  # still in the batch until the next step boundary
            if not handle.done():
                if now < send.lease_end:
                    continue
                handle.cancel("the sender's lease ran out")
            error = handle.future.exception()
            if key in self.rank_sends and self.ranks is not None:
                ranks_error = self.ranks.settled(SEND, self.rank_sends[key][1]) if error is None else None
                if ranks_error is None:  # a follower's part has not settled
                    if error is None and now < send.lease_end:
                        continue
                    self._drop_rank_send(key, "the transfer failed on rank 0 or its lease ran out")
                    error = error or KVTransferError("a rank's part did not settle within the lease")
                else:
                    del self.rank_sends[key]
                    error = KVTransferError(ranks_error) if ranks_error else None
            del self.sending[key]
            if error is not None:
                handle.cancel("the transfer failed")  # a group's other parts stop reading the slots
            if error is None:
                self.counters["pd_transfers_sent_total"] += 1
            else:
                self.counters["pd_transfers_failed_total"] += 1
                logger.warning("request %s: KV transfer failed: %s", req.rid, error)
            self.scheduler.release(req)

    def _drop_rank_send(self, key: str, reason: str) -> None:
        entry = self.rank_sends.pop(key, None)
        if entry is not None:
            self._cancel_ranks(SEND, [entry[1]], reason)

    def _cancel_ranks(self, kind: str, ids: list[str], reason: str) -> None:
        """Stop the followers' parts of these transfers; returns once none touches their slots.
        A group that is gone raises nothing here: its ranks touch nothing any more."""
        if self.ranks is None or not ids:
            return
        try:
            self.ranks.cancel(kind, ids, reason)
        except Exception:
            logger.warning("cancelling the followers' KV transfers failed", exc_info=True)

    # Both ------------------------------------------------------------------------------------
    def poll(self, out: list) -> None:
        """At a step boundary: settle what the transfer engine finished."""
        if self.receiving or self.landed:
            self._poll_receiving(out)
        if self.streaming or self.rank_sends:
            self._poll_streaming()
        if self.sending:
            self._poll_sending()

    def fail_all(self) -> None:
        """Drop every transfer and give its slots back (the requests were failed already)."""
        for _req, handle in self.receiving.values():
            handle.cancel("the engine stopped")
        self._cancel_ranks(
            RECV, [h.ticket.transfer_id for _r, h in self.receiving.values()], "the engine stopped"
        )
        self._cancel_ranks(SEND, [tid for _r, tid in self.rank_sends.values()], "the engine stopped")
        self.rank_sends.clear()
        for req, _handle in self.receiving.values():
            self._free_reserved(req)
        for req, _aux in self.landed.values():
            self._free_reserved(req)
        for _req, streamed in self.streaming.values():
            streamed.cancel("the engine stopped")
        self.streaming.clear()
        for send in self.sending.values():
            send.handle.cancel("the engine stopped")
            if send.detached:  # the others leave the batch with it (EngineCore.fail_all)
                self.scheduler.release(send.req)
        self.receiving.clear()
        self.landed.clear()
        self.sending.clear()

    def stats(self) -> dict[str, Any]:
        snap = self.transfer.stats_snapshot()
        total = snap.get("total", {}) if isinstance(snap, dict) else {}
        return {
            **self.counters,
            "pd_bytes_sent_total": int(total.get("bytes_sent", 0)),
            "pd_bytes_received_total": int(total.get("bytes_received", 0)),
            "pd_bytes_saved_total": int(total.get("bytes_saved", 0)),
        }

    def close(self) -> None:
        self.transfer.close()
