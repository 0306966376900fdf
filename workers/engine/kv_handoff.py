"""The KV connector: the engine's side of prefill/decode disaggregation. Engine thread only.

The engine calls one `KVConnector` at fixed points of its step (a new request's tickets, the
step boundary's `poll`, the forward's `stream_layers`, each sampled token, a finished sequence's
slots, reservations); the base class is a unified replica's and does nothing, so the engine has
no role conditionals. `DecodeConnector` and `PrefillConnector` are the two halves of a transfer;
the requests they serve stay on the scheduler's queues, in its states (WAITING_FOR_REMOTE_KV,
SENDING_KV: engine/scheduler.py), and the connectors keep only the transfers (handles, leases).
Their worker side is the transfer engine's (workers/disaggregation): each layer is sent or
received off the engine thread.

Decode role: `reserve` has the scheduler reserve each sequence's prompt past this replica's cached
prefix (locked) and registers them with the KV transfer engine; the
tickets go back to the router, which hands them to a prefill replica. The sequence waits here,
on the scheduler's `remote` queue, until its KV arrived with the first token the prefill replica
sampled; `poll` then has the scheduler publish the prompt to the radix tree and admit the
sequence straight into the running batch with that token as its first output (grammar, penalties, stop strings and counts
see it; the client got it from the prefill replica, so it is not sent again).

Prefill role: a sequence that carries a ticket is computed as any other and stops after its first
token (OutputProcessor), whose chunk goes out at once. Its transfer starts with the forward of
its last prefill chunk (`stream_layers`): what earlier chunks (or this replica's cache) hold goes
at once, and each layer of the last chunk as soon as the forward has written it, so the KV moves
while the later layers compute. `start_send` then closes the transfer with the first token, and
the sequence keeps its slots locked (SENDING_KV) until the send settled or its lease ran out. Its prompt
enters this replica's tree when the send settled (not while the pair may still read its slots:
the tree would free duplicates of slots it already holds).

Either way a transfer that does not settle within `kv_transfer_timeout_s` frees its slots. On
the decode side that deadline covers the transfer, not the wait for it: a reservation holds a
lease of `kv_transfer_timeout_s` that the ingress renews (`renew`) while the request's prefill is
still on its way (queued or computing on a prefill replica), and that starts again when the
prefill replica begins the transfer. A reservation whose lease runs out fails its request and
frees its slots; so does one held HOLD_LIMIT_S in all, renewed or not. A prefill side that dies
stops the renewals (the ingress sees its call fail, and cancels the reservation at once), so
its reservations are freed within one lease.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
from radixserve.workers.engine.commands import ReserveRequest
from radixserve.workers.engine.grammar_queue import GrammarQueue
from radixserve.workers.engine.inflight import InflightRequests
from radixserve.workers.engine.output_processor import OutputProcessor
from radixserve.workers.engine.request import Req, ReqStatus
from radixserve.workers.engine.reservations import WaitingReservations
from radixserve.workers.engine.scheduler import Scheduler
from radixserve.workers.executor.plan import BatchKind, ScheduledBatch
from radixserve.workers.executor.tp_kv import (
    RECV,
    SEND,
    KVLayout,
    RankKVSpec,
    RankTransfers,
    RecvGroup,
    SendGroup,
)
from radixserve.workers.executor.tp_orders import ExpectItem, SendItem
from radixserve.workers.protocol import EngineError, InvalidRequest, QueueFull, Role, TransferFailed

if TYPE_CHECKING:
    from radixserve.workers.engine.config import EngineConfig

logger = logging.getLogger("radixserve.engine")

# A send outlives its own deadline (the transfer engine fails it then) by at most this before
# its slots are taken back regardless.
LEASE_GRACE_S = 5.0
# The most a reservation is held, however often its lease is renewed (a prefill call that stays
# open but never sends); also the transfer engine's own deadline of every rank's receive, behind
# the lease that this rank keeps (it cancels the followers' parts when the lease runs out).
HOLD_LIMIT_S = 600.0


@dataclass
class _Lease:
    """A reservation's lease (decode side): the request fails once `until` has passed."""

    until: float
    began: bool = False  # the prefill replica has begun the transfer: the lease restarted then


@dataclass
class _Send:
    req: Req
    handle: SendHandle | SendGroup
    lease_end: float


