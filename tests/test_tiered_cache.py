"""The radix tree with host and disk tiers beneath it: eviction moves KV down (device -> host ->
disk -> gone), a match reports what lies below the device and `load_back` copies it into fresh
device slots with the very K/V that was evicted; every failure of the disk (a corrupt file, a full
budget) ends in recomputation, never in a wrong value; the tier invariant holds after every step of
a randomized run whose K/V contents are checked on every hit."""

import asyncio
import logging
import os
import random

import pytest
import torch

from radixserve.workers.mem_cache.disk_tier import DiskTier
from radixserve.workers.mem_cache.host_tier import HostTier
from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.mem_cache.prefix_cache import kv_invariant_ok
from radixserve.workers.mem_cache.radix_cache import RadixCache


def fingerprint(ns, tokens) -> float:
    return float(hash((ns, tuple(tokens))) % (1 << 20))


class Tiered:
    """A device pool with tiers, and a model of what every device slot must hold: K row
    [fingerprint of (namespace, tokens up to the position), position] in every layer."""

    def __init__(self, tmp_path, device=16, host=16, disk_bytes=1 << 20, page_size=1, layers=2):
        self.p = page_size
        self.pool = KVPool(layers, 1, 2, device, dtype=torch.float32, page_size=page_size)
        self.host = HostTier(self.pool, host)
        self.disk = DiskTier(str(tmp_path / "kv"), disk_bytes) if disk_bytes else None
        self.cache = RadixCache(self.pool, page_size, host_tier=self.host, disk_tier=self.disk)

    def write(self, ns, tokens, slots, start=0):
        for i, s in enumerate(slots, start=start):
            row = torch.tensor([fingerprint(ns, tokens[: i + 1]), float(i)])
            for layer, (k, v) in enumerate(zip(self.pool.k_buffers, self.pool.v_buffers)):
                k[s, 0] = row + layer
                v[s, 0] = -row - layer

    def assert_holds(self, ns, tokens, slots):
        for i, s in enumerate(slots):
            row = torch.tensor([fingerprint(ns, tokens[: i + 1]), float(i)])
            for layer, (k, v) in enumerate(zip(self.pool.k_buffers, self.pool.v_buffers)):
                assert torch.equal(k[s, 0], row + layer), (i, s)
                assert torch.equal(v[s, 0], -row - layer), (i, s)

    def alloc(self, n, last=None):
        slots = self.pool.alloc(n, last)
        if slots is None:
            self.cache.evict(n + self.p - self.pool.available())
            slots = self.pool.alloc(n, last)
        return slots

    def run(self, tokens, ns=None):
        """One whole request: match (loading the lower tiers back), lock, compute the rest, finish.
        Returns (device hit, loaded from lower tiers)."""
        m = self.cache.match_prefix(tokens[:-1], ns)
        device_hit = len(m.slots)
        m = self.cache.load_back(m)
        self.assert_holds(ns, tokens, m.slots)
        self.cache.lock(m.node)
        new = self.alloc(len(tokens) - len(m.slots), m.slots[-1] if m.slots else None)
        assert new is not None
        self.write(ns, tokens, new, start=len(m.slots))
        self.cache.cache_finished(tokens, m.slots + new, m.node, ns)
        self.cache.check_integrity()
        return device_hit, len(m.slots) - device_hit

    def recompute(self, tokens):
        """A request that computes `tokens` itself (as if the device had no room to load them
        back): its insert adopts whatever part of them lies below the device."""
        m = self.cache.match_prefix(tokens[:-1])
        self.cache.lock(m.node)
        slots = self.alloc(len(tokens) - len(m.slots), m.slots[-1] if m.slots else None)
        self.write(None, tokens, slots, start=len(m.slots))
        self.cache.cache_finished(tokens, m.slots + slots, m.node)
        self.cache.check_integrity()

    def where(self, tokens, ns=None) -> tuple[int, int]:
        m = self.cache.match_prefix(tokens, ns)
        return len(m.slots), m.lower_tokens


