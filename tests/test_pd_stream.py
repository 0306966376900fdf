"""PDStream, the ingress's side of one PD request, against scripted replica calls: the order of
the calls, what each side is sent, the client's view of the two streams, and each failure."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError

from radixserve.router.frontend.ingress import Ingress
from radixserve.router.frontend.metrics import Metrics
from radixserve.router.frontend.pd_stream import RECOMPUTE_TAG, RESERVE_ATTEMPTS, PDStream
from radixserve.router.routing.policy import PolicyConfig
from radixserve.router.routing.routing_state import RoutingState
from radixserve.workers.protocol import (
    EngineError,
    GenerateRequest,
    OutputChunk,
    QueueFull,
    ReplicaStats,
    SamplingParams,
    TransferFailed,
    attempt_rid,
)
from tests.scripted_replicas import TICKET, ScriptedPool, accepted, chunk, failure, reserved

PROMPT = [5, 6, 7]


def final(ids, text, completion, **kw) -> dict:
    reason = {"type": "length", "matched": None}
    return chunk(ids=ids, text=text, finished=True, finish_reason=reason, completion_tokens=completion, **kw)


def request(**params) -> GenerateRequest:
    return GenerateRequest(list(PROMPT), SamplingParams(max_new_tokens=4, **params), rid="r", stream=True)


def run(stream: PDStream) -> list[OutputChunk]:
    async def go():
        await stream.open()
        return [c async for c in stream]

    return asyncio.run(go())


def prefill_ok(first=(11,)) -> list[Any]:
    # acceptance, then the first token as the prefill replica sends it (its own end marks on)
    return [accepted(), chunk(ids=first, text="A", finished=True, finish_reason={"type": "handoff"})]


def make(decode_script, prefill_scripts, on_failure="recompute", req=None, decode_generate=()):
    decode = ScriptedPool(reserve=[decode_script], generate=list(decode_generate))
    prefill = ScriptedPool(generate=prefill_scripts)
    s = PDStream(req or request(), prefill, decode, Metrics("m").timer(), on_failure)  # type: ignore[arg-type]
    return s, prefill, decode


def bare_ingress(prefill, decode, **config: Any) -> Ingress:
    """The ingress's open/resend logic alone, without Serve behind it."""
    ing = Ingress.__new__(Ingress)
    ing.replicas, ing.decode, ing.metrics = prefill, decode, Metrics("m")
    settings = dict(pd_on_failure="recompute", pd_local_prefill_tokens=0, pd_reserve_wait_s=0.0)
    ing.config = SimpleNamespace(**{**settings, **config})  # type: ignore[assignment]
    ing.pools = [(prefill, None), (decode, None)]  # type: ignore[list-item]
    ing.held = set()
    return ing


def test_reserve_then_prefill_with_the_tickets_then_decode():
    reservation = reserved(TICKET)
    s, prefill, decode = make(
        [reservation, chunk(ids=[12], text="B"), final([13, 14], "CD", 4, prompt_tokens=3, cached_tokens=2)],
        [prefill_ok()],
    )
    out = run(s)
    assert [c.token_ids for c in out] == [[11], [12], [13, 14]]
    assert "".join(c.text for c in out) == "ABCD"
    assert not out[0].finished and out[0].finish_reason is None  # the prefill's end is not the client's
    assert out[-1].finished and out[-1].completion_tokens == 4 and out[-1].cached_tokens == 2
    ((method, sent),) = prefill.calls
    assert method == "generate" and sent["kv_tickets"] == [TICKET.to_dict()] and sent["input_ids"] == PROMPT
    assert decode.calls[0][0] == "reserve" and "kv_tickets" not in decode.calls[0][1]


def test_a_refused_reservation_is_the_clients_refusal_and_nothing_is_prefilled():
    s, prefill, _ = make([failure(QueueFull("full"))], [])
    with pytest.raises(QueueFull):
        run(s)
    assert prefill.calls == []


def test_a_prefill_failure_before_output_cancels_the_reservation():
    s, _, decode = make([reserved(TICKET)], [[failure(EngineError("boom"))]])
    with pytest.raises(EngineError):
        run(s)
    assert decode.streams[0].cancelled


@pytest.mark.parametrize("on_failure", ["recompute", "error"])
def test_transfer_failure_after_the_first_token(on_failure):
    reservation = reserved(TICKET)
    recompute = [
        accepted(),
        chunk(ids=[12], text="B"),
        final([13, 14], "CD", 4, prompt_tokens=3, cached_tokens=3),
    ]
    s, _, decode = make(
        [reservation, failure(TransferFailed("KV transfer failed: timed out"))],
        [prefill_ok()],
        on_failure,
        decode_generate=[recompute],
    )
    if on_failure == "error":
        with pytest.raises(EngineError, match="decode side failed after the prefill"):
            run(s)
        return
    out = run(s)
    assert [t for c in out for t in c.token_ids] == [11, 12, 13, 14]
    # The rest was asked of the decode pool (alive; only the transfer failed): the prompt, resumed
    # from the token the client has (the replica counts it as output: the usage is the request's).
    method, cont = decode.calls[1]
    assert method == "generate" and cont["input_ids"] == PROMPT and cont["output_prefix"] == [[11]]
    assert cont["sampling_params"]["max_new_tokens"] == 4 and cont["rid"] == attempt_rid("r", RECOMPUTE_TAG)
    assert (out[-1].prompt_tokens, out[-1].completion_tokens, out[-1].cached_tokens) == (3, 4, 3)


