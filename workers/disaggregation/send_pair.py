"""`SendPair`: this replica's end of the pair with one receiving replica, and its thread.

The thread owns the pair's link: it connects (lazily, on the first transfer to that receiver),
then gathers and sends the queued ops in order, numbering the ordered frames. A broken pair fails
every transfer it carries with the pair's error and leaves its sender's map.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable

import torch

from radixserve.workers.disaggregation.config import KVTransferConfig
from radixserve.workers.disaggregation.errors import (
    KVTransferError,
    PeerLost,
    TransferRefused,
    TransferTimeout,
    about,
)
from radixserve.workers.disaggregation.link import SendLink
from radixserve.workers.disaggregation.messages import Frame, FrameKind, KVEndpoint
from radixserve.workers.disaggregation.packing import PoolView, StagingBuffer
from radixserve.workers.disaggregation.stats import TransferStats
from radixserve.workers.disaggregation.transfer import SendHandle, SendOp

logger = logging.getLogger(__name__)

# Payloads of one pair on the wire at once (each holds a staging buffer of up to max_message_bytes).
SEND_WINDOW = 2

NOTHING = object()  # an empty queue, or no op carried over from coalescing

LinkFactory = Callable[[KVEndpoint, Callable[[Frame], None], Callable[[BaseException], None]], SendLink]


class SendPair:
    """This replica's end of the pair with one receiver.

    Wire state of a transfer: `_live` from its BEGIN going out to its outcome (ACK, refusal,
    deadline, cancel); `_open` from BEGIN to the END or ABORT that closes it on the wire. Frames
    of a transfer that is not open are dropped from the queue, never sent.
    """

    def __init__(
        self,
        endpoint: KVEndpoint,
        open_link: LinkFactory,
        view: PoolView,
        stats: TransferStats,
        config: KVTransferConfig,
        on_closed: Callable[[SendPair], None],
    ):
        self.endpoint = endpoint
        self.peer = endpoint.replica_id
        self._view = view
        self._stats = stats
        self._config = config
        self._on_closed = on_closed
        self._queue: queue.SimpleQueue[SendOp | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._broken: KVTransferError | None = None
        self._connected = False
        self._live: dict[str, SendHandle] = {}
        self._open: set[str] = set()
        self._seq = 0
        self.link = open_link(endpoint, self._on_ack, self._on_link_broken)
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{self.peer}", daemon=True)
        self._thread.start()

    def submit(self, op: SendOp) -> None:
        with self._lock:
            broken = self._broken
            if broken is None:
                self._queue.put(op)
        if broken is not None:
            self._settle(op.handle, about(broken, op.handle.transfer_id))

    def abandon(self, handle: SendHandle, error: KVTransferError) -> bool:
        """End a transfer from this side (cancel, deadline): settle it and tell the receiver."""
        if not self._settle(handle, error):
            return False
        reason = str(error).removeprefix(f"transfer {handle.transfer_id!r}: ")
        self.submit(SendOp(handle, Frame(FrameKind.ABORT, handle.transfer_id, error=reason)))
        return True

    def break_(self, error: KVTransferError) -> None:
        """Fail everything this pair carries and stop it; idempotent, callable from any thread."""
        with self._lock:
            if self._broken is not None:
                return
            self._broken = error
            live = list(self._live.values())
        self._queue.put(None)
        for handle in live:
            self._settle(handle, about(error, handle.transfer_id))
        self._on_closed(self)

    def check(self, now: float) -> None:
        """The ticker's visit: heartbeat, the receiver's liveness, and transfer deadlines."""
        if self._broken is not None or not self._connected:
            return
        silent = now - self.link.last_seen
        if silent > self._config.peer_timeout:
            self.break_(PeerLost(f"no word from decode replica {self.peer!r} for {silent:.1f}s"))
            return
        try:
            self.link.heartbeat()
        except Exception as exc:  # any failure of the link breaks the pair
            self.break_(PeerLost(f"heartbeat to decode replica {self.peer!r} failed: {exc}"))
            return
        with self._lock:
            late = [h for h in self._live.values() if h.deadline < now]
        for handle in late:
            waited = now - handle.started
            self.abandon(
                handle,
                TransferTimeout(
                    f"transfer {handle.transfer_id!r} to {self.peer!r}: not acknowledged after {waited:.1f}s"
                ),
            )

    def join(self, timeout: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _settle(self, handle: SendHandle, error: KVTransferError | None) -> bool:
        with self._lock:
            self._live.pop(handle.transfer_id, None)
        if not handle.settle(error):
            return False
        if error is None:
            saved = handle.ticket.held_tokens * self._view.num_layers * handle.token_layer_bytes
            self._stats.count(self.peer, transfers_sent=1, bytes_saved=saved)
        else:
            self._stats.count(self.peer, transfers_failed=1)
        return True

    def _on_ack(self, frame: Frame) -> None:
        with self._lock:
            handle = self._live.get(frame.transfer_id)
            if frame.error:  # the receiver dropped it: nothing more of it goes on the wire
                self._open.discard(frame.transfer_id)
        if handle is not None:
            error = TransferRefused(
                f"transfer {frame.transfer_id!r}: decode replica {self.peer!r}: {frame.error}"
            )
            self._settle(handle, error if frame.error else None)

    def _on_link_broken(self, exc: BaseException) -> None:
        self.break_(PeerLost(f"pair with decode replica {self.peer!r} broke: {exc}"))

    def _run(self) -> None:
        try:
            self.link.connect()
            self.link.touch()
            self._connected = True
            self._stats.count(self.peer, pairs_opened=1)
            self._pump()
        except KVTransferError as exc:
            self.break_(exc)
        except Exception as exc:  # a transport error of any kind breaks the pair
            logger.warning("KV pair with %s broke: %s", self.peer, exc)
            self.break_(PeerLost(f"pair with decode replica {self.peer!r} broke: {exc}"))
        finally:
            self.break_(PeerLost(f"pair with decode replica {self.peer!r} closed"))
            self._drain()
            self.link.close()

    def _admit(self, op: SendOp) -> bool:
        """Whether `op` goes on the wire, updating the transfer's wire state."""
        tid, kind = op.handle.transfer_id, op.frame.kind
        with self._lock:
            if kind == FrameKind.BEGIN:
                # Sent even for a transfer abandoned while queued: the receiver then hears of
                # it through the ABORT queued behind, instead of waiting out its deadline.
                if not op.handle.done():
                    self._live[tid] = op.handle
                self._open.add(tid)
                return True
            if tid not in self._open:
                return False
            if kind == FrameKind.ABORT:
                self._open.discard(tid)
                return True
            if op.handle.done():  # settled meanwhile: its ABORT (if any) is queued behind
                return False
            if kind == FrameKind.END:
                self._open.discard(tid)
            return True

    def _pump(self) -> None:
        """Send queued ops in order, with up to SEND_WINDOW payloads in flight: the next payload
        is gathered and posted while the previous one is still on the wire."""
        staging = [StagingBuffer(self._view) for _ in range(SEND_WINDOW)]
        inflight: deque[Callable[[], None]] = deque()
        turn = 0
        carry: object = NOTHING
        while True:
            op: object
            if carry is not NOTHING:
                op, carry = carry, NOTHING
            elif inflight:
                try:
                    op = self._queue.get_nowait()
                except queue.Empty:  # idle: finish what is on the wire before blocking
                    inflight.popleft()()
                    continue
            else:
                op = self._queue.get()
            if not isinstance(op, SendOp) or self._broken is not None:
                return
            if not self._admit(op):
                continue
            payload = None
            if op.piece is not None:
                op, carry = coalesce(op, self._next_nowait, self._view, self._config.max_message_bytes)
                piece = op.piece
                assert piece is not None
                if len(inflight) == SEND_WINDOW:  # the oldest buffer is the one to reuse
                    inflight.popleft()()
                for event in op.ready:
                    event.wait(torch.cuda.current_stream(self._view.device))
                payload = self._view.gather(op.handle.src, piece, staging[turn].payload(piece))
                turn = (turn + 1) % SEND_WINDOW
                self._stats.count(self.peer, bytes_sent=self._view.payload_bytes(piece), payloads_sent=1)
            op.frame.seq = self._seq
            self._seq += 1
            wait = self.link.send(op.frame, payload)
            if wait is not None:
                inflight.append(wait)

    def _next_nowait(self) -> object:
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return NOTHING

    def _drain(self) -> None:
        while True:
            try:
                op = self._queue.get_nowait()
            except queue.Empty:
                return
            if op is not None:
                self._settle(op.handle, about(self._broken or PeerLost("pair closed"), op.handle.transfer_id))


def coalesce(op: SendOp, take: Callable[[], object], view: PoolView, max_bytes: int) -> tuple[SendOp, object]:
    """Merge into DATA `op` the ops that `take` yields while they continue it (same transfer, same
    tokens, the next layers) and fit in `max_bytes` together: when the forward writes layers
    faster than the pair sends them, the backlog goes as fewer, larger payloads. Returns the merged
    op and the first op taken that did not merge (NOTHING once `take` ran dry)."""
    piece, ready = op.piece, op.ready
    assert piece is not None
    while True:
        nxt = take()
        if not isinstance(nxt, SendOp) or nxt.handle is not op.handle or nxt.piece is None:
            break
        p = nxt.piece
        if (p.token_begin, p.token_end, p.layer_begin) != (
            piece.token_begin,
            piece.token_end,
            piece.layer_end,
        ):
            break
        if view.payload_bytes(piece) + view.payload_bytes(p) > max_bytes:
            break
        piece = dataclasses.replace(piece, layer_end=p.layer_end)
        ready += nxt.ready
    if piece == op.piece:
        return op, nxt
    return SendOp(op.handle, dataclasses.replace(op.frame, layer_end=piece.layer_end), piece, ready), nxt