class KVConnector:
    """A unified replica's connector: no KV moves, every hook does nothing. The engine calls
    these and nothing else of prefill/decode disaggregation."""

    ranks: RankTransfers | None = None

    def busy(self) -> bool:
        """Transfers in progress (the engine keeps polling)."""
        return False

    def bind_tickets(self, reqs: list[Req], tickets: Sequence[Any] | None) -> None:
        """Thread-safe, pure: attach a request's KV tickets to its sequences (prefill side)."""
        if tickets is not None:
            raise InvalidRequest("KV tickets are for prefill replicas only", "kv_tickets")

    def reserve(self, cmd: ReserveRequest, out: list) -> None:
        """Reserve slots and KV tickets for a request's prompts, answering `cmd.done` (decode side)."""
        if cmd.done.set_running_or_notify_cancel():
            cmd.done.set_exception(InvalidRequest("this replica does not decode for others", "role"))

    def abort(self, rid: str) -> None:
        """The request ended (its sequences are flagged): drop what of it waits here."""

    def renew(self, rids: Sequence[str]) -> int:
        return 0

    def grammar_ready(self, req: Req) -> bool:
        """A compiled grammar came back: True if its sequence waits here (not for the scheduler)."""
        return False

    def poll(self, out: list) -> None:
        """At a step boundary: settle what the transfer engine finished."""

    def before_forward(self, plan: ScheduledBatch) -> Callable[[int], None] | None:
        """Before a forward: the callback the forward calls as each layer is written, or None."""
        return None

    def after_token(self, req: Req) -> None:
        """A sequence appended its sampled token."""

    def keeps_slots(self, req: Req) -> bool:
        """A finished sequence leaves the batch: True if a peer still reads its slots (they stay
        locked, SENDING_KV, until the connector has the scheduler finish it)."""
        return False

    def open_rank_transfers(self) -> int:
        """The KV transfers the tensor-parallel followers hold open (0 at idle)."""
        return self.ranks.open_count() if self.ranks is not None else 0

    def fail_all(self, message: str) -> None:
        """Cancel every transfer (the engine fails its requests and the scheduler frees their
        slots after this: no transfer reads or writes them once it returns)."""

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def make_connector(
    config: EngineConfig,
    scheduler: Scheduler,
    outputs: OutputProcessor,
    inflight: InflightRequests,
    grammars: GrammarQueue,
    served_model_name: str,
    fingerprint: str,
    layout: KVLayout,
    ranks: Callable[[Role], RankTransfers | None],
) -> KVConnector:
    """The connector of `config.role`; `ranks(role)` opens the followers' transfers (tp > 1)."""
    if config.role is Role.UNIFIED:
        return KVConnector()
    transfers = (served_model_name, fingerprint, layout, ranks(config.role))
    if config.role is Role.DECODE:
        return DecodeConnector(config, scheduler, outputs, inflight, grammars, *transfers)
    return PrefillConnector(config, scheduler, outputs, inflight, *transfers)


def rank_kv_spec(config: EngineConfig) -> RankKVSpec | None:
    """What a prefill or decode replica's following ranks need for KV transfers of their own."""
    if config.role is Role.UNIFIED:
        return None
    return RankKVSpec(
        config.role,
        config.kv_transfer,
        config.kv_transfer_timeout_s,
        config.served_model_name,
        config.tp_size,
        config.kv_peer_tp_size,
    )


