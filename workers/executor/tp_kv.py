"""KV transfers of a tensor-parallel PD replica: every rank moves its own heads.

At tp_size N a prefill or decode replica's KV lies in N pools, each with its rank's KV heads at
the same slot indices (the followers take rank 0's slot decisions). Every rank has a
KVTransferEngine of its own over its own pool, and a decode replica's ticket carries one endpoint
per rank (`KVTicket.rank_endpoints`).

Which rank sends which heads to which (`transfer_plan`): between replicas of one degree, rank r
sends all its heads to rank r, one transfer per rank. Between degrees (`--prefill-tp` and
`--decode-tp`), each receiving rank takes each of its KV heads from one sending rank that holds
it (itself by index where it holds them, else spread over the holders), and each (sender rank,
receiver rank) pair with heads in common is one transfer of those heads, the request's transfer
id plus "/p-d". A rank's parts of one request form one handle (`RecvGroup`, `SendGroup`): it
settles when all of them have. Every layout the model has at both degrees works this way: whole
KV heads split unevenly (9 query / 3 KV heads over 2 ranks), KV heads replicated over several
ranks (fewer KV heads than ranks), and either side larger. The decode replica plans for the
prefill degree it was configured with (`sender_tp_size` in the ticket); a prefill replica of
another degree refuses the ticket up front, with both degrees named.

Rank 0 keeps all the bookkeeping (engine/kv_handoff.py) and gives the followers orders (typed,
executor/tp_orders.py). An order rides the batch broadcast (`broadcast_control`), so it is ordered
with the forwards, and it returns once every follower has acted on it:

  expect   decode: register receives into the slots just reserved (before the ticket leaves)
  send     prefill: start sends with the next batch, each layer queued as that forward writes
           it (or all of it after the forward), closed when the forward ends
  cancel   either: drop transfers (abort, deadline, lease); once it returns no thread of any
           rank reads or writes their slots, so rank 0 may free them

A follower reports each transfer it settled under a key of the group's store; rank 0 reads the
keys (`RankTransfers.settled`) before it admits a sequence (decode) or releases its slots
(prefill), so no rank's slots are reused while a transfer still touches them.

The cost (load_tests/bench_pd_tp.py, the default model on 2 cores, medians): at tp 2 the
hand-off (first token -> second) is 91 ms for a 1k-token prompt and 84 ms for 4k, against one
tp-2 decode step of 92-94 ms alone: the per-rank sends and the reports hide behind the prefill
forward. (tp 1: 31 / 47 ms against a 36 / 40 ms step. The tp-2 step itself is 2.3-2.6x the
tp-1 one here: two gloo all-reduces per layer on a CPU.) Between degrees, a tp-2 prefill replica
into a tp-1 decode replica (two parts into one pool): 21.8 / 33.9 ms for 1k / 4k tokens, beside
23.9 / 31.8 ms for tp 1 into tp 1 in the same run, so the second part costs nothing that shows.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, assert_never

import torch.distributed as dist

from radixserve.workers.disaggregation import (
    KVEndpoint,
    KVTicket,
    KVTransferConfig,
    KVTransferEngine,
    KVTransferError,
    RecvHandle,
    SendHandle,
    create_kv_transfer_engine,
    layer_by_layer,
    model_fingerprint,
)
from radixserve.workers.distributed.parallel import HeadSplit
from radixserve.workers.executor.tp_orders import (
    RECV,
    SEND,
    CancelOrder,
    CountOrder,
    ExpectItem,
    ExpectOrder,
    Order,
    SendItem,
    SendOrder,
    TransferOrder,
)
from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.models.loader import iter_checkpoint_edges
from radixserve.workers.protocol import Role

logger = logging.getLogger("radixserve.engine")


def endpoint_key(rank: int) -> str:
    """Where a decode follower publishes its transfer engine's endpoint (JSON) at start-up."""
    return f"tp/kv/endpoint/{rank}"


def report_key(kind: str, transfer_id: str, rank: int) -> str:
    """Where a follower reports a transfer it settled: "" if it completed, else the error."""
    return f"tp/kv/{kind}/{rank}/{transfer_id}"