def test_an_evicted_prefix_moves_to_host_and_loads_back_with_its_kv(tmp_path):
    t = Tiered(tmp_path, device=8, host=8, disk_bytes=0)
    a = [1, 2, 3, 4, 5, 6]
    assert t.run(a) == (0, 0)
    assert t.cache.evict(6) == 6  # the whole path goes to the host tier
    assert t.pool.available() == 8 and t.host.available() == 2
    assert t.where(a) == (0, 6)
    stats = t.cache.tier_stats()
    assert stats["tier_device_to_host_tokens"] == 6 and stats["kv_host_cached_tokens"] == 6
    assert t.run(a + [7]) == (0, 6)  # read back, the K/V checked in run
    stats = t.cache.tier_stats()
    assert stats["tier_host_loaded_tokens"] == 6 and stats["kv_host_cached_tokens"] == 0
    assert t.host.available() == 8 and t.where(a + [7]) == (7, 0)
    assert kv_invariant_ok(t.pool, t.cache)


def test_host_eviction_spills_to_disk_and_the_disk_loads_back(tmp_path):
    t = Tiered(tmp_path, device=8, host=8)
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    for seq in (a, b, c):  # each new one evicts an older one down a tier
        t.run(seq)
    for seq in (a, b, c):
        t.cache.match_prefix(seq[:-1])  # no reorder: stamps refreshed in order a, b, c
    t.cache.evict(8)  # b, c (and a) leave the device; the host holds 8: a goes on to disk
    assert t.cache.tier_stats()["tier_host_to_disk_tokens"] >= 4
    assert t.where(a) == (0, 4) and len(t.disk.keys()) >= 1
    assert t.run(a + [9]) == (0, 4)
    assert t.cache.tier_stats()["tier_disk_loaded_tokens"] == 4
    assert t.where(b) == (0, 4) and t.where(c) == (0, 4)
    assert t.run(b + [9]) == (0, 4) and t.run(c + [9]) == (0, 4)


def test_a_corrupt_disk_file_is_recomputed_and_forgotten_with_its_subtree(tmp_path, caplog):
    t = Tiered(tmp_path, device=12, host=4)
    a = [1, 2, 3, 4]
    t.run(a)
    t.run(a + [5, 6, 7, 8])  # a's node and a child below it
    t.cache.evict(8)  # the child, then a: host full, the child spills to disk
    t.cache.evict(8)
    assert t.where(a + [5, 6, 7, 8]) == (0, 8)
    for key in t.disk.keys():
        path = os.path.join(t.disk.directory, f"{key}.kv")
        raw = bytearray(open(path, "rb").read())
        raw[-1] ^= 0xFF
        open(path, "wb").write(bytes(raw))
    with caplog.at_level(logging.WARNING):
        device_hit, loaded = t.run(a + [5, 6, 7, 8, 9])
    assert device_hit == 0 and loaded == 4  # a came from the host; the rest was recomputed
    assert "unreadable" in caplog.text and t.cache.tier_stats()["tier_disk_load_failures"] == 1
    assert t.disk.keys() == [] and os.listdir(t.disk.directory) == []
    assert t.where(a + [5, 6, 7, 8, 9]) == (9, 0)


def test_a_full_disk_budget_drops_its_oldest_files_and_then_forgets(tmp_path):
    file_bytes = DiskTier.file_bytes(KVPool(2, 1, 2, 1, dtype=torch.float32), 4)
    t = Tiered(tmp_path, device=4, host=4, disk_bytes=2 * file_bytes)
    seqs = [[k] * 4 for k in range(1, 6)]
    for seq in seqs:
        t.run(seq)  # each evicts the one before: down a tier, and the oldest out of the last
    assert t.disk.used_bytes == 2 * file_bytes and len(t.disk.keys()) == 2
    assert t.cache.tier_stats()["tier_dropped_tokens"] == 4
    assert t.where(seqs[0]) == (0, 0)  # the oldest fell out of every tier
    assert [t.where(seq) for seq in seqs[1:]] == [(0, 4), (0, 4), (0, 4), (4, 0)]
    assert t.run(seqs[3][:3] + [0]) == (0, 3)  # a host node is split and its upper part loaded


def test_recomputing_a_prefix_that_lies_below_the_device_adopts_the_new_slots(tmp_path):
    t = Tiered(tmp_path, device=8, host=8, disk_bytes=0)
    a = [1, 2, 3, 4]
    t.run(a)
    t.cache.evict(4)
    assert t.where(a) == (0, 4)
    t.recompute(a)
    assert t.where(a) == (4, 0) and t.host.available() == 8  # the host copy was given up


