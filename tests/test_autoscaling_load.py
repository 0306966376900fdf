"""The load signals a replica reports for autoscaling: exact numbers from the scheduler's
bookkeeping, and the engine's thread-safe read of them while its loop is busy."""

from __future__ import annotations

import asyncio
import threading

import pytest

from radixserve.workers.protocol import EngineLoad, GenerateRequest, SamplingParams
from tests.engine_utils import assert_kv_invariant, wait_idle
from tests.test_scheduler import fake_step, make, req


def test_queued_prompt_tokens_count_past_the_cached_prefix_once_matched():
    sched, pool, cache = make(pool_tokens=256, max_running_requests=1)
    a = req("a", range(1, 21), max_new=2)
    sched.add(a)
    fake_step(sched, sched.schedule())  # a's prompt computed and published to the cache
    assert sched.load() == EngineLoad(0, 1, 0, 20 / 256)  # a decodes next: nothing queued
    b = req("b", list(range(1, 16)) + [99, 98])  # shares 15 tokens with a
    c = req("c", range(200, 210))
    sched.add(b)
    sched.add(c)
    # Not matched yet: whole prompts.
    assert sched.load().queued_prompt_tokens == 17 + 10
    # The admission round matches them (and admits none: the one running row is a's).
    plan = sched.schedule()
    assert [r.key for r in plan.reqs] == ["a#0"]
    assert sched.load() == EngineLoad(2 + 10, 1, 2, 21 / 256)  # a's decode slot is taken
    fake_step(sched, plan)  # a finishes; its KV stays in the tree, evictable: not held
    assert a.finished
    assert sched.load() == EngineLoad(12, 0, 2, 0.0)


def test_a_chunked_prefill_in_progress_counts_what_it_has_left():
    sched, pool, cache = make(pool_tokens=256, chunked_prefill_size=8)
    d = req("d", range(1, 21))
    sched.add(d)
    plan = sched.schedule()
    assert plan.extend_lens == [8]
    # Scheduled tokens are being computed, not queued: 12 remain.
    assert sched.load() == EngineLoad(12, 1, 0, 8 / 256)
    fake_step(sched, plan)
    fake_step(sched, sched.schedule())
    assert sched.load().queued_prompt_tokens == 4


@pytest.fixture(scope="module")
def engine():
    from radixserve.workers import Engine

    e = Engine(dtype="float32", max_total_tokens=2048, max_running_requests=1, chunked_prefill_size=512)
    yield e
    e.shutdown()


def test_engine_load_is_read_without_waiting_for_the_engine_thread(engine):
    """The replica's metrics come while the engine thread is stuck inside a forward, and show one
    running sequence, two queued ones and their whole prompts (nothing of theirs is cached)."""
    from radixserve.workers.replica import EngineReplica

    replica = object.__new__(EngineReplica.func_or_class)
    replica.engine, replica.replica_id = engine, "test"
    params = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    stuck, release = threading.Event(), threading.Event()

    def hook(stage, req):
        if stage == "forward" and engine.load().queued_prompt_tokens == 57:
            stuck.set()
            release.wait(60)

    engine.core.worker.fault_hook = hook

    async def run():
        a = engine.submit(GenerateRequest(list(range(1000, 1030)), params, stream=True))
        await a.__anext__()  # a runs
        b = engine.submit(GenerateRequest(list(range(2000, 2050)), params))
        c = engine.submit(GenerateRequest(list(range(3000, 3007)), params))
        # The engine thread sees b and c at a step boundary, then sticks in the next forward.
        assert await asyncio.to_thread(stuck.wait, 30)
        metrics = await replica.record_autoscaling_stats()
        release.set()
        for s in (a, b, c):
            engine.abort(s.rid)
        for s in (a, b, c):
            [chunk async for chunk in s]
        return metrics

    try:
        metrics = asyncio.run(run())
    finally:
        release.set()
        engine.core.worker.fault_hook = None
        replica.engine = None  # the test's engine outlives this replica object
    assert set(metrics) == {
        "queued_prompt_tokens",
        "running_sequences",
        "queued_sequences",
        "kv_usage",
        "ttft_s",
        "itl_s",
    }
    assert all(isinstance(v, int | float) for v in metrics.values())  # what Serve accepts
    assert (metrics["queued_prompt_tokens"], metrics["running_sequences"], metrics["queued_sequences"]) == (
        57,
        1,
        2,
    )
    assert 30 / 2048 < metrics["kv_usage"] < 80 / 2048  # a's prompt and a few tokens; b's and c's not
    wait_idle(engine)
    assert_kv_invariant(engine)
    idle = engine.load()  # finished KV is evictable: not held; the latencies of the last 30 s stay
    assert (idle.queued_prompt_tokens, idle.running_sequences, idle.queued_sequences, idle.kv_usage) == (
        0,
        0,
        0,
        0.0,
    )
    assert idle.ttft_s > 0 and idle.itl_s > 0
