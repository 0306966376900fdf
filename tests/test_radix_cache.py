"""RadixCache / NullCache: exact slot ids, eviction order, locks, namespaces, pages, properties."""

import random

import pytest
import torch

from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.mem_cache.prefix_cache import NullCache, PrefixCache, kv_invariant_ok
from radixserve.workers.mem_cache.radix_cache import RadixCache, _common_len


def make(num_slots=16, page_size=1):
    pool = KVPool(1, 1, 2, num_slots, dtype=torch.float32, page_size=page_size)
    return pool, RadixCache(pool, page_size)


def run_request(cache, pool, tokens, ns=None):
    """One whole request as the scheduler drives it: match tokens[:-1], lock, compute, finish."""
    m = cache.match_prefix(tokens[:-1], ns)
    cache.lock(m.node)
    last = m.slots[-1] if m.slots else None
    new = pool.alloc(len(tokens) - len(m.slots), last)
    cache.cache_finished(tokens, m.slots + new, m.node, ns)
    cache.check_integrity()
    return m.slots, new


def build_three(cache, pool):
    """Tree afterwards: [1,2] -> {[3,4] -> {[5,6]}, [7,8]} over slots 1..8."""
    assert run_request(cache, pool, [1, 2, 3, 4]) == ([], [1, 2, 3, 4])
    assert run_request(cache, pool, [1, 2, 3, 4, 5, 6]) == ([1, 2, 3, 4], [5, 6])
    assert run_request(cache, pool, [1, 2, 7, 8]) == ([1, 2], [7, 8])


def test_insert_match_split_and_exact_lru_eviction_order():
    pool, cache = make()
    build_three(cache, pool)
    assert cache.evictable_size() == 8 and pool.available() == 8 and kv_invariant_ok(pool, cache)
    # Leaves by last use: [5,6] (request 2) before [7,8] (request 3). [3,4] joins after its child.
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots == [1, 2, 3, 4]
    # That match touched [3,4]; the oldest leaf is now [7,8], then [3,4], then [1,2].
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 2, 7]).slots == [1, 2]
    assert cache.evict(3) == 4
    assert cache.total_size() == 0 and pool.available() == 16
    cache.check_integrity()
    # FIFO reuse in eviction order: never-used 9..16, then 5,6 / 7,8 / 3,4 / 1,2.
    assert pool.alloc(16) == list(range(9, 17)) + [5, 6, 7, 8, 3, 4, 1, 2]


def test_split_refreshes_only_the_matched_upper_part():
    pool, cache = make()
    run_request(cache, pool, [1, 2, 3, 4])  # slots 1..4
    run_request(cache, pool, [9, 9])  # slots 5, 6
    assert cache.match_prefix([1, 2, 7]).slots == [1, 2]  # splits [1,2,3,4]
    # [3,4] keeps its old stamp and goes first; [9,9] is older than the refreshed [1,2].
    assert cache.evict(1) == 2
    assert cache.evict(1) == 2
    assert cache.match_prefix([9, 9]).slots == []
    assert cache.match_prefix([1, 2]).slots == [1, 2]
    assert pool.alloc(14) == list(range(7, 17)) + [3, 4, 5, 6]


def test_evict_stops_when_nothing_evictable():
    pool, cache = make()
    build_three(cache, pool)
    assert cache.evict(0) == 0
    assert cache.evict(100) == 8
    assert cache.evict(1) == 0
    assert kv_invariant_ok(pool, cache)


def test_fully_cached_prompt_still_computes_last_token_and_dup_is_freed():
    pool, cache = make()
    run_request(cache, pool, [1, 2, 3, 4])
    # The caller passes tokens[:-1]: the hit stops at 3 tokens, token 4 is recomputed into slot 5.
    cached, new = run_request(cache, pool, [1, 2, 3, 4])
    assert cached == [1, 2, 3] and new == [5]
    # The tree already holds token 4 at slot 4, so the duplicate slot 5 went back to the pool.
    assert pool.available() == 12 and cache.evictable_size() == 4
    assert cache.match_prefix([1, 2, 3, 4]).slots == [1, 2, 3, 4]