def test_a_disk_node_is_split_and_its_parts_read_their_ranges_of_one_file(tmp_path):
    t = Tiered(tmp_path, device=8, host=8)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    t.run(a)
    t.run([9] * 8)  # a -> host
    t.run([8] * 8)  # [9]*8 -> host, a -> disk
    assert t.where(a) == (0, 8) and len(t.disk.keys()) == 1
    # A prompt diverging inside a's file: its first half is read back (the range 0..4 of it).
    assert t.run([1, 2, 3, 4, 7, 7]) == (0, 4)
    assert 1 in t.disk.keys() and t.cache.tier_stats()["tier_dropped_tokens"] == 0
    assert t.where(a) == (4, 4)  # the second half still on disk, in the same file
    assert t.run(a) == (4, 3)  # tokens 4..7 of the file read back, K/V checked
    # It computed the last token itself and the tree adopted it: no node reads the file now.
    assert t.where(a) == (8, 0) and 1 not in t.disk.keys()


def test_cached_paths_tell_the_device_from_the_lower_tiers(tmp_path):
    t = Tiered(tmp_path, device=8, host=8, disk_bytes=0)
    t.run([1, 2, 3, 4])
    t.run([1, 2, 3, 4, 5, 6])
    t.cache.evict(2)  # [5, 6] -> host
    assert t.cache.cached_paths(100) == [(None, [1, 2, 3, 4])]
    assert t.cache.cached_paths(100, lower=True) == [(None, [1, 2, 3, 4, 5, 6])]
    t.run([7, 7, 7])
    assert t.cache.cached_paths(100) == [(None, [7, 7, 7]), (None, [1, 2, 3, 4])]
    assert t.cache.cached_paths(5) == [(None, [7, 7, 7])]


class GatedReads:
    """DiskTier.read held until released: a prefetch stays in flight as long as a test wants."""

    def __init__(self, monkeypatch):
        import threading

        self.gate, self.started = threading.Event(), threading.Event()
        real = DiskTier.read

        def read(path, pool, slots, offset=0):
            self.started.set()
            assert self.gate.wait(10)
            real(path, pool, slots, offset)

        monkeypatch.setattr(DiskTier, "read", staticmethod(read))

    def settle(self, cache):
        self.gate.set()
        cache.close()  # waits for the loader thread, then settles


def on_disk(tmp_path):
    """A cache whose [1..8] prefix lies on disk (8 tokens, one file)."""
    t = Tiered(tmp_path, device=8, host=8)
    t.run([1, 2, 3, 4, 5, 6, 7, 8])
    t.run([9] * 8)  # the first -> host
    t.run([8] * 8)  # [9]*8 -> host, the first -> disk
    assert t.where([1, 2, 3, 4, 5, 6, 7, 8]) == (0, 8) and len(t.disk.keys()) == 1
    return t


def test_a_prefetch_reads_the_disk_off_the_calling_thread_and_admission_loads_from_host(
    tmp_path, monkeypatch
):
    t = on_disk(tmp_path)
    reads = GatedReads(monkeypatch)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    waits = t.cache.prefetch(t.cache.match_prefix(a))
    assert [len(w.slots) for w in waits] == [8] and reads.started.wait(10)
    t.cache.check_integrity()  # the in-flight host slots are accounted for
    assert t.cache.poll_prefetches() == 1 and not waits[0].settled
    assert t.where(a) == (0, 8)  # still a disk node while the read runs
    assert t.cache.prefetch(t.cache.match_prefix(a)) == waits  # one read per node
    reads.settle(t.cache)
    # The host room came from spilling [9]*8 (the host's only leaf) to disk.
    assert waits[0].settled and t.disk.keys() == [2] and t.disk.bytes_read > 0
    stats = t.cache.tier_stats()
    assert stats["tier_disk_prefetched_tokens"] == 8 and stats["kv_host_cached_tokens"] == 8
    assert t.run(a) == (0, 7)  # from the host tier now (a match stops before the last token)
    assert t.cache.tier_stats()["tier_host_loaded_tokens"] == 7


