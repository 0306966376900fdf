"""The two ends of one transfer, as a replica holds them: `SendHandle` on the prefill side,
`RecvHandle` on the decode side. Each carries a `concurrent.futures.Future` that resolves when the
transfer completed (the receiver scattered every page and acknowledged) or fails with a
`KVTransferError`; `asyncio.wrap_future(handle.future)` awaits it from an event loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from radixserve.workers.disaggregation.errors import KVTransferError, TransferCancelled
from radixserve.workers.disaggregation.messages import Frame, FrameKind, KVTicket
from radixserve.workers.disaggregation.packing import Piece, PoolView


class _Coverage:
    """Which tokens of each layer have moved: per layer, tokens go in order, without gaps."""

    def __init__(self, num_layers: int, num_tokens: int):
        self.num_tokens = num_tokens
        self.next = [0] * num_layers

    def check(self, piece: Piece) -> str:
        if not (0 <= piece.layer_begin < piece.layer_end <= len(self.next)):
            return f"layers [{piece.layer_begin}, {piece.layer_end}) outside [0, {len(self.next)})"
        if not (0 <= piece.token_begin < piece.token_end <= self.num_tokens):
            return f"tokens [{piece.token_begin}, {piece.token_end}) outside [0, {self.num_tokens})"
        for layer in range(piece.layer_begin, piece.layer_end):
            if self.next[layer] != piece.token_begin:
                return f"layer {layer}: next token is {self.next[layer]}, got {piece.token_begin}"
        return ""

    def add(self, piece: Piece) -> None:
        for layer in range(piece.layer_begin, piece.layer_end):
            self.next[layer] = piece.token_end

    @property
    def complete(self) -> bool:
        return all(n == self.num_tokens for n in self.next)


class _Outcome:
    """A future that is resolved exactly once, whoever gets there first."""

    def __init__(self):
        self.future: Future[Any] = Future()
        self._lock = threading.Lock()

    def settle(self, error: BaseException | None = None, value: Any = None) -> bool:
        with self._lock:
            if self.future.done():
                return False
            if error is None:
                self.future.set_result(value)
            else:
                self.future.set_exception(error)
            return True

    def done(self) -> bool:
        return self.future.done()


@dataclass
class SendOp:
    """One unit of a pair's send queue: a frame, and for DATA the piece to gather first."""

    handle: SendHandle
    frame: Frame
    piece: Piece | None = None
    ready: tuple[torch.cuda.Event, ...] = ()  # the compute that wrote the piece's KV, on CUDA pools