def test_cache_finished_frees_exactly_the_duplicates():
    pool, cache = make()
    # Two requests with the same prompt start before either finishes: both miss.
    m1 = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m1.node)
    m2 = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.lock(m2.node)
    s1, s2 = pool.alloc(5), pool.alloc(7)
    assert s1 == [1, 2, 3, 4, 5] and s2 == [6, 7, 8, 9, 10, 11, 12]
    cache.cache_finished([1, 2, 3, 4, 5], s1, m1.node)
    assert pool.available() == 16 - 12
    cache.cache_finished([1, 2, 3, 4, 5, 6, 9], s2, m2.node)
    # s2's first five duplicate the tree (slots 6..10 freed); 11, 12 are inserted.
    assert pool.available() == 9
    assert cache.evictable_size() == 7 and cache.protected_size() == 0
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 9, 0]).slots == [1, 2, 3, 4, 5, 11, 12]
    assert pool.alloc(9) == [13, 14, 15, 16, 6, 7, 8, 9, 10]
    cache.check_integrity()


def test_same_slot_ids_are_kept_not_freed():
    pool, cache = make()
    run_request(cache, pool, [1, 2, 3])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.node)
    assert m.slots == [1, 2, 3]
    new = pool.alloc(2)
    cache.cache_finished([1, 2, 3, 4, 5], m.slots + new, m.node)
    assert pool.available() == 11 and cache.evictable_size() == 5
    cache.check_integrity()


def test_cache_finished_length_mismatch_raises():
    pool, cache = make()
    with pytest.raises(ValueError):
        cache.cache_finished([1, 2], [1], cache.match_prefix([1]).node)


def test_locked_nodes_are_never_evicted():
    pool, cache = make()
    build_three(cache, pool)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.slots == [1, 2, 3, 4, 5, 6]
    cache.lock(m.node)
    assert cache.protected_size() == 6 and cache.evictable_size() == 2
    assert cache.evict(100) == 2  # only [7,8]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).slots == [1, 2, 3, 4, 5, 6]
    assert not cache.all_locks_released() and cache.reset() is False
    cache.unlock(m.node)
    assert cache.all_locks_released() and cache.evictable_size() == 6
    with pytest.raises(AssertionError, match="not locked"):
        cache.unlock(m.node)
    assert cache.evict(100) == 6
    cache.check_integrity()


def test_lock_counts_nest_and_split_inherits_lock():
    pool, cache = make()
    run_request(cache, pool, [1, 2, 3, 4])
    full = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(full)
    cache.lock(full)
    # A match ending inside the locked edge splits it; the new upper node carries both locks.
    part = cache.match_prefix([1, 2, 9])
    assert part.slots == [1, 2]
    cache.check_integrity()
    assert cache.protected_size() == 4
    cache.lock(part.node)
    cache.unlock(full)
    cache.unlock(full)
    assert cache.protected_size() == 2 and cache.evictable_size() == 2
    assert cache.evict(100) == 2  # [3,4] goes, [1,2] is still locked
    cache.unlock(part.node)
    assert cache.evict(100) == 2
    assert kv_invariant_ok(pool, cache)


def test_split_keeps_slots_and_children():
    pool, cache = make(32)
    run_request(cache, pool, [1, 2, 3, 4, 5, 6])
    run_request(cache, pool, [1, 2, 3, 4, 5, 6, 7, 8])
    run_request(cache, pool, [1, 2, 3, 10, 11])
    assert cache.match_prefix([1, 2, 3]).slots == [1, 2, 3]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).slots == [1, 2, 3, 4, 5, 6, 7, 8]
    assert cache.match_prefix([1, 2, 3, 10, 11]).slots == [1, 2, 3, 9, 10]
    assert cache.match_prefix([1, 2, 4]).slots == [1, 2]
    assert cache.match_prefix([2]).slots == []
    assert cache.total_size() == 10
    cache.check_integrity()