def test_with_the_host_tier_held_by_reads_in_flight_eviction_goes_straight_to_disk(tmp_path, monkeypatch):
    t = on_disk(tmp_path)
    reads = GatedReads(monkeypatch)
    t.cache.prefetch(t.cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]))  # all 8 host slots in flight
    assert reads.started.wait(10) and t.host.available() == 0
    assert t.run([7] * 8) == (0, 0)  # [8]*8 leaves the device: no host room, so to disk
    assert t.cache.tier_stats()["tier_device_to_disk_tokens"] == 8
    assert t.cache.tier_stats()["tier_dropped_tokens"] == 0 and t.where([8] * 8) == (0, 8)
    reads.settle(t.cache)
    t.cache.check_integrity()


def test_a_prefetch_whose_node_is_recomputed_meanwhile_gives_its_slots_back(tmp_path, monkeypatch):
    t = on_disk(tmp_path)
    reads = GatedReads(monkeypatch)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    waits = t.cache.prefetch(t.cache.match_prefix(a))
    assert reads.started.wait(10)
    t.recompute(a)  # another request computed the prefix itself (its insert adopts the node)
    reads.settle(t.cache)
    assert waits[0].settled
    t.cache.check_integrity()  # the slots went back: nothing leaked
    assert t.where(a) == (8, 0)


def test_a_prefetch_of_a_corrupt_file_forgets_it(tmp_path, caplog):
    t = on_disk(tmp_path)
    path = t.disk.path(t.disk.keys()[0])
    raw = bytearray(open(path, "rb").read())
    raw[100] ^= 1
    open(path, "wb").write(bytes(raw))
    waits = t.cache.prefetch(t.cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]))
    with caplog.at_level(logging.WARNING):
        t.cache.close()
    assert waits[0].settled and "unreadable" in caplog.text
    assert t.cache.tier_stats()["tier_disk_load_failures"] == 1 and 1 not in t.disk.keys()
    assert t.where([1, 2, 3, 4, 5, 6, 7, 8]) == (0, 0)
    t.cache.check_integrity()


def test_a_flush_during_a_prefetch_leaves_nothing_behind(tmp_path, monkeypatch):
    t = on_disk(tmp_path)
    reads = GatedReads(monkeypatch)
    t.cache.prefetch(t.cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]))
    assert reads.started.wait(10)
    assert t.cache.reset()
    reads.settle(t.cache)
    t.cache.check_integrity()
    assert t.host.available() == t.host.size and t.disk.keys() == []


def test_reset_empties_every_tier(tmp_path):
    t = Tiered(tmp_path, device=8, host=8)
    for k in range(1, 6):
        t.run([k] * 4)
    assert t.cache.tier_stats()["kv_host_cached_tokens"] > 0
    assert t.cache.reset()
    t.cache.check_integrity()
    assert t.host.available() == t.host.size and t.disk.keys() == [] and t.disk.used_bytes == 0
    assert t.pool.available() == t.pool.size


def test_without_a_host_tier_eviction_forgets_as_before(tmp_path):
    pool = KVPool(1, 1, 2, 8, dtype=torch.float32)
    cache = RadixCache(pool)
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.node)
    cache.cache_finished([1, 2, 3, 4], pool.alloc(4), m.node)
    assert cache.evict(4) == 4 and cache.match_prefix([1, 2, 3, 4]).lower_tokens == 0
    assert cache.tier_stats() == {}
    with pytest.raises(ValueError, match="needs a host tier"):
        RadixCache(pool, disk_tier=DiskTier(str(tmp_path), 1 << 20))


