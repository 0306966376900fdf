"""The orders rank 0 gives its followers' KV transfers (executor/tp_kv.py), and their one codec.

An order crosses the group as JSON (`broadcast_control` of executor/tp_wire.py), tagged with its
"op". A follower decodes it once (`decode_order`) and acts on it by its type. Nothing in it is
pickled: an order it cannot read (an unknown op, a missing or mistyped field) raises ValueError,
and the follower fails that order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from radixserve.workers.disaggregation import KVTicket

RECV, SEND = "recv", "send"  # a transfer's kind: a decode rank receives, a prefill rank sends


def _slots(value: Any) -> list[int]:
    return [int(s) for s in value]


@dataclass(frozen=True)
class ExpectItem:
    """Decode: receive transfer `transfer_id` into `slots`, as rank 0 expects the same transfer
    into the same slots of its own pool. The first `held` tokens are cached on this side already."""

    transfer_id: str
    slots: list[int]
    held: int
    timeout_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.transfer_id, "slots": self.slots, "held": self.held, "timeout": self.timeout_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExpectItem:
        return cls(str(d["id"]), _slots(d["slots"]), int(d["held"]), float(d["timeout"]))


@dataclass(frozen=True)
class SendItem:
    """Prefill: send this rank's parts of `ticket`'s transfer from `slots` with the next batch.
    `first` is the first token that batch computes (the tokens before it are cached, queued at
    once when `layerwise`); a layerwise send queues each layer as the forward writes it."""

    transfer_id: str
    ticket: KVTicket
    slots: list[int]
    first: int
    layerwise: bool
    timeout_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.transfer_id,
            "ticket": self.ticket.to_dict(),
            "slots": self.slots,
            "first": self.first,
            "layerwise": self.layerwise,
            "timeout": self.timeout_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SendItem:
        return cls(
            str(d["id"]),
            KVTicket.from_dict(d["ticket"]),
            _slots(d["slots"]),
            int(d["first"]),
            bool(d["layerwise"]),
            float(d["timeout"]),
        )


@dataclass(frozen=True)
class ExpectOrder:
    """Register these receives before the tickets leave rank 0."""

    op: ClassVar[str] = "expect"
    items: tuple[ExpectItem, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"items": [item.to_dict() for item in self.items]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExpectOrder:
        return cls(tuple(ExpectItem.from_dict(item) for item in d["items"]))


@dataclass(frozen=True)
class SendOrder:
    """Start these sends with the next batch; closed when its forward ends."""

    op: ClassVar[str] = "send"
    items: tuple[SendItem, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"items": [item.to_dict() for item in self.items]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SendOrder:
        return cls(tuple(SendItem.from_dict(item) for item in d["items"]))


@dataclass(frozen=True)
class CancelOrder:
    """Drop these transfers of one kind (RECV or SEND); once the order returns, no thread of any
    rank touches their slots."""

    op: ClassVar[str] = "cancel"
    kind: str
    ids: tuple[str, ...]
    reason: str

    def __post_init__(self) -> None:
        if self.kind not in (RECV, SEND):
            raise ValueError(f"a transfer's kind is {RECV!r} or {SEND!r}, not {self.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ids": list(self.ids), "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CancelOrder:
        return cls(str(d["kind"]), tuple(str(i) for i in d["ids"]), str(d["reason"]))


@dataclass(frozen=True)
class CountOrder:
    """Answer how many transfers this rank has open (not settled, or settled unreported)."""

    op: ClassVar[str] = "count"

    def to_dict(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CountOrder:
        return cls()


@dataclass(frozen=True)
class LoRASlotOrder:
    """Put LoRA adapter (name, path) in batch slot `slot` (each rank reads its own shard)."""

    op: ClassVar[str] = "lora_slot"
    slot: int
    name: str
    path: str

    def to_dict(self) -> dict[str, Any]:
        return {"slot": self.slot, "name": self.name, "path": self.path}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoRASlotOrder:
        return cls(int(d["slot"]), str(d["name"]), str(d["path"]))


TransferOrder = ExpectOrder | SendOrder | CancelOrder | CountOrder  # executor/tp_kv.py's
Order = TransferOrder | LoRASlotOrder

_DECODERS: dict[str, Callable[[Mapping[str, Any]], Order]] = {
    cls.op: cls.from_dict for cls in (ExpectOrder, SendOrder, CancelOrder, CountOrder, LoRASlotOrder)
}


def encode_order(order: Order) -> dict[str, Any]:
    """The order as JSON-compatible data, tagged with its op."""
    return {"op": order.op, **order.to_dict()}


def decode_order(data: Any) -> Order:
    """The order `encode_order` made. Raises ValueError for anything else."""
    if not isinstance(data, Mapping):
        raise ValueError(f"an order is a JSON object, got {type(data).__name__}")
    op = data.get("op")
    decoder = _DECODERS.get(op) if isinstance(op, str) else None
    if decoder is None:
        raise ValueError(f"unknown order {op!r}")
    try:
        return decoder(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed {op!r} order: {type(exc).__name__}: {exc}") from exc
