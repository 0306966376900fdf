"""Frozen settings of a KV transfer engine (one per replica)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVTransferConfig:
    # Default lifetime of a transfer on either side (from `expect` / `send` to the ACK); the
    # receiver's slots are held at most this long for a sender that never shows up.
    transfer_timeout: float = 120.0
    # One payload's wire time (a gloo/nccl wait): past it the pair is torn down and rebuilt.
    op_timeout: float = 30.0
    # Setting up a pair: store connection, handshake, process group rendezvous.
    connect_timeout: float = 30.0
    # Idle pairs exchange heartbeats this often; a peer silent for `peer_timeout` is dead.
    heartbeat_interval: float = 1.0
    peer_timeout: float = 10.0
    # Largest payload: a whole-request send is cut into payloads of at most this size. A pair's
    # sender and its receiver each stage two payloads at once, so this bounds their memory; and
    # payloads this size let the gather of one overlap the wire time of the one before
    # (load_tests/bench_kv_transfer.py: 8 MiB moved 1k tokens of the default model's KV at 103%
    # of one raw send of the same bytes, 32 MiB at 70%, 4 MiB at 80%).
    max_message_bytes: int = 8 << 20
    # The address peers reach this replica at (its TCPStore and gloo device); None = the Ray
    # node address when Ray is up, else 127.0.0.1.
    host: str | None = None
    # TCPStore port of a receiving replica; 0 = a free port chosen by the OS.
    port: int = 0

    def __post_init__(self):
        for name in (
            "transfer_timeout",
            "op_timeout",
            "connect_timeout",
            "heartbeat_interval",
            "peer_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"KVTransferConfig.{name} must be > 0")
        if self.peer_timeout <= 2 * self.heartbeat_interval:
            raise ValueError("KVTransferConfig.peer_timeout must exceed two heartbeat intervals")
        if self.max_message_bytes < 1:
            raise ValueError("KVTransferConfig.max_message_bytes must be >= 1")
