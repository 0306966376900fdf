"""PD disaggregation at the engine level, without Ray: a prefill and a decode engine in one
process over loopback gloo, driven as the ingress drives them (reserve on decode, prefill with
the tickets, first token from prefill, the rest from decode), against a unified engine."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future

import pytest

from radixserve.workers import Engine
from radixserve.workers.engine.commands import ReserveRequest
from radixserve.workers.protocol import (
    EngineLoad,
    GenerateRequest,
    OutputChunk,
    QueueFull,
    SamplingParams,
    TransferFailed,
)
from tests.engine_utils import assert_kv_invariant
from tests.tiny_models import make_tiny_checkpoint

POOL = 2048
ENGINE_ARGS = dict(dtype="float32", max_total_tokens=POOL, chunked_prefill_size=32, kv_transfer="gloo")
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    list(range(100, 170)),  # several prefill chunks
    [42] * 5,
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pd"), "llama")


@pytest.fixture(scope="module")
def engines(checkpoint):
    unified = Engine(checkpoint, **ENGINE_ARGS)
    prefill = Engine(checkpoint, role="prefill", kv_transfer_timeout_s=10.0, **ENGINE_ARGS)
    decode = Engine(checkpoint, role="decode", kv_transfer_timeout_s=8.0, **ENGINE_ARGS)
    yield unified, prefill, decode
    for e in (unified, prefill, decode):
        e.shutdown()


@pytest.fixture(autouse=True)
def idle(request):
    yield
    if "engines" in request.fixturenames:
        for e in request.getfixturevalue("engines"):
            assert_kv_invariant(e)
            assert not e.core.has_work()


def merge(outs: dict[int, dict], chunk: OutputChunk, final: bool) -> None:
    o = outs.setdefault(chunk.index, {"ids": [], "text": "", "logprobs": [], "finish": None, "meta": {}})
    o["ids"] += chunk.token_ids
    o["text"] += chunk.text
    o["logprobs"] += [lp.token_id for lp in chunk.logprobs or []]
    if final and chunk.finished:
        o["finish"] = chunk.finish_reason
        o["meta"] = dict(
            prompt=chunk.prompt_tokens, completion=chunk.completion_tokens, cached=chunk.cached_tokens
        )


@contextlib.asynccontextmanager
async def renewing(decode: Engine, rid: str) -> AsyncIterator[None]:
    """Renew the reservation of `rid` every quarter lease while the body runs, as the ingress
    does until the first token (a grammar compiled on the prefill side may take longer than a
    lease on a busy machine)."""

    async def renew() -> None:
        while True:
            decode.renew([rid])
            await asyncio.sleep(decode.config.kv_transfer_timeout_s / 4)

    task = asyncio.ensure_future(renew())
    try:
        yield
    finally:
        task.cancel()


async def pd_run(prefill: Engine, decode: Engine, req: GenerateRequest) -> dict[int, dict]:
    """As the ingress serves a PD request, renewing the reservation until the first token."""
    dstream, done = decode.reserve(req)
    tickets = await asyncio.wrap_future(done)
    assert len(tickets) == req.sampling_params.n
    outs: dict[int, dict] = {}
    async with renewing(decode, req.rid):
        async for chunk in prefill.submit(dataclasses.replace(req, kv_tickets=tickets)):
            merge(outs, chunk, final=False)
    async for chunk in dstream:
        merge(outs, chunk, final=True)
    return outs


async def unified_run(engine: Engine, req: GenerateRequest) -> dict[int, dict]:
    outs: dict[int, dict] = {}
    async for chunk in engine.submit(req):
        merge(outs, chunk, final=True)
    return outs


def run_both(engines, ids, params: dict, stream: bool = True):
    unified, prefill, decode = engines
    sp = SamplingParams.from_dict(params)
    pd = asyncio.run(pd_run(prefill, decode, GenerateRequest(list(ids), sp, stream=stream)))
    ref = asyncio.run(unified_run(unified, GenerateRequest(list(ids), sp, stream=stream)))
    return pd, ref


@pytest.mark.parametrize("stream", [True, False])
def test_pd_greedy_equals_unified(engines, stream):
    for ids in PROMPTS:
        pd, ref = run_both(engines, ids, {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}, stream)
        assert pd[0]["ids"] == ref[0]["ids"] and len(ref[0]["ids"]) == 9
        assert pd[0]["text"] == ref[0]["text"]
        assert pd[0]["finish"]["type"] == ref[0]["finish"]["type"] == "length"
        assert pd[0]["meta"]["prompt"] == ref[0]["meta"]["prompt"] == len(ids)
        assert pd[0]["meta"]["completion"] == 9


def test_pd_n_logprobs_stop_and_penalties(engines):
    params = {
        "max_new_tokens": 7,
        "temperature": 0,
        "ignore_eos": True,
        "n": 3,
        "logprobs": True,
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.5,
    }
    pd, ref = run_both(engines, PROMPTS[0], params)
    assert sorted(pd) == [0, 1, 2]
    for i in range(3):
        assert pd[i]["ids"] == ref[i]["ids"]
        assert pd[i]["logprobs"] == pd[i]["ids"]  # one logprob per token, the first one included
    # A stop string inside the output: cut at the same place, the stop text withheld.
    full = ref[0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if stop.strip():
        pd, ref = run_both(engines, PROMPTS[0], {"max_new_tokens": 7, "temperature": 0, "stop": [stop]})
        assert pd[0]["text"] == ref[0]["text"] and pd[0]["finish"] == ref[0]["finish"]


def test_pd_first_token_can_end_the_request(engines):
    pd, ref = run_both(engines, PROMPTS[0], {"max_new_tokens": 1, "temperature": 0})
    assert pd[0]["ids"] == ref[0]["ids"] and len(pd[0]["ids"]) == 1
    assert pd[0]["text"] == ref[0]["text"]
    assert pd[0]["finish"]["type"] == "length"


def test_pd_json_schema(engines):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    params = {"max_new_tokens": 24, "temperature": 0, "json_schema": schema}
    pd, ref = run_both(engines, PROMPTS[0], params)
    assert pd[0]["ids"] == ref[0]["ids"]
    assert pd[0]["text"] == ref[0]["text"]
    assert pd[0]["finish"] == ref[0]["finish"]


def test_follow_up_turn_moves_only_new_tokens_and_reports_cached(engines):
    _, prefill, decode = engines
    first = list(range(300, 340))
    run_both(engines, first, {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    before = decode.stats()["pd_bytes_received_total"]
    pd, _ = run_both(engines, first + [7, 8, 9], {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    moved = decode.stats()["pd_bytes_received_total"] - before
    per_token = decode.core.pool.size and decode.stats()["pd_bytes_received_total"] // (
        decode.stats()["pd_transfers_received_total"] or 1
    )
    assert 0 < moved < per_token  # 4 tokens (the last cached one is recomputed), not 43
    assert pd[0]["meta"]["cached"] == 40  # the prefill replica's hit: the first turn's prompt
    assert decode.stats()["pd_bytes_saved_total"] > 0
    assert prefill.stats()["pd_transfers_sent_total"] >= 2


def test_the_transfer_moves_each_layer_as_the_last_chunk_computes_it(engines):
    """A new 70-token prompt is prefilled in chunks of 32: its transfer begins with the forward of
    the last chunk (the first 64 tokens go at once), and each layer of the last 6 is queued from
    inside the forward, once that layer has run. Output still equals unified."""
    unified, prefill, decode = engines
    handoff = prefill.core.connector
    real, seen = handoff.stream_layers, []

    def spy(plan, layerwise):
        callback = real(plan, layerwise)
        if callback is None:
            return None
        starts = [s for r, s in zip(plan.reqs, plan.starts) if r.kv_ticket is not None]

        def layer_done(layer):
            seen.append((starts, layer))
            callback(layer)

        return layer_done

    handoff.stream_layers = spy
    try:
        pd, ref = run_both(
            engines, list(range(700, 770)), {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
        )
    finally:
        handoff.stream_layers = real
    assert pd[0]["ids"] == ref[0]["ids"] and pd[0]["text"] == ref[0]["text"]
    layers = prefill.core.model_config.num_layers
    assert seen == [([64], layer) for layer in range(layers)]


def test_equal_prompts_prefilled_together_both_arrive_whole(engines):
    """Two requests with one new prompt in the same prefill step: the tree would keep one copy of
    its KV and free the other's slots, but not while their transfers still read them."""
    unified, prefill, decode = engines
    ids = list(range(500, 566))
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)

    async def both():
        return await asyncio.gather(
            *(pd_run(prefill, decode, GenerateRequest(list(ids), sp)) for _ in range(2))
        )

    ref = asyncio.run(unified_run(unified, GenerateRequest(list(ids), sp)))
    for pd in asyncio.run(both()):
        assert pd[0]["ids"] == ref[0]["ids"] and pd[0]["text"] == ref[0]["text"]


