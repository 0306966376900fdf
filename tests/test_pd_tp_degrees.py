"""PD between replicas of different tensor-parallel degrees, at the engine level, without Ray.

The model has 6 query / 3 KV heads, so at tp_size 2 the ranks hold 2 and 1 KV heads (the uneven
split of the default model's 9 / 3 at tp 2). Two directions, each against a unified tp-1 engine:
- a tp-2 prefill replica (its own process: one tensor-parallel group per process) into a tp-1
  decode replica: the decode rank takes heads [0, 2) from prefill rank 0 and [2, 3) from rank 1,
  two transfers into one pool;
- a tp-1 prefill replica into a tp-2 decode replica: prefill rank 0 sends heads [0, 2) to decode
  rank 0 and [2, 3) to rank 1, each a slice of its pool.

After every test every replica is idle on every rank: the KV invariant, no transfer open on a
follower, no follower report left unread in a group's store."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest
import torch

from load_tests.engine_process import EngineProcess
from radixserve.workers import Engine
from radixserve.workers.disaggregation import (
    KVEndpoint,
    KVTicket,
    KVTransferError,
    RecvHandle,
    TransferCancelled,
)
from radixserve.workers.disaggregation.packing import PoolView
from radixserve.workers.executor.tp_kv import KVPart, RecvGroup, SendGroup, transfer_plan
from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.protocol import GenerateRequest, InvalidRequest, SamplingParams
from tests.engine_utils import assert_kv_invariant
from tests.test_pd_engine import abort_while_reserved, merge, pd_run, unified_run
from tests.test_pd_tp import ARGS, idle_on_every_rank
from tests.test_pd_tp import PROMPTS as PROMPTS_TP
from tests.test_pd_tp import pd_run as pd_run_in_process
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # six engines, three of them tensor-parallel ranks

PROMPTS = PROMPTS_TP[:2]  # short, and three prefill chunks (the transfer starts mid-prompt)
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize(
    ("heads", "kv_heads", "sender", "receiver", "plan"),
    [
        (9, 3, 2, 2, [(0, 0, (0, 2)), (1, 1, (2, 3))]),  # one degree: rank r to rank r, all its heads
        (9, 3, 2, 1, [(0, 0, (0, 2)), (1, 0, (2, 3))]),
        (9, 3, 1, 2, [(0, 0, (0, 2)), (0, 1, (2, 3))]),
        (9, 3, 3, 2, [(0, 0, (0, 1)), (1, 0, (1, 2)), (2, 1, (2, 3))]),
        (9, 3, 2, 3, [(0, 0, (0, 1)), (0, 1, (1, 2)), (1, 2, (2, 3))]),
        # One KV head replicated on both ranks: the tp-1 decode rank takes it from rank 0 only,
        # a tp-2 decode replica's ranks each from their own peer.
        (4, 1, 2, 1, [(0, 0, (0, 1))]),
        (4, 1, 1, 2, [(0, 0, (0, 1)), (0, 1, (0, 1))]),
        (4, 1, 2, 2, [(0, 0, (0, 1)), (1, 1, (0, 1))]),
        # Two KV heads over four prefill ranks: the second decode rank's head from the second of
        # its holders, spreading the sends.
        (8, 2, 4, 2, [(0, 0, (0, 1)), (3, 1, (1, 2))]),
    ],
)
def test_the_plan_gives_every_receiving_rank_each_of_its_heads_once(heads, kv_heads, sender, receiver, plan):
    assert transfer_plan(heads, kv_heads, sender, receiver) == tuple(KVPart(*p) for p in plan)


def test_a_degree_the_model_has_no_layout_at_is_refused():
    with pytest.raises(ValueError, match="cannot split 9 query heads / 3 KV heads over 6 ranks"):
        transfer_plan(9, 3, 1, 6)


def test_a_group_fails_at_its_first_failing_part_once_the_others_are_cancelled():
    """A rank's parts of one transfer as one handle: the first part to fail cancels the others
    (after which none writes the slots) before the group's future fails, so the caller may free
    the slots the moment it sees the failure. Done only when every part is; results merged."""
    pool = KVPool(2, 3, 4, num_slots=32, dtype=torch.float32)
    view = PoolView(pool)
    endpoint = KVEndpoint("gloo", "d", "h:1")

    def part(i: int) -> RecvHandle:
        ticket = KVTicket(f"t/{i}-0", endpoint, (1, 2, 3))
        return RecvHandle(ticket, view.slot_index([1, 2, 3]), view, 1e18, (i, i + 1))

    group = RecvGroup("t", [part(0), part(1), part(2)])
    seen: list[bool] = []
    group.future.add_done_callback(lambda _f: seen.append(all(h.done() for h in group.handles)))
    group.handles[1].fail(KVTransferError("part 1 failed"))
    assert group.done() and seen == [True]
    with pytest.raises(KVTransferError, match="part 1 failed"):
        group.future.result()
    assert all(
        isinstance(h.future.exception(), TransferCancelled) for h in (group.handles[0], group.handles[2])
    )
    assert group.ticket.transfer_id == "t" and not group.cancel()

    ok = RecvGroup("u", [part(0), part(1)])
    ok.handles[0]._outcome.settle(None, {"token": 7})
    assert not ok.done()
    ok.handles[1]._outcome.settle(None, {})
    assert ok.future.result() == {"token": 7}
    assert SendGroup("v", 3, []).future.result() == {}  # a rank whose heads others send


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("pd_degrees"),
        "llama",
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=3,
    )


@dataclasses.dataclass
class Replicas:
    unified: Engine
    prefill2: EngineProcess  # tp 2, its own process
    decode1: Engine  # tp 1, expects KV from tp-2 prefill replicas
    prefill1: Engine
    decode2: Engine  # tp 2, expects KV from tp-1 prefill replicas
    baseline: tuple[int, int]  # the keys the groups' stores hold at idle (prefill2, decode2)


@pytest.fixture(scope="module")
def replicas(checkpoint):
    prefill2 = EngineProcess(checkpoint, role="prefill", tp_size=2, kv_transfer_timeout_s=8.0, **ARGS)
    started: list[Engine] = []
    try:
        for kwargs in (
            {},
            dict(role="decode", kv_peer_tp_size=2, kv_transfer_timeout_s=8.0),
            dict(role="prefill", kv_transfer_timeout_s=8.0),
            dict(role="decode", tp_size=2, kv_peer_tp_size=1, kv_transfer_timeout_s=8.0),
        ):
            started.append(Engine(checkpoint, **kwargs, **ARGS))
        unified, decode1, prefill1, decode2 = started
        baseline = (prefill2.call(idle_on_every_rank)[1], decode2.core.tp.store.num_keys())
        yield Replicas(unified, prefill2, decode1, prefill1, decode2, baseline)
    finally:
        prefill2.close()
        for e in started:
            e.shutdown()


@pytest.fixture(autouse=True)
def idle(request):
    if "replicas" not in request.fixturenames:
        yield
        return
    r: Replicas = request.getfixturevalue("replicas")
    yield
    for engine in (r.unified, r.decode1, r.prefill1, r.decode2):
        assert_kv_invariant(engine)
    assert r.decode2.rank_transfers_open() == 0
    assert r.decode2.core.tp.store.num_keys() == r.baseline[1]
    assert r.prefill2.call(idle_on_every_rank) == (0, r.baseline[0])


def tp2_to_tp1(r: Replicas, ids: list[int], **params: Any) -> tuple[dict, list]:
    sp = SamplingParams.from_dict({**GREEDY, **params})
    return asyncio.run(pd_run_in_process(r.prefill2, r.decode1, GenerateRequest(list(ids), sp, stream=True)))


def tp1_to_tp2(r: Replicas, ids: list[int], **params: Any) -> dict:
    sp = SamplingParams.from_dict({**GREEDY, **params})
    return asyncio.run(pd_run(r.prefill1, r.decode2, GenerateRequest(list(ids), sp, stream=True)))


def reference(r: Replicas, ids: list[int], **params: Any) -> dict:
    sp = SamplingParams.from_dict({**GREEDY, **params})
    return asyncio.run(unified_run(r.unified, GenerateRequest(list(ids), sp)))


def peers_received(engine: Engine) -> dict[str, int]:
    """Transfers this replica's rank 0 received, by sending rank."""
    peers = engine.core.connector.transfer.stats_snapshot()["peers"]
    return {p: s.get("transfers_received", 0) for p, s in peers.items()}


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "chunked"])
def test_tp2_prefill_into_tp1_decode_equals_unified(replicas, prompt):
    before = sum(peers_received(replicas.decode1).values())
    pd, tickets = tp2_to_tp1(replicas, prompt)
    ref = reference(replicas, prompt)
    assert pd[0]["ids"] == ref[0]["ids"] and pd[0]["text"] == ref[0]["text"]
    assert pd[0]["finish"] == ref[0]["finish"]
    (ticket,) = tickets
    assert ticket.sender_tp_size == 2 and ticket.rank_endpoints == ()
    # Both prefill ranks sent a part into the one decode pool.
    received = peers_received(replicas.decode1)
    assert len(received) == 2 and sum(received.values()) == before + 2


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "chunked"])
def test_tp1_prefill_into_tp2_decode_equals_unified(replicas, prompt):
    pd = tp1_to_tp2(replicas, prompt)
    ref = reference(replicas, prompt)
    assert pd[0]["ids"] == ref[0]["ids"] and pd[0]["text"] == ref[0]["text"]
    assert pd[0]["finish"] == ref[0]["finish"]
    sent = replicas.prefill1.core.connector.transfer.stats_snapshot()["peers"]
    assert len(sent) == 2  # one pair per decode rank, each with its own heads