class _Transfers(KVConnector):
    """What both halves share: the transfer engine over this rank's pool, the followers' part."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        inflight: InflightRequests,
        served_model_name: str,
        fingerprint: str,
        layout: KVLayout,
        ranks: RankTransfers | None,
    ):
        self.timeout_s = config.kv_transfer_timeout_s
        self.scheduler = scheduler
        self.pool = scheduler.pool
        self.outputs = outputs
        self.inflight = inflight
        self.replica_id = f"{config.role.value}-{uuid.uuid4().hex[:8]}"
        self.transfer: KVTransferEngine = create_kv_transfer_engine(
            config.kv_transfer,
            self.pool,
            self.replica_id,
            served_model_name,
            fingerprint,
            KVTransferConfig(transfer_timeout=self.timeout_s),
            layout.kv_heads,
        )
        self.layout = layout
        # tp_size > 1: the followers' part of each transfer.
        self.ranks = ranks
        self.num_layers = len(self.pool.k_buffers)
        self.counters = dict(
            pd_transfers_received_total=0,
            pd_transfers_sent_total=0,
            pd_transfers_failed_total=0,
        )

    def _cancel_ranks(self, kind: str, ids: list[str], reason: str) -> None:
        """Stop the followers' parts of these transfers; returns once none touches their slots.
        A group that is gone raises nothing here: its ranks touch nothing any more."""
        if self.ranks is None or not ids:
            return
        try:
            self.ranks.cancel(kind, ids, reason)
        except Exception:
            logger.warning("cancelling the followers' KV transfers failed", exc_info=True)

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


class DecodeConnector(_Transfers):
    """Receives prompts' KV into reserved slots; their sequences then decode here."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        inflight: InflightRequests,
        grammars: GrammarQueue,
        *transfers: Any,
    ):
        super().__init__(config, scheduler, outputs, inflight, *transfers)
        self.grammars = grammars
        self.reservations = WaitingReservations()  # reservations waiting for room
        # the prefill replicas' degree, which each rank plans its receives for
        self.sender_tp = config.kv_peer_tp_size or self.layout.tp_size
        self.layout.parts(self.sender_tp, self.layout.tp_size, sending=False)  # raises: no layout there
        self.receiving: dict[str, tuple[Req, RecvHandle | RecvGroup]] = {}  # by sequence key
        self.leases: dict[str, _Lease] = {}  # of `receiving`, by sequence key
        self.hold_limit_s = max(HOLD_LIMIT_S, self.timeout_s)
        self.landed: dict[str, tuple[Req, dict[str, Any]]] = {}  # KV in, grammar pending

    def busy(self) -> bool:
        return bool(self.receiving or self.landed or self.reservations)

    def reserve(self, cmd: ReserveRequest, out: list) -> None:
        """Reserve the sequences' slots and tickets; they start once their KV is in. Without room
        now, the reservation waits up to `cmd.wait_s` for some (behind those waiting already:
        reservations.py)."""
        if not cmd.done.set_running_or_notify_cancel():
            return  # the caller gave up waiting (its task was cancelled): reserve nothing
        if cmd.wait_s > 0 and self.reservations:
            self.reservations.add(cmd)
        elif not self._try_reserve(cmd, out, last=cmd.wait_s <= 0):
            self.reservations.add(cmd)

    def _try_reserve(self, cmd: ReserveRequest, out: list, last: bool) -> bool:
        """Reserve now and answer `cmd.done`: True; no room yet: False (never when `last`)."""
        if not last and not self.has_room(cmd.reqs):
            return False  # a try now would only evict the cache for nothing
        try:
            tickets = self._reserve(cmd.reqs)
        except QueueFull as exc:
            if not last:
                return False
            cmd.done.set_exception(exc)
            return True
        except Exception as exc:
            cmd.done.set_exception(exc)
            return True
        self.inflight.add(cmd.reqs, cmd.stream)
        if cmd.reqs[0].params.grammar is not None:
            try:
                self.grammars.add(cmd.reqs)
            except Exception as exc:
                error = EngineError(f"starting the grammar compile failed: {exc!r}")
                self.inflight.fail(cmd.reqs[0].rid, error, out)
        cmd.done.set_result(tickets)
        return True

    def abort(self, rid: str) -> None:
        self.reservations.drop(rid, EngineError(f"request {rid} aborted while waiting for KV room"))

    def _reserve(self, reqs: list[Req]) -> list[KVTicket]:
        """Slots and a ticket for each sequence's prompt past the cached prefix; all or none
        (raises QueueFull when the rows or the KV pool cannot take them now)."""
        handles: list[RecvHandle | RecvGroup] = []
        try:
            for req in reqs:
                handles.append(self._reserve_one(req))
            if self.ranks is not None:  # the followers expect the same transfers, into the same slots
                self.ranks.expect(
                    [
                        ExpectItem(
                            h.ticket.transfer_id,
                            list(h.ticket.dst_slots),
                            h.ticket.held_tokens,
                            self.hold_limit_s,
                        )
                        for h in handles
                    ]
                )
        except BaseException:
            refused = [e for e in (self._stop_receiving(r.key) for r in reqs) if e is not None]
            for _req, handle in refused:
                handle.cancel("reservation refused")
            self._cancel_ranks(RECV, [h.ticket.transfer_id for _r, h in refused], "reservation refused")
            for req, _handle in refused:
                self._free_reserved(req)
            raise
        endpoints = self.ranks.endpoints if self.ranks is not None else ()
        sender_tp = self.sender_tp if self.sender_tp != self.layout.tp_size else 0
        return [
            dataclasses.replace(h.ticket, rank_endpoints=endpoints, sender_tp_size=sender_tp) for h in handles
        ]

    def has_room(self, reqs: list[Req]) -> bool:
        """Whether `reserve(reqs)` could find the rows and slots now (free and evictable slots
        past each prompt's cached prefix; an estimate: the prefix may be evictable itself)."""
        kv = self.scheduler.kv
        if kv.req_pool.available() < len(reqs):
            return False
        need = sum(len(r.origin_input_ids) - kv.cached_prefix_len(r) for r in reqs)
        return need + len(reqs) * kv.page_size <= kv.room()

    def renew(self, rids: Sequence[str]) -> int:
        """The prefill of these requests is still on its way: the leases of their reservations
        (those still waiting for their KV) start again. Returns how many were renewed."""
        wanted, until, renewed = set(rids), time.monotonic() + self.timeout_s, 0
        for key, (req, _handle) in self.receiving.items():
            if req.rid in wanted:
                lease = self.leases[key]
                lease.until = max(lease.until, until)
                renewed += 1
        return renewed

    def _reserve_one(self, req: Req) -> RecvHandle | RecvGroup:
        slots = self.scheduler.reserve_remote(req)
        if not isinstance(slots, list):
            raise QueueFull(
                "the decode replica has no room for another running sequence; retry later"
                if slots == "no table row"
                else "the decode replica's KV pool is full; retry later"
            )
        transfer_id = f"{req.key}@{uuid.uuid4().hex[:12]}"
        try:
            handle = self.layout.expect(
                self.transfer, self.sender_tp, transfer_id, slots, req.cache_len, self.hold_limit_s
            )
        except BaseException:
            self._free_reserved(req)
            raise
        self.receiving[req.key] = (req, handle)
        self.leases[req.key] = _Lease(time.monotonic() + self.timeout_s)
        return handle

    def _stop_receiving(self, key: str) -> tuple[Req, RecvHandle | RecvGroup] | None:
        self.leases.pop(key, None)
        return self.receiving.pop(key, None)

    def _lease_ran_out(self, key: str, handle: RecvHandle | RecvGroup, now: float) -> bool:
        """Whether the reservation's lease has run out; a transfer begun since the last look
        restarts it: from there the deadline covers the transfer itself."""
        lease = self.leases[key]
        if not lease.began and handle.began:
            lease.began, lease.until = True, max(lease.until, now + self.timeout_s)
        return now >= lease.until

    def _free_reserved(self, req: Req) -> None:
        """Give back a reservation whose KV never (fully) arrived (the scheduler frees it unread)."""
        if req.status is ReqStatus.WAITING_FOR_REMOTE_KV:
            self.scheduler.finish(req)

    def _poll_receiving(self, out: list) -> None:
        now = time.monotonic()
        for key, (req, handle) in list(self.receiving.items()):
            transfer_id = handle.ticket.transfer_id
            if req.aborted:
                handle.cancel("the request ended")
            elif not handle.done():
                if not self._lease_ran_out(key, handle, now):
                    continue
                held = now - self.leases[key].until + self.timeout_s
                handle.cancel(f"no word of its prefill for {held:.1f}s: the reservation's lease ran out")
                if not handle.done():  # settled meanwhile by the transfer engine's own thread
                    continue
            error = None if req.aborted else handle.future.exception()
            if self.ranks is not None and error is None and not req.aborted:
                ranks_error = self.ranks.settled(RECV, transfer_id)
                if ranks_error is None:
                    if not self._lease_ran_out(key, handle, now):
                        continue  # this rank's part is in, a follower's is not yet
                    late = ", ".join(f"rank {r}" for r in self.ranks.unsettled(RECV, transfer_id))
                    ranks_error = f"the part of {late or 'a follower'} did not arrive within the lease"
                    self._cancel_ranks(RECV, [transfer_id], "the reservation's lease ran out")
                error = KVTransferError(ranks_error) if ranks_error else None
            elif self.ranks is not None:  # the followers' parts are not wanted any more
                self._cancel_ranks(RECV, [transfer_id], "the transfer failed on rank 0 or the request ended")
            self._stop_receiving(key)
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
                wait = self.scheduler.adapter_wait(req)
                if wait == "wait":
                    continue  # its adapter is being read, or every batch slot holds another
                del self.landed[key]
                if wait is not None:
                    self._free_reserved(req)
                    self.inflight.fail(req.rid, EngineError(wait), out)
                    continue
                self._admit(req, aux, out)

    def _admit(self, req: Req, aux: dict[str, Any], out: list) -> None:
        """The KV is in: the scheduler publishes the prompt and runs it from the first token."""
        req.cached_tokens = int(aux.get("cached_tokens", req.cached_tokens or 0))
        self.scheduler.start_arrived(req)
        req.last_token_at = time.monotonic()  # its next token's interval counts from here
        try:
            self.outputs.append_token(req, int(aux["token"]), None)
            self.outputs.detokenize(req)
            self.outputs.mark_sent(req)
            self.outputs.take_forced(req)  # as a unified engine does right after sampling it
        except Exception as exc:
            self.inflight.fail(
                req.rid, TransferFailed(f"continuing from the first token failed: {exc!r}"), out
            )
            return
        if req.finish_reason is not None:
            self.inflight.emit_final(req, out)

    def grammar_ready(self, req: Req) -> bool:
        """Ours if its KV is still on its way or in (it is admitted once both are there)."""
        return req.key in self.receiving or req.key in self.landed

    def poll(self, out: list) -> None:
        if self.reservations:  # what finished at the last boundary may make room for them
            self.reservations.retry(lambda cmd, last: self._try_reserve(cmd, out, last))
        if self.receiving or self.landed:
            self._poll_receiving(out)

    def fail_all(self, message: str) -> None:
        self.reservations.fail_all(EngineError(message))
        for _req, handle in self.receiving.values():
            handle.cancel("the engine stopped")
        self._cancel_ranks(
            RECV, [h.ticket.transfer_id for _r, h in self.receiving.values()], "the engine stopped"
        )
        self.receiving.clear()
        self.leases.clear()
        self.landed.clear()