class Sim:
    """Requests driven against a tiered cache, several at a time, chunk by chunk; every hit's K/V
    is checked against what was written for those tokens."""

    def __init__(self, tmp_path, rng, page_size):
        self.rng, self.p = rng, page_size
        self.t = Tiered(tmp_path, device=48, host=24, disk_bytes=6 * 4 * 2 * 2 * 4 * 12, page_size=page_size)
        self.active = []

    def start(self):
        base = self.rng.choice([[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 7, 7, 7, 7], [9], []])
        tail = [self.rng.randint(0, 1) for _ in range(self.rng.randint(1, 12))]
        toks = base[: self.rng.randint(0, len(base))] + tail
        ns = self.rng.choice([None, None, "t"])
        c = self.t.cache
        m = c.match_prefix(toks[:-1], ns)
        if self.rng.random() < 0.8:
            m = c.load_back(m)
        self.t.assert_holds(ns, toks, m.slots)
        c.lock(m.node)
        self.active.append(dict(tokens=toks, ns=ns, slots=list(m.slots), tree_len=len(m.slots), node=m.node))

    def compute(self, req):
        left = len(req["tokens"]) - len(req["slots"])
        n = self.rng.randint(0, left)
        new = self.t.alloc(n, req["slots"][-1] if req["slots"] else None)
        if new is None:
            return
        self.t.write(req["ns"], req["tokens"], new, start=len(req["slots"]))
        req["slots"] += new
        if self.rng.random() < 0.5:
            k = len(req["slots"])
            r = self.t.cache.cache_unfinished(req["tokens"][:k], req["slots"], req["node"], req["ns"])
            req.update(slots=r.slots, node=r.node, tree_len=k - k % self.p)
            self.t.assert_holds(req["ns"], req["tokens"], r.slots)

    def finish(self, req):
        self.active.remove(req)
        k = len(req["slots"])
        self.t.cache.cache_finished(req["tokens"][:k], req["slots"], req["node"], req["ns"])

    def check(self):
        if self.rng.random() < 0.3:
            self.t.cache.poll_prefetches()
        self.t.cache.check_integrity()
        pages = {s // self.p for r in self.active for s in r["slots"][r["tree_len"] :]}
        c, pool = self.t.cache, self.t.pool
        assert pool.available() + c.evictable_size() + c.protected_size() + len(pages) * self.p == pool.size

    def step(self):
        op = self.rng.random()
        if op < 0.3 and len(self.active) < 4:
            self.start()
        elif op < 0.6 and self.active:
            self.compute(self.rng.choice(self.active))
        elif op < 0.85 and self.active:
            self.finish(self.rng.choice(self.active))
        elif op < 0.9:
            self.t.cache.evict(self.rng.randint(1, 12))
        elif op < 0.95:  # a request arriving: its disk part starts on its way to the host
            toks = [1, 2, 3, 4, 5, 6, 7, 8, 9][: self.rng.randint(1, 9)] + [self.rng.randint(0, 1)]
            self.t.cache.prefetch(self.t.cache.match_prefix(toks, self.rng.choice([None, "t"])))
        elif op > 0.995 and not self.active:
            assert self.t.cache.reset() is True
        self.check()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_tiers_keep_the_invariant_and_the_kv(tmp_path, seed, page_size):
    sim = Sim(tmp_path, random.Random(seed * 10 + page_size), page_size)
    for _ in range(1500):
        sim.step()
    while sim.active:
        sim.finish(sim.active[0])
    sim.t.cache.close()
    sim.check()
    stats = sim.t.cache.tier_stats()
    assert stats["tier_disk_prefetched_tokens"] > 0, stats
    assert stats["tier_host_loaded_tokens"] > 0 and stats["tier_disk_loaded_tokens"] > 0, stats
    assert kv_invariant_ok(sim.t.pool, sim.t.cache)
    assert sim.t.cache.reset()
    assert sim.t.host.available() == sim.t.host.size and sim.t.disk.keys() == []


def test_the_tier_flags_are_checked():
    from radixserve.workers.engine.config import EngineConfig

    EngineConfig(hicache_host_size=0.5, hicache_disk_dir="/tmp/kv", hicache_disk_size=1)
    for bad, match in (
        (dict(hicache_host_size=-1), ">= 0"),
        (dict(hicache_host_size=1, hicache_disk_dir="/tmp/kv"), "both"),
        (dict(hicache_host_size=1, hicache_disk_size=1), "both"),
        (dict(hicache_disk_dir="/tmp/kv", hicache_disk_size=1), "host tier"),
        (dict(hicache_host_size=1, disable_radix_cache=True), "radix cache"),
        (dict(hicache_host_size=1, tp_size=2), "tp_size 1"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)


GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def conversations(tokenizer, n=6):
    """n conversations, each opening with its own ~100-token document; turns in rounds."""
    docs = [
        f"Document {i}: " + " ".join(f"item {i}-{j} is worth {i * j + 3} coins;" for j in range(14))
        for i in range(n)
    ]
    return [tokenizer.encode(d) for d in docs]


def chat_rounds(engine, openings, turns=3):
    """Every conversation's first turn, then every second turn, ...: each prompt is the whole
    history (earlier prompts and answers) plus a question. Returns outputs and cached tokens."""
    question = engine.tokenizer.encode(" What next?")
    history = [list(o) for o in openings]
    outputs, cached = [], []
    for _ in range(turns):
        for h in history:
            out = engine.generate(input_ids=h + question, sampling_params=GREEDY)
            outputs.append(out["output_ids"])
            cached.append(out["meta_info"]["cached_tokens"])
            h.extend(question + out["output_ids"])
    return outputs, cached


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from radixserve.workers import Engine

    common = dict(dtype="float32", max_total_tokens=640, chunked_prefill_size=128)
    plain = Engine(**common)
    tiered = Engine(
        **common,
        hicache_host_size=0.01,  # ~230 tokens of this model's fp32 KV
        hicache_disk_dir=str(tmp_path_factory.mktemp("kv")),
        hicache_disk_size=0.25,
    )
    yield plain, tiered
    plain.shutdown()
    tiered.shutdown()


@pytest.fixture(scope="module")
def reference(engines):
    """The conversations, and the untiered engine's answers and cached tokens for them."""
    plain, _ = engines
    openings = conversations(plain.tokenizer)
    want, cached = chat_rounds(plain, openings)
    return openings, want, cached


def test_returning_turns_load_from_the_tiers_and_answer_as_recomputation_does(engines, reference):
    from tests.engine_utils import assert_kv_invariant

    plain, tiered = engines
    openings, want, cached_plain = reference
    got, cached_tiered = chat_rounds(tiered, openings)
    assert got == want  # greedy tokens, fp32: loaded K/V is the K/V that was computed
    n = len(openings)
    returning = slice(n, None)
    assert sum(cached_tiered[returning]) > 2 * sum(cached_plain[returning]) + 400, (
        cached_plain,
        cached_tiered,
    )
    s = tiered.stats()
    assert s["tier_device_to_host_tokens"] > 0 and s["tier_host_to_disk_tokens"] > 0, s
    # Turns in rounds: a conversation comes back after all the others went through the pool,
    # by then mostly on disk (the host tier here holds ~230 tokens).
    assert s["tier_host_loaded_tokens"] + s["tier_disk_loaded_tokens"] >= 1000, s
    # Disk reads ran on the loader thread, then loads from the host: none from disk at admission.
    assert s["tier_disk_prefetched_tokens"] > 0 and s["tier_disk_loaded_tokens"] == 0, s
    assert s["kv_disk_bytes_written"] > 0 and s["tier_disk_load_failures"] == 0
    assert_kv_invariant(tiered)
    assert_kv_invariant(plain)
    # What the router's correction reads: the device's paths, and those ending in a lower tier.
    from radixserve.workers.protocol import CacheSummary
    from radixserve.workers.replica import EngineReplica

    replica = object.__new__(EngineReplica.func_or_class)
    replica.engine, replica.replica_id, replica.config = tiered, "t", tiered.config
    try:
        summary = CacheSummary.from_dict(asyncio.run(replica.cache_summary(1 << 20)))
    finally:
        replica.engine = None
    assert summary.paths and summary.lower_paths
    assert sum(len(p) for _, p in summary.paths) <= 640  # the device pool's size
    st = summary.stats
    assert (st.kv_host_cached_tokens, st.kv_disk_cached_tokens) == (
        s["kv_host_cached_tokens"],
        s["kv_disk_cached_tokens"],
    )
    assert st.kv_host_cached_tokens + st.kv_disk_cached_tokens > 0


def test_corrupt_disk_files_are_recomputed_with_the_same_answers(engines, reference, caplog):
    from tests.engine_utils import assert_kv_invariant

    _, tiered = engines
    openings, want, _ = reference
    want = want[: 2 * len(openings)]  # the first two rounds
    tiered.flush_cache()
    # First turns fill the tiers; then every file on disk is damaged before the second round.
    question = tiered.tokenizer.encode(" What next?")
    firsts = [tiered.generate(input_ids=o + question, sampling_params=GREEDY)["output_ids"] for o in openings]
    disk = tiered.core.disk_tier
    assert disk.keys(), "the first round should have spilled to disk"
    for key in disk.keys():
        path = os.path.join(disk.directory, f"{key}.kv")
        raw = bytearray(open(path, "rb").read())
        raw[len(raw) // 2] ^= 0x5A
        open(path, "wb").write(bytes(raw))
    before = tiered.stats()["tier_disk_load_failures"]
    with caplog.at_level(logging.WARNING):
        seconds = [
            tiered.generate(input_ids=o + question + f + question, sampling_params=GREEDY)["output_ids"]
            for o, f in zip(openings, firsts)
        ]
    assert firsts + seconds == want
    assert tiered.stats()["tier_disk_load_failures"] > before and "unreadable" in caplog.text
    assert_kv_invariant(tiered)


def test_flush_and_shutdown_leave_no_file_behind(engines):
    _, tiered = engines
    disk = tiered.core.disk_tier
    assert tiered.flush_cache()
    assert disk.keys() == [] and os.listdir(disk.directory) == []
    s = tiered.stats()
    assert s["kv_host_cached_tokens"] == s["kv_disk_cached_tokens"] == 0


@pytest.fixture(scope="module", params=["host", "disk"])
def pd_engines(request, tmp_path_factory):
    """A unified engine with a pool that holds everything, and a PD pair whose pools hold one
    conversation, each with a host tier beneath (tiny model: well under 1 KB of KV per token);
    "disk": a host tier of ~150 tokens with a disk tier under it."""
    from radixserve.workers import Engine
    from tests.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tiers-pd"), "llama")
    args = dict(dtype="float32", chunked_prefill_size=64, kv_transfer="gloo")
    tiers: dict = dict(max_total_tokens=192, hicache_host_size=0.01)
    if request.param == "disk":
        token_bytes = 2 * 2 * 2 * 16 * 4  # layers, K and V, KV heads, head dim, fp32 (tiny_models)
        tiers["hicache_host_size"] = 150 * token_bytes / (1 << 30)
        tiers.update(hicache_disk_dir=str(tmp_path_factory.mktemp("pd-kv")), hicache_disk_size=0.01)
    unified = Engine(ckpt, max_total_tokens=4096, **args)
    prefill = Engine(ckpt, role="prefill", kv_transfer_timeout_s=10.0, **tiers, **args)
    decode = Engine(ckpt, role="decode", kv_transfer_timeout_s=8.0, **tiers, **args)
    yield request.param, (unified, prefill, decode)
    for e in (unified, prefill, decode):
        e.shutdown()


def test_pd_pools_load_an_earlier_turn_from_their_tiers_and_move_only_the_new_pages(pd_engines):
    from radixserve.workers.protocol import GenerateRequest, SamplingParams
    from tests.engine_utils import assert_kv_invariant
    from tests.test_pd_engine import pd_run, unified_run

    kind, (unified, prefill, decode) = pd_engines
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)

    def both(ids):
        pd = asyncio.run(pd_run(prefill, decode, GenerateRequest(list(ids), params)))[0]
        ref = asyncio.run(unified_run(unified, GenerateRequest(list(ids), params)))[0]
        assert pd["ids"] == ref["ids"]
        return pd

    first = list(range(200, 300))
    out = both(first)
    for k in range(3):  # other conversations push the first out of both pools
        both([1000 + 100 * k + i for i in range(100)])
    d, p = decode.stats(), prefill.stats()
    below = "kv_host_cached_tokens" if kind == "host" else "kv_disk_cached_tokens"
    assert d[below] >= 96 and p[below] >= 96, (d, p)
    saved_before = d["pd_bytes_saved_total"]
    second = first + out["ids"] + list(range(300, 310))
    out2 = both(second)
    assert out2["meta"]["cached"] >= 96  # the prefill side read the first turn back
    d, p = decode.stats(), prefill.stats()
    assert p["tier_host_loaded_tokens"] >= 96, p
    if kind == "host":
        assert d["tier_host_loaded_tokens"] >= 96, d
        assert d["pd_bytes_saved_total"] > saved_before  # the decode side held it: not sent again
    else:  # the prefill side read its disk on the loader thread; the decode side's reservation
        # does not wait for a disk read: the prefill replica sent those pages
        assert p["tier_disk_prefetched_tokens"] >= 96 and p["tier_disk_loaded_tokens"] == 0, p
        assert d["tier_disk_loaded_tokens"] == 0, d
    for e in (unified, prefill, decode):
        assert_kv_invariant(e)
