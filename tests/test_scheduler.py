"""Scheduler bookkeeping without a model: a fake 'forward' appends a deterministic token."""

import pytest

from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.engine.request import Req, ReqStatus
from radixserve.workers.engine.scheduler import Scheduler
from radixserve.workers.executor.plan import BatchKind, ScheduledBatch
from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.mem_cache.prefix_cache import NullCache, kv_invariant_ok
from radixserve.workers.mem_cache.radix_cache import RadixCache
from radixserve.workers.mem_cache.req_to_token_pool import ReqToTokenPool
from radixserve.workers.protocol import SamplingParams


def make(pool_tokens=256, page_size=1, cache=True, **cfg):
    config = EngineConfig(page_size=page_size, disable_radix_cache=not cache, **cfg)
    pool = KVPool(1, 1, 1, pool_tokens, page_size=page_size)
    req_pool = ReqToTokenPool(config.max_running_requests + 1, 4096)
    c = (RadixCache if cache else NullCache)(pool, page_size=page_size)
    return Scheduler(config, pool, req_pool, c), pool, c


def req(rid, ids, max_new=4, index=0):
    return Req(rid, index, list(ids), SamplingParams(max_new_tokens=max_new, temperature=0))


def next_token(r):
    return (sum(r.fill_ids) * 31 + 7) % 1000  # deterministic function of the sequence so far


def run(sched, reqs, max_steps=10_000):
    """Drive to completion; returns (per-request outputs, plans)."""
    for r in reqs:
        sched.add(r)
    plans = []
    for _ in range(max_steps):
        sched.take_ended(lambda r: False)
        plan = sched.schedule()
        if plan is None:
            break
        plans.append((plan.kind, [r.key for r in plan.reqs], list(plan.extend_lens)))
        fake_step(sched, plan)
    assert not sched.has_work()
    return {r.key: list(r.output_ids) for r in reqs}, plans


def fake_step(sched, plan):
    """What the engine does with a plan, minus the model: one token per sampled sequence."""
    for r, start, n in zip(plan.reqs, plan.starts, plan.extend_lens):
        assert r.num_computed == start + n
        assert len(set(r.kv_slots)) == len(r.kv_slots)
    sched.after_step(plan)
    for r, m in zip(plan.reqs, plan.sample_mask):
        if m:
            r.output_ids.append(next_token(r))
            if len(r.output_ids) >= r.params.max_new_tokens:
                sched.finish(r)


def check_idle(pool, cache):
    cache.check_integrity()
    assert kv_invariant_ok(pool, cache)


def test_prefix_reuse_and_exact_slot_accounting():
    sched, pool, cache = make()
    a = req("a", range(1, 21))
    outs, plans = run(sched, [a])
    assert plans[0] == (BatchKind.PREFILL, ["a#0"], [20])
    assert [p[0] for p in plans[1:]] == [BatchKind.DECODE] * 3
    assert a.cached_tokens == 0
    # A second request sharing the first 15 tokens reuses them.
    b = req("b", list(range(1, 16)) + [99, 98])
    outs_b, plans_b = run(sched, [b])
    assert b.cached_tokens == 15
    assert plans_b[0] == (BatchKind.PREFILL, ["b#0"], [2])
    # Fully cached prompt: hits stop at len - 1, the last token is still computed.
    c = req("c", range(1, 21))
    run(sched, [c])
    assert c.cached_tokens == 19
    check_idle(pool, cache)


def test_chunked_prefill_matches_unchunked_and_publishes_chunks():
    prompt = list(range(1, 101))
    s1, p1, c1 = make(chunked_prefill_size=32)
    r1 = req("x", prompt)
    o1, plans = run(s1, [r1])
    assert [p[2] for p in plans[:4]] == [[32], [32], [32], [4]]
    s2, p2, c2 = make(chunked_prefill_size=-1)
    r2 = req("x", prompt)
    o2, _ = run(s2, [r2])
    assert o1 == o2
    check_idle(p1, c1)
    check_idle(p2, c2)