def fingerprint_of(loaded: Any) -> str:
    """The model's identity for the KV transfer handshake: its config and its checkpoint's
    tensors (names, shapes, dtypes, first and last rows), not this rank's shard, so that the ranks
    of replicas of any degrees agree."""
    mc = loaded.config
    is_instance = dataclasses.is_dataclass(mc) and not isinstance(mc, type)
    config = dataclasses.asdict(mc) if is_instance else dict(vars(mc))
    return model_fingerprint(config, iter_checkpoint_edges(Path(loaded.model_path)))


@dataclass(frozen=True)
class KVPart:
    """One transfer of a request between two replicas' ranks: the model's KV heads [lo, hi)."""

    sender: int
    receiver: int
    heads: tuple[int, int]


def transfer_plan(num_heads: int, num_kv_heads: int, sender_tp: int, receiver_tp: int) -> tuple[KVPart, ...]:
    """Every (sender rank, receiver rank) transfer of one request's KV, and the heads it moves:
    each receiving rank gets each of its heads exactly once. Raises ValueError for a degree the
    model has no layout at."""
    held = [HeadSplit.of(num_heads, num_kv_heads, sender_tp, r) for r in range(sender_tp)]
    parts: list[KVPart] = []
    for d in range(receiver_tp):
        want = HeadSplit.of(num_heads, num_kv_heads, receiver_tp, d)
        sources = []
        for h in range(want.kv_lo, want.kv_hi):
            holders = [p for p, split in enumerate(held) if split.kv_lo <= h < split.kv_hi]
            sources.append(d if d in holders else holders[d % len(holders)])
        start = want.kv_lo
        for i, source in enumerate(sources):
            h = want.kv_lo + i
            if i + 1 == len(sources) or sources[i + 1] != source:
                parts.append(KVPart(source, d, (start, h + 1)))
                start = h + 1
    return tuple(parts)


@dataclass(frozen=True)
class KVLayout:
    """One rank's place in a PD replica's KV: the model's heads and the replica's degree."""

    num_heads: int
    num_kv_heads: int
    tp_size: int = 1
    rank: int = 0

    @classmethod
    def of(cls, loaded: Any, tp_size: int = 1, rank: int = 0) -> KVLayout:
        return cls(loaded.config.num_heads, loaded.config.num_kv_heads, tp_size, rank)

    @property
    def kv_heads(self) -> tuple[int, int, int]:
        """(begin, end, the model's): the KV heads this rank's pool holds."""
        split = HeadSplit.of(self.num_heads, self.num_kv_heads, self.tp_size, self.rank)
        return split.kv_lo, split.kv_hi, self.num_kv_heads

    def parts(self, sender_tp: int, receiver_tp: int, sending: bool) -> list[KVPart]:
        """This rank's transfers of a request between replicas of these degrees."""
        plan = transfer_plan(self.num_heads, self.num_kv_heads, sender_tp, receiver_tp)
        return [p for p in plan if (p.sender if sending else p.receiver) == self.rank]

    def expect(
        self, engine: KVTransferEngine, sender_tp: int, transfer_id: str, slots, held: int, timeout: float
    ) -> RecvHandle | RecvGroup:
        """Register this rank's parts of a transfer from a replica of `sender_tp` ranks."""
        if sender_tp == self.tp_size:
            return engine.expect(transfer_id, slots, held, timeout=timeout)
        handles: list[RecvHandle] = []
        try:
            for part in self.parts(sender_tp, self.tp_size, sending=False):
                part_id = part_transfer_id(transfer_id, part)
                handles.append(engine.expect(part_id, slots, held, timeout=timeout, heads=part.heads))
        except BaseException:
            for h in handles:
                h.cancel("registering the transfer's other parts failed")
            raise
        return RecvGroup(transfer_id, handles)

    def send(
        self, engine: KVTransferEngine, ticket: KVTicket, slots, timeout: float
    ) -> SendHandle | SendGroup:
        """Start this rank's parts of the ticket's transfer (the ticket as the receiver's rank 0
        issued it, with every rank's endpoint)."""
        if ticket.sender_tp != self.tp_size:
            raise KVTransferError(
                f"the decode replica expects KV from a prefill replica of tp_size {ticket.sender_tp}, "
                f"this one runs tp_size {self.tp_size}"
            )
        if ticket.tp_size == self.tp_size:
            return engine.send(ticket.for_rank(self.rank), slots, timeout=timeout)
        handles: list[SendHandle] = []
        try:
            for part in self.parts(self.tp_size, ticket.tp_size, sending=True):
                peer = dataclasses.replace(
                    ticket.for_rank(part.receiver), transfer_id=part_transfer_id(ticket.transfer_id, part)
                )
                handles.append(engine.send(peer, slots, timeout=timeout, heads=part.heads))
        except BaseException:
            for h in handles:
                h.cancel("starting the transfer's other parts failed")
            raise
        return SendGroup(ticket.transfer_id, len(slots), handles)