def test_namespaces_never_share():
    pool, cache = make()
    run_request(cache, pool, [1, 2, 3, 4], ns="a")
    assert cache.match_prefix([1, 2, 3, 4]).slots == []
    assert cache.match_prefix([1, 2, 3, 4], "b").slots == []
    assert run_request(cache, pool, [1, 2, 3, 4], ns="b") == ([], [5, 6, 7, 8])
    assert run_request(cache, pool, [1, 2, 3, 4]) == ([], [9, 10, 11, 12])
    assert cache.match_prefix([1, 2, 3, 4], "a").slots == [1, 2, 3, 4]
    assert cache.match_prefix([1, 2, 3, 4], "b").slots == [5, 6, 7, 8]
    assert cache.evict(4) == 4  # the default namespace is now the least recently used
    assert cache.match_prefix([1, 2, 3, 4]).slots == []
    assert cache.match_prefix([1, 2, 3, 4], "b").slots == [5, 6, 7, 8]
    assert cache.evict(4) == 4  # then "a"
    assert cache.match_prefix([1, 2, 3, 4], "a").slots == []
    assert cache.match_prefix([1, 2, 3, 4], "b").slots == [5, 6, 7, 8]
    cache.check_integrity()
    assert cache.evict(100) == 4 and kv_invariant_ok(pool, cache)
    cache.check_integrity()