def test_a_lost_decode_replica_is_recomputed_on_the_prefill_pool_grammar_and_all():
    reservation = reserved(TICKET)
    lost = RuntimeError("actor died")
    recompute = [accepted(), final([12, 13, 14], "BCD", 4, prompt_tokens=3)]
    s, prefill, _ = make([reservation, lost], [prefill_ok(), recompute], req=request(regex="[A-Z]+"))
    assert [t for c in run(s) for t in c.token_ids] == [11, 12, 13, 14]
    cont = prefill.calls[1][1]
    assert cont["input_ids"] == PROMPT and cont["output_prefix"] == [[11]] and "kv_tickets" not in cont
    assert cont["sampling_params"]["regex"] == "[A-Z]+"  # the replica replays [11] through it


def test_a_recompute_resumes_only_the_unfinished_sequences_under_their_own_indices():
    reservation = reserved(TICKET, TICKET)
    first = [accepted(), chunk(0, [11], "A", True), chunk(1, [21], "a", True)]
    decode = [reservation, final([12], "B", 2, index=0), chunk(1, [22], "b"), RuntimeError("lost")]
    # The replica numbers the one sequence it resumes 0; the client sees it as 1.
    recompute = [accepted(), final([23, 24], "cd", 4, prompt_tokens=3)]
    s, prefill, _ = make(decode, [first, recompute], req=request(n=2))
    out = run(s)
    by_index = {i: [t for c in out if c.index == i for t in c.token_ids] for i in (0, 1)}
    assert by_index == {0: [11, 12], 1: [21, 22, 23, 24]}
    assert [c.index for c in out if c.finished] == [0, 1]
    cont = prefill.calls[1][1]
    assert cont["sampling_params"]["n"] == 1 and cont["output_prefix"] == [[21, 22]]


def test_cancel_cancels_both_calls():
    reservation = reserved(TICKET)
    s, prefill, decode = make([reservation, chunk(ids=[12])], [prefill_ok() + [chunk(ids=[99])]])

    async def go():
        await s.open()
        s.cancel()

    asyncio.run(go())
    assert decode.streams[0].cancelled and prefill.streams[0].cancelled


def test_a_resend_after_a_lost_prefill_replica_goes_out_under_a_fresh_id():
    """The prefill replica is lost before any output: the ingress cancels the reservation and
    sends the request again. The decode side may still hold the first reservation (its cancel is
    on its way), so the resend must not reuse the rid: it goes out as attempt 2 of it."""
    reservation = reserved(TICKET)
    decode = ScriptedPool(reserve=[[reservation], [reservation, final([12], "B", 2)]])
    prefill = ScriptedPool(generate=[[ActorUnavailableError("lost", b"\0" * 16)], prefill_ok()])
    ing = bare_ingress(prefill, decode)

    async def go():
        stream = await ing.open(request())
        return [c async for c in stream]

    out = asyncio.run(go())
    assert [t for c in out for t in c.token_ids] == [11, 12]
    assert decode.streams[0].cancelled
    rids = [(m, r["rid"]) for m, r in decode.calls + prefill.calls]
    assert rids == [
        ("reserve", "r"),
        ("reserve", attempt_rid("r", "2")),
        ("generate", "r"),
        ("generate", attempt_rid("r", "2")),
    ]


def test_a_prompt_under_the_local_prefill_bound_is_served_whole_by_a_decode_replica():
    """pd_local_prefill_tokens: a prompt this short skips the prefill pool and the transfer; a
    longer one is disaggregated as usual."""
    reservation = reserved(TICKET)
    decode = ScriptedPool(
        generate=[[accepted(), final([11, 12], "AB", 2)]], reserve=[[reservation, final([12], "B", 2)]]
    )
    prefill = ScriptedPool(generate=[prefill_ok()])
    ing = bare_ingress(prefill, decode, pd_local_prefill_tokens=len(PROMPT))

    async def go(req):
        stream = await ing.open(req)
        return [c async for c in stream]

    out = asyncio.run(go(request()))
    assert [t for c in out for t in c.token_ids] == [11, 12]
    assert [m for m, _ in decode.calls] == ["generate"] and prefill.calls == []
    longer = GenerateRequest(PROMPT + [8], SamplingParams(max_new_tokens=4), rid="s", stream=True)
    asyncio.run(go(longer))
    assert [m for m, _ in decode.calls] == ["generate", "reserve"] and len(prefill.calls) == 1


def full(replica_id: str) -> dict:
    """A decode replica's refusal for want of room, with its stats (no KV slot to spare)."""
    report = ReplicaStats(replica_id=replica_id, role="decode", kv_total=64, kv_free=0, kv_evictable=0)
    return failure(QueueFull("the decode replica's KV pool is full; retry later", report))