def part_transfer_id(transfer_id: str, part: KVPart) -> str:
    return f"{transfer_id}/{part.sender}-{part.receiver}"


def _all_of(futures: Sequence[Future], on_failure: Callable[[Future, str], Any]) -> Future:
    """Resolves once every future has, with their dict results merged. At the first failure,
    `on_failure(that future, why)` runs (the group cancels its other parts: once it returns, none
    of them touches the slots), then the result fails with that error. It runs on the thread
    that settled the failed part, inside that part's locks: it must not touch that part."""
    out: Future = Future()
    state = {"pending": len(futures), "failed": False}
    lock = threading.Lock()
    merged: dict[str, Any] = {}

    def done(f: Future) -> None:
        error = f.exception()
        with lock:
            state["pending"] -= 1
            first_failure = error is not None and not state["failed"]
            state["failed"] = state["failed"] or error is not None
            if error is None and not state["failed"]:
                merged.update(f.result() or {})
            complete = state["pending"] == 0 and not state["failed"]
        if first_failure:
            try:
                on_failure(f, f"another part of the transfer failed: {error}")
            finally:
                out.set_exception(error)
        elif complete:
            out.set_result(merged)

    if not futures:
        out.set_result({})
    for f in futures:
        f.add_done_callback(done)
    return out


class _Group:
    """A rank's parts of one request's transfer, as one handle: done once every part is, failed
    (every other part cancelled first) at the first that fails."""

    def __init__(self, handles: Sequence[RecvHandle | SendHandle]):
        self.handles = list(handles)
        self.future = _all_of([h.future for h in self.handles], self._cancel_others)

    def done(self) -> bool:
        return self.future.done()

    def cancel(self, reason: str = "cancelled") -> bool:
        return any([h.cancel(reason) for h in self.handles])

    def _cancel_others(self, failed: Future, reason: str) -> None:
        for h in self.handles:
            if h.future is not failed:
                h.cancel(reason)


class RecvGroup(_Group):
    """A decode rank's parts of one request's transfer."""

    def __init__(self, transfer_id: str, handles: list[RecvHandle]):
        assert handles, "a decode rank receives every one of its heads"
        self.ticket = dataclasses.replace(handles[0].ticket, transfer_id=transfer_id)
        super().__init__(handles)

    @property
    def began(self) -> bool:
        """Whether a sender has begun any of the parts."""
        return any(h.began for h in self.handles if isinstance(h, RecvHandle))


class SendGroup(_Group):
    """A prefill rank's parts of one request's transfer (none, where the receiving ranks take
    every head this rank holds from others)."""

    def __init__(self, transfer_id: str, num_tokens: int, handles: list[SendHandle]):
        self.transfer_id = transfer_id
        self.num_tokens = num_tokens
        self.sends = handles
        super().__init__(handles)

    def send_layers(
        self, layer_begin: int, layer_end: int, token_begin: int = 0, token_end: int | None = None
    ) -> None:
        for h in self.sends:
            h.send_layers(layer_begin, layer_end, token_begin, token_end)

    def send_all(self) -> None:
        for h in self.sends:
            h.send_all()

    def finish(self, aux: dict[str, Any] | None = None) -> Future:
        for h in self.sends:
            h.finish(aux)
        return self.future


