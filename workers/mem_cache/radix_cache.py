"""RadixAttention's prefix tree: token ids -> KV slot indices, with lock counts and LRU eviction.

The cache speaks token ids and slot indices only, never requests. Contract for callers:

* `match_prefix(tokens[:-1])`: pass the prompt minus its last token, so a fully cached prompt
  still computes its last token (its logits are needed to sample); hits stop at len - 1.
* The returned `node` handle and its slots are only valid while locked: `lock(node)` at once,
  and hand the node back through `cache_finished` / `cache_unfinished` (which unlock it).
* Slots handed to `cache_finished` change owner: the tree keeps what it inserts and frees the rest.

Idle invariant (see `kv_invariant_ok`): pool.available() + evictable + protected == pool.size,
and every lock count is 0.

LRU uses a monotonic counter bumped once per match/insert; every node on the touched path gets
that stamp. Eviction pops the leaf with the smallest (stamp, node id): least recently used first,
ties broken by creation order (older node first). With eviction_policy="lfu" (SGLang's
--radix-eviction-policy lfu) every touch also counts a hit, and the smallest (hits, stamp, node id)
goes first: a leaf only one request ever used (a unique question, a generated answer) is evicted
before a prefix many requests share, however recently it was used.

Tiers (HiCache's layout): with a host tier (host_tier.py) and optionally a disk tier beneath it
(disk_tier.py), an evicted node keeps its place and tokens in the tree and its KV moves down:
device eviction writes the node's K/V back to host slots (write-back on eviction: a prefix that is
never evicted costs no copy), host eviction spills it to a file, disk eviction forgets it. Each
node's KV lives in exactly one place: device slots (`value`), host slots (`host`) or a disk file
(`disk`). The tiers are nested from the root: a device node's parent is on the device, a host
node's parent on the device or host, so each tier evicts its own leaves (nodes with no child in
its tier or above) in the eviction order above, with a heap of its own. `match_prefix` reports the
device part as the match and the lower part beside it (`lower_tokens`); `load_back` copies that
part into fresh device slots when a request is admitted, so a returning conversation reads its
earlier turns back instead of recomputing them. A split disk node's two parts share its file (each
reads its own range; the file goes when neither needs it). Without a host tier nothing changes:
an evicted node is detached as before.

Disk reads stay off the engine thread where the scheduler can wait: `prefetch` (when a request
arrives) allocates host slots for the disk part of its match and has a loader thread read the
files into them; `poll_prefetches` (each step) moves each node whose read is done to the host
tier, top node first, and the request is admitted after that, loading from host memory (a copy).
While a read runs its node stays a disk node; whatever happens to the node meanwhile (recomputed,
forgotten, split, flushed) only sends the prefetch's host slots back when it settles.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.workers.mem_cache.prefix_cache import MatchResult, PrefixCache

if TYPE_CHECKING:  # the cache is torch-free bookkeeping; the pool and tiers are only duck-typed
    from radixserve.workers.mem_cache.kv_pool import KVPool


EVICTION_POLICIES = ("lru", "lfu")
TIERS = ("device", "host", "disk")


class _Node:
    __slots__ = (
        "key",
        "value",
        "host",
        "disk",
        "disk_off",
        "parent",
        "children",
        "lock_ref",
        "stamp",
        "hits",
        "nid",
        "namespace",
    )

    def __init__(self, key, value, parent, stamp, nid, namespace=None, hits=1):
        self.key: list[int] = key
        self.value: list[int] = value  # device slots; [] while the KV lives in a lower tier
        self.host: list[int] | None = None  # host-tier slots, when the KV lives there
        self.disk: int | None = None  # disk-tier file key, when the KV lives there ...
        self.disk_off = 0  # ... from this token of the file on (split nodes share files)
        self.parent: _Node | None = parent
        self.children: dict = {}
        self.lock_ref = 0
        self.stamp = stamp
        self.hits = hits  # matches and inserts that went through this node
        self.nid = nid
        self.namespace = namespace  # only meaningful on roots

    def touch(self, clock: int) -> None:
        self.stamp = clock
        self.hits += 1

    @property
    def tier(self) -> str:
        if self.value or not self.key:  # a root holds no KV and counts as the device's
            return "device"
        return "host" if self.host is not None else "disk"


@dataclass
class Prefetch:
    """A disk node's KV on its way into host slots on the loader thread."""

    node: _Node
    key: int  # the node's disk file ...
    offset: int  # ... and its first token there
    slots: list[int]  # host slots the loader thread writes (this prefetch's alone until settled)
    future: Future
    settled: bool = False  # polled: the node is on the host now, or the slots went back