def test_cache_unfinished_returns_tree_slots_plus_tail():
    pool, cache = make(32)
    run_request(cache, pool, [1, 2, 3, 4, 5])  # slots 1..5
    # A request that missed the cache computed 7 tokens into its own slots 6..12.
    m = cache.match_prefix([])
    cache.lock(m.node)
    own = pool.alloc(7)
    key = [1, 2, 3, 4, 5, 6, 7]
    r = cache.cache_unfinished(key, own, m.node)
    assert r.slots == [1, 2, 3, 4, 5, 11, 12]
    assert pool.available() == 32 - 7  # duplicates 6..10 freed
    assert cache.protected_size() == 7 and cache.evictable_size() == 0
    cache.check_integrity()
    # The next chunk continues from the returned slots; then the request finishes.
    more = pool.alloc(2)
    assert more == [13, 14]
    cache.cache_finished(key + [8, 9], r.slots + more, r.node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 9
    assert kv_invariant_ok(pool, cache)
    cache.check_integrity()


def test_cache_unfinished_paged_keeps_unaligned_tail_with_caller():
    pool, cache = make(32, page_size=4)  # pages 1..8 -> slots 4..35
    m = cache.match_prefix([])
    cache.lock(m.node)
    own = pool.alloc(6)
    assert own == [4, 5, 6, 7, 8, 9]
    key = list(range(100, 106))
    r = cache.cache_unfinished(key, own, m.node)
    assert r.slots == own and cache.protected_size() == 4 and cache.evictable_size() == 0
    assert pool.available() == 24  # the tail page (8..11) still belongs to the request
    more = pool.alloc(4, last_slot=r.slots[-1])
    assert more == [10, 11, 12, 13]
    key2 = key + [106, 107, 108, 109]
    r2 = cache.cache_unfinished(key2, r.slots + more, r.node)
    assert r2.slots == list(range(4, 14)) and cache.protected_size() == 8
    cache.cache_finished(key2, r2.slots, r2.node)
    assert cache.evictable_size() == 8 and pool.available() == 24
    assert kv_invariant_ok(pool, cache)
    cache.check_integrity()


def test_paged_match_rounds_down_and_frees_tail_page():
    pool, cache = make(32, page_size=4)
    toks = list(range(50, 60))  # 10 tokens
    assert run_request(cache, pool, toks) == ([], list(range(4, 14)))
    # Two whole pages are cached; the tail page 12..15 was freed.
    assert cache.evictable_size() == 8 and pool.available() == 24
    assert cache.match_prefix(toks).slots == list(range(4, 12))
    assert cache.match_prefix(toks[:7]).slots == list(range(4, 8))
    # Mismatch inside the second page: only the first page matches, and the edge splits there.
    m = cache.match_prefix(toks[:6] + [0, 0, 0])
    assert m.slots == [4, 5, 6, 7]
    cache.check_integrity()
    cached, new = run_request(cache, pool, toks[:6] + [0, 0, 0])
    assert cached == [4, 5, 6, 7] and new == [16, 17, 18, 19, 20]
    assert cache.evictable_size() == 12 and pool.available() == 20
    assert cache.match_prefix(toks[:6] + [0, 0, 0, 1]).slots == [4, 5, 6, 7, 16, 17, 18, 19]
    # Eviction frees whole pages: the older branch [8..11] first.
    assert cache.evict(1) == 4
    assert cache.match_prefix(toks).slots == [4, 5, 6, 7]
    assert cache.evict(100) == 8 and pool.available() == 32
    cache.check_integrity()


def test_paged_duplicate_pages_are_freed():
    pool, cache = make(32, page_size=4)
    toks = list(range(8))
    m1, m2 = cache.match_prefix(toks[:-1]), cache.match_prefix(toks[:-1])
    cache.lock(m1.node)
    cache.lock(m2.node)
    s1, s2 = pool.alloc(8), pool.alloc(8)
    cache.cache_finished(toks, s1, m1.node)
    cache.cache_finished(toks, s2, m2.node)
    assert pool.available() == 24 and cache.evictable_size() == 8
    assert cache.match_prefix(toks).slots == s1 == list(range(4, 12))
    cache.check_integrity()


def test_reset_flushes_everything_unlocked():
    pool, cache = make()
    build_three(cache, pool)
    run_request(cache, pool, [5, 5], ns="x")
    assert cache.reset() is True
    assert cache.total_size() == 0 and pool.available() == 16
    assert cache.match_prefix([1, 2, 3]).slots == []
    cache.check_integrity()
    assert run_request(cache, pool, [1, 2]) == ([], [11, 12])  # never-used slots come first


def test_page_size_must_match_pool():
    pool = KVPool(1, 1, 2, 16, dtype=torch.float32, page_size=4)
    assert RadixCache(pool).page_size == 4
    with pytest.raises(ValueError):
        RadixCache(pool, 1)


def test_lazy_heap_stays_bounded():
    pool, cache = make()
    run_request(cache, pool, [1, 2, 3])
    for _ in range(1000):
        cache.match_prefix([1, 2, 3])
    assert len(cache._heaps["device"]) <= 2 * 1 + 64 + 1
    cache.check_integrity()
    assert cache.evict(1) == 3


def test_common_len_matches_naive_on_long_runs():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 3000)
        a = [rng.randint(0, 5) for _ in range(n)]
        b = a[: rng.randint(0, n)] + [rng.randint(0, 5) for _ in range(rng.randint(0, 50))]
        naive = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert _common_len(a, b) == naive


def test_long_prompt_match():
    pool, cache = make(20000)
    prompt = list(range(8000))
    run_request(cache, pool, prompt)
    run_request(cache, pool, prompt[:4000] + [-1] * 100)
    assert cache.match_prefix(prompt).slots == list(range(1, 8001))
    assert cache.match_prefix(prompt[:3999] + [-2]).slots == list(range(1, 4000))
    cache.check_integrity()


def test_null_cache():
    pool = KVPool(1, 1, 2, 16, dtype=torch.float32)
    cache = NullCache(pool)
    m = cache.match_prefix([1, 2, 3])
    assert m.slots == []
    cache.lock(m.node)
    slots = pool.alloc(3)
    r = cache.cache_unfinished([1, 2, 3], slots, m.node)
    assert r.slots == slots and pool.available() == 13
    cache.cache_finished([1, 2, 3], r.slots, r.node)
    assert pool.available() == 16
    assert cache.evict(10) == 0
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
    assert cache.all_locks_released() and cache.reset() is True and kv_invariant_ok(pool, cache)
    cache.check_integrity()