@dataclass(frozen=True)
class RankKVSpec:
    """What a follower of a prefill or decode replica needs for its own transfer engine."""

    role: Role  # PREFILL | DECODE
    kv_transfer: str
    timeout_s: float
    served_model_name: str | None  # None: the model's own name
    tp_size: int = 1  # the replica's
    peer_tp_size: int = 0  # decode: the prefill replicas' degree (0: the same)


class FollowerTransfers:
    """A following rank's transfers: it acts on rank 0's orders and reports what settles."""

    def __init__(
        self, layout: KVLayout, engine: KVTransferEngine, store: dist.Store, num_layers: int, peer_tp: int
    ):
        self.layout, self.engine, self.store = layout, engine, store
        self.rank = layout.rank
        self.num_layers = num_layers
        self.peer_tp = peer_tp or layout.tp_size
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], Any] = {}  # (kind, transfer id) -> its handle
        self._next: list[SendItem] = []  # sends ordered for the next batch
        self._batch: list[tuple[Any, bool]] = []  # sends of the batch in flight: (handle, layerwise)

    @classmethod
    def start(
        cls, rank: int, spec: RankKVSpec, pool: KVPool, loaded: Any, store: dist.Store
    ) -> FollowerTransfers:
        """Its transfer engine over this rank's pool; a decode follower publishes its endpoint."""
        layout = KVLayout.of(loaded, spec.tp_size, rank)
        engine = create_kv_transfer_engine(
            spec.kv_transfer,
            pool,
            f"{spec.role.value}-rank{rank}-{uuid.uuid4().hex[:8]}",
            spec.served_model_name or loaded.name,
            fingerprint_of(loaded),
            KVTransferConfig(transfer_timeout=spec.timeout_s),
            layout.kv_heads,
        )
        if spec.role is Role.DECODE:
            store.set(endpoint_key(rank), json.dumps(engine.endpoint().to_dict()))
        return cls(layout, engine, store, len(pool.k_buffers), spec.peer_tp_size)

    # Orders (the follower's main thread, between batches) ----------------------------------------
    def on_control(self, order: TransferOrder) -> int:
        """Act on one order; its answer (summed over the followers): the open transfers, for a
        CountOrder, else 0."""
        match order:
            case ExpectOrder(items=items):
                for item in items:
                    handle = self.layout.expect(
                        self.engine, self.peer_tp, item.transfer_id, item.slots, item.held, item.timeout_s
                    )
                    self._track(RECV, item.transfer_id, handle.future, handle)
            case SendOrder(items=items):
                self._next.extend(items)
            case CancelOrder(kind=kind, ids=ids, reason=reason):
                self._cancel(kind, ids, reason)
            case CountOrder():
                return self.open_count()
            case _:
                assert_never(order)
        return 0

    def _track(self, kind: str, transfer_id: str, future: Future, handle: Any) -> None:
        with self._lock:
            self._open[(kind, transfer_id)] = handle
        future.add_done_callback(lambda f: self._report(kind, transfer_id, f))

    def _report(self, kind: str, transfer_id: str, future: Future) -> None:
        with self._lock:
            if self._open.pop((kind, transfer_id), None) is None:
                return  # cancelled by order: rank 0 does not wait for it
            error = future.exception()
            value = "" if error is None else f"rank {self.rank}: {type(error).__name__}: {error}"
            try:
                self.store.set(report_key(kind, transfer_id, self.rank), value)
            except Exception:  # rank 0's store is gone: the group is ending
                logger.warning("rank %d: reporting transfer %r failed", self.rank, transfer_id, exc_info=True)

    def _cancel(self, kind: str, ids: Sequence[str], reason: str) -> None:
        if kind == SEND:  # not started yet (no batch ran since the order): never will be
            dropped = set(ids)
            self._next = [item for item in self._next if item.transfer_id not in dropped]
        for transfer_id in ids:
            with self._lock:
                handle = self._open.pop((kind, transfer_id), None)
            if handle is not None:
                handle.cancel(reason)  # returns once no thread touches the transfer's slots
            else:  # it settled first: its report is not wanted any more
                self.store.delete_key(report_key(kind, transfer_id, self.rank))

    # The batch's sends ----------------------------------------------------------------------------
    def begin_batch(self) -> Callable[[int], None] | None:
        """Before a forward: start the sends ordered for it. The callback (the batch's
        `layer_done`) queues each layer of the layerwise ones as the forward writes it."""
        items, self._next = self._next, []
        streamed: list[tuple[Any, int]] = []
        for item in items:
            transfer_id = item.transfer_id
            try:
                handle = self.layout.send(self.engine, item.ticket, item.slots, item.timeout_s)
            except Exception as exc:
                logger.exception("rank %d: starting transfer %r failed", self.rank, transfer_id)
                failed: Future = Future()
                failed.set_exception(KVTransferError(f"starting the send failed: {exc!r}"))
                self._track(SEND, transfer_id, failed, None)
                continue
            self._track(SEND, transfer_id, handle.future, handle)
            first, layerwise = item.first, item.layerwise
            try:
                if layerwise and first > 0:
                    handle.send_layers(0, self.num_layers, 0, first)
            except Exception as exc:
                handle.cancel(f"queueing the cached prefix failed: {exc!r}")
                continue
            self._batch.append((handle, layerwise))
            if layerwise and first < handle.num_tokens:
                streamed.append((handle, first))
        return layer_by_layer(streamed)

    def end_batch(self) -> None:
        """After the forward: every layer of the batch's sends is written; close them."""
        batch, self._batch = self._batch, []
        for handle, layerwise in batch:
            try:
                if not layerwise:
                    handle.send_all()
                handle.finish({})
            except Exception as exc:
                handle.cancel(f"closing the transfer failed: {exc!r}")

    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        self.engine.close()