def test_n_a_grammar_and_a_follow_up_turn_across_degrees(replicas):
    pd = tp1_to_tp2(replicas, PROMPTS[1], n=2)
    ref = reference(replicas, PROMPTS[1], n=2)
    assert [pd[i]["ids"] for i in (0, 1)] == [ref[i]["ids"] for i in (0, 1)]
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    grammar = dict(max_new_tokens=24, ignore_eos=False, json_schema=schema)
    pd, _ = tp2_to_tp1(replicas, PROMPTS[0], **grammar)
    ref = reference(replicas, PROMPTS[0], **grammar)
    assert pd[0]["ids"] == ref[0]["ids"] and pd[0]["finish"] == ref[0]["finish"]
    # The next turn moves only the tokens past what the decode replica holds, on every part.
    first = list(range(300, 345))
    pd, _ = tp2_to_tp1(replicas, first)
    turn2 = first + pd[0]["ids"] + list(range(400, 420))
    pd, tickets = tp2_to_tp1(replicas, turn2)
    assert pd[0]["ids"] == reference(replicas, turn2)[0]["ids"]
    held = tickets[0].held_tokens
    assert held >= 32 and len(tickets[0].dst_slots) == len(turn2) - held


def test_abort_while_reserved_frees_every_part(replicas):
    decode2 = replicas.decode2

    def rank1_expects_its_part() -> None:
        assert decode2.rank_transfers_open() == 1

    asyncio.run(abort_while_reserved(decode2, PROMPTS[1], rank1_expects_its_part))
    asyncio.run(abort_while_reserved(replicas.decode1, PROMPTS[1]))


