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
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import TYPE_CHECKING

from radixserve.workers.mem_cache.prefix_cache import MatchResult, PrefixCache

if TYPE_CHECKING:  # the cache is torch-free bookkeeping; the pool is only duck-typed
    from radixserve.workers.mem_cache.kv_pool import KVPool


EVICTION_POLICIES = ("lru", "lfu")


class _Node:
    __slots__ = ("key", "value", "parent", "children", "lock_ref", "stamp", "hits", "nid", "namespace")

    def __init__(self, key, value, parent, stamp, nid, namespace=None, hits=1):
        self.key: list[int] = key
        self.value: list[int] = value
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
    has its own root, so different namespaces never share nodes.
    """

    def __init__(self, pool: KVPool, page_size: int | None = None, eviction_policy: str = "lru"):
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {eviction_policy!r}")
        self.eviction_policy = eviction_policy
        pool_page = getattr(pool, "page_size", 1)
        self.page_size = pool_page if page_size is None else page_size
        if self.page_size != pool_page:
            raise ValueError(f"RadixCache page_size {self.page_size} != pool page_size {pool_page}")
        self.pool = pool
        self._ids = itertools.count()
        self._clock = 0
        self._reset_state()

    def _reset_state(self) -> None:
        self._roots: dict = {None: self._new_root(None)}
        self._evictable = 0
        self._protected = 0
        self._heap: list = []  # (priority, nid, node); stale entries are skipped when popped
        self._num_nodes = 0

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
                break
            child.touch(self._clock)
            node, pos = child, pos + n
        self._push_if_evictable(node)  # its stamp changed: a fresh heap entry replaces the old
        return node, pos

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after n tokens; the new upper node inherits its lock count."""
        top = _Node(
            child.key[:n], child.value[:n], child.parent, child.stamp, next(self._ids), hits=child.hits
        )
        top.lock_ref = child.lock_ref
        top.children[self._child_key(child.key, n)] = child
        assert child.parent is not None  # only edges below a node are split
        child.parent.children[self._child_key(child.key, 0)] = top
        child.key, child.value, child.parent = child.key[n:], child.value[n:], top
        self._num_nodes += 1
        return top

    def _path_slots(self, node: _Node) -> list[int]:
        parts = []
        while node.parent is not None:
            parts.append(node.value)
            node = node.parent
        return [s for part in reversed(parts) for s in part]

    def match_prefix(self, key: list[int], namespace: Hashable | None = None) -> MatchResult:
        """Longest cached prefix of `key`, rounded down to whole pages; updates LRU stamps.

        Callers pass key = tokens[:-1] so a fully cached prompt still computes its last token.
        Lock the returned node before anything can evict.
        """
        root = self._roots.get(namespace)
        if root is None:
            return MatchResult([], self._roots[None])
        node, _ = self._walk(root, _as_list(key))
        return MatchResult(self._path_slots(node), node)

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
                self._push_if_evictable(node)
            node = node.parent

    # ----- insert -----
    def _insert(self, key: list[int], slots: list[int], namespace) -> tuple[_Node, list[int]]:
        """Insert a page-aligned key; return the deepest node and the caller's duplicate slots."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self._new_root(namespace)
        node, pos = self._walk(root, key)
        tree_slots = self._path_slots(node) if pos else []
        dups = [c for t, c in zip(tree_slots, slots) if t != c]
        if pos < len(key):
            leaf = _Node(key[pos:], list(slots[pos:]), node, self._clock, next(self._ids))
            node.children[self._child_key(key, pos)] = leaf
            self._evictable += len(leaf.value)
            self._num_nodes += 1
            self._push_if_evictable(leaf)
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

    def _push_if_evictable(self, node: _Node) -> None:
        if node.parent is not None and not node.children and node.lock_ref == 0:
            heapq.heappush(self._heap, (self._priority(node), node.nid, node))
            if len(self._heap) > 2 * self._num_nodes + 64:
                self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop stale entries; amortized O(1) per push since it runs when they dominate."""
        self._heap = [(self._priority(n), n.nid, n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(self._heap)

    @staticmethod
    def _is_evictable_leaf(node: _Node) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _entry_valid(self, priority, node: _Node) -> bool:
        return self._is_evictable_leaf(node) and self._priority(node) == priority

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from unlocked leaves, in eviction order (see above).

        Returns how many slots were freed (fewer when not enough is evictable).
        """
        freed = 0
        while freed < num_tokens and self._heap:
            priority, _, node = heapq.heappop(self._heap)
            if not self._entry_valid(priority, node):
                continue
            self.pool.free(node.value)
            freed += len(node.value)
            self._evictable -= len(node.value)
            self._detach(node)
        return freed

    def _detach(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None  # only attached leaves are evicted
        del parent.children[self._child_key(node.key, 0)]
        node.parent = None
        self._num_nodes -= 1
        if parent.parent is not None:
            self._push_if_evictable(parent)
        elif not parent.children and parent.namespace is not None:
            del self._roots[parent.namespace]  # an empty namespace root is not worth keeping

    # ----- sizes and maintenance -----
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def _new_root(self, namespace) -> _Node:
        return _Node([], [], None, 0, next(self._ids), namespace)

    def _nodes(self):
        """Every non-root node (iterative DFS)."""
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_paths(self, max_tokens: int) -> list[tuple[Hashable | None, list[int]]]:
        """Token paths (root to leaf) of the cached leaves with their namespace, most recently
        used first, until their lengths add up to max_tokens."""
        leaves = sorted((n for n in self._nodes() if not n.children), key=lambda n: -n.stamp)
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
        """Drop the whole tree (flush_cache); refuses and returns False if anything is locked."""
        if self._protected:
            return False
        slots = [s for node in self._nodes() for s in node.value]
        self.pool.free(slots)
        self._reset_state()
        return True

    def check_integrity(self) -> None:
        """Raise AssertionError when sizes, locks, links, slots or the eviction heap disagree."""
        p, seen, sizes = self.page_size, set(), [0, 0]
        is_free = getattr(self.pool, "is_free", None)
        heap_ok = {id(n) for s, _, n in self._heap if self._entry_valid(s, n)}
        count = 0
        for node in self._nodes():
            count += 1
            assert node.key and len(node.key) == len(node.value) and len(node.key) % p == 0
            assert node.parent.children.get(self._child_key(node.key, 0)) is node
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0
            for i, s in enumerate(node.value):
                assert s >= p and s % p == i % p and s - i % p == node.value[i - i % p], s
                assert s not in seen, f"slot {s} held twice"
                assert is_free is None or not is_free(s), f"slot {s} is in tree and free"
                seen.add(s)
            sizes[node.lock_ref > 0] += len(node.value)
            if self._is_evictable_leaf(node):
                assert id(node) in heap_ok, "evictable leaf missing from the eviction heap"
        assert sizes == [self._evictable, self._protected], (sizes, self._evictable, self._protected)
        assert count == self._num_nodes, (count, self._num_nodes)
        assert self._roots[None].namespace is None
