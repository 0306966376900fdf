"""KV transfers of a tensor-parallel PD replica: every rank moves its own heads.

At tp_size N a prefill or decode replica's KV lies in N pools, each with its rank's KV heads at
the same slot indices (the followers take rank 0's slot decisions). A transfer therefore runs
rank r -> rank r of a replica of the same degree: every rank has a KVTransferEngine of its own
over its own pool, and a decode replica's ticket carries one endpoint per rank
(`KVTicket.rank_endpoints`). Degrees that differ are refused: rank r of one would hold other
heads than rank r of the other (the handshake would refuse the pair anyway, its head counts
differ; the prefill replica refuses the ticket up front, with both degrees named).

Rank 0 keeps all the bookkeeping (engine/kv_handoff.py) and gives the followers orders. An order
rides the batch broadcast (`broadcast_control`), so it is ordered with the forwards, and it
returns once every follower has acted on it:

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
tp-1 one here: two gloo all-reduces per layer on a CPU.)
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
from typing import Any

import torch.distributed as dist

from radixserve.workers.disaggregation import (
    KVEndpoint,
    KVTicket,
    KVTransferConfig,
    KVTransferEngine,
    KVTransferError,
    create_kv_transfer_engine,
    layer_by_layer,
    model_fingerprint,
)
from radixserve.workers.mem_cache.kv_pool import KVPool

logger = logging.getLogger("radixserve.engine")

RECV, SEND = "recv", "send"


def endpoint_key(rank: int) -> str:
    """Where a decode follower publishes its transfer engine's endpoint (JSON) at start-up."""
    return f"tp/kv/endpoint/{rank}"


def report_key(kind: str, transfer_id: str, rank: int) -> str:
    """Where a follower reports a transfer it settled: "" if it completed, else the error."""
    return f"tp/kv/{kind}/{rank}/{transfer_id}"


def fingerprint_of(loaded: Any) -> str:
    """The model's identity for the KV transfer handshake (this rank's shard: ranks r of two
    replicas of one degree hold equal shards)."""
    mc = loaded.config
    is_instance = dataclasses.is_dataclass(mc) and not isinstance(mc, type)
    config = dataclasses.asdict(mc) if is_instance else dict(vars(mc))
    return model_fingerprint(config, loaded.model.state_dict().items())


@dataclass(frozen=True)
class RankKVSpec:
    """What a follower of a prefill or decode replica needs for its own transfer engine."""

    role: str  # prefill | decode
    kv_transfer: str
    timeout_s: float
    served_model_name: str | None  # None: the model's own name


class FollowerTransfers:
    """A following rank's transfers: it acts on rank 0's orders and reports what settles."""

    def __init__(self, rank: int, engine: KVTransferEngine, store: dist.Store, num_layers: int):
        self.rank, self.engine, self.store = rank, engine, store
        self.num_layers = num_layers
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], Any] = {}  # (kind, transfer id) -> its handle
        self._next: list[dict[str, Any]] = []  # send orders for the next batch
        self._batch: list[tuple[Any, bool]] = []  # sends of the batch in flight: (handle, layerwise)

    @classmethod
    def start(
        cls, rank: int, spec: RankKVSpec, pool: KVPool, loaded: Any, store: dist.Store
    ) -> FollowerTransfers:
        """Its transfer engine over this rank's pool; a decode follower publishes its endpoint."""
        engine = create_kv_transfer_engine(
            spec.kv_transfer,
            pool,
            f"{spec.role}-rank{rank}-{uuid.uuid4().hex[:8]}",
            spec.served_model_name or loaded.name,
            fingerprint_of(loaded),
            KVTransferConfig(transfer_timeout=spec.timeout_s),
        )
        if spec.role == "decode":
            store.set(endpoint_key(rank), json.dumps(engine.endpoint().to_dict()))
        return cls(rank, engine, store, len(pool.k_buffers))

    # Orders (the follower's main thread, between batches) ----------------------------------------
    def on_control(self, order: dict[str, Any]) -> int:
        """Act on one order; its answer (summed over the followers): the open transfers, for
        "count", else 0."""
        op = order["op"]
        if op == "expect":
            for item in order["items"]:
                handle = self.engine.expect(
                    item["id"], item["slots"], int(item["held"]), timeout=float(item["timeout"])
                )
                self._track(RECV, item["id"], handle.future, handle)
        elif op == "send":
            self._next.extend(order["items"])
        elif op == "cancel":
            self._cancel(order["kind"], order["ids"], order["reason"])
        elif op == "count":
            return self.open_count()
        else:
            raise ValueError(f"unknown order {op!r}")
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
            self._next = [o for o in self._next if o["id"] not in dropped]
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
        orders, self._next = self._next, []
        streamed: list[tuple[Any, int]] = []
        for order in orders:
            transfer_id = order["id"]
            try:
                ticket = KVTicket.from_dict(order["ticket"]).for_rank(self.rank)
                handle = self.engine.send(ticket, order["slots"], timeout=float(order["timeout"]))
            except Exception as exc:
                logger.exception("rank %d: starting transfer %r failed", self.rank, transfer_id)
                failed: Future = Future()
                failed.set_exception(KVTransferError(f"starting the send failed: {exc!r}"))
                self._track(SEND, transfer_id, failed, None)
                continue
            self._track(SEND, transfer_id, handle.future, handle)
            first, layerwise = int(order["first"]), bool(order["layerwise"])
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
        order: Callable[[dict[str, Any]], tuple[int, int]],
        store: dist.Store,
        endpoints: tuple[KVEndpoint, ...] = (),
    ):
        self.world_size = world_size
        self._order, self.store = order, store
        self.endpoints = endpoints  # decode: ranks 1..N-1's, for tickets

    @classmethod
    def for_decode(
        cls, world_size: int, order: Callable[[dict[str, Any]], tuple[int, int]], store: dist.Store
    ) -> RankTransfers:
        endpoints = tuple(
            KVEndpoint.from_dict(json.loads(store.get(endpoint_key(r)))) for r in range(1, world_size)
        )
        return cls(world_size, order, store, endpoints)

    def _give(self, order: dict[str, Any]) -> int:
        failed, answer = self._order(order)
        if failed:
            raise KVTransferError(f"{failed} tensor-parallel rank(s) failed to {order['op']} a KV transfer")
        return answer

    def open_count(self) -> int:
        """Transfers the followers have not settled (or settled unreported), summed: 0 at idle."""
        return self._give({"op": "count"})

    def expect(self, items: list[dict[str, Any]]) -> None:
        """Each item: {"id", "slots", "held", "timeout"} as rank 0 expects the same transfer."""
        if items:
            self._give({"op": "expect", "items": items})

    def send(self, items: list[dict[str, Any]]) -> None:
        """Each item: {"id", "ticket", "slots", "first", "layerwise", "timeout"}, started by the
        followers with the next batch."""
        if items:
            self._give({"op": "send", "items": items})

    def cancel(self, kind: str, ids: list[str], reason: str) -> None:
        if ids:
            self._give({"op": "cancel", "kind": kind, "ids": ids, "reason": reason})

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
