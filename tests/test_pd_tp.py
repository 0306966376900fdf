"""PD with tensor parallelism at the engine level, without Ray: a prefill and a decode engine at
tp_size 2 (two ranks each, local processes), every rank moving its own KV heads to the same rank
of the other replica over loopback gloo (replicas of different degrees: test_pd_tp_degrees.py), driven as the ingress drives them; against a unified
engine at tp_size 1. One process holds one tensor-parallel group, so the prefill engine runs in a
process of its own (load_tests/engine_process.py).

After every test both replicas are idle on every rank: rank 0's KV invariant, no transfer open on
a follower, and no follower report left unread in the group's store."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from load_tests.engine_process import EngineProcess
from radixserve.workers import Engine
from radixserve.workers.protocol import (
    EngineError,
    GenerateRequest,
    InvalidRequest,
    SamplingParams,
    TransferFailed,
)
from tests.engine_utils import assert_kv_invariant
from tests.test_pd_engine import abort_while_reserved, merge, renewing, reserved_until_timeout, unified_run
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # five engines, four of them tensor-parallel ranks

POOL = 2048
ARGS = dict(
    dtype="float32", max_total_tokens=POOL, chunked_prefill_size=32, kv_transfer="gloo", num_threads=1
)
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    list(range(100, 170)),  # three prefill chunks: the last one's transfer starts mid-prompt
    [42] * 5,
]


def pd_failed_total(engine: Engine) -> int:
    return engine.stats()["pd_transfers_failed_total"]


def idle_on_every_rank(engine: Engine) -> tuple[int, int]:
    """In the prefill engine's process: the KV invariant at idle, then the transfers open on its
    followers and the keys its group's store holds."""
    assert_kv_invariant(engine)
    store = engine.core.tp.store
    return engine.rank_transfers_open(), store.num_keys() if store else 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # 4 query / 2 KV heads: one KV head per rank at tp_size 2.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pd_tp"), "llama")


@pytest.fixture(scope="module")
def engines(checkpoint):
    prefill = EngineProcess(checkpoint, role="prefill", tp_size=2, kv_transfer_timeout_s=6.0, **ARGS)
    unified = decode = None
    try:
        unified = Engine(checkpoint, **ARGS)
        decode = Engine(checkpoint, role="decode", tp_size=2, kv_transfer_timeout_s=8.0, **ARGS)
        # What the groups' stores hold at idle: start-up keys only, no transfer reports.
        baseline = (prefill.call(idle_on_every_rank)[1], decode.core.tp.store.num_keys())
        yield unified, prefill, decode, baseline
    finally:
        prefill.close()
        for e in (unified, decode):
            if e is not None:
                e.shutdown()


@pytest.fixture(autouse=True)
def idle(engines):
    yield
    _, prefill, decode, (prefill_keys, decode_keys) = engines
    if decode.core.rank_failed() is None:  # the last test kills a rank of it
        assert_kv_invariant(decode)
        assert decode.rank_transfers_open() == 0
        assert decode.core.tp.store.num_keys() == decode_keys
    assert prefill.call(idle_on_every_rank) == (0, prefill_keys)


async def pd_run(prefill: EngineProcess, decode: Engine, req: GenerateRequest) -> tuple[dict, list]:
    dstream, done = decode.reserve(req)
    tickets = await asyncio.wrap_future(done)
    outs: dict[int, dict] = {}
    async with renewing(decode, req.rid):
        chunks = await asyncio.to_thread(prefill.generate, dataclasses.replace(req, kv_tickets=tickets))
    for chunk in chunks:
        merge(outs, chunk, final=False)
    async for chunk in dstream:
        merge(outs, chunk, final=True)
    return outs, tickets


def run_both(engines, ids: list[int], **params: Any) -> tuple[dict, dict, list]:
    unified, prefill, decode, _ = engines
    sp = SamplingParams.from_dict({"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, **params})
    pd, tickets = asyncio.run(pd_run(prefill, decode, GenerateRequest(list(ids), sp, stream=True)))
    ref = asyncio.run(unified_run(unified, GenerateRequest(list(ids), sp)))
    return pd, ref, tickets


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "chunked", "repeated"])
def test_pd_tp2_greedy_equals_unified_tp1(engines, prompt):
    pd, ref, tickets = run_both(engines, prompt)
    assert pd[0]["ids"] == ref[0]["ids"] and pd[0]["text"] == ref[0]["text"]
    assert pd[0]["finish"] == ref[0]["finish"]
    (ticket,) = tickets
    assert len(ticket.rank_endpoints) == 1  # rank 1's own endpoint travels with the ticket