async def abort_while_reserved(decode: Engine, ids: list[int], while_reserved=None) -> None:
    """Reserve for a request, then abort it before any KV came: its stream ends "abort"."""
    req = GenerateRequest(list(ids), SamplingParams(max_new_tokens=4, temperature=0))
    stream, done = decode.reserve(req)
    await asyncio.wrap_future(done)
    if while_reserved is not None:
        while_reserved()
    decode.abort(req.rid)
    chunks = [c async for c in stream]
    assert chunks[-1].finish_reason["type"] == "abort"


async def reserved_until_timeout(decode: Engine, ids: list[int]) -> None:
    """Reserve for a request whose KV never comes: it fails clearly at the transfer deadline."""
    req = GenerateRequest(list(ids), SamplingParams(max_new_tokens=4, temperature=0))
    stream, done = decode.reserve(req)
    await asyncio.wrap_future(done)
    with pytest.raises(TransferFailed, match="KV transfer failed"):
        async for _ in stream:
            pass


def test_a_reservation_its_caller_gave_up_on_reserves_nothing_and_harms_no_one(engines):
    """The caller's task was cancelled (the client went away) before the engine took up its
    reservation: the engine reserves nothing for it, and a request waiting for its KV meanwhile
    is served whole (it was failed with the rest, "internal engine error", when the engine still
    answered a cancelled future). The fixture checks nothing stays reserved."""
    _, prefill, decode = engines
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)

    async def go():
        waiting = GenerateRequest(list(PROMPTS[1]), sp, stream=True)
        stream, done = decode.reserve(waiting)
        tickets = await asyncio.wrap_future(done)
        given_up: Future = Future()
        given_up.cancel()
        gone = GenerateRequest(list(PROMPTS[0]), sp)
        decode._put(ReserveRequest(decode.core.make_reqs(gone), False, given_up))
        async for _ in prefill.submit(dataclasses.replace(waiting, kv_tickets=tickets)):
            pass
        outs: dict[int, dict] = {}
        async for chunk in stream:
            merge(outs, chunk, final=True)
        return outs[0]

    out = asyncio.run(asyncio.wait_for(go(), timeout=60))
    assert out["finish"]["type"] == "length" and len(out["ids"]) == 5


