"""The receiving side of a replica: expected transfers, and the frames of every connection.

A transport calls `connected` when a sender's handshake succeeds, `on_frame` for each frame in the
order the sender sent them (on one thread per connection, or one for all), and `disconnected`
when the connection breaks. Every DATA frame's payload is read, even for a transfer that was
refused or cancelled, so that a connection's byte stream stays aligned with its frames.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from radixserve.workers.disaggregation.config import KVTransferConfig
from radixserve.workers.disaggregation.errors import (
    KVTransferError,
    PeerLost,
    TransferCancelled,
    TransferRefused,
    TransferTimeout,
    about,
)
from radixserve.workers.disaggregation.messages import Frame, FrameKind, KVEndpoint, KVTicket, slots_digest
from radixserve.workers.disaggregation.packing import Piece, PoolView
from radixserve.workers.disaggregation.stats import TransferStats
from radixserve.workers.disaggregation.transfer import RecvHandle

# Dropped connections remembered for their late frames (one per sender reconnect or death).
MAX_DROPPED = 256
# The stats key of transfers that failed before any sender began them.
NO_SENDER = "(no sender)"


class ProtocolError(KVTransferError):
    """A connection's frames broke the protocol (a gap in the sequence); the pair is torn down."""


@dataclass
class Connection:
    """One sender's connection, as the receiver tracks it."""

    key: str  # unique per connection (the handshake nonce)
    peer: str  # the sender's replica id
    ack: Callable[[Frame], None]  # send a frame back to the sender (never blocks for long)
    # Tear the connection down: the transport's reader exits, the sender learns why.
    close: Callable[[KVTransferError], None]
    # Frames waiting for this side's reader: a silent sender with a backlog is alive, and the
    # reader is the one lagging (a starved process); None where the transport cannot tell.
    backlog: Callable[[], int] | None = None
    next_seq: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    # The last heartbeat this side sent: past `peer_timeout` (this process stalled: stopped,
    # swapped, starved) the sender has given the pair up, whatever is still in its backlog.
    last_sent: float = field(default_factory=time.monotonic)
    busy: bool = False  # inside a payload read, whose own timeout bounds it