def test_a_replica_without_room_answers_at_once_and_the_next_try_goes_where_there_is_room():
    """The first decode replica refuses at once (it was asked with no wait) with its stats: the
    decode pool's routing state now knows it is full and prefers the replica with room, and the
    next try waits for room on its replica for what is left of the request's wait."""
    routing = RoutingState(PolicyConfig(policy="kv_aware"))
    routing.set_replicas(["d1", "d2"])
    roomy = ReplicaStats(replica_id="d2", role="decode", kv_total=64, kv_free=64)
    routing.apply_report(roomy, None, routing.sync_point())
    reservation = reserved(TICKET)
    decode = ScriptedPool(reserve=[[full("d1")], [reservation, final([12], "B", 2)]])
    prefill = ScriptedPool(generate=[prefill_ok()])
    s = PDStream(request(), prefill, decode, Metrics("m").timer(), "recompute", 5.0, routing)  # type: ignore[arg-type]
    assert [t for c in run(s) for t in c.token_ids] == [11, 12]
    assert [m for m, _ in decode.calls] == ["reserve", "reserve"]
    (first_wait,), (second_wait,) = decode.args
    assert first_wait == 0.0 and 4.0 < second_wait <= 5.0
    rooms = {x.replica_id: x.kv_room for x in routing.loads(["d1", "d2"])}
    assert rooms == {"d1": 0, "d2": 64}
    assert routing.choose(PROMPT, ["d1", "d2"]).replica_id == "d2"
    assert prefill.calls[0][1]["kv_tickets"] == [TICKET.to_dict()]


def test_no_room_anywhere_within_the_wait_is_the_clients_503():
    """Every try refused: QueueFull (the HTTP layer's 503 with Retry-After) after
    RESERVE_ATTEMPTS tries, nothing prefilled; without a wait, after one try."""
    decode = ScriptedPool(reserve=[[full("d1")] for _ in range(RESERVE_ATTEMPTS)])
    prefill = ScriptedPool(generate=[])
    s = PDStream(request(), prefill, decode, Metrics("m").timer(), "recompute", 5.0)  # type: ignore[arg-type]
    with pytest.raises(QueueFull, match="KV pool is full"):
        run(s)
    assert len(decode.calls) == RESERVE_ATTEMPTS == 3 and prefill.calls == []
    decode = ScriptedPool(reserve=[[full("d1")], [reserved(TICKET)]])
    s = PDStream(request(), prefill, decode, Metrics("m").timer(), "recompute", 0.0)  # type: ignore[arg-type]
    with pytest.raises(QueueFull):
        run(s)
    assert len(decode.calls) == 1 and decode.args == [(0.0,)]


def test_a_reservation_is_held_for_renewal_from_reservation_to_first_token():
    """From the reservation until the prefill's first output the request's id is in `held` (the
    ingress renews those reservations' leases); after it, or after a failure, it is not."""
    seen: list[bool] = []
    held: set[str] = set()
    reservation = reserved(TICKET)
    probe = lambda: seen.append("r" in held)
    decode = ScriptedPool(reserve=[[reservation, probe, final([12], "B", 2)]])
    prefill = ScriptedPool(generate=[[accepted(), probe, *prefill_ok()[1:]]])
    s = PDStream(request(), prefill, decode, Metrics("m").timer(), "recompute", 0.0, None, held)  # type: ignore[arg-type]
    out = run(s)
    assert [t for c in out for t in c.token_ids] == [11, 12]
    assert seen == [True, False]  # held while the prefill was on its way, not while decoding
    assert held == set()
    decode = ScriptedPool(reserve=[[reservation]])
    prefill = ScriptedPool(generate=[[accepted(), probe, failure(EngineError("boom"))]])
    s = PDStream(request(), prefill, decode, Metrics("m").timer(), "recompute", 0.0, None, held)  # type: ignore[arg-type]
    with pytest.raises(EngineError):
        run(s)
    assert seen[-1] is True and held == set() and decode.streams[0].cancelled


class Broadcast:
    """What `DeploymentHandle.broadcast` returns: every replica's answer at once."""

    def __init__(self, answers: list[Any]):
        self.answers = answers

    async def results_async(self, timeout_s: float, return_exceptions: bool) -> list[Any]:
        assert return_exceptions
        return self.answers


def test_the_ingress_renews_the_held_reservations_on_every_decode_replica():
    sent: list[tuple[str, tuple]] = []

    class DecodePool:
        def broadcast(self, method: str, *args: Any) -> Broadcast:
            sent.append((method, args))
            return Broadcast([1, RuntimeError("replica gone"), 0])

    ing = bare_ingress(ScriptedPool(), DecodePool(), pd_lease_renew_s=10.0)
    assert asyncio.run(ing.renew_leases()) == 0 and sent == []  # nothing held: nobody is asked
    ing.held |= {"b", "a"}
    assert asyncio.run(ing.renew_leases()) == 2  # the replicas that answered
    assert sent == [("renew", (["a", "b"],))]