def test_abort_while_reserved_frees_the_decode_side(engines):
    _, _, decode = engines

    def holds_slots() -> None:
        assert decode.stats()["kv_free"] < POOL

    asyncio.run(abort_while_reserved(decode, PROMPTS[1], holds_slots))


def test_transfer_timeout_fails_clearly_and_frees(engines):
    _, _, decode = engines  # its transfers time out after 8 s
    asyncio.run(reserved_until_timeout(decode, PROMPTS[0]))


def test_decode_side_gone_after_reserving_the_prefill_side_frees_its_slots(engines, checkpoint):
    """The decode engine (and its transfer engine) stops after handing out a ticket: the prefill
    replica still answers with the first token, its send fails at once (the dead receiver refuses
    the connection: no wait for the 10 s deadline), and its slots come back."""
    _, prefill, _ = engines
    gone = Engine(checkpoint, role="decode", **ENGINE_ARGS)

    async def go():
        req = GenerateRequest(list(PROMPTS[2]), SamplingParams(max_new_tokens=4, temperature=0))
        stream, done = gone.reserve(req)
        tickets = await asyncio.wrap_future(done)
        gone.shutdown()
        with pytest.raises(Exception, match="engine shut down"):
            async for _ in stream:
                pass
        failed = prefill.stats()["pd_transfers_failed_total"]
        chunks = [c async for c in prefill.submit(dataclasses.replace(req, kv_tickets=tickets))]
        assert len(chunks) == 1 and len(chunks[0].token_ids) == 1
        return failed

    failed = asyncio.run(go())
    answered = time.monotonic()
    assert_kv_invariant(prefill)  # waits until the send settled and the slots are back
    assert prefill.stats()["pd_transfers_failed_total"] == failed + 1
    assert time.monotonic() - answered < 8.0  # well before the send's deadline


