"""Byte and transfer accounting of one replica's KV transfer engine, per peer and in total.

`bytes_sent` / `bytes_received` count K/V payload bytes that crossed the wire; `bytes_saved`
counts the bytes of the pages a transfer did not move because the receiver already held them
(its radix cache matched a prefix). Both sides count, each from its own point of view, so a
metrics scrape of either pool tells the same story.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any


@dataclass
class PeerStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_saved: int = 0
    payloads_sent: int = 0
    payloads_received: int = 0
    transfers_sent: int = 0  # completed and acknowledged by the receiver
    transfers_received: int = 0  # completed into this replica's slots
    transfers_failed: int = 0
    pairs_opened: int = 0  # a number above 1 means the pair broke and was rebuilt
    handshakes_refused: int = 0

    def add(self, other: PeerStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class TransferStats:
    """Thread-safe counters keyed by peer replica id (stable across reconnects)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._peers: dict[str, PeerStats] = {}

    def count(self, peer: str, **deltas: int) -> None:
        with self._lock:
            stats = self._peers.setdefault(peer, PeerStats())
            for name, delta in deltas.items():
                setattr(stats, name, getattr(stats, name) + delta)

    def peer(self, peer: str) -> PeerStats:
        with self._lock:
            return dataclasses.replace(self._peers.get(peer, PeerStats()))

    def total(self) -> PeerStats:
        out = PeerStats()
        with self._lock:
            for stats in self._peers.values():
                out.add(stats)
        return out

    def snapshot(self) -> dict[str, Any]:
        """{"total": {...}, "peers": {peer id: {...}}}: plain data, ready for a metrics exporter."""
        with self._lock:
            peers = {k: dataclasses.asdict(v) for k, v in sorted(self._peers.items())}
        total = PeerStats()
        for d in peers.values():
            total.add(PeerStats(**d))
        return {"total": dataclasses.asdict(total), "peers": peers}