class _Sim:
    """Requests driven against the cache while a model of slot contents checks every hit."""

    def __init__(self, rng, page_size):
        self.rng, self.p = rng, page_size
        self.pool, self.cache = make(96, page_size)
        self.content = {}  # slot -> (namespace, tokens up to and including that position)
        self.active = []  # dicts: tokens, ns, slots (computed), tree_len, node

    def alloc(self, n, last):
        slots = self.pool.alloc(n, last)
        if slots is None:
            self.cache.evict(n + self.p)
            slots = self.pool.alloc(n, last)
        return slots

    def start(self):
        base = self.rng.choice([[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 7, 7, 7, 7], [9], []])
        tail = [self.rng.randint(0, 1) for _ in range(self.rng.randint(1, 12))]
        toks = base[: self.rng.randint(0, len(base))] + tail
        ns = self.rng.choice([None, None, "t"])
        m = self.cache.match_prefix(toks[:-1], ns)
        for i, s in enumerate(m.slots):
            assert self.content[s] == (ns, tuple(toks[: i + 1]))
        self.cache.lock(m.node)
        self.active.append(dict(tokens=toks, ns=ns, slots=list(m.slots), tree_len=len(m.slots), node=m.node))

    def compute(self, req):
        left = len(req["tokens"]) - len(req["slots"])
        n = self.rng.randint(0, left)
        new = self.alloc(n, req["slots"][-1] if req["slots"] else None)
        if new is None:
            return
        for i, s in enumerate(new, start=len(req["slots"])):
            self.content[s] = (req["ns"], tuple(req["tokens"][: i + 1]))
        req["slots"] += new
        if self.rng.random() < 0.5:
            r = self.cache.cache_unfinished(
                req["tokens"][: len(req["slots"])], req["slots"], req["node"], req["ns"]
            )
            k = len(req["slots"])
            assert len(r.slots) == k and r.slots[k - k % self.p :] == req["slots"][k - k % self.p :]
            req.update(slots=r.slots, node=r.node, tree_len=k - k % self.p)

    def finish(self, req):
        self.active.remove(req)
        k = len(req["slots"])
        self.cache.cache_finished(req["tokens"][:k], req["slots"], req["node"], req["ns"])

    def owned_by_requests(self):
        pages = set()
        for req in self.active:
            pages.update(s // self.p for s in req["slots"][req["tree_len"] :])
        return len(pages) * self.p

    def check(self):
        self.cache.check_integrity()
        for req in self.active:
            assert not any(self.pool.is_free(s) for s in req["slots"])
        c, pool = self.cache, self.pool
        assert (
            pool.available() + c.evictable_size() + c.protected_size() + self.owned_by_requests() == pool.size
        )

    def step(self):
        op = self.rng.random()
        if op < 0.3 and len(self.active) < 6:
            self.start()
        elif op < 0.6 and self.active:
            self.compute(self.rng.choice(self.active))
        elif op < 0.85 and self.active:
            self.finish(self.rng.choice(self.active))
        elif op < 0.92:
            self.cache.evict(self.rng.randint(1, 8))
        elif op > 0.99 and not self.active:
            assert self.cache.reset() is True
        self.check()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_property(seed, page_size):
    sim = _Sim(random.Random(seed * 10 + page_size), page_size)
    for _ in range(1500):
        sim.step()
    while sim.active:
        sim.finish(sim.active[0])
    sim.check()
    assert kv_invariant_ok(sim.pool, sim.cache)
    evictable = sim.cache.evictable_size()
    assert evictable == sim.pool.size - sim.pool.available()
    assert sim.cache.evict(10**6) == evictable
    assert sim.pool.available() == sim.pool.size


def test_check_integrity_detects_corruption():
    pool, cache = make()
    build_three(cache, pool)
    cache.check_integrity()
    pool.free([3])  # a tree slot freed behind the cache's back
    with pytest.raises(AssertionError):
        cache.check_integrity()
    pool.alloc(9)  # takes slot 3 back (last in FIFO order)
    cache.check_integrity()
    cache._evictable += 1
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache._evictable -= 1
    cache._heaps["device"].clear()  # an evictable leaf the eviction heap no longer knows about
    with pytest.raises(AssertionError, match="heap"):
        cache.check_integrity()


def test_tensor_keys_and_slots_are_accepted():
    pool, cache = make()
    m = cache.match_prefix(torch.tensor([1, 2]))
    cache.lock(m.node)
    cache.cache_finished(torch.tensor([1, 2, 3]), torch.tensor(pool.alloc(3)), m.node)
    assert cache.match_prefix([1, 2, 3]).slots == [1, 2, 3]
    cache.check_integrity()


def test_cached_paths_most_recent_first_within_budget():
    pool = KVPool(1, 1, 1, 64)
    cache = RadixCache(pool)
    for key in ([1, 2, 3, 4], [1, 2, 9], [5, 6]):
        m = cache.match_prefix(key)
        slots = m.slots + pool.alloc(len(key) - len(m.slots))
        cache.lock(m.node)
        cache.cache_finished(key, slots, m.node)
    assert cache.cached_paths(100) == [(None, [5, 6]), (None, [1, 2, 9]), (None, [1, 2, 3, 4])]
    assert cache.cached_paths(5) == [(None, [5, 6]), (None, [1, 2, 9])]
    assert NullCache(pool).cached_paths(10) == []
    assert "cached_paths" in PrefixCache.__abstractmethods__  # every prefix cache answers it


def test_lfu_evicts_one_off_suffixes_before_a_shared_prefix_used_longer_ago():
    orders = {}
    for policy in ("lru", "lfu"):
        pool = KVPool(1, 1, 2, 16, dtype=torch.float32)
        cache = RadixCache(pool, eviction_policy=policy)
        run_request(cache, pool, [1, 2, 3])  # slots 1 2 3
        run_request(cache, pool, [1, 2, 3])  # reuses [1, 2]: the tree is [1, 2] -> [3], both used twice
        run_request(cache, pool, [9, 4, 5])  # slots 5 6 7 (slot 4 went back as a duplicate)
        run_request(cache, pool, [8, 6, 7])  # slots 8 9 10
        freed = []
        while cache.evictable_size():
            held = {s for s in range(1, 17) if not pool.is_free(s)}
            cache.evict(1)  # one leaf at a time
            freed.append(sorted(held - {s for s in range(1, 17) if not pool.is_free(s)}))
            cache.check_integrity()
        assert kv_invariant_ok(pool, cache)
        orders[policy] = freed
    # lru: the shared path was used before the two one-off requests, so it goes first;
    # lfu: the one-off leaves (one use each) go before the twice-used path.
    assert orders["lru"] == [[3], [1, 2], [5, 6, 7], [8, 9, 10]]
    assert orders["lfu"] == [[5, 6, 7], [8, 9, 10], [3], [1, 2]]
    with pytest.raises(ValueError, match="eviction_policy"):
        RadixCache(pool, eviction_policy="fifo")


def test_cached_paths_name_each_path_s_namespace():
    pool = KVPool(1, 1, 1, 64)
    cache = RadixCache(pool)
    for key, namespace in (([1, 2, 3], None), ([1, 2, 3], "acme"), ([1, 2, 7], "acme")):
        m = cache.match_prefix(key, namespace)
        slots = m.slots + pool.alloc(len(key) - len(m.slots))
        cache.lock(m.node)
        cache.cache_finished(key, slots, m.node, namespace)
    assert cache.cached_paths(100) == [("acme", [1, 2, 7]), ("acme", [1, 2, 3]), (None, [1, 2, 3])]
    assert [p for _, p in cache.cached_paths(100)] == [[1, 2, 7], [1, 2, 3], [1, 2, 3]]
    assert NullCache(pool).cached_paths(10) == []
    cache.check_integrity()
