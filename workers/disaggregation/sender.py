"""The sending side of a replica: one pair (send_pair.py) per receiving replica.

Transfers to one receiver share its pair, so their frames interleave in queue order and are
numbered by the pair's sequence. A broken pair leaves the map; the next transfer to that receiver
builds a new pair (a new connection, handshake included).
"""

from __future__ import annotations

import threading
import time

from radixserve.workers.disaggregation.config import KVTransferConfig
from radixserve.workers.disaggregation.errors import KVTransferError, PeerLost
from radixserve.workers.disaggregation.messages import Frame, FrameKind, KVEndpoint, KVTicket, slots_digest
from radixserve.workers.disaggregation.packing import PoolView
from radixserve.workers.disaggregation.send_pair import LinkFactory, SendPair
from radixserve.workers.disaggregation.stats import TransferStats
from radixserve.workers.disaggregation.transfer import SendHandle, SendOp


class KVSender:
    """All of a replica's sending pairs, keyed by receiving replica."""

    def __init__(
        self, view: PoolView, stats: TransferStats, config: KVTransferConfig, open_link: LinkFactory
    ):
        self._view = view
        self._stats = stats
        self._config = config
        self._open_link = open_link
        self._pairs: dict[tuple[str, str], SendPair] = {}
        # Broken pairs out of the map whose threads may still be winding down (closing the
        # link): `close` joins them too, so a closed engine leaves no thread behind.
        self._ending: list[SendPair] = []
        self._open: dict[str, SendHandle] = {}  # by transfer id, until settled
        self._lock = threading.Lock()
        self._closed = False

    def send(
        self, ticket: KVTicket, src_slots, timeout: float | None = None, heads: tuple[int, int] | None = None
    ) -> SendHandle:
        """Start a transfer of `src_slots` (this replica's slots, in token order) into the ticket's
        `dst_slots`: the model's KV heads `heads` (default: every head of this pool). The pair to
        the ticket's receiver is built on first use."""
        src = self._view.slot_index(src_slots)
        heads = heads or self._view.kv_heads
        self._view.check_heads(heads)
        if src.numel() != len(ticket.dst_slots):
            raise ValueError(
                f"transfer {ticket.transfer_id!r}: {src.numel()} source slots for {len(ticket.dst_slots)} destination slots"
            )
        with self._lock:
            if ticket.transfer_id in self._open:
                raise ValueError(f"transfer {ticket.transfer_id!r} is already being sent")
        pair = self._pair(ticket.endpoint)
        deadline = time.monotonic() + (self._config.transfer_timeout if timeout is None else timeout)
        handle = SendHandle(
            ticket,
            src,
            self._view,
            pair.submit,
            pair.abandon,
            self._config.max_message_bytes,
            deadline,
            heads,
        )
        begin = Frame(
            FrameKind.BEGIN,
            ticket.transfer_id,
            num_tokens=src.numel(),
            held_tokens=ticket.held_tokens,
            slots_digest=slots_digest(ticket.dst_slots),
            head_begin=heads[0],
            head_end=heads[1],
        )
        with self._lock:
            self._open[ticket.transfer_id] = handle
        handle.future.add_done_callback(lambda _f: self._settled(handle))
        pair.submit(SendOp(handle, begin))
        return handle

    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    def _settled(self, handle: SendHandle) -> None:
        with self._lock:
            if self._open.get(handle.transfer_id) is handle:
                del self._open[handle.transfer_id]

    def tick(self, now: float) -> None:
        with self._lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            pair.check(now)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            ending, self._ending = self._ending, []
        for pair in pairs:
            pair.break_(PeerLost("the KV transfer engine closed"))
        for pair in pairs + ending:
            pair.join(self._config.op_timeout)

    def _pair(self, endpoint: KVEndpoint) -> SendPair:
        key = (endpoint.replica_id, endpoint.address)
        with self._lock:
            if self._closed:
                raise KVTransferError("the KV transfer engine is closed")
            pair = self._pairs.get(key)
            if pair is None:
                pair = SendPair(
                    endpoint, self._open_link, self._view, self._stats, self._config, self._forget
                )
                self._pairs[key] = pair
            return pair

    def _forget(self, pair: SendPair) -> None:
        with self._lock:
            key = (pair.endpoint.replica_id, pair.endpoint.address)
            if self._pairs.get(key) is pair:
                del self._pairs[key]
            self._ending = [p for p in self._ending if p.alive()] + [pair]