class RankTransfers:
    """Rank 0's side: the orders it gives its followers and their reports.

    `order` is the TP leader's control broadcast (TPLeader.control); `store` the group's."""

    def __init__(
        self,
        world_size: int,
        order: Callable[[Order], tuple[int, int]],
        store: dist.Store,
        endpoints: tuple[KVEndpoint, ...] = (),
    ):
        self.world_size = world_size
        self._order, self.store = order, store
        self.endpoints = endpoints  # decode: ranks 1..N-1's, for tickets

    @classmethod
    def for_decode(
        cls, world_size: int, order: Callable[[Order], tuple[int, int]], store: dist.Store
    ) -> RankTransfers:
        endpoints = tuple(
            KVEndpoint.from_dict(json.loads(store.get(endpoint_key(r)))) for r in range(1, world_size)
        )
        return cls(world_size, order, store, endpoints)

    def _give(self, order: Order) -> int:
        failed, answer = self._order(order)
        if failed:
            raise KVTransferError(f"{failed} tensor-parallel rank(s) failed to {order.op} a KV transfer")
        return answer

    def open_count(self) -> int:
        """Transfers the followers have not settled (or settled unreported), summed: 0 at idle."""
        return self._give(CountOrder())

    def expect(self, items: Sequence[ExpectItem]) -> None:
        """The followers register these receives, as rank 0 expects the same transfers."""
        if items:
            self._give(ExpectOrder(tuple(items)))

    def send(self, items: Sequence[SendItem]) -> None:
        """The followers start these sends with the next batch."""
        if items:
            self._give(SendOrder(tuple(items)))

    def cancel(self, kind: str, ids: Sequence[str], reason: str) -> None:
        if ids:
            self._give(CancelOrder(kind, tuple(ids), reason))

    def unsettled(self, kind: str, transfer_id: str) -> list[int]:
        """The followers that have not reported the transfer settled yet."""
        return [
            r for r in range(1, self.world_size) if not self.store.check([report_key(kind, transfer_id, r)])
        ]

    def settled(self, kind: str, transfer_id: str) -> str | None:
        """None while a follower has not settled the transfer; once all have: "" if every rank's
        completed, else the first error. Consumes the reports."""
        keys = [report_key(kind, transfer_id, r) for r in range(1, self.world_size)]
        if not self.store.check(keys):
            return None
        values = [self.store.get(k).decode() for k in keys]
        for k in keys:
            self.store.delete_key(k)
        return next((v for v in values if v), "")