def test_a_prefill_replica_of_another_degree_than_planned_is_refused(replicas):
    """decode1 plans for tp-2 prefill replicas: a tp-1 one refuses its ticket, naming both."""
    req = GenerateRequest(list(PROMPTS[0]), SamplingParams(max_new_tokens=4, temperature=0))

    async def go():
        stream, done = replicas.decode1.reserve(req)
        tickets = await asyncio.wrap_future(done)
        with pytest.raises(
            InvalidRequest, match="expects KV from prefill replicas of tp_size 2, this one runs tp_size 1"
        ):
            replicas.prefill1.core.make_reqs(dataclasses.replace(req, kv_tickets=tickets))
        replicas.decode1.abort(req.rid)
        assert [c async for c in stream][-1].finish_reason["type"] == "abort"

    asyncio.run(go())


def test_concurrent_requests_both_ways_with_aborts(replicas):
    """Eight requests at once in each direction, every third aborted once its ticket is out: the
    rest equal unified, and every rank is idle after (the fixture)."""
    r = replicas
    prompts = [list(range(500 + 7 * i, 540 + 11 * i)) for i in range(8)]
    sp = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)

    async def one(i: int, ids: list[int], tp2_prefill: bool):
        decode = r.decode1 if tp2_prefill else r.decode2
        req = GenerateRequest(ids, sp, stream=True)
        stream, done = decode.reserve(req)
        tickets = await asyncio.wrap_future(done)
        if i % 3 == 2:
            decode.abort(req.rid)
        ticketed = dataclasses.replace(req, kv_tickets=tickets)
        if tp2_prefill:
            await asyncio.to_thread(r.prefill2.generate, ticketed)
        else:
            async for _ in r.prefill1.submit(ticketed):
                pass
        outs: dict[int, dict] = {}
        async for chunk in stream:
            merge(outs, chunk, final=True)
        return outs[0]

    async def all_of():
        jobs = [one(i, p, way) for way in (True, False) for i, p in enumerate(prompts)]
        return await asyncio.gather(*jobs)

    got = asyncio.run(asyncio.wait_for(all_of(), timeout=180))
    refs = [reference(r, ids, max_new_tokens=5)[0]["ids"] for ids in prompts]
    for k, out in enumerate(got):
        i = k % len(prompts)
        if i % 3 == 2:
            assert out["finish"]["type"] == "abort"
        else:
            assert out["finish"]["type"] == "length" and out["ids"][-4:] == refs[i][1:], k