def test_lpm_in_batch_dedup_defers_shared_prefix():
    sched, pool, cache = make(chunked_prefill_size=-1)
    shared = list(range(500, 564))
    reqs = [req(f"r{i}", shared + [i + 1, i + 2]) for i in range(3)]
    outs, plans = run(sched, reqs)
    # The first warms the shared prefix; the others wait one round and then reuse it.
    assert plans[0] == (BatchKind.PREFILL, ["r0#0"], [66])
    assert reqs[1].cached_tokens == 64 and reqs[2].cached_tokens == 64
    check_idle(pool, cache)


def test_lpm_dedup_defers_behind_a_chunked_prefill_of_the_same_prefix():
    """A fork's branches on a cold cache, the shared part longer than a chunk: the others wait
    while the first one's chunks are computed (each published as it lands), never computing one
    of its chunks beside it, and then reuse the whole shared part (steps unmixed: each counts
    only prefill tokens)."""
    sched, pool, cache = make(chunked_prefill_size=64, enable_mixed_chunk=False)
    shared = list(range(500, 600))
    reqs = [req(f"r{i}", shared + [i + 1, i + 2]) for i in range(3)]
    outs, plans = run(sched, reqs)
    prefills = [p for p in plans if p[0] is BatchKind.PREFILL]
    # r0 in two chunks; in the second one's round 26 tokens of budget are left, and r1 (whose
    # match ends where that chunk starts) would have spent them on the same tokens.
    assert prefills[:2] == [(BatchKind.PREFILL, ["r0#0"], [64]), (BatchKind.PREFILL, ["r0#0"], [38])]
    assert reqs[1].cached_tokens == 100 and reqs[2].cached_tokens == 100
    assert sum(sum(p[2]) for p in prefills) == 102 + 2 + 2
    check_idle(pool, cache)


@pytest.fixture
def optimistic(monkeypatch):
    """Admit as if requests will stop early, so running ones must be retracted later."""
    import radixserve.workers.engine.scheduler as mod

    monkeypatch.setattr(mod, "INIT_NEW_TOKEN_RATIO", 0.05)
    monkeypatch.setattr(mod, "MIN_NEW_TOKEN_RATIO", 0.05)


def test_memory_pressure_retracts_and_outputs_match_unpressured(optimistic):
    prompts = [list(range(10 * i + 1, 10 * i + 41)) for i in range(8)]
    big, bp, bc = make(pool_tokens=4096)
    ref, _ = run(big, [req(f"q{i}", p, max_new=30) for i, p in enumerate(prompts)])
    small, sp, scache = make(pool_tokens=150)
    reqs = [req(f"q{i}", p, max_new=30) for i, p in enumerate(prompts)]
    outs, _ = run(small, reqs)
    assert outs == ref
    assert small.num_retractions > 0
    check_idle(sp, scache)
    check_idle(bp, bc)


def test_memory_pressure_without_cache(optimistic):
    prompts = [list(range(10 * i + 1, 10 * i + 41)) for i in range(6)]
    ref, _ = run(make(pool_tokens=4096, cache=False)[0], [req(f"q{i}", p, 40) for i, p in enumerate(prompts)])
    small, sp, sc = make(pool_tokens=100, cache=False)
    outs, _ = run(small, [req(f"q{i}", p, 40) for i, p in enumerate(prompts)])
    assert outs == ref
    assert small.num_retractions > 0
    assert sp.available() == sp.size