def _as_list(xs) -> list[int]:
    return xs.tolist() if hasattr(xs, "tolist") else list(xs)


def _common_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, compared in C-level slices rather than token by token."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, step = 0, 64
    while a[lo : lo + step] == b[lo : lo + step]:
        lo += step
    while a[lo] == b[lo]:
        lo += 1
    return lo


class RadixCache(PrefixCache):
    """Radix tree over token ids; each edge holds the KV slots of its tokens.

    With page_size > 1 children are keyed by their first page (a tuple of page_size tokens),
    edges are whole pages, and matches are whole pages. Each namespace (tenant salt, LoRA id)
    has its own root, so different namespaces never share nodes. `host_tier` / `disk_tier` add
    the lower tiers described in the module docstring (None: the device pool alone).
    """

    def __init__(
        self,
        pool: KVPool,
        page_size: int | None = None,
        eviction_policy: str = "lru",
        host_tier: Any = None,
        disk_tier: Any = None,
    ):
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {eviction_policy!r}")
        if disk_tier is not None and not getattr(host_tier, "size", 0):
            raise ValueError("a disk tier spills from the host tier: it needs a host tier")
        self.eviction_policy = eviction_policy
        pool_page = getattr(pool, "page_size", 1)
        self.page_size = pool_page if page_size is None else page_size
        if self.page_size != pool_page:
            raise ValueError(f"RadixCache page_size {self.page_size} != pool page_size {pool_page}")
        self.pool = pool
        self.host_tier: Any = host_tier if getattr(host_tier, "size", 0) else None
        self.disk_tier: Any = disk_tier
        self.prefetches = disk_tier is not None  # disk reads run on a loader thread
        self._ids = itertools.count()
        self._clock = 0
        # Tokens moved between tiers, loads and their time, and what fell out of every tier.
        self._moves: dict[str, float] = dict.fromkeys(
            (
                "tier_device_to_host_tokens",
                "tier_host_to_disk_tokens",
                "tier_device_to_disk_tokens",
                "tier_dropped_tokens",
                "tier_host_loaded_tokens",
                "tier_disk_loaded_tokens",
                "tier_host_load_seconds",
                "tier_disk_load_seconds",
                "tier_disk_load_failures",
                "tier_host_write_seconds",
                "tier_disk_write_seconds",
                "tier_disk_prefetched_tokens",
            ),
            0,
        )
        self._prefetches: list[Prefetch] = []  # unsettled, in the order they started
        self._loading: dict[int, Prefetch] = {}  # id(node) -> its unsettled prefetch
        self._loader: ThreadPoolExecutor | None = None
        self._reset_state()

    def _reset_state(self) -> None:
        self._roots: dict = {None: self._new_root(None)}
        self._evictable = 0
        self._protected = 0
        # Per tier: (priority, nid, node); stale entries are skipped when popped.
        self._heaps: dict[str, list] = {t: [] for t in TIERS}
        self._num_nodes = 0
        self._held = {"host": 0, "disk": 0}  # tokens whose KV lives in each lower tier
        self._file_refs: dict[int, int] = {}  # disk file -> the nodes that read a range of it

    # ----- lookup -----
    def _child_key(self, key: list[int], pos: int):
        p = self.page_size
        return key[pos] if p == 1 else tuple(key[pos : pos + p])

    def _walk(self, root: _Node, key: list[int]) -> tuple[_Node, int]:
        """Descend along `key` from `root`, splitting where the match ends mid-edge; touch the path.

        Returns the deepest node whose whole path is a prefix of key, and that prefix's length.
        """
        self._clock += 1
        node, pos, p = root, 0, self.page_size
        while len(key) - pos >= p:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = _common_len(child.key, key[pos : pos + len(child.key)])
            n -= n % p
            if n < len(child.key):
                # Only the upper part was used; the lower part keeps its stamp (and heap entry).
                node, pos = self._split(child, n), pos + n
                node.touch(self._clock)
                self._push(node)
                break
            child.touch(self._clock)
            self._push(child)  # its stamp changed: a fresh heap entry replaces the old
            node, pos = child, pos + n
        return node, pos

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after n tokens; the new upper node inherits its lock count and tier."""
        top = _Node(
            child.key[:n], child.value[:n], child.parent, child.stamp, next(self._ids), hits=child.hits
        )
        top.lock_ref = child.lock_ref
        if child.host is not None:
            top.host, child.host = child.host[:n], child.host[n:]
        if child.disk is not None:  # both parts read their range of the one file
            top.disk, top.disk_off = child.disk, child.disk_off
            child.disk_off += n
            self._file_refs[child.disk] += 1
        top.children[self._child_key(child.key, n)] = child
        assert child.parent is not None  # only edges below a node are split
        child.parent.children[self._child_key(child.key, 0)] = top
        child.key, child.value, child.parent = child.key[n:], child.value[n:], top
        self._num_nodes += 1
        return top

    @staticmethod
    def _path(node: _Node) -> list[_Node]:
        """The nodes from below the root down to `node`."""
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def _path_slots(self, node: _Node) -> list[int]:
        return [s for n in self._path(node) for s in n.value]

    @staticmethod
    def _device_ancestor(node: _Node) -> _Node:
        """The deepest node on node's path whose KV is on the device (a root counts)."""
        while node.tier != "device":
            assert node.parent is not None
            node = node.parent
        return node

    def _match(self, node: _Node, pos: int) -> MatchResult:
        dev = self._device_ancestor(node)
        slots = self._path_slots(dev)
        lower = pos - len(slots)
        return MatchResult(slots, dev, lower, node if lower else None)

    def match_prefix(self, key: list[int], namespace: Hashable | None = None) -> MatchResult:
        """Longest cached prefix of `key`, rounded down to whole pages; updates LRU stamps.

        Callers pass key = tokens[:-1] so a fully cached prompt still computes its last token.
        Lock the returned node before anything can evict. The match is the device part; what
        lies below it in the host or disk tier is `lower_tokens` (see `load_back`).
        """
        root = self._roots.get(namespace)
        if root is None:
            return MatchResult([], self._roots[None])
        node, pos = self._walk(root, _as_list(key))
        return self._match(node, pos)

    def load_back(self, match: MatchResult, from_disk: bool = True) -> MatchResult:
        """Copy the lower-tier part of `match` into fresh device slots, top node first, as far as
        the device pool has room (evicting other prefixes for it); the match that results.

        A disk file that fails its check is forgotten with its subtree, and the match ends above
        it: those tokens are recomputed. Synchronous: a host load is a copy, a disk load a file
        read on the calling thread; `from_disk=False` stops at the first disk node instead (the
        engine's choice: its thread never reads the disk, `prefetch` does)."""
        if not match.lower_tokens:
            return match
        target = match.lower_node
        assert isinstance(target, _Node)
        self.lock(target)  # pins the path: no tier evicts it while slots are found for it
        failed = None
        loaded = 0
        for node in self._path(target):
            if node.tier == "device":
                continue
            if node.tier == "disk" and not from_disk:
                break
            slots = self._alloc_device(len(node.key))
            if slots is None:
                break
            start, tier = time.perf_counter(), node.tier
            if tier == "host":
                self.host_tier.load(node.host, slots)
                self._forget_copy(node)
            elif self.disk_tier.fetch(node.disk, self.pool, slots, node.disk_off):
                self._forget_copy(node)
            else:
                self.pool.free(slots)
                self._moves["tier_disk_load_failures"] += 1
                failed = node
                break
            self._moves[f"tier_{tier}_load_seconds"] += time.perf_counter() - start
            self._moves[f"tier_{tier}_loaded_tokens"] += len(slots)
            node.value = slots
            self._protected += len(slots)  # locked (by the pin) and now on the device
            loaded += len(slots)
        self.unlock(target)
        anchor = target if failed is None else failed.parent
        assert anchor is not None
        deepest = self._device_ancestor(anchor)
        if failed is not None:
            self._drop_subtree(failed)
        out = self._match(deepest, len(match.slots) + loaded)
        if failed is None and out.node is not target:  # stopped for room: the rest stays below
            out.lower_tokens, out.lower_node = match.lower_tokens - loaded, target
        return out

    def prefetch(self, match: MatchResult) -> list[Prefetch]:
        """Start reading the disk part of `match` into host slots on the loader thread, top node
        first, as far as the host tier has room; the prefetches the match now waits for (those
        already running for its nodes included)."""
        if self.disk_tier is None or not match.lower_tokens:
            return []
        target = match.lower_node
        assert isinstance(target, _Node)
        path = [n for n in self._path(target) if n.tier == "disk"]
        waits = [self._loading[id(n)] for n in path if id(n) in self._loading]
        self.lock(target)  # pins the path while host room is found for it
        try:
            for node in path:
                if id(node) in self._loading:
                    continue
                slots = self._alloc_host(len(node.key))
                if slots is None:
                    break
                assert node.disk is not None
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-loader")
                future = self._loader.submit(
                    self.disk_tier.read,
                    self.disk_tier.path(node.disk),
                    self.host_tier.pool,
                    slots,
                    node.disk_off,
                )
                pending = Prefetch(node, node.disk, node.disk_off, slots, future)
                self._prefetches.append(pending)
                self._loading[id(node)] = pending
                waits.append(pending)
        finally:
            self.unlock(target)
        return waits

    def _alloc_host(self, n: int) -> list[int] | None:
        host = self.host_tier
        if n > host.size:
            return None
        if host.available() < n:
            self._evict_host(n - host.available())
        return host.pool.alloc(n)

    def poll_prefetches(self) -> int:
        """Settle the prefetches whose reads are done (engine thread): each node still on disk
        with the same file, under a parent on the device or host, moves to the host tier; a
        failed read forgets the node and its subtree (recomputed); any other outcome sends the
        slots back. A node whose parent's read is still running waits for it. Returns how many
        are still running."""
        still: list[Prefetch] = []
        for p in self._prefetches:
            node, parent = p.node, p.node.parent
            current = (
                parent is not None
                and node.disk == p.key
                and node.disk_off == p.offset
                and len(node.key) == len(p.slots)  # not split meanwhile
            )
            if not p.future.done() or (
                parent is not None and current and parent.tier == "disk" and id(parent) in self._loading
            ):
                still.append(p)
                continue
            p.settled = True
            del self._loading[id(node)]
            error = p.future.exception()
            if parent is None or not current or parent.tier == "disk":
                self.host_tier.free(p.slots)  # recomputed, loaded, forgotten or moved meanwhile
            elif error is not None:
                self.host_tier.free(p.slots)
                self._moves["tier_disk_load_failures"] += 1
                self.disk_tier.read_failed(p.key, error)
                self._drop_subtree(node)
            else:
                self.disk_tier.read_done(p.key)
                self._forget_copy(node)
                node.host = p.slots
                self._held["host"] += len(p.slots)
                self._moves["tier_disk_prefetched_tokens"] += len(p.slots)
                self._push(node)
                self._push(parent)
        self._prefetches = still
        return len(still)

    def close(self) -> None:
        """Wait for the loader thread's reads and stop it."""
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        self.poll_prefetches()

    def _alloc_device(self, n: int) -> list[int] | None:
        slots = self.pool.alloc(n)
        if slots is None:
            self.evict(n - self.pool.available() + self.page_size)
            slots = self.pool.alloc(n)
        return slots

    # ----- locks -----
    def lock(self, node) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.value)
                self._protected += len(node.value)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise AssertionError("unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.value)
                self._evictable += len(node.value)
                self._push(node)
            node = node.parent

    # ----- insert -----
    def _insert(self, key: list[int], slots: list[int], namespace) -> tuple[_Node, list[int]]:
        """Insert a page-aligned key; return the deepest node and the caller's duplicate slots.

        Nodes on the path whose KV lies in a lower tier take the caller's slots instead (the
        caller computed those tokens again): their lower-tier copy is given up."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self._new_root(namespace)
        node, pos = self._walk(root, key)
        dups: list[int] = []
        off = 0
        for n in self._path(node) if pos else []:
            mine = slots[off : off + len(n.key)]
            if n.value:
                dups.extend(c for t, c in zip(n.value, mine) if t != c)
            else:
                self._forget_copy(n)
                n.value = list(mine)
                if n.lock_ref:
                    self._protected += len(mine)
                else:
                    self._evictable += len(mine)
                self._push(n)
            off += len(n.key)
        if pos < len(key):
            leaf = _Node(key[pos:], list(slots[pos:]), node, self._clock, next(self._ids))
            node.children[self._child_key(key, pos)] = leaf
            self._evictable += len(leaf.value)
            self._num_nodes += 1
            self._push(leaf)
            node = leaf
        return node, dups

    def _aligned(self, key, slots) -> int:
        if len(slots) != len(key):
            raise ValueError(f"len(slots)={len(slots)} != len(key)={len(key)}")
        return len(key) - len(key) % self.page_size

    def cache_finished(self, key, slots, node, namespace=None) -> None:
        """Take over all of a finished request's slots (len(slots) == len(key)) and unlock `node`.

        The page-aligned part is inserted; slots duplicating tokens the tree already holds under
        other slot ids, and the unaligned tail, are freed to the pool.
        """
        key, slots = _as_list(key), _as_list(slots)
        n = self._aligned(key, slots)
        _, dups = self._insert(key[:n], slots[:n], namespace)
        self.pool.free(dups + slots[n:])
        self.unlock(node)

    def cache_unfinished(self, key, slots, node, namespace=None) -> MatchResult:
        """Insert what a running request computed so far; move its lock to the new deepest node.

        Returns slots covering the whole key: the tree's slots for the page-aligned part plus
        the caller's unaligned tail (still owned by the caller), and the node now locked.
        """
        key, slots = _as_list(key), _as_list(slots)
        n = self._aligned(key, slots)
        new_node, dups = self._insert(key[:n], slots[:n], namespace)
        self.pool.free(dups)
        self.lock(new_node)
        self.unlock(node)
        return MatchResult(self._path_slots(new_node) + slots[n:], new_node)

    # ----- eviction -----
    def _priority(self, node: _Node) -> tuple[int, ...]:
        """Eviction order key: smallest first. Changes whenever the node is touched."""
        return (node.hits, node.stamp) if self.eviction_policy == "lfu" else (node.stamp,)

    def _evictable_in(self, node: _Node, tier: str) -> bool:
        """Whether `node` is a leaf that `tier` may evict: unlocked, its KV in that tier, and no
        child holding KV in that tier or above."""
        if node.parent is None or node.lock_ref or node.tier != tier:
            return False
        if tier == "disk" or self.host_tier is None:
            return not node.children
        above = ("device",) if tier == "device" else ("device", "host")
        return not any(c.tier in above for c in node.children.values())

    def _push(self, node: _Node | None) -> None:
        """Give `node` a fresh entry in the heap of its tier if it is a leaf there."""
        if node is None:
            return
        tier = node.tier
        if not self._evictable_in(node, tier):
            return
        heap = self._heaps[tier]
        heapq.heappush(heap, (self._priority(node), node.nid, node))
        if len(heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap(tier)

    def _rebuild_heap(self, tier: str) -> None:
        """Drop stale entries; amortized O(1) per push since it runs when they dominate."""
        heap = [(self._priority(n), n.nid, n) for n in self._nodes() if self._evictable_in(n, tier)]
        heapq.heapify(heap)
        self._heaps[tier] = heap

    def _entry_valid(self, tier: str, priority, node: _Node) -> bool:
        return self._evictable_in(node, tier) and self._priority(node) == priority

    def _pop(self, tier: str) -> _Node | None:
        """The tier's next leaf in eviction order, or None when it has none."""
        heap = self._heaps[tier]
        while heap:
            priority, _, node = heapq.heappop(heap)
            if self._entry_valid(tier, priority, node):
                return node
        return None

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens device slots from unlocked leaves, in eviction order (see
        above); with a host tier their KV moves there instead of being forgotten.

        Returns how many slots were freed (fewer when not enough is evictable).
        """
        freed = 0
        while freed < num_tokens:
            node = self._pop("device")
            if node is None:
                break
            host = self._write_back(node.value)  # may evict host leaves, never this node
            key = None
            if host is None and not any(c.tier == "host" for c in node.children.values()):
                # The host tier has no room (its slots held by reads in flight, or the node is
                # larger than it): straight to disk, where the tiers still nest.
                key = self._spill(node.value, self.pool)
            slots, node.value = node.value, []
            self._evictable -= len(slots)
            if key is not None:
                node.disk, node.disk_off = key, 0
                self._file_refs[key] = 1
                self._held["disk"] += len(slots)
                self._moves["tier_device_to_disk_tokens"] += len(slots)
                self._push(node)
                self._push(node.parent)
            elif host is None:
                self._drop_subtree(node, pending=len(slots))
            else:
                node.host = host
                self._held["host"] += len(slots)
                self._moves["tier_device_to_host_tokens"] += len(slots)
                self._push(node)
                self._push(node.parent)  # may now be a device leaf
            self.pool.free(slots)
            freed += len(slots)
        return freed

    def _write_back(self, slots: list[int]) -> list[int] | None:
        """Host slots now holding the K/V of device `slots`, or None (no host tier, or no room
        even after the host tier evicted every leaf it could)."""
        host = self.host_tier
        if host is None:
            return None
        if host.available() < len(slots):
            self._evict_host(len(slots) - host.available())
        start = time.perf_counter()
        out = host.write_back(slots)
        self._moves["tier_host_write_seconds"] += time.perf_counter() - start
        return out

    def _evict_host(self, num_tokens: int) -> None:
        """Free host slots from the host tier's leaves: spilled to disk, or forgotten."""
        freed = 0
        while freed < num_tokens:
            node = self._pop("host")
            if node is None:
                break
            assert node.host is not None
            key = self._spill(node.host)  # may evict disk leaves, never this node
            n = self._forget_copy(node)
            if key is None:
                self._drop_subtree(node, pending=n)
            else:
                node.disk, node.disk_off = key, 0
                self._file_refs[key] = 1
                self._held["disk"] += n
                self._moves["tier_host_to_disk_tokens"] += n
                self._push(node)
                self._push(node.parent)
            freed += n

    def _spill(self, slots: list[int], pool: Any = None) -> int | None:
        """A new disk file with the K/V of `slots` of `pool` (the host tier's by default), making
        room by forgetting the disk's leaves; None when there is no disk tier or no room."""
        disk = self.disk_tier
        if disk is None:
            return None
        pool = self.host_tier.pool if pool is None else pool
        need = disk.file_bytes(pool, len(slots))
        while disk.used_bytes + need > disk.max_bytes:
            node = self._pop("disk")
            if node is None:
                return None
            self._drop_subtree(node)
        start = time.perf_counter()
        key = disk.spill(pool, slots)
        self._moves["tier_disk_write_seconds"] += time.perf_counter() - start
        return key

    def _forget_copy(self, node: _Node) -> int:
        """Give up a node's lower-tier copy (host slots or disk file); its token count."""
        if node.host is not None:
            self.host_tier.free(node.host)
            node.host = None
            self._held["host"] -= len(node.key)
        elif node.disk is not None:
            self._file_refs[node.disk] -= 1
            if not self._file_refs[node.disk]:
                del self._file_refs[node.disk]
                self.disk_tier.drop(node.disk)
            node.disk = None
            self._held["disk"] -= len(node.key)
        else:
            return 0
        return len(node.key)

    def _drop_subtree(self, node: _Node, pending: int = 0) -> None:
        """Detach an unlocked node with no device KV below it, forgetting every lower-tier copy in
        its subtree. `pending`: device tokens of `node` being evicted (counted as dropped)."""
        dropped, stack = pending, [node]
        while stack:
            n = stack.pop()
            assert not n.value and not n.lock_ref, "only unlocked KV off the device is dropped"
            dropped += self._forget_copy(n)
            stack.extend(n.children.values())
            if n is not node:
                n.parent = None  # its heap entries go stale with it
                self._num_nodes -= 1
        self._moves["tier_dropped_tokens"] += dropped
        self._detach(node)

    def _detach(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None  # only attached nodes are detached
        del parent.children[self._child_key(node.key, 0)]
        node.parent = None
        self._num_nodes -= 1
        if parent.parent is not None:
            self._push(parent)
        elif not parent.children and parent.namespace is not None:
            del self._roots[parent.namespace]  # an empty namespace root is not worth keeping

    # ----- sizes and maintenance -----
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def tier_stats(self) -> dict[str, int | float]:
        if self.host_tier is None:
            return {}
        held = self._held  # counters, not a walk: other threads read stats while the tree changes
        out: dict[str, int | float] = {k: round(v, 6) for k, v in self._moves.items()}
        out.update(
            kv_host_total=self.host_tier.size,
            kv_host_cached_tokens=held["host"],
            kv_host_bytes_written=self.host_tier.bytes_written,
            kv_host_bytes_loaded=self.host_tier.bytes_loaded,
        )
        disk = self.disk_tier
        if disk is not None:
            out.update(
                kv_disk_cached_tokens=held["disk"],
                kv_disk_used_bytes=disk.used_bytes,
                kv_disk_max_bytes=disk.max_bytes,
                kv_disk_bytes_written=disk.bytes_written,
                kv_disk_bytes_read=disk.bytes_read,
            )
        return out

    def _new_root(self, namespace) -> _Node:
        return _Node([], [], None, 0, next(self._ids), namespace)

    def _nodes(self):
        """Every non-root node (iterative DFS)."""
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_paths(self, max_tokens: int, lower: bool = False) -> list[tuple[Hashable | None, list[int]]]:
        """Token paths (root to leaf) with their namespace, most recently used first, until their
        lengths add up to max_tokens: of the device's leaves, or with `lower` of the leaves whose
        KV lies in the host or disk tier (the whole path, its device part included)."""
        if lower:
            leaves = [n for n in self._nodes() if not n.children and n.tier != "device"]
        else:
            leaves = [
                n
                for n in self._nodes()
                if n.tier == "device" and not any(c.tier == "device" for c in n.children.values())
            ]
        leaves.sort(key=lambda n: -n.stamp)
        out, total = [], 0
        for leaf in leaves:
            parts, node = [], leaf
            while node.parent is not None:
                parts.append(node.key)
                node = node.parent
            path = [t for part in reversed(parts) for t in part]
            if total + len(path) > max_tokens:
                break
            out.append((node.namespace, path))
            total += len(path)
        return out

    def reset(self) -> bool:
        """Drop the whole tree (flush_cache), every tier's copies with it; refuses and returns
        False if anything is locked."""
        if self._protected:
            return False
        nodes = list(self._nodes())
        self.pool.free([s for node in nodes for s in node.value])
        for node in nodes:
            self._forget_copy(node)
        self._reset_state()
        return True

    def check_integrity(self) -> None:
        """Raise AssertionError when sizes, locks, links, slots, tiers or the eviction heaps
        disagree. The tier invariant: every node's KV is in exactly one tier, the tiers nest from
        the root, every host slot is one node's, free or an in-flight read's, and every disk file is
        read by the nodes that count it."""
        p, seen, sizes = self.page_size, set(), [0, 0]
        is_free = getattr(self.pool, "is_free", None)
        heap_ok = {
            (t, id(n)) for t, heap in self._heaps.items() for s, _, n in heap if self._entry_valid(t, s, n)
        }
        host_seen: set[int] = set()
        disk_seen: dict[int, int] = {}  # file -> nodes reading a range of it
        order = {t: i for i, t in enumerate(TIERS)}
        held = {"host": 0, "disk": 0}
        count = 0
        for node in self._nodes():
            count += 1
            tier = node.tier
            assert node.key and len(node.key) % p == 0
            assert node.parent.children.get(self._child_key(node.key, 0)) is node
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0
            places = bool(node.value) + (node.host is not None) + (node.disk is not None)
            assert places == 1, f"node {node.nid} holds its KV in {places} places"
            assert order[node.parent.tier] <= order[tier], "tiers must nest from the root"
            assert tier == "device" or not node.lock_ref, "only device KV is locked"
            if tier == "device":
                assert len(node.key) == len(node.value)
                for i, s in enumerate(node.value):
                    assert s >= p and s % p == i % p and s - i % p == node.value[i - i % p], s
                    assert s not in seen, f"slot {s} held twice"
                    assert is_free is None or not is_free(s), f"slot {s} is in tree and free"
                    seen.add(s)
                sizes[node.lock_ref > 0] += len(node.value)
            elif tier == "host":
                held["host"] += len(node.key)
                assert len(node.host) == len(node.key)
                assert not host_seen.intersection(node.host), "host slot held twice"
                assert not any(self.host_tier.pool.is_free(s) for s in node.host)
                host_seen.update(node.host)
            else:
                held["disk"] += len(node.key)
                disk_seen[node.disk] = disk_seen.get(node.disk, 0) + 1
            if self._evictable_in(node, tier):
                assert (tier, id(node)) in heap_ok, f"evictable {tier} leaf missing from its heap"
        assert sizes == [self._evictable, self._protected], (sizes, self._evictable, self._protected)
        assert count == self._num_nodes, (count, self._num_nodes)
        assert held == self._held, (held, self._held)
        assert self._roots[None].namespace is None
        if self.host_tier is not None:
            in_flight = sum(len(p.slots) for p in self._prefetches)
            assert self.host_tier.available() + len(host_seen) + in_flight == self.host_tier.size, (
                "host slot leaked"
            )
        if self.disk_tier is not None:
            assert disk_seen == self._file_refs, (disk_seen, self._file_refs)
            # A file that failed a read is forgotten at once; the other nodes sharing it fail
            # their own reads later. No file is kept that no node reads.
            assert set(self.disk_tier.keys()) <= set(disk_seen), "disk file leaked"
