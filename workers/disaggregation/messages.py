"""The typed messages of the KV transfer protocol and their one codec.

Two kinds of traffic cross a pair. The control plane carries these dataclasses as JSON (through
the receiver's TCPStore for the torch.distributed transports, through the receiver's inbox actor
for Ray); the data plane carries raw K/V bytes, one payload per DATA frame. Nothing here is
pickled: a replica of another version fails loudly at decode time.

`KVTicket` is what a decode replica hands out (through the router) so that a prefill replica can
send it a request's pages: where to connect, which transfer, and the receiver's slots. The router
carries it too, so it is a message of the router's contract (workers/protocol.py), re-exported
here with its `KVEndpoint`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.workers.disaggregation.packing import Piece
from radixserve.workers.disaggregation.spec import KVSpec
from radixserve.workers.protocol import KVEndpoint as KVEndpoint
from radixserve.workers.protocol import KVTicket as KVTicket


class FrameKind(enum.StrEnum):
    BEGIN = "begin"  # a transfer starts: its token count and the digest of the receiver's slots
    DATA = "data"  # one payload follows: layers [layer_begin, layer_end) x tokens [token_begin, token_end) x heads
    END = "end"  # every payload was sent: the receiver checks coverage and acknowledges
    ABORT = "abort"  # the sender gave up on the transfer (`error` says why)
    ACK = "ack"  # receiver -> sender: the transfer completed (`error` empty) or failed
    HEARTBEAT = "heartbeat"  # either direction, while a pair is idle
    STOP = "stop"  # a side wakes its own blocked reader when it closes; never crosses the pair


@dataclass
class Frame:
    """One control message of a pair. `seq` numbers the ordered frames of a pair (BEGIN, DATA,
    END, ABORT) from 0; a DATA payload travels with tag `seq`, so payloads of concurrent transfers
    cannot be matched to the wrong frame, and a gap in `seq` breaks the pair."""

    kind: FrameKind
    transfer_id: str = ""
    seq: int = -1
    layer_begin: int = 0
    layer_end: int = 0
    token_begin: int = 0
    token_end: int = 0
    # BEGIN and DATA: the model's KV heads [head_begin, head_end) the transfer moves
    head_begin: int = 0
    head_end: int = 0
    num_tokens: int = 0
    held_tokens: int = 0
    slots_digest: str = ""
    error: str = ""
    # END only: what the receiver needs besides the KV to continue the request (the first sampled
    # token, ...), small JSON values; the receiver's future resolves with it.
    aux: dict[str, Any] | None = None

    def piece(self) -> Piece:
        """A DATA frame's extent."""
        return Piece(
            self.layer_begin, self.layer_end, self.token_begin, self.token_end, self.head_begin, self.head_end
        )

    @property
    def ordered(self) -> bool:
        return self.kind in (FrameKind.BEGIN, FrameKind.DATA, FrameKind.END, FrameKind.ABORT)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if v != _FRAME_DEFAULTS[k]}
        d["kind"] = self.kind.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Frame:
        d = dict(d)
        d["kind"] = FrameKind(d["kind"])
        return cls(**d)


_FRAME_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Frame)}


@dataclass(frozen=True)
class Hello:
    """Sender -> receiver when a pair is set up. `nonce` names this connection: a sender that
    reconnects sends a new one, and the receiver drops the old pair."""

    sender_id: str
    nonce: str
    spec: KVSpec

    def to_dict(self) -> dict[str, Any]:
        return {"sender_id": self.sender_id, "nonce": self.nonce, "spec": self.spec.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Hello:
        return cls(str(d["sender_id"]), str(d["nonce"]), KVSpec.from_dict(d["spec"]))


@dataclass(frozen=True)
class HelloReply:
    """Receiver -> sender: its own spec, and the refusal if the specs differ."""

    receiver_id: str
    spec: KVSpec
    error: str = ""
    fields: dict[str, list[Any]] = field(default_factory=dict)  # field -> [receiver's, sender's]

    def to_dict(self) -> dict[str, Any]:
        return {
            "receiver_id": self.receiver_id,
            "spec": self.spec.to_dict(),
            "error": self.error,
            "fields": self.fields,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HelloReply:
        return cls(str(d["receiver_id"]), KVSpec.from_dict(d["spec"]), str(d["error"]), dict(d["fields"]))


_TYPES: dict[str, type] = {"frame": Frame, "hello": Hello, "hello_reply": HelloReply}
_NAMES = {t: name for name, t in _TYPES.items()}


def encode(msg: Frame | Hello | HelloReply) -> bytes:
    """The one wire form of a control message: JSON with a type tag."""
    return json.dumps({"type": _NAMES[type(msg)], "body": msg.to_dict()}, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    d = json.loads(data)
    kind = _TYPES.get(d.get("type"))
    if kind is None:
        raise ValueError(f"unknown KV transfer message type {d.get('type')!r}")
    return kind.from_dict(d["body"])  # type: ignore[attr-defined]


def slots_digest(slots: Sequence[int]) -> str:
    """A short digest of a slot list: the BEGIN frame carries it so that a stale ticket (the
    receiver re-allocated its slots since) is refused instead of written into the wrong slots."""
    return hashlib.sha1(",".join(map(str, slots)).encode()).hexdigest()[:16]