class PrefillConnector(_Transfers):
    """Computes prompts whose sequences carry a ticket and sends their KV, layer by layer."""

    def __init__(self, config: EngineConfig, *args: Any):
        super().__init__(config, *args)
        self.layerwise = config.kv_transfer_layerwise
        self.tp_size = config.tp_size
        self.sending: dict[str, _Send] = {}  # by sequence key
        # transfers begun with a last prefill chunk, until its first token closes them
        self.streaming: dict[str, tuple[Req, SendHandle | SendGroup]] = {}
        # tp_size > 1: the transfers the followers send, by sequence key, from the batch that
        # completes the prompt until this rank releases it.
        self.rank_sends: dict[str, tuple[Req, str]] = {}

    def busy(self) -> bool:
        return bool(self.sending or self.streaming or self.rank_sends)

    def bind_tickets(self, reqs: list[Req], tickets: Sequence[Any] | None) -> None:
        if tickets is None:
            return
        if len(tickets) != len(reqs):
            raise InvalidRequest(f"{len(tickets)} KV tickets for {len(reqs)} sequences", "kv_tickets")
        for req, ticket in zip(reqs, tickets):
            req.kv_ticket = ticket
            if req.kv_ticket.held_tokens + len(req.kv_ticket.dst_slots) != len(req.origin_input_ids):
                raise InvalidRequest("the KV ticket does not cover the prompt", "kv_tickets")
            if req.kv_ticket.sender_tp != self.tp_size:
                raise InvalidRequest(
                    f"the decode replica expects KV from prefill replicas of tp_size "
                    f"{req.kv_ticket.sender_tp}, this one runs tp_size {self.tp_size} "
                    "(--prefill-tp must be the prefill pool's degree)",
                    "kv_tickets",
                )

    def keeps_slots(self, req: Req) -> bool:
        return req.key in self.sending

    def before_forward(self, plan: ScheduledBatch) -> Callable[[int], None] | None:
        return self.stream_layers(plan, self.layerwise)

    def after_token(self, req: Req) -> None:
        if req.kv_ticket is not None and len(req.output_ids) == 1:
            self.start_send(req)

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
        items: list[SendItem] = []
        for req, _start, first in completing:
            ticket: KVTicket = req.kv_ticket
            slots = req.kv_slots[ticket.held_tokens : len(req.origin_input_ids)]
            items.append(SendItem(ticket.transfer_id, ticket, slots, first, layerwise, self.timeout_s))
        if not items:
            return
        try:
            self.ranks.send(items)
        except KVTransferError:
            # A follower could not take the order: the decode side fails these transfers at its
            # deadline (or the router cancels them) and the request is recomputed there.
            logger.exception("ordering the followers' KV sends failed")
            self._cancel_ranks(SEND, [i.transfer_id for i in items], "a rank could not start its part")
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
            if req.status is not ReqStatus.SENDING_KV:
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
            self.scheduler.finish(req)

    def _drop_rank_send(self, key: str, reason: str) -> None:
        entry = self.rank_sends.pop(key, None)
        if entry is not None:
            self._cancel_ranks(SEND, [entry[1]], reason)

    def poll(self, out: list) -> None:
        if self.streaming or self.rank_sends:
            self._poll_streaming()
        if self.sending:
            self._poll_sending()

    def fail_all(self, message: str) -> None:
        self._cancel_ranks(SEND, [tid for _r, tid in self.rank_sends.values()], "the engine stopped")
        self.rank_sends.clear()
        for _req, streamed in self.streaming.values():
            streamed.cancel("the engine stopped")
        self.streaming.clear()
        for send in self.sending.values():
            send.handle.cancel("the engine stopped")
        self.sending.clear()
