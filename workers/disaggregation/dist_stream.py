"""`FrameStream`: the receiving end of one torch.distributed pair, as a stream of frames.

Frames come from the pair's `tx` queue in the receiver's TCPStore, payloads from the pair's
process group. When a payload has arrived, the stream looks one frame ahead: if the sender has
already queued the next DATA frame, its receive is posted into the other staging buffer before
the current payload is scattered, so the wire does not stand idle while the pool is written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from radixserve.workers.disaggregation.dist_link import TAG_SPACE, timed_wait, wire
from radixserve.workers.disaggregation.messages import Frame, FrameKind, decode
from radixserve.workers.disaggregation.packing import Piece, PoolView, StagingBuffer


class FrameStream:
    def __init__(self, store: Any, queue_key: str, pg: Any, view: PoolView, op_timeout: float):
        self._store = store
        self._key = queue_key
        self._pg = pg
        self._op_timeout = op_timeout
        self._staging = [StagingBuffer(view), StagingBuffer(view)]
        self._turn = 0
        self._ahead: Frame | None = None  # popped by the look-ahead, not yet handed out
        self._posted: tuple[int, Any, torch.Tensor] | None = None  # (seq, work, buffer) of `_ahead`

    def next(self) -> Frame:
        """The next frame, blocking until the sender queues one."""
        if self._ahead is not None:
            frame, self._ahead = self._ahead, None
            return frame
        return decode(self._store.queue_pop(self._key))

    def reader(self, frame: Frame) -> Callable[[Piece], torch.Tensor]:
        """The payload reader of a DATA frame (what KVReceiver.on_frame calls)."""

        def read(piece: Piece) -> torch.Tensor:
            if self._posted is not None and self._posted[0] == frame.seq:
                _, work, buf = self._posted
                self._posted = None
            else:
                buf = self._buffer(piece)
                work = self._post(frame.seq, buf)
            timed_wait(work, self._op_timeout)
            self._look_ahead()
            return buf

        return read

    def _look_ahead(self) -> None:
        if self._ahead is not None:
            return
        try:
            self._ahead = decode(self._store.queue_pop(self._key, False))
        except dist.QueueEmptyError:
            return
        piece = self._ahead.piece()
        if self._ahead.kind == FrameKind.DATA and piece.num_layers > 0 and piece.num_tokens > 0:
            buf = self._buffer(piece)
            self._posted = (self._ahead.seq, self._post(self._ahead.seq, buf), buf)

    def _buffer(self, piece: Piece) -> torch.Tensor:
        # Two buffers in turn: the one handed out last is still being scattered.
        self._turn ^= 1
        return self._staging[self._turn].payload(piece)

    def _post(self, seq: int, buf: torch.Tensor) -> Any:
        return self._pg.recv([wire(buf)], 0, seq % TAG_SPACE)