LEASE_S = 2.0  # the small decode engine's kv_transfer_timeout_s: its reservations' lease


@pytest.fixture(scope="module")
def small_decode(checkpoint):
    """A decode engine with KV room for one 100-token prompt at a time, whose reservations'
    leases run out after LEASE_S."""
    engine = Engine(
        checkpoint, role="decode", kv_transfer_timeout_s=LEASE_S, **{**ENGINE_ARGS, "max_total_tokens": 160}
    )
    yield engine
    engine.shutdown()


SP = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


async def finish_pd(
    prefill: Engine, decode: Engine, req: GenerateRequest, tickets: list, stream
) -> list[int]:
    """The prefill with the tickets (renewing the reservation meanwhile, as the ingress does:
    these tests' leases are short, and a loaded machine's prefill may outlast one), then the
    decode stream: every token of sequence 0."""
    async with renewing(decode, req.rid):
        ids = [
            t async for c in prefill.submit(dataclasses.replace(req, kv_tickets=tickets)) for t in c.token_ids
        ]
    return ids + [t async for c in stream for t in c.token_ids]


def test_a_reservation_waits_for_room_and_is_served_once_room_is_freed(engines, small_decode):
    """No room now: a reservation that may wait does (one that may not is refused at once), and
    gets its slots the moment a holder lets go; the request is then served whole."""
    _, prefill, _ = engines
    decode = small_decode

    async def go():
        holder = GenerateRequest(list(range(600, 700)), SP)
        hstream, hdone = decode.reserve(holder)
        await asyncio.wrap_future(hdone)
        waiting = GenerateRequest(list(range(700, 800)), SP, stream=True)
        stream, done = decode.reserve(waiting, wait_s=30)
        try:
            # The engine thread parks it among the waiting reservations (on a loaded machine that
            # takes a while: wait for it rather than for a fixed time).
            deadline = time.monotonic() + 10
            while not decode.core.connector.reservations and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert not done.done() and len(decode.core.connector.reservations) == 1
            _, quick = decode.reserve(GenerateRequest(list(range(800, 870)), SP))
            with pytest.raises(QueueFull, match="KV pool is full"):
                await asyncio.wrap_future(quick)
        except BaseException:
            decode.abort(waiting.rid)  # leave the shared small pool empty for the next test
            raise
        finally:
            decode.abort(holder.rid)
        assert [c.finish_reason["type"] for c in [c async for c in hstream]][-1] == "abort"
        tickets = await asyncio.wait_for(asyncio.wrap_future(done), timeout=10)
        assert len(decode.core.connector.reservations) == 0
        return await finish_pd(prefill, decode, waiting, tickets, stream)

    assert len(asyncio.run(asyncio.wait_for(go(), timeout=60))) == 4
    assert_kv_invariant(decode)


def test_a_reservation_that_finds_no_room_within_its_wait_is_refused(small_decode):
    decode = small_decode

    async def go():
        holder = GenerateRequest(list(range(900, 1000)), SP)
        hstream, hdone = decode.reserve(holder)
        await asyncio.wrap_future(hdone)
        t0 = time.monotonic()
        _, done = decode.reserve(GenerateRequest(list(range(1000, 1100)), SP), wait_s=0.5)
        with pytest.raises(QueueFull, match="KV pool is full"):
            await asyncio.wrap_future(done)
        waited = time.monotonic() - t0
        decode.abort(holder.rid)
        _ = [c async for c in hstream]
        return waited

    waited = asyncio.run(asyncio.wait_for(go(), timeout=30))
    assert 0.5 <= waited < 0.5 + 1.0
    assert len(decode.core.connector.reservations) == 0
    assert_kv_invariant(decode)