class SendHandle:
    """The sending side of one transfer. Methods only queue work and never block, so they are safe
    to call from a forward hook; the pair's thread gathers and sends in queue order.

    The source slots must stay allocated and unmodified until `future` resolves: payloads are
    gathered from them on the pair's thread, after `send_layers` has returned.
    """

    def __init__(
        self,
        ticket: KVTicket,
        src: torch.Tensor,
        view: PoolView,
        submit: Callable[[SendOp], None],
        abandon: Callable[[SendHandle, KVTransferError], bool],
        max_message_bytes: int,
        deadline: float,
        heads: tuple[int, int] | None = None,
    ):
        self.ticket = ticket
        self.transfer_id = ticket.transfer_id
        self.peer = ticket.endpoint.replica_id
        self.src = src
        self.view = view
        # the model's KV heads it moves (all of the pool's, but across degrees)
        self.heads = heads or view.kv_heads
        self.token_layer_bytes = view.payload_bytes(Piece(0, 1, 0, 1, *self.heads))
        self.deadline = deadline
        self.started = time.monotonic()
        self._submit = submit
        self._abandon = abandon
        self._max_bytes = max_message_bytes
        self._coverage = _Coverage(view.num_layers, len(ticket.dst_slots))
        self._outcome = _Outcome()
        self._finished = False
        self._lock = threading.Lock()

    @property
    def future(self) -> Future[Any]:
        return self._outcome.future

    @property
    def num_tokens(self) -> int:
        return self._coverage.num_tokens

    def send_layers(
        self, layer_begin: int, layer_end: int, token_begin: int = 0, token_end: int | None = None
    ):
        """Queue layers [layer_begin, layer_end) of tokens [token_begin, token_end) (indices into
        the slot lists; default: to the end). Per layer, tokens must be sent in order without gaps
        (chunked prefill sends each chunk's range). A no-op once the transfer has failed."""
        piece = Piece(
            layer_begin,
            layer_end,
            token_begin,
            self.num_tokens if token_end is None else token_end,
            *self.heads,
        )
        with self._lock:
            if self._finished:
                raise ValueError(f"transfer {self.transfer_id!r}: send_layers after finish")
            problem = self._coverage.check(piece)
            if problem:
                raise ValueError(f"transfer {self.transfer_id!r}: {problem}")
            self._coverage.add(piece)
            if self._outcome.done():
                return
            ready: tuple[torch.cuda.Event, ...] = ()
            if self.view.device.type == "cuda":
                ready = (torch.cuda.Event(),)
                ready[0].record()
            for part in self.view.split(piece, self._max_bytes):
                frame = Frame(
                    FrameKind.DATA,
                    self.transfer_id,
                    layer_begin=part.layer_begin,
                    layer_end=part.layer_end,
                    token_begin=part.token_begin,
                    token_end=part.token_end,
                    head_begin=part.head_begin,
                    head_end=part.head_end,
                )
                self._submit(SendOp(self, frame, part, ready))

    def send_all(self) -> None:
        """Queue every token of every layer not yet sent (consecutive layers at the same progress
        go as one piece, so an untouched transfer goes as whole-layer payloads)."""
        progress = list(self._coverage.next)
        layer = 0
        while layer < len(progress):
            end = layer + 1
            while end < len(progress) and progress[end] == progress[layer]:
                end += 1
            if progress[layer] < self.num_tokens:
                self.send_layers(layer, end, progress[layer])
            layer = end

    def finish(self, aux: dict[str, Any] | None = None) -> Future[Any]:
        """Queue the END frame (every token of every layer must have been queued) and return the
        future, which resolves when the receiver acknowledges. `aux` (small JSON values) travels
        with the END frame: the receiver's future resolves with it."""
        with self._lock:
            if not self._coverage.complete:
                raise ValueError(f"transfer {self.transfer_id!r}: finish before every layer was sent")
            if not self._finished:
                self._finished = True
                if not self._outcome.done():
                    self._submit(SendOp(self, Frame(FrameKind.END, self.transfer_id, aux=aux)))
        return self.future

    def cancel(self, reason: str = "cancelled by the sender") -> bool:
        """Give up: the future fails with TransferCancelled and the receiver is told to drop the
        transfer. False if it had already completed or failed."""
        return self._abandon(self, TransferCancelled(f"transfer {self.transfer_id!r}: {reason}"))

    def result(self, timeout: float | None = None) -> None:
        self.future.result(timeout)

    def settle(self, error: KVTransferError | None = None) -> bool:
        return self._outcome.settle(error)

    def done(self) -> bool:
        return self._outcome.done()


class LayerSends(Protocol):
    """What a forward's layers are queued on: a SendHandle, or a rank's group of them."""

    def send_layers(
        self, layer_begin: int, layer_end: int, token_begin: int = 0, token_end: int | None = None
    ) -> None: ...

    def cancel(self, reason: str = ...) -> bool: ...


def layer_by_layer(started: Sequence[tuple[LayerSends, int]]) -> Callable[[int], None] | None:
    """A forward's `layer_done` for sends begun with it: each call queues that layer of every
    send, tokens `first ..` (the forward's chunk). A send whose queueing fails is cancelled (the
    receiver fails the transfer). None when there is nothing to stream."""
    if not started:
        return None

    def layer_done(layer: int) -> None:
        for handle, first in started:
            try:
                handle.send_layers(layer, layer + 1, first)
            except Exception as exc:
                handle.cancel(f"queueing layer {layer} failed: {exc!r}")

    return layer_done


