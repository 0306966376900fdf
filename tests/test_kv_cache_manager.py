"""The KV cache manager as every caller uses it, and the scheduler's states around it: a prompt
reserved for KV from a peer, admitted once it arrived, a finished sequence held while a peer reads
its slots. No model: slots are bookkeeping."""

import pytest

from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.engine.kv_cache_manager import KVCacheManager
from radixserve.workers.engine.request import Req, ReqStatus
from radixserve.workers.engine.scheduler import Scheduler
from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.mem_cache.radix_cache import RadixCache
from radixserve.workers.mem_cache.req_to_token_pool import ReqToTokenPool
from radixserve.workers.protocol import SamplingParams


def manager(pool_tokens=64, rows=4, page_size=1):
    pool = KVPool(1, 1, 1, pool_tokens, page_size=page_size)
    return KVCacheManager(pool, ReqToTokenPool(rows, 4096), RadixCache(pool, page_size=page_size))


def scheduler(pool_tokens=64, max_running=4):
    config = EngineConfig(max_running_requests=max_running)
    pool = KVPool(1, 1, 1, pool_tokens)
    return Scheduler(config, pool, ReqToTokenPool(max_running + 1, 4096), RadixCache(pool))


def req(rid, ids, max_new=4):
    return Req(rid, 0, list(ids), SamplingParams(max_new_tokens=max_new, temperature=0))


def compute(kv, r, n):
    """What a prefill does to the manager: allocate, then publish what was computed."""
    assert kv.allocate(r, n)
    kv.publish(r, r.num_computed)


def test_a_computed_prompt_is_reused_and_every_slot_comes_back():
    kv = manager()
    a = req("a", range(1, 21))
    assert kv.open(a) and a.cache_len == 0
    compute(kv, a, 20)
    assert kv.held() == 20 and not kv.idle()
    kv.release(a)
    assert kv.idle() and a.row is None and a.kv_slots == []
    b = req("b", list(range(1, 16)) + [7, 8])
    assert kv.cached_prefix_len(b) == 15
    assert kv.open(b) and b.cache_len == 15 and b.num_computed == 15
    assert kv.held() == 15  # the prefix is locked: no longer evictable
    kv.drop(b)
    assert kv.idle()


def test_a_reservation_for_external_kv_takes_the_prompt_past_its_cached_prefix():
    kv = manager()
    a = req("a", range(1, 11))
    kv.open(a)
    compute(kv, a, 10)
    kv.release(a)
    b = req("b", list(range(1, 9)) + [50, 51, 52])
    slots = kv.reserve_external(b)
    assert isinstance(slots, list) and len(slots) == 3 and b.cache_len == 8
    assert slots == b.kv_slots[8:] and b.num_computed == len(b.origin_input_ids)
    kv.publish(b, len(b.origin_input_ids))  # the KV arrived: the tree takes the prompt
    kv.release(b)
    assert kv.idle()
    assert kv.cached_prefix_len(req("c", list(range(1, 9)) + [50, 51, 52, 9])) == 11


def test_a_reservation_without_room_holds_nothing():
    kv = manager(pool_tokens=16, rows=1)
    holder = req("h", range(100, 110))
    assert isinstance(kv.reserve_external(holder), list)
    assert kv.reserve_external(req("x", range(1, 5))) == "no table row"
    kv.drop(holder)
    assert kv.idle()
    kv = manager(pool_tokens=16, rows=4)
    holder = req("h", range(100, 110))
    kv.reserve_external(holder)
    assert kv.reserve_external(req("y", range(1, 12))) == "no KV slots"
    assert kv.req_pool.available() == kv.req_pool.max_reqs - 1  # only the holder's row
    kv.drop(holder)
    assert kv.idle()


def test_a_failed_sequence_publishes_only_its_cached_prefix():
    kv = manager()
    a = req("a", range(1, 21))
    kv.open(a)
    compute(kv, a, 12)  # published: the tree holds 12
    assert kv.allocate(a, 8)  # the next chunk, whose step fails
    a.error = "the model step failed"
    kv.release(a)
    assert kv.idle()
    assert kv.cached_prefix_len(req("b", range(1, 21))) == 12


def test_the_scheduler_runs_a_remote_prompt_once_its_kv_arrived():
    sched = scheduler()
    r = req("r", range(1, 11))
    assert isinstance(sched.reserve_remote(r), list)
    assert r.status is ReqStatus.WAITING_FOR_REMOTE_KV and sched.has_work()
    assert sched.schedule() is None  # not ready: skipped, not planned
    r.output_ids.append(5)  # the first token, sampled by the prefill side
    sched.start_arrived(r)
    assert r.status is ReqStatus.RUNNING and sched.running == [r] and not sched.remote
    plan = sched.schedule()
    assert plan is not None and plan.reqs == [r] and plan.extend_lens == [1]
    sched.finish(r)
    assert r.status is ReqStatus.FINISHED and not sched.has_work() and sched.kv.idle()


@pytest.mark.parametrize("arrived", [False, True])
def test_a_remote_prompt_that_ends_first_gives_its_slots_back(arrived):
    sched = scheduler()
    r = req("r", range(1, 11))
    sched.reserve_remote(r)
    if arrived:
        sched.start_arrived(r)
    sched.finish(r)
    assert r.status is ReqStatus.FINISHED and not sched.has_work() and sched.kv.idle()


def test_a_finished_sequence_whose_slots_a_peer_reads_waits_in_sending():
    sched = scheduler()
    a, b = req("a", range(1, 11)), req("b", range(20, 30))
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert plan is not None and {x.key for x in plan.reqs} == {"a#0", "b#0"}
    sched.after_step(plan)
    for x in (a, b):
        x.output_ids.append(1)
        x.finish("length")
    assert sched.take_ended(lambda x: x is a) == []  # nothing was aborted
    assert a.status is ReqStatus.SENDING_KV and sched.sending == {"a#0": a}
    assert b.status is ReqStatus.FINISHED and not sched.running
    assert sched.has_work() and not sched.kv.idle()  # a's slots stay locked
    sched.finish(a)
    assert a.status is ReqStatus.FINISHED and not sched.has_work() and sched.kv.idle()


def test_aborted_sequences_leave_every_queue_and_clear_releases_all():
    sched = scheduler(max_running=2)
    reqs = [req(f"q{i}", range(10 * i + 1, 10 * i + 9)) for i in range(4)]
    for r in reqs:
        sched.add(r)
    sched.after_step(sched.schedule())
    running = list(sched.running)
    assert len(running) == 2 and len(sched.waiting) == 2
    running[0].aborted = True
    sched.waiting[0].aborted = True
    gone = sched.take_ended(lambda x: False)
    assert len(gone) == 2 and all(r.status is ReqStatus.FINISHED for r in gone)
    remote = req("remote", range(200, 210))
    sched.reserve_remote(remote)
    sched.clear()
    assert all(r.status is ReqStatus.FINISHED for r in [*reqs, remote])
    assert not sched.has_work() and sched.kv.idle()