def test_pd_tp2_n_and_a_grammar(engines):
    pd, ref, _ = run_both(engines, PROMPTS[1], n=2)
    assert [pd[i]["ids"] for i in (0, 1)] == [ref[i]["ids"] for i in (0, 1)]
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    pd, ref, _ = run_both(engines, PROMPTS[0], max_new_tokens=24, ignore_eos=False, json_schema=schema)
    assert pd[0]["ids"] == ref[0]["ids"] and pd[0]["text"] == ref[0]["text"]
    assert pd[0]["finish"] == ref[0]["finish"]


def test_whole_prompt_sends_after_the_forward_at_tp2(engines, checkpoint):
    """kv_transfer_layerwise off: every rank sends the whole prompt once its forward is done."""
    unified, _, decode, _ = engines
    after = EngineProcess(
        checkpoint, role="prefill", tp_size=2, kv_transfer_timeout_s=6.0, kv_transfer_layerwise=False, **ARGS
    )
    try:
        sp = SamplingParams.from_dict({"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        for ids in (PROMPTS[1], list(range(600, 640))):
            req = GenerateRequest(list(ids), sp, stream=True)
            pd, _ = asyncio.run(pd_run(after, decode, req))
            ref = asyncio.run(unified_run(unified, GenerateRequest(list(ids), sp)))
            assert pd[0]["ids"] == ref[0]["ids"]
        open_, _keys = after.call(idle_on_every_rank)
        assert open_ == 0
    finally:
        after.close()


def test_follow_up_turn_moves_only_new_tokens_on_every_rank(engines):
    first = list(range(300, 345))
    pd, ref, _ = run_both(engines, first)
    turn2 = first + pd[0]["ids"] + list(range(400, 420))
    pd, ref, tickets = run_both(engines, turn2)
    assert pd[0]["ids"] == ref[0]["ids"]
    held = tickets[0].held_tokens
    assert held >= 32 and len(tickets[0].dst_slots) == len(turn2) - held


def test_abort_while_reserved_frees_every_rank(engines):
    _, _, decode, _ = engines

    def rank1_expects_it() -> None:
        assert decode.rank_transfers_open() == 1  # rank 1 expects its own heads of it

    asyncio.run(abort_while_reserved(decode, PROMPTS[1], rank1_expects_it))


def test_transfer_timeout_fails_clearly_and_frees_every_rank(engines):
    _, _, decode, _ = engines  # its transfers time out after 8 s
    asyncio.run(reserved_until_timeout(decode, PROMPTS[0]))


def test_one_ranks_part_failing_fails_the_request_on_both_sides(engines):
    """Rank 1 of the prefill replica is pointed at rank 0 of the decode replica (a forged
    ticket): that pair's handshake refuses it (another shard of the model), while rank 0's part
    lands. The decode replica fails the request once rank 1's part is overdue, the prefill
    replica counts the transfer failed, and both free every rank."""
    _, prefill, decode, _ = engines

    async def go():
        req = GenerateRequest(list(PROMPTS[1]), SamplingParams(max_new_tokens=4, temperature=0))
        stream, done = decode.reserve(req)
        (ticket,) = await asyncio.wrap_future(done)
        forged = dataclasses.replace(ticket, rank_endpoints=(ticket.endpoint,))
        chunks = await asyncio.to_thread(prefill.generate, dataclasses.replace(req, kv_tickets=[forged]))
        assert len(chunks) == 1  # the first token, from the prefill replica
        with pytest.raises(TransferFailed, match="rank 1"):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(go(), timeout=60))
    assert prefill.call(pd_failed_total) >= 1


def test_a_prefill_replica_of_another_degree_than_planned_for_is_refused_up_front(engines, checkpoint):
    """A decode replica plans its receives for one prefill degree (its own unless configured,
    tests/test_pd_tp_degrees.py): a tp_size 1 decode replica's ticket is refused by a tp_size 2
    prefill replica (and the other way round), with both degrees named."""
    _, prefill, decode, _ = engines
    single = Engine(checkpoint, role="decode", **ARGS)
    single_prefill = Engine(checkpoint, role="prefill", **ARGS)
    req = GenerateRequest(list(PROMPTS[0]), SamplingParams(max_new_tokens=4, temperature=0))

    async def go():
        stream, done = single.reserve(req)
        tickets = await asyncio.wrap_future(done)
        with pytest.raises(
            RuntimeError, match="expects KV from prefill replicas of tp_size 1, this one runs tp_size 2"
        ):
            await asyncio.to_thread(prefill.generate, dataclasses.replace(req, kv_tickets=tickets))
        single.abort(req.rid)
        assert [c async for c in stream][-1].finish_reason["type"] == "abort"

        req2 = dataclasses.replace(req, rid=req.rid + "-2")
        stream, done = decode.reserve(req2)
        tickets = await asyncio.wrap_future(done)
        with pytest.raises(
            InvalidRequest, match="expects KV from prefill replicas of tp_size 2, this one runs tp_size 1"
        ):
            single_prefill.core.make_reqs(dataclasses.replace(req2, kv_tickets=tickets))
        decode.abort(req2.rid)
        assert [c async for c in stream][-1].finish_reason["type"] == "abort"

    try:
        asyncio.run(go())
        assert_kv_invariant(single)
    finally:
        single.shutdown()
        single_prefill.shutdown()


def test_concurrent_requests_and_aborts_keep_every_rank_consistent(engines):
    """Twelve requests at once through both tensor-parallel replicas (several reservations and
    transfers per step, settling in any order), every third aborted on the decode side once its
    ticket is out: the others equal unified, and every rank is idle after (the fixture)."""
    unified, prefill, decode, _ = engines
    prompts = [list(range(500 + 7 * i, 540 + 11 * i)) for i in range(12)]
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)

    async def one(i: int, ids: list[int]):
        req = GenerateRequest(ids, sp, stream=True)
        stream, done = decode.reserve(req)
        tickets = await asyncio.wrap_future(done)
        if i % 3 == 2:
            decode.abort(req.rid)
        await asyncio.to_thread(prefill.generate, dataclasses.replace(req, kv_tickets=tickets))
        outs: dict[int, dict] = {}
        async for chunk in stream:
            merge(outs, chunk, final=True)
        return outs[0]

    async def all_of():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    got = asyncio.run(asyncio.wait_for(all_of(), timeout=180))
    for i, (ids, out) in enumerate(zip(prompts, got)):
        if i % 3 == 2:
            assert out["finish"]["type"] == "abort"
            continue
        ref = asyncio.run(unified_run(unified, GenerateRequest(list(ids), sp)))
        assert out["finish"]["type"] == "length"
        assert out["ids"][-5:] == ref[0]["ids"][1:], i  # the decode replica's part


def test_a_decode_rank_dying_ends_its_replica_and_the_prefill_side_frees_every_rank(engines):
    """Rank 1 of the decode replica is killed while a sequence waits for its KV: the decode
    engine stops (its streams end with an error naming the rank). The prefill replica still
    answers the ticket with the first token; both of its ranks' sends fail (rank 1's peer is
    dead, rank 0's closed its transfer engine), and it releases the slots on every rank. Last
    in the module: the decode replica does not come back."""
    _, prefill, decode, _ = engines
    (follower,) = decode.core.tp.handles

    async def go():
        req = GenerateRequest(list(PROMPTS[1]), SamplingParams(max_new_tokens=4, temperature=0))
        stream, done = decode.reserve(req)
        tickets = await asyncio.wrap_future(done)
        follower.kill()
        with pytest.raises(EngineError, match="tensor-parallel rank 1 of 2 was killed by signal 9"):
            async for _ in stream:
                pass
        return await asyncio.to_thread(prefill.generate, dataclasses.replace(req, kv_tickets=tickets))

    chunks = asyncio.run(asyncio.wait_for(go(), timeout=120))
    assert len(chunks) == 1 and len(chunks[0].token_ids) == 1
