"""The sender's end of one pair, as a transport implements it.

A `SendLink` is one connection from this replica to one receiving replica. It is driven by the
pair's own thread (connect, send, close) plus the engine's ticker (heartbeat); what the receiver
says back (ACK frames, heartbeats) and a broken connection are reported through the two
callbacks, from whatever thread the transport reads on.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from radixserve.workers.disaggregation.messages import Frame


class SendLink(ABC):
    def __init__(self, on_ack: Callable[[Frame], None], on_broken: Callable[[BaseException], None]):
        self.on_ack = on_ack
        self.on_broken = on_broken
        self.last_seen = time.monotonic()  # the last sign of life from the receiver

    @abstractmethod
    def connect(self) -> None:
        """Reach the receiver, exchange the handshake (HandshakeMismatch on a refusal) and set up
        the data plane. Blocking; called once, on the pair's thread."""

    @abstractmethod
    def send(self, frame: Frame, payload: torch.Tensor | None) -> Callable[[], None] | None:
        """Send one ordered frame and, for DATA, start sending its payload. Returns None when the
        payload's buffer is free again already, else a wait that blocks until it is (at most the
        op timeout, raising past it). The caller keeps the buffer untouched until then."""

    @abstractmethod
    def heartbeat(self) -> None:
        """Tell the receiver this side is alive. Never blocks for long (called by the ticker)."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection; a blocked reader of this link wakes and exits."""

    def touch(self) -> None:
        self.last_seen = time.monotonic()