def test_abort_waiting_and_running_frees_slots():
    sched, pool, cache = make(pool_tokens=512, max_running_requests=1)
    a, b = req("a", range(1, 50), max_new=100), req("b", range(200, 250), max_new=100)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [r.key for r in plan.reqs] == ["a#0"]
    sched.after_step(plan)
    a.output_ids.append(1)
    assert pool.available() < pool.size
    a.aborted = b.aborted = True
    gone = sched.take_ended(lambda r: False)
    assert {r.key for r in gone} == {"a#0", "b#0"}
    assert not sched.has_work()
    assert all(r.status is ReqStatus.FINISHED for r in gone)
    check_idle(pool, cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_page_sizes_give_same_outputs(page_size):
    prompts = [list(range(1, 30)), list(range(1, 23)) + [7, 8, 9], list(range(40, 77))]
    ref, _ = run(make(page_size=1)[0], [req(f"p{i}", p, 9) for i, p in enumerate(prompts)])
    sched, pool, cache = make(page_size=page_size, pool_tokens=400)
    outs, _ = run(sched, [req(f"p{i}", p, 9) for i, p in enumerate(prompts)])
    assert outs == ref
    check_idle(pool, cache)


# Admission order: one tree, one queue, every policy against both caches ----------------------
P1, P2 = list(range(1, 21)), list(range(51, 61))
B1, B2 = P1 + list(range(101, 111)), P1 + list(range(201, 211))
QUEUE = {  # arrival order; the last token is never matched (hits stop at len - 1)
    "a": list(range(900, 906)),  # shares nothing
    "b": B1 + [7777],  # matches all of B1 (30)
    "c": P1 + list(range(201, 206)) + [8888],  # matches P1 and half of B2's branch (25)
    "d": B1 + [5555, 6666],  # matches B1 (30), like b
    "e": P2 + [4444],  # matches P2 (10)
    "f": P1 + [300, 301],  # matches P1 (20)
}
ADMISSION_ORDER = {
    ("fcfs", True): "abcdef",
    # Longest match first; equal matches keep arrival order.
    ("lpm", True): "bdcfea",
    # Depth first from the root, heaviest subtree first: the root's own request, then P1's subtree
    # (4 waiting: its own f, then B1's branch with b and d before B2's with c), then P2's (e).
    ("dfs-weight", True): "afbdce",
    # Without a tree nothing is shared: every policy admits in arrival order.
    ("fcfs", False): "abcdef",
    ("lpm", False): "abcdef",
    ("dfs-weight", False): "abcdef",
}


@pytest.mark.parametrize("cache", [True, False], ids=["radix", "null"])
@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight"])
def test_admission_order_per_policy_and_cache(policy, cache):
    sched, pool, c = make(pool_tokens=512, cache=cache, schedule_policy=policy, chunked_prefill_size=-1)
    run(sched, [req("wa", B1, 2), req("wb", B2, 2), req("wc", P2, 2)])  # warms the tree (if any)
    queue = [req(rid, ids) for rid, ids in QUEUE.items()]
    for r in queue:
        sched.add(r)
    plan = sched.schedule()
    assert plan.kind is BatchKind.PREFILL
    assert "".join(r.rid for r in plan.reqs) == ADMISSION_ORDER[policy, cache]
    expected_cached = (
        {"a": 0, "b": 30, "c": 25, "d": 30, "e": 10, "f": 20} if cache else dict.fromkeys(QUEUE, 0)
    )
    assert {r.rid: r.cached_tokens for r in queue} == expected_cached
    assert plan.extend_lens == [len(QUEUE[r.rid]) - expected_cached[r.rid] for r in plan.reqs]
    fake_step(sched, plan)
    run(sched, [])  # and everything completes
    assert all(len(r.output_ids) == 4 for r in queue)
    check_idle(pool, c)


@pytest.mark.parametrize("cache", [True, False], ids=["radix", "null"])
@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight"])
def test_one_at_a_time_admission_follows_the_policy(policy, cache):
    """With one running request at a time, each round admits the policy's first choice."""
    sched, pool, c = make(
        pool_tokens=512, cache=cache, schedule_policy=policy, chunked_prefill_size=-1, max_running_requests=1
    )
    run(sched, [req("wa", B1, 2), req("wb", B2, 2), req("wc", P2, 2)])
    _, plans = run(sched, [req(rid, ids, 1) for rid, ids in QUEUE.items()])
    admitted = "".join(keys[0][0] for kind, keys, _ in plans if kind is BatchKind.PREFILL)
    # Each finished request joins the tree; for dfs-weight that changes the weights: once b is done,
    # B1's branch (d) and B2's (c) hold one waiting request each, and the tie goes to the branch
    # the walk pushed last (B1's, created first, sorts first among equals and is popped last).
    expected = {**ADMISSION_ORDER, ("dfs-weight", True): "afbced"}
    assert admitted == expected[policy, cache]
    check_idle(pool, c)


# A sequence that fits the pool alone always finishes -------------------------------------------
@pytest.mark.parametrize("chunk", [-1, 16])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("cache", [True, False], ids=["radix", "null"])
def test_a_sequence_filling_the_whole_pool_finishes(cache, page_size, chunk):
    """prompt + max_new - 1 == pool size (the last token is never fed back), beside other
    requests that must be retracted to let it finish: nothing is aborted."""
    sched, pool, c = make(pool_tokens=64, page_size=page_size, cache=cache, chunked_prefill_size=chunk)
    big = req("big", range(1, 41), max_new=25)  # 40 + 25 - 1 == 64
    others = [req(f"o{i}", range(100 + 10 * i, 108 + 10 * i), max_new=20) for i in range(3)]
    outs, _ = run(sched, [big] + others)
    assert len(outs["big#0"]) == 25 and all(len(outs[f"o{i}#0"]) == 20 for i in range(3))
    assert all(r.error is None and not r.aborted for r in [big] + others)
    check_idle(pool, c)


def test_a_sequence_that_cannot_fit_alone_fails_with_an_error(optimistic):
    """The engine refuses such a request at submission; should one get here anyway, it ends with
    an error for the client (Req.error), never with a silent abort."""
    sched, pool, c = make(pool_tokens=32, cache=False, chunked_prefill_size=8)
    r = req("x", range(1, 31), max_new=10)  # needs 39 slots of 32
    sched.add(r)
    while (plan := sched.schedule()) is not None:
        fake_step(sched, plan)
    assert len(r.output_ids) == 32 - 30 + 1  # decoded until the pool was full
    assert r.error == "out of KV cache memory: the sequence does not fit in the KV pool even alone"
    assert r.finish_reason is None  # the engine turns the error into an EngineError
    assert sched.take_ended(lambda r: False) == [r]  # at the next step boundary
    assert not sched.has_work() and r.status is ReqStatus.FINISHED
    check_idle(pool, c)


@pytest.mark.parametrize("cache", [True, False], ids=["radix", "null"])
def test_a_failed_sequence_publishes_only_its_cached_prefix(cache):
    sched, pool, c = make(pool_tokens=128, cache=cache, chunked_prefill_size=8)
    run(sched, [req("warm", range(1, 17), max_new=1)])  # 16 tokens, 16 cached with the radix cache
    r = req("x", list(range(1, 17)) + list(range(50, 70)), max_new=5)
    sched.add(r)
    fake_step(sched, sched.schedule())  # one chunk of 8 past the cached prefix, then published
    plan = sched.schedule()  # the next chunk: its forward "fails"
    assert [x.key for x in plan.reqs] == ["x#0"]
    cached_before = c.evictable_size() + c.protected_size()
    r.error, r.aborted = "the model step failed", True
    assert [x.key for x in sched.take_ended(lambda r: False)] == ["x#0"]
    # The failed chunk's slots went back to the pool; the tree holds only what it held before.
    assert c.evictable_size() + c.protected_size() == cached_before
    assert cached_before == (16 + 8 if cache else 0)  # the warm prompt, then x's first chunk
    check_idle(pool, c)


def drive_arrivals(sched, reqs, every=3):
    """Requests arrive one every `every` steps while the earlier ones run; returns
    (outputs, plans as (kind, [(key, extend_len)]))."""
    pending, plans, step = list(reqs), [], 0
    while pending or sched.has_work():
        if pending and step % every == 0:
            sched.add(pending.pop(0))
        step += 1
        plan = sched.schedule()
        if plan is None:
            continue
        plans.append((plan.kind, [(r.key, n) for r, n in zip(plan.reqs, plan.extend_lens)]))
        fake_step(sched, plan)
    return {r.key: list(r.output_ids) for r in reqs}, plans


@pytest.mark.parametrize("pool_tokens", [4096, 160])
def test_mixed_steps_carry_every_decode_and_change_no_output(pool_tokens, optimistic):
    prompts = [list(range(50 * i + 1, 50 * i + 41 + i)) for i in range(6)]
    runs = {}
    for mixed in (False, True):
        sched, pool, cache = make(pool_tokens=pool_tokens, chunked_prefill_size=16, enable_mixed_chunk=mixed)
        runs[mixed] = drive_arrivals(sched, [req(f"m{i}", p, max_new=12) for i, p in enumerate(prompts)])
        check_idle(pool, cache)
    (ref, plain), (outs, mixed) = runs[False], runs[True]
    assert outs == ref
    assert all(len(o) == 12 for o in outs.values())
    # Without mixing a step is all prefill or all decode; with it, prefill steps carry decodes.
    assert not any({n == 1 for _k, n in p} == {True, False} for kind, p in plain if kind is BatchKind.PREFILL)
    carried = [p for kind, p in mixed if kind is BatchKind.PREFILL and any(n == 1 for _k, n in p)]
    assert carried and any(n > 1 for p in carried for _k, n in p)
    if pool_tokens == 4096:  # nothing retracted: a decoding sequence advances at every step
        assert max(decode_gaps(mixed)) == 1 < max(decode_gaps(plain))


def test_a_mixed_step_carries_the_prefill_tokens_its_cost_allows(optimistic):
    """With mixed_step_ratio the chunk beside the decodes is what keeps the step near that many
    decode steps' time (the engine feeds the step times; here a machine of 10 ms a step plus 0.1
    ms a row); the outputs stay those of unmixed steps."""
    prompts = [list(range(100 * i + 1, 100 * i + 91)) for i in range(6)]
    ref, _ = drive_arrivals(
        make(pool_tokens=4096, chunked_prefill_size=64, enable_mixed_chunk=False)[0],
        [req(f"m{i}", p, max_new=12) for i, p in enumerate(prompts)],
    )
    sched, pool, cache = make(
        pool_tokens=4096, chunked_prefill_size=64, enable_mixed_chunk=True, mixed_step_ratio=1.5
    )
    for rows, kind in [
        (1, BatchKind.DECODE),
        (4, BatchKind.DECODE),
        (64, BatchKind.PREFILL),
        (200, BatchKind.PREFILL),
    ]:
        sched.cost.observe(ScheduledBatch(kind, [], [], [rows], []), 0.01 + rows * 0.0001)
    outs, plans = drive_arrivals(sched, [req(f"m{i}", p, max_new=12) for i, p in enumerate(prompts)])
    check_idle(pool, cache)
    assert outs == ref
    mixed = [[n for _k, n in p] for kind, p in plans if kind is BatchKind.PREFILL and 1 in [n for _k, n in p]]
    budgets = [sched.cost.mixed_budget(ns.count(1), 64 - ns.count(1)) for ns in mixed]
    assert all(50 <= b < 64 for b in budgets)  # (1.5 - 1) * (10 ms + d rows) / 0.1 ms, d decodes
    assert all(sum(n for n in ns if n > 1) <= b for ns, b in zip(mixed, budgets))
    assert any(sum(n for n in ns if n > 1) == b for ns, b in zip(mixed, budgets))


def decode_gaps(plans):
    """Steps between a sequence's consecutive sampled tokens (its last prefill chunk's first),
    over every sequence."""
    seen: dict[str, list[int]] = {}
    for k, (_kind, p) in enumerate(plans):
        for key, n in p:
            steps = seen.setdefault(key, [])
            if n > 1:
                steps.clear()  # a chunk: the tokens are sampled from its last chunk on
            steps.append(k)
    return [b - a for steps in seen.values() for a, b in zip(steps, steps[1:])]