class RecvHandle:
    """The receiving side of one transfer: the slots it will write, and its outcome.

    Writes into the slots happen only between BEGIN and the outcome, under the handle's lock;
    once `cancel()` returns (or the future has failed), nothing is ever written to the slots
    again, so the caller may free them.
    """

    def __init__(
        self,
        ticket: KVTicket,
        dst: torch.Tensor,
        view: PoolView,
        deadline: float,
        heads: tuple[int, int] | None = None,
    ):
        self.ticket = ticket
        self.transfer_id = ticket.transfer_id
        self.dst = dst
        self.view = view
        self.heads = heads or view.kv_heads  # the model's KV heads it writes
        self.token_layer_bytes = view.payload_bytes(Piece(0, 1, 0, 1, *self.heads))
        self.deadline = deadline
        self.peer_key: str | None = None  # the connection that began it
        self.peer: str | None = None  # that connection's replica id
        self._coverage = _Coverage(view.num_layers, len(ticket.dst_slots))
        self._outcome = _Outcome()
        self._lock = threading.Lock()

    @property
    def future(self) -> Future[Any]:
        """Resolves with the sender's `aux` (None if it sent none) once every page is in place."""
        return self._outcome.future

    @property
    def began(self) -> bool:
        return self.peer_key is not None

    def progress(self) -> list[int]:
        """Tokens in place so far, per layer (layers arrive and are written one payload at a time)."""
        with self._lock:
            return list(self._coverage.next)

    def begin(self, peer_key: str, peer: str, frame: Frame, digest: str) -> str:
        """Bind the transfer to the connection that announced it; '' or why it is refused."""
        with self._lock:
            if self._outcome.done():
                return "the receiver already ended it"
            if self.peer_key is not None:
                return f"already begun by {self.peer}"
            if frame.num_tokens != self._coverage.num_tokens:
                return f"sender has {frame.num_tokens} tokens to send, receiver expects {self._coverage.num_tokens}"
            if frame.held_tokens != self.ticket.held_tokens:
                return (
                    f"sender skips {frame.held_tokens} held tokens, receiver holds {self.ticket.held_tokens}"
                )
            if frame.slots_digest != digest:
                return "the receiver's slot list differs from the ticket's (stale ticket)"
            if (frame.head_begin, frame.head_end) != self.heads:
                return (
                    f"sender moves KV heads [{frame.head_begin}, {frame.head_end}), receiver expects "
                    f"[{self.heads[0]}, {self.heads[1]})"
                )
            self.peer_key, self.peer = peer_key, peer
            return ""

    def accept(self, piece: Piece, payload: torch.Tensor) -> str:
        """Scatter a payload into the slots; '' or why it was not (the transfer then fails)."""
        with self._lock:
            if self._outcome.done():
                return ""
            if piece.heads != self.heads:
                return f"a payload of KV heads {piece.heads}, the transfer moves {self.heads}"
            problem = self._coverage.check(piece)
            if problem:
                return problem
            self.view.scatter(self.dst, piece, payload)
            self._coverage.add(piece)
            return ""

    def complete(self, aux: dict[str, Any] | None = None) -> str:
        """At END: settle successfully (with the END frame's `aux`) if every token of every layer
        arrived; '' or why not."""
        with self._lock:
            if self._outcome.done():
                return "the receiver already ended it"
            if not self._coverage.complete:
                return "END before every layer arrived"
            if self.view.device.type == "cuda":
                torch.cuda.current_stream(self.view.device).synchronize()
            self._outcome.settle(None, aux)
            return ""

    def fail(self, error: KVTransferError) -> bool:
        with self._lock:
            return self._outcome.settle(error)

    def cancel(self, reason: str = "cancelled by the receiver") -> bool:
        """Stop the transfer; no slot is written after this returns. False if already ended."""
        return self.fail(TransferCancelled(f"transfer {self.transfer_id!r}: {reason}"))

    def done(self) -> bool:
        return self._outcome.done()

    def result(self, timeout: float | None = None) -> None:
        self.future.result(timeout)
