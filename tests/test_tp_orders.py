"""The orders rank 0 gives its followers' KV transfers: their one codec, the follower's dispatch by
type, and rank 0's side (executor/tp_orders.py, executor/tp_kv.py). No processes: the group's
wire itself is exercised in test_tp.py."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import pytest

from radixserve.workers.disaggregation import KVEndpoint, KVTicket, KVTransferError
from radixserve.workers.executor.tp_kv import FollowerTransfers, KVLayout, RankTransfers, report_key
from radixserve.workers.executor.tp_orders import (
    RECV,
    SEND,
    CancelOrder,
    CountOrder,
    ExpectItem,
    ExpectOrder,
    SendItem,
    SendOrder,
    decode_order,
    encode_order,
)

TICKET = KVTicket(
    transfer_id="req-1",
    endpoint=KVEndpoint("gloo", "decode-0", "10.0.0.2:4100"),
    dst_slots=(7, 8, 9),
    held_tokens=2,
    rank_endpoints=(KVEndpoint("gloo", "decode-0-rank1", "10.0.0.2:4101"),),
    sender_tp_size=2,
)

ORDERS = {
    "expect": ExpectOrder((ExpectItem("req-1", [7, 8, 9], 2, 30.0), ExpectItem("req-2", [], 0, 1.5))),
    "send": SendOrder((SendItem("req-1", TICKET, [11, 12, 13], 1, True, 20.0),)),
    "cancel": CancelOrder(SEND, ("req-1", "req-2"), "aborted"),
    "count": CountOrder(),
}


@pytest.mark.parametrize("op", ORDERS)
def test_each_order_survives_json_and_back(op):
    order = ORDERS[op]
    data = json.loads(json.dumps(encode_order(order)))
    assert data["op"] == op == order.op
    assert decode_order(data) == order


def test_the_encoded_orders_are_plain_tagged_json():
    assert encode_order(ORDERS["expect"]) == {
        "op": "expect",
        "items": [
            {"id": "req-1", "slots": [7, 8, 9], "held": 2, "timeout": 30.0},
            {"id": "req-2", "slots": [], "held": 0, "timeout": 1.5},
        ],
    }
    assert encode_order(ORDERS["send"]) == {
        "op": "send",
        "items": [
            {
                "id": "req-1",
                "ticket": TICKET.to_dict(),
                "slots": [11, 12, 13],
                "first": 1,
                "layerwise": True,
                "timeout": 20.0,
            }
        ],
    }
    assert encode_order(ORDERS["cancel"]) == {
        "op": "cancel",
        "kind": "send",
        "ids": ["req-1", "req-2"],
        "reason": "aborted",
    }
    assert encode_order(CountOrder()) == {"op": "count"}


@pytest.mark.parametrize(
    "data, message",
    [
        ({"op": "rewind", "ids": ["req-1"]}, "unknown order 'rewind'"),
        ({"items": []}, "unknown order None"),
        ({"op": 3}, "unknown order 3"),
        (["count"], "an order is a JSON object, got list"),
        ({"op": "expect", "items": [{"id": "req-1", "slots": [1], "held": 0}]}, "malformed 'expect' order"),
        ({"op": "send"}, "malformed 'send' order"),
        ({"op": "expect", "items": [{"id": "a", "slots": 5, "held": 0, "timeout": 1}]}, "malformed 'expect'"),
        ({"op": "cancel", "kind": "both", "ids": ["a"], "reason": "x"}, "malformed 'cancel' order"),
    ],
)
def test_an_order_that_cannot_be_read_fails_loudly(data, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        decode_order(data)


def test_a_cancel_names_a_transfer_kind():
    with pytest.raises(ValueError, match="'recv' or 'send', not 'both'"):
        CancelOrder("both", ("a",), "x")


class _Store:
    def __init__(self):
        self.deleted: list[str] = []

    def delete_key(self, key: str) -> bool:
        self.deleted.append(key)
        return False


class _RecvHandle:
    def __init__(self):
        self.future: Future = Future()
        self.cancelled: list[str] = []

    def cancel(self, reason: str = "cancelled") -> bool:
        self.cancelled.append(reason)
        return True


class _Engine:
    def __init__(self):
        self.expected: list[tuple] = []
        self.handles: list[_RecvHandle] = []

    def expect(self, transfer_id, slots, held, timeout):
        self.expected.append((transfer_id, slots, held, timeout))
        self.handles.append(_RecvHandle())
        return self.handles[-1]


def test_a_follower_acts_on_each_order_by_its_type():
    engine, store = _Engine(), _Store()
    follower = FollowerTransfers(KVLayout(4, 2, tp_size=2, rank=1), engine, store, num_layers=3, peer_tp=0)  # type: ignore[arg-type]
    assert follower.on_control(decode_order(encode_order(ORDERS["expect"]))) == 0
    assert engine.expected == [("req-1", [7, 8, 9], 2, 30.0), ("req-2", [], 0, 1.5)]
    assert follower.on_control(CountOrder()) == 2

    follower.on_control(CancelOrder(RECV, ("req-2",), "deadline"))
    assert engine.handles[1].cancelled == ["deadline"]
    assert follower.on_control(CountOrder()) == 1

    follower.on_control(ORDERS["send"])
    follower.on_control(SendOrder((SendItem("req-3", TICKET, [1], 0, False, 5.0),)))
    assert [item.transfer_id for item in follower._next] == ["req-1", "req-3"]
    # A send not started yet is dropped from the next batch; its report is not wanted.
    follower.on_control(CancelOrder(SEND, ("req-1",), "aborted"))
    assert [item.transfer_id for item in follower._next] == ["req-3"]
    assert store.deleted == [report_key(SEND, "req-1", 1)]


def test_rank_zero_gives_typed_orders_and_names_the_failed_ones():
    given = []
    answers = iter([(0, 4), (0, 0), (1, 0)])

    def order(o):
        given.append(o)
        return next(answers)

    ranks = RankTransfers(3, order, store=None)  # type: ignore[arg-type]
    assert ranks.open_count() == 4
    ranks.expect([])  # nothing to order: nothing crosses
    ranks.send([])
    ranks.cancel(RECV, [], "x")
    ranks.expect([ExpectItem("req-1", [7], 0, 3.0)])
    with pytest.raises(
        KVTransferError, match="^1 tensor-parallel rank\\(s\\) failed to cancel a KV transfer$"
    ):
        ranks.cancel(RECV, ["req-1"], "deadline")
    assert given == [
        CountOrder(),
        ExpectOrder((ExpectItem("req-1", [7], 0, 3.0),)),
        CancelOrder(RECV, ("req-1",), "deadline"),
    ]
