"""The protocol's codecs: every stream event and every typed message survives the wire (JSON)
unchanged, the wire forms are pinned, and what is not a message fails loudly."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixserve.workers import disaggregation
from radixserve.workers.disaggregation import messages
from radixserve.workers.protocol import (
    Accepted,
    CacheSummary,
    EngineError,
    Failure,
    GenerateRequest,
    InvalidRequest,
    KVEndpoint,
    KVReservation,
    KVTicket,
    OutputChunk,
    ProtocolError,
    QueueFull,
    ReplicaStats,
    SamplingParams,
    TokenLogprob,
    TransferFailed,
    decode_event,
    encode_event,
)

ENDPOINT = KVEndpoint("gloo", "decode-1", "10.0.0.2:5555")
TICKET = KVTicket("t/1-0", ENDPOINT, (4, 5, 6), held_tokens=16)
TP_TICKET = KVTicket(
    "t/2-0",
    ENDPOINT,
    (7,),
    rank_endpoints=(KVEndpoint("gloo", "decode-1", "10.0.0.2:5556"),),
    sender_tp_size=2,
)


def wire(d: dict[str, Any]) -> dict[str, Any]:
    """What arrives at the other end of the network."""
    return json.loads(json.dumps(d))


@pytest.mark.parametrize(
    "event",
    [
        Accepted("r"),
        KVReservation("r", [TICKET, TP_TICKET]),
        OutputChunk(rid="r", index=1, token_ids=[11, 12], text="AB"),
        OutputChunk(
            rid="r",
            token_ids=[13],
            text="C",
            logprobs=[TokenLogprob(13, -0.5, [(13, -0.5), (14, -1.25)])],
            finished=True,
            finish_reason={"type": "stop", "matched": "."},
            prompt_tokens=3,
            completion_tokens=3,
            cached_tokens=2,
            e2e_latency=0.25,
        ),
        OutputChunk(
            rid="r",
            token_ids=[13],
            input_logprobs=[None, TokenLogprob(7, -2.5, [(8, -0.5)]), TokenLogprob(9, -0.75)],
        ),
    ],
    ids=["accepted", "reservation", "chunk", "final-chunk-with-logprobs", "chunk-with-input-logprobs"],
)
def test_every_event_round_trips(event):
    assert decode_event(wire(encode_event(event))) == event


def test_the_wire_form_is_tagged():
    assert encode_event(Accepted("r")) == {"type": "accepted", "body": {"rid": "r"}}
    assert encode_event(KVReservation("r", [TICKET])) == {
        "type": "reservation",
        "body": {"rid": "r", "tickets": [TICKET.to_dict()]},
    }
    assert encode_event(OutputChunk(rid="r"))["type"] == "chunk"
    assert encode_event(Failure(EngineError("boom"))) == {
        "type": "error",
        "body": {"kind": "engine_error", "message": "boom"},
    }


def test_every_error_round_trips_as_its_exception():
    report = ReplicaStats(replica_id="d1", role="decode", kv_total=64, kv_free=0)
    for error in (
        InvalidRequest("too long", "max_tokens", "context_length_exceeded"),
        QueueFull("full", report),
        QueueFull("full"),
        TransferFailed("KV transfer failed: timed out"),
        EngineError("step failed"),
    ):
        event = decode_event(wire(encode_event(Failure(error))))
        assert isinstance(event, Failure) and type(event.error) is type(error)
        assert str(event.error) == str(error)
        if isinstance(error, InvalidRequest):
            assert isinstance(event.error, InvalidRequest)
            assert (event.error.param, event.error.code) == ("max_tokens", "context_length_exceeded")
        if isinstance(error, QueueFull):
            assert isinstance(event.error, QueueFull) and event.error.report == error.report


def test_only_protocol_errors_are_sent():
    with pytest.raises(TypeError, match="not a protocol error: KeyError"):
        encode_event(Failure(KeyError("x")))


@pytest.mark.parametrize(
    "message",
    [
        {"type": "chunks", "body": {"rid": "r"}},  # a tag this version does not know
        {"body": {"rid": "r"}},
        {"type": ["chunk"], "body": {}},
        OutputChunk(rid="r").to_dict(),  # an untagged chunk: no key is sniffed for its type
        ["accepted"],
        None,
    ],
)
def test_an_unknown_or_missing_tag_fails_loudly(message):
    with pytest.raises(ProtocolError, match="not a replica stream event"):
        decode_event(message)


def test_an_unknown_error_kind_fails_loudly():
    with pytest.raises(ProtocolError, match="unknown error kind 'overheated'"):
        decode_event({"type": "error", "body": {"kind": "overheated", "message": "hot"}})


def test_a_cache_summary_round_trips_in_its_wire_shape():
    stats = ReplicaStats(replica_id="a", kv_total=128, kv_free=100)
    summary = CacheSummary(stats, [("acme", [1, 2, 3]), (None, [4, 5])], [(None, [4, 5, 6])])
    d = summary.to_dict()
    assert d == {
        "stats": stats.to_dict(),
        "prefixes": [[1, 2, 3], [4, 5]],
        "namespaces": ["acme", None],
        "lower_prefixes": [[4, 5, 6]],
        "lower_namespaces": [None],
    }
    assert CacheSummary.from_dict(wire(d)) == summary
    older = {k: v for k, v in d.items() if not k.startswith("lower_")}  # a replica of the last version
    assert CacheSummary.from_dict(wire(older)) == CacheSummary(stats, summary.paths)
    with pytest.raises(ProtocolError, match="2 prefixes and 1 namespaces"):
        CacheSummary.from_dict({**d, "namespaces": ["acme"]})


def test_a_request_carries_typed_tickets():
    req = GenerateRequest(
        [1, 2, 3], SamplingParams(max_new_tokens=2), rid="r", kv_tickets=[TICKET, TP_TICKET]
    )
    d = wire(req.to_dict())
    assert d["kv_tickets"] == [TICKET.to_dict(), TP_TICKET.to_dict()]
    back = GenerateRequest.from_dict(d)
    assert back.kv_tickets == [TICKET, TP_TICKET] and back == req
    assert "kv_tickets" not in GenerateRequest([1], rid="s").to_dict()


def test_the_ticket_is_one_type_for_the_router_and_the_transfer_engines():
    assert disaggregation.KVTicket is messages.KVTicket is KVTicket
    assert disaggregation.KVEndpoint is messages.KVEndpoint is KVEndpoint
    assert KVTicket.from_dict(wire(TP_TICKET.to_dict())) == TP_TICKET


def test_sampling_params_from_a_dict_are_validated_once_against_the_vocabulary():
    assert SamplingParams.from_dict({"stop_token_ids": [9]}, vocab_size=10).stop_token_ids == (9,)
    with pytest.raises(InvalidRequest, match="invalid stop token id 10") as e:
        SamplingParams.from_dict({"stop_token_ids": [10]}, vocab_size=10)
    assert e.value.param == "stop_token_ids"
    assert SamplingParams.from_dict({"stop_token_ids": [10]}).stop_token_ids == (10,)  # no vocabulary
    with pytest.raises(InvalidRequest, match="'top_p' must be in"):
        SamplingParams.from_dict({"top_p": 0})
    with pytest.raises(InvalidRequest, match="invalid sampling parameters"):
        SamplingParams.from_dict({1: 2})  # type: ignore[dict-item]
