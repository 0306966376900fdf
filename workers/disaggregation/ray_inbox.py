"""`KVInbox`: the mailbox actor of a replica that receives KV over the Ray object store.

Senders cannot call into a Serve replica's process directly, so each receiving replica owns one
small async actor (no CPU reserved; it dies with its owner). Senders hand it frames and the
ObjectRefs of their payloads; the receiving replica long-polls `take` and gets them back, in each
connection's sequence order, with the refs still refs (Ray tracks them as borrowed all along).
Acknowledgements travel the other way through `ack` / `next_acks`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from radixserve.workers.disaggregation.errors import HandshakeMismatch
from radixserve.workers.disaggregation.messages import Frame, Hello, HelloReply
from radixserve.workers.disaggregation.spec import KVSpec, check_peer, spec_mismatches


@dataclass
class _Conn:
    sender_id: str
    next_seq: int = 0
    pending: dict[int, tuple] = field(default_factory=dict)  # out-of-order frames by seq
    acks: list[dict[str, Any]] = field(default_factory=list)
    acks_ready: asyncio.Event = field(default_factory=asyncio.Event)


class KVInbox:
    def __init__(self, receiver_id: str, spec: dict[str, Any]):
        self._receiver_id = receiver_id
        self._spec = KVSpec.from_dict(spec)
        self._conns: dict[str, _Conn] = {}
        self._inbound: list[tuple] = []  # ("hello", nonce, hello) | ("frame", nonce, frame, refs)
        self._ready = asyncio.Event()

    async def hello(self, hello: dict[str, Any]) -> dict[str, Any]:
        """The handshake: the reply carries this side's spec and, on a mismatch, the refusal."""
        h = Hello.from_dict(hello)
        fields = spec_mismatches(self._spec, h.spec)
        error = ""
        if fields:
            try:
                check_peer(
                    self._spec,
                    h.spec,
                    f"decode replica {self._receiver_id!r}",
                    f"prefill replica {h.sender_id!r}",
                )
            except HandshakeMismatch as exc:
                error = str(exc)
        else:
            self._conns[h.nonce] = _Conn(h.sender_id)
        self._push(("hello", h.nonce, hello, error))
        return HelloReply(
            self._receiver_id, self._spec, error, {k: list(v) for k, v in fields.items()}
        ).to_dict()

    async def deliver(self, nonce: str, frame: dict[str, Any], refs: list) -> bool:
        """A sender's frame (and, for DATA, its payload's ref); False if the connection is gone."""
        conn = self._conns.get(nonce)
        if conn is None:
            return False
        f = Frame.from_dict(frame)
        if not f.ordered:
            self._push(("frame", nonce, frame, refs))
            return True
        # Ray does not promise that an async actor runs one caller's calls in submission order.
        conn.pending[f.seq] = ("frame", nonce, frame, refs)
        while conn.next_seq in conn.pending:
            self._push(conn.pending.pop(conn.next_seq))
            conn.next_seq += 1
        return True

    async def take(self, wait: float) -> list[tuple]:
        """Everything delivered since the last call, waiting up to `wait` seconds for something."""
        if not self._inbound:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), wait)
            except TimeoutError:
                pass
        items, self._inbound = self._inbound, []
        return items

    async def ack(self, nonce: str, frame: dict[str, Any]) -> None:
        conn = self._conns.get(nonce)
        if conn is not None:
            conn.acks.append(frame)
            conn.acks_ready.set()

    async def next_acks(self, nonce: str, wait: float) -> list[dict[str, Any]] | None:
        """The receiver's frames for a sender, waiting up to `wait`; None once the connection is gone."""
        conn = self._conns.get(nonce)
        if conn is None:
            return None
        if not conn.acks:
            conn.acks_ready.clear()
            try:
                await asyncio.wait_for(conn.acks_ready.wait(), wait)
            except TimeoutError:
                pass
        if self._conns.get(nonce) is not conn:
            return None
        out, conn.acks = conn.acks, []
        return out

    async def drop(self, nonce: str) -> None:
        conn = self._conns.pop(nonce, None)
        if conn is not None:
            conn.acks_ready.set()

    def _push(self, item: tuple) -> None:
        self._inbound.append(item)
        self._ready.set()