class KVReceiver:
    def __init__(self, view: PoolView, stats: TransferStats, config: KVTransferConfig):
        self._view = view
        self._stats = stats
        self._config = config
        self._lock = threading.Lock()
        self._expected: dict[str, RecvHandle] = {}
        self._conns: dict[str, Connection] = {}
        self._dropped: OrderedDict[str, KVTransferError] = OrderedDict()  # recent, by key

    def expect(
        self,
        transfer_id: str,
        endpoint: KVEndpoint,
        dst_slots,
        held_tokens: int,
        timeout: float | None,
        heads: tuple[int, int] | None = None,
    ) -> RecvHandle:
        dst = self._view.slot_index(dst_slots)
        if held_tokens < 0:
            raise ValueError("held_tokens must be >= 0")
        heads = heads or self._view.kv_heads
        self._view.check_heads(heads)
        ticket = KVTicket(transfer_id, endpoint, tuple(dst.tolist()), held_tokens)
        deadline = time.monotonic() + (self._config.transfer_timeout if timeout is None else timeout)
        handle = RecvHandle(ticket, dst, self._view, deadline, heads)
        with self._lock:
            if transfer_id in self._expected:
                raise ValueError(f"transfer {transfer_id!r} is already expected")
            self._expected[transfer_id] = handle
        handle.future.add_done_callback(lambda _f: self._ended(handle))
        return handle

    def open_count(self) -> int:
        with self._lock:
            return len(self._expected)

    def connected(self, conn: Connection) -> None:
        """Register a connection; an older connection of the same sender is dead (it reconnected)."""
        with self._lock:
            old = [c for c in self._conns.values() if c.peer == conn.peer]
            self._conns[conn.key] = conn
        for c in old:
            self.drop(c.key, PeerLost(f"prefill replica {c.peer!r} reconnected"))
        self._stats.count(conn.peer, pairs_opened=1)

    def drop(self, key: str, error: KVTransferError) -> None:
        """Forget a connection and fail the transfers it had begun; tears it down."""
        with self._lock:
            conn = self._conns.pop(key, None)
            handles = [h for h in self._expected.values() if h.peer_key == key]
            if conn is not None:
                self._dropped[key] = error
                while len(self._dropped) > MAX_DROPPED:
                    self._dropped.popitem(last=False)
        if conn is None:
            return
        for h in handles:
            h.fail(about(error, h.transfer_id))
        try:
            conn.close(error)
        except Exception:  # the link is already gone
            pass

    def on_frame(self, key: str, frame: Frame, read_payload: Callable[[Piece], torch.Tensor]) -> None:
        conn = self._conns.get(key)
        if conn is None:
            self._on_orphan(key, frame)
            return
        conn.last_seen = time.monotonic()
        if not frame.ordered:
            return
        if frame.seq != conn.next_seq:
            raise ProtocolError(
                f"prefill replica {conn.peer!r}: frame {frame.seq} where {conn.next_seq} was due"
            )
        conn.next_seq += 1
        if frame.kind == FrameKind.DATA:
            self._on_data(conn, frame, read_payload)
        elif frame.kind == FrameKind.BEGIN:
            self._on_begin(conn, frame)
        elif frame.kind == FrameKind.END:
            self._on_end(conn, frame)
        else:
            handle = self._handle(conn, frame.transfer_id)
            if handle is not None:
                handle.fail(
                    TransferCancelled(
                        f"transfer {frame.transfer_id!r}: prefill replica {conn.peer!r} aborted it: {frame.error}"
                    )
                )

    def tick(self, now: float) -> None:
        """Deadlines of expected transfers, heartbeats to and liveness of the senders."""
        with self._lock:
            late = [h for h in self._expected.values() if h.deadline < now]
            conns = list(self._conns.values())
        for h in late:
            h.fail(TransferTimeout(f"transfer {h.transfer_id!r}: not complete within its deadline"))
        for conn in conns:
            if self._mute(conn, now):
                continue
            silent = now - conn.last_seen
            if not conn.busy and silent > self._config.peer_timeout and not self._lagging(conn):
                self.drop(conn.key, PeerLost(f"no word from prefill replica {conn.peer!r} for {silent:.1f}s"))
                continue
            try:
                conn.ack(Frame(FrameKind.HEARTBEAT))
            except Exception as exc:  # any failure of the link ends the connection
                self.drop(conn.key, PeerLost(f"heartbeat to prefill replica {conn.peer!r} failed: {exc}"))
                continue
            conn.last_sent = now

    def _mute(self, conn: Connection, now: float) -> bool:
        """Drop `conn` if this side sent it no heartbeat for `peer_timeout`: the sender has then
        declared the pair lost, so a transfer it began must not complete here either (the frames
        a stalled process finds in its backlog on waking would otherwise finish it)."""
        mute = now - conn.last_sent
        if mute <= self._config.peer_timeout:
            return False
        self.drop(conn.key, PeerLost(f"no heartbeat went to prefill replica {conn.peer!r} for {mute:.1f}s"))
        return True

    def _lagging(self, conn: Connection) -> bool:
        try:
            return conn.backlog is not None and conn.backlog() > 0
        except Exception:  # the link is gone: not lagging, dead
            return False

    def close(self) -> None:
        with self._lock:
            keys = list(self._conns)
            handles = list(self._expected.values())
        for key in keys:
            self.drop(key, PeerLost("the KV transfer engine closed"))
        for h in handles:
            h.fail(TransferCancelled(f"transfer {h.transfer_id!r}: the KV transfer engine closed"))

    def _on_orphan(self, key: str, frame: Frame) -> None:
        """A frame the sender queued before its connection was dropped (the transport reads
        such frames until its STOP). A BEGIN there claims a transfer whose sender is already
        lost: fail it now instead of at its deadline. Payloads are not read: the pair is dead."""
        with self._lock:
            error = self._dropped.get(key)
            handle = self._expected.get(frame.transfer_id)
        if error is None:
            raise ProtocolError(f"frame on unknown connection {key!r}")
        if frame.kind == FrameKind.BEGIN and handle is not None and not handle.began:
            handle.fail(about(error, frame.transfer_id))

    def _handle(self, conn: Connection, transfer_id: str) -> RecvHandle | None:
        with self._lock:
            handle = self._expected.get(transfer_id)
        return handle if handle is not None and handle.peer_key == conn.key else None

    def _refuse(self, conn: Connection, transfer_id: str, reason: str, handle: RecvHandle | None) -> None:
        if handle is not None:
            handle.fail(TransferRefused(f"transfer {transfer_id!r} from {conn.peer!r}: {reason}"))
        conn.ack(Frame(FrameKind.ACK, transfer_id, error=reason))

    def _on_begin(self, conn: Connection, frame: Frame) -> None:
        with self._lock:
            handle = self._expected.get(frame.transfer_id)
        if handle is None:
            self._refuse(conn, frame.transfer_id, "not expected (unknown, expired or cancelled)", None)
            return
        problem = handle.begin(conn.key, conn.peer, frame, slots_digest(handle.ticket.dst_slots))
        if problem:
            self._refuse(conn, frame.transfer_id, problem, handle if handle.peer_key is None else None)

    def _on_data(self, conn: Connection, frame: Frame, read_payload: Callable[[Piece], torch.Tensor]) -> None:
        piece = frame.piece()
        if piece.num_layers < 1 or piece.num_tokens < 1:
            raise ProtocolError(f"prefill replica {conn.peer!r}: empty payload {piece}")
        try:  # the payload is sized from the frame: refused before any byte is read
            self._view.check_heads(self._view.heads_of(piece))
            if piece.layer_end > self._view.num_layers or piece.token_end > self._view.num_slots:
                raise ValueError(f"{piece} exceeds the pool's layers or slots")
        except ValueError as exc:
            raise ProtocolError(f"prefill replica {conn.peer!r}: {exc}") from None
        conn.busy = True
        try:
            payload = read_payload(piece)
        finally:
            conn.busy = False
            conn.last_seen = time.monotonic()
        self._stats.count(conn.peer, bytes_received=self._view.payload_bytes(piece), payloads_received=1)
        handle = self._handle(conn, frame.transfer_id)
        if handle is None:  # refused, cancelled or expired: the payload is read and dropped
            return
        problem = handle.accept(piece, payload)
        if problem:
            self._refuse(conn, frame.transfer_id, problem, handle)

    def _on_end(self, conn: Connection, frame: Frame) -> None:
        if self._mute(conn, time.monotonic()):
            return
        handle = self._handle(conn, frame.transfer_id)
        if handle is None:
            conn.ack(Frame(FrameKind.ACK, frame.transfer_id, error="not expected (expired or cancelled)"))
            return
        problem = handle.complete(frame.aux)
        if problem:
            self._refuse(conn, frame.transfer_id, problem, handle)
            return
        saved = handle.ticket.held_tokens * self._view.num_layers * handle.token_layer_bytes
        self._stats.count(conn.peer, transfers_received=1, bytes_saved=saved)
        conn.ack(Frame(FrameKind.ACK, frame.transfer_id))

    def _ended(self, handle: RecvHandle) -> None:
        """A handle settled (any way): forget it; on a failure, tell a sender that may still be
        sending (a duplicate ACK, or one for a transfer the sender ended itself, is ignored there)."""
        with self._lock:
            if self._expected.get(handle.transfer_id) is handle:
                del self._expected[handle.transfer_id]
            conn = self._conns.get(handle.peer_key) if handle.peer_key else None
        error = handle.future.exception()
        if error is None:
            return
        self._stats.count(handle.peer or NO_SENDER, transfers_failed=1)
        if conn is not None:
            try:
                conn.ack(Frame(FrameKind.ACK, handle.transfer_id, error=str(error)))
            except Exception:  # a dead link is found and dropped by the next tick
                pass