def test_a_prefill_queue_longer_than_the_lease_does_not_time_the_reservation_out(engines, small_decode):
    """The prefill waits three leases (queued behind others) while the ingress renews the
    reservation: its KV still lands and the request is served; the lease then bounds only the
    transfer."""
    _, prefill, _ = engines
    decode = small_decode

    async def go():
        req = GenerateRequest(list(range(1100, 1140)), SP, stream=True)
        stream, done = decode.reserve(req)
        tickets = await asyncio.wrap_future(done)
        queued_until = time.monotonic() + 3 * LEASE_S
        while time.monotonic() < queued_until:
            assert decode.renew([req.rid, "another-ingress-request"]) == 1
            await asyncio.sleep(LEASE_S / 4)
        return await finish_pd(prefill, decode, req, tickets, stream)

    assert len(asyncio.run(asyncio.wait_for(go(), timeout=60))) == 4
    assert_kv_invariant(decode)


def test_a_silent_prefill_side_frees_the_reservation_within_one_lease(small_decode):
    """Nobody renews the reservation and no KV comes (the prefill side and its ingress died):
    the request fails at the end of its lease, and its slots are back."""
    decode = small_decode

    async def go():
        req = GenerateRequest(list(range(1200, 1250)), SP)
        stream, done = decode.reserve(req)
        await asyncio.wrap_future(done)
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match="the reservation's lease ran out"):
            async for _ in stream:
                pass
        return time.monotonic() - t0

    failed_after = asyncio.run(asyncio.wait_for(go(), timeout=30))
    assert LEASE_S - 0.1 <= failed_after < LEASE_S + 1.0
    assert_kv_invariant(decode)


def test_each_pool_reports_its_own_latency_for_autoscaling(engines):
    """Each engine's load (its autoscaling metrics) carries the latency its pool scales on: the
    prefill engine its requests' time to first token, the decode engine their inter-token latency
    (their first tokens came from the prefill side: it has no TTFT of its own), the unified one
    both."""
    unified, prefill, decode = engines
    run_both(engines, PROMPTS[1], {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # published at the next step boundary
        p, d, u = prefill.load(), decode.load(), unified.load()
        if p.ttft_s and d.itl_s and u.ttft_s and u.itl_s:
            break
        time.sleep(0.05)
    assert p.ttft_s > 0 and p.itl_s == 0  # a prefill replica samples one token per sequence
    assert d.itl_s > 0 and d.ttft_s == 0
    assert u.ttft_s > 0 and u.itl_s > 0
    assert EngineLoad.from_metrics(p.to_metrics()) == p  # what Serve carries to the policy


def test_pd_prefill_side_computes_the_prompt_logprobs(engines):
    """The ingress reserves on the decode side without them; the prefill replica's first chunk
    carries them, as a unified engine's does."""
    unified, prefill, decode = engines
    sp = SamplingParams.from_dict(
        {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "logprob_start_len": 3, "top_logprobs": 2}
    )
    req = GenerateRequest(list(PROMPTS[1]), sp, stream=True)

    async def pd() -> tuple[list[OutputChunk], list[OutputChunk]]:
        plain = dataclasses.replace(sp, logprob_start_len=-1)
        dstream, done = decode.reserve(dataclasses.replace(req, sampling_params=plain))
        tickets = await asyncio.wrap_future(done)
        first = [c async for c in prefill.submit(dataclasses.replace(req, kv_tickets=tickets))]
        return first, [c async for c in dstream]

    async def alone() -> list[OutputChunk]:
        return [c async for c in unified.submit(dataclasses.replace(req, rid="alone"))]

    first, rest = asyncio.run(pd())
    ref = asyncio.run(alone())
    got, want = first[0].input_logprobs, ref[0].input_logprobs
    assert got is not None and want is not None and len(got) == len(want) == len(PROMPTS[1]) - 3
    assert [lp.token_id for lp in got] == [lp.token_id for lp in want] == PROMPTS[1][3:]
    assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-4)
    assert all(c.input_logprobs is None for c in first[1:] + rest + ref[1:])
    pd_ids = [t for c in first + rest for t in c.token_ids]
    assert pd_ids == [t for c in ref for t in c.token_ids]
