"""An approximate radix tree over token ids: which replica holds which prefix.

The router cannot see the replicas' KV caches, so it keeps a model of them: one tree shared by all
replicas, each node an edge of token ids claimed by the replicas believed to cache that prefix.

Contract:
- Namespaces (tenants) have separate roots, as in the replicas' radix caches: a sequence is
  matched, recorded and evicted within one namespace (None: the shared one), and a prefix of one
  namespace never matches a query of another.
- Claims are prefix-closed: a replica that claims a node claims every ancestor. `match` therefore
  reports, per replica, the length of the longest claimed prefix of the query.
- Recency is a logical clock (one tick per insert), not wall time, so eviction orders are exact
  and testable. Touching a path stamps every node on it, so a parent is never older than its
  children for the same replica; eviction removes a replica's least-recently-touched *leaf claim*
  (a node it claims with no child it claims), never a middle of its path.
- Budgets: `max_tokens` bounds the tokens stored in the tree (shared edges count once);
  a per-replica budget (default `max_tokens_per_replica`, or `set_replica_budget`) bounds the
  tokens one replica claims, in all namespaces together (they share the replica's KV pool). An
  insert longer than a budget is recorded only up to the budget. Over a budget, LRU leaf claims
  are dropped until it fits; a node left with no claim is deleted, and so is an empty root.
- Not thread-safe: the owner (RoutingPolicy) serializes calls with its lock. `match` is
  read-only; everything else mutates.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence

DEFAULT_MAX_TOKENS = 1 << 22  # token ids the tree stores, all replicas and namespaces together
_BLOCK = 64  # tokens compared per slice while hunting for the first mismatch

Namespace = str | None


class _Node:
    __slots__ = ("key", "parent", "children", "replicas", "child_claims", "alive", "namespace")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, namespace: Namespace = None):
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.replicas: dict[str, int] = {}  # replica -> logical time of its last touch here
        self.child_claims: dict[str, int] = {}  # replica -> how many children it claims
        self.alive = True
        self.namespace = namespace  # only meaningful on roots


def common_prefix_len(key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `key` and `tokens[start:]`, compared in C-speed slices."""
    n = min(len(key), len(tokens) - start)
    if key[:n] == tokens[start : start + n]:
        return n
    lo = 0
    hi = n
    while lo < n:  # find the first block that differs, then the token inside it
        hi = min(lo + _BLOCK, n)
        if key[lo:hi] != tokens[start + lo : start + hi]:
            break
        lo = hi
    for i in range(lo, hi):
        if key[i] != tokens[start + i]:
            return i
    return hi


class PrefixTree:
    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, max_tokens_per_replica: int | None = None):
        if max_tokens <= 0:
            raise ValueError("max_tokens must be positive")
        self.max_tokens = max_tokens
        self.max_tokens_per_replica = max_tokens_per_replica
        self._roots: dict[Namespace, _Node] = {}  # created on first insert, deleted when empty
        self._clock = 0
        self._seq = itertools.count()  # heap tie-break; nodes are not comparable
        self._total_tokens = 0
        self._num_nodes = 0
        self._claims: dict[str, set[_Node]] = {}
        self._replica_tokens: dict[str, int] = {}
        self._heaps: dict[str, list[tuple[int, int, _Node]]] = {}  # lazy LRU of leaf claims
        self._budgets: dict[str, int] = {}

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def total_tokens(self) -> int:
        return self._total_tokens

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def clock(self) -> int:
        """Logical time of the latest insert; pass it to `sync_replica(keep_newer_than=...)`."""
        return self._clock

    def replica_tokens(self, replica_id: str) -> int:
        return self._replica_tokens.get(replica_id, 0)

    def replicas(self) -> list[str]:
        return sorted(r for r, n in self._replica_tokens.items() if n > 0)

    @property
    def num_namespaces(self) -> int:
        return len(self._roots)

    def replica_budget(self, replica_id: str) -> int:
        budget = self._budgets.get(replica_id, self.max_tokens_per_replica)
        return self.max_tokens if budget is None else min(budget, self.max_tokens)

    def set_replica_budget(self, replica_id: str, tokens: int | None) -> None:
        """Bound one replica's claims (e.g. by its KV pool size); None restores the default."""
        if tokens is None:
            self._budgets.pop(replica_id, None)
        else:
            self._budgets[replica_id] = max(0, int(tokens))
        self._evict_replica(replica_id)

    # ---- queries --------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], namespace: Namespace = None) -> dict[str, int]:
        """Per replica, the length of its longest claimed prefix of `tokens` within `namespace`
        (absent if 0)."""
        tokens = tuple(tokens)
        matched: dict[str, int] = {}
        node, pos = self._roots.get(namespace), 0
        while node is not None and pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = common_prefix_len(child.key, tokens, pos)
            pos += k
            for replica in child.replicas:
                matched[replica] = pos
            if k < len(child.key):
                break
            node = child
        return matched

    # ---- updates --------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], replica_id: str, namespace: Namespace = None) -> int:
        """Record that `replica_id` caches `tokens` (and so all its prefixes) in `namespace`;
        touch the path.

        Returns how many tokens were recorded (fewer when the sequence exceeds a budget).
        May evict other LRU claims of this replica, then of any replica, to stay in budget.
        """
        tokens = tuple(tokens)[: self.replica_budget(replica_id)]
        if not tokens:
            return 0
        self._clock += 1
        node, pos = self._root(namespace), 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                child = self._new_child(node, tokens[pos:])
            else:
                k = common_prefix_len(child.key, tokens, pos)
                if k < len(child.key):
                    child = self._split(child, k)
            self._claim(child, replica_id)
            pos += len(child.key)
            node = child
        self._push(replica_id, node)
        self._evict_replica(replica_id)
        self._evict_total()
        return len(tokens)

    def evict_prefix(self, tokens: Sequence[int], replica_id: str, namespace: Namespace = None) -> None:
        """The replica no longer holds `tokens` nor any extension of it (in `namespace`).

        Its claim along this path is cut to len(tokens) - 1 tokens: the replica is assumed to
        still hold the shorter prefixes. A replica's radix cache that evicts the node with key K
        under cached path P should report P + K[:1]; reporting P + K instead over-claims
        len(K) - 1 tokens until the next `sync_replica`. Unknown paths are ignored.
        """
        tokens = tuple(tokens)
        node, pos = self._roots.get(namespace), 0
        while node is not None and pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or replica_id not in child.replicas:
                return
            k = common_prefix_len(child.key, tokens, pos)
            if pos + k == len(tokens):
                cut = len(tokens) - 1 - pos  # offset of the last token inside child.key
                if cut > 0:
                    self._split(child, cut)  # `child` keeps the lower half: the cut onwards
                self._drop_claims(replica_id, self._subtree_claims(child, replica_id))
                return
            if k < len(child.key):
                return
            pos += k
            node = child

    def apply_replica_events(
        self,
        replica_id: str,
        inserted: Iterable[Sequence[int]] = (),
        evicted: Iterable[Sequence[int]] = (),
        namespace: Namespace = None,
    ) -> None:
        """Apply a replica's reported cache changes in one namespace: all `evicted` first, then
        all `inserted`. Send separate calls when the order within a window matters.
        """
        for tokens in evicted:
            self.evict_prefix(tokens, replica_id, namespace)
        for tokens in inserted:
            self.insert(tokens, replica_id, namespace)

    def sync_replica(
        self,
        replica_id: str,
        summary: Iterable[tuple[Namespace, Sequence[int]]],
        keep_newer_than: int | None = None,
    ) -> None:
        """Replace the replica's claims, in every namespace, by its own report of what it caches.

        `summary` lists (namespace, cached sequence) pairs (e.g. the full paths of its radix
        tree's leaves), least recently used first; afterwards the replica claims exactly their
        prefixes, stamped in that order. Claims touched after `keep_newer_than` (a `clock` value read when the report
        was requested) are kept, so requests routed while the report was in flight still count.
        """
        claims = self._claims.get(replica_id, set())
        if keep_newer_than is None:
            stale = list(claims)
        else:
            stale = [n for n in claims if n.replicas[replica_id] <= keep_newer_than]
        self._drop_claims(replica_id, stale)
        for namespace, tokens in summary:
            self.insert(tokens, replica_id, namespace)

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica entirely (it died or was scaled away)."""
        self._drop_claims(replica_id, list(self._claims.get(replica_id, ())))
        for table in (self._claims, self._replica_tokens, self._heaps, self._budgets):
            table.pop(replica_id, None)

    # ---- internals ------------------------------------------------------------------------

    def _root(self, namespace: Namespace) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node((), None, namespace)
        return root

    def _new_child(self, parent: _Node, key: tuple[int, ...]) -> _Node:
        child = _Node(key, parent)
        parent.children[key[0]] = child
        self._total_tokens += len(key)
        self._num_nodes += 1
        return child

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut `node` after its first k tokens; return the new upper half (same claims)."""
        parent = node.parent
        assert parent is not None  # roots are never split, claimed or deleted
        upper = _Node(node.key[:k], parent)
        parent.children[upper.key[0]] = upper
        node.key = node.key[k:]
        node.parent = upper
        upper.children[node.key[0]] = node
        upper.replicas = dict(node.replicas)
        upper.child_claims = {r: 1 for r in node.replicas}
        for replica in upper.replicas:
            self._claims[replica].add(upper)
        self._num_nodes += 1
        return upper

    def _claim(self, node: _Node, replica_id: str) -> None:
        if replica_id not in node.replicas:
            self._claims.setdefault(replica_id, set()).add(node)
            self._replica_tokens[replica_id] = self.replica_tokens(replica_id) + len(node.key)
            parent = node.parent
            assert parent is not None
            parent.child_claims[replica_id] = parent.child_claims.get(replica_id, 0) + 1
        node.replicas[replica_id] = self._clock

    def _drop_claims(self, replica_id: str, nodes: list[_Node]) -> None:
        """Remove the replica's claim on `nodes`, a set closed under r-claimed descendants."""
        for node in nodes:
            del node.replicas[replica_id]
            self._claims[replica_id].discard(node)
            self._replica_tokens[replica_id] -= len(node.key)
        for node in nodes:
            parent = node.parent
            assert parent is not None
            left = parent.child_claims[replica_id] - 1
            if left:
                parent.child_claims[replica_id] = left
                continue
            del parent.child_claims[replica_id]
            if replica_id in parent.replicas:  # the parent just became this replica's leaf
                self._push(replica_id, parent)
        for node in nodes:
            if not node.replicas and node.alive:
                self._delete(node)

    def _delete(self, node: _Node) -> None:
        # Prefix-closure: a node nobody claims has no claimed descendants, so none survive it.
        node.alive = False
        parent = node.parent
        assert parent is not None
        if parent.children.get(node.key[0]) is node:
            del parent.children[node.key[0]]
        if parent.parent is None and not parent.children:
            del self._roots[parent.namespace]
        self._total_tokens -= len(node.key)
        self._num_nodes -= 1

    def _subtree_claims(self, top: _Node, replica_id: str) -> list[_Node]:
        found, stack = [], [top]
        while stack:
            node = stack.pop()
            if replica_id in node.replicas:
                found.append(node)
                stack.extend(node.children.values())
        return found

    def _push(self, replica_id: str, node: _Node) -> None:
        heap = self._heaps.setdefault(replica_id, [])
        heapq.heappush(heap, (node.replicas[replica_id], next(self._seq), node))
        if len(heap) > 2 * len(self._claims[replica_id]) + 64:
            self._rebuild_heap(replica_id)

    def _rebuild_heap(self, replica_id: str) -> None:
        heap = [
            (n.replicas[replica_id], next(self._seq), n)
            for n in self._claims[replica_id]
            if replica_id not in n.child_claims
        ]
        heapq.heapify(heap)
        self._heaps[replica_id] = heap

    def _lru_leaf(self, replica_id: str) -> tuple[int, _Node] | None:
        """The replica's least recently touched leaf claim (stale heap entries are discarded)."""
        heap = self._heaps.get(replica_id, [])
        while heap:
            stamp, _, node = heap[0]
            live = node.alive and node.replicas.get(replica_id) == stamp
            if live and replica_id not in node.child_claims:
                return stamp, node
            heapq.heappop(heap)
        return None

    def _evict_replica(self, replica_id: str) -> None:
        budget = self.replica_budget(replica_id)
        while self.replica_tokens(replica_id) > budget:
            leaf = self._lru_leaf(replica_id)
            if leaf is None:
                break
            self._drop_claims(replica_id, [leaf[1]])

    def _evict_total(self) -> None:
        while self._total_tokens > self.max_tokens:
            oldest = None
            for replica in sorted(self._heaps):
                leaf = self._lru_leaf(replica)
                if leaf is not None and (oldest is None or leaf[0] < oldest[1]):
                    oldest = (replica, leaf[0], leaf[1])
            if oldest is None:
                break
            self._drop_claims(oldest[0], [oldest[2]])

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping disagrees with the tree (for tests)."""
        tokens, nodes = 0, 0
        claims: dict[str, set[_Node]] = {}
        for namespace, root in self._roots.items():
            assert root.namespace == namespace and root.parent is None and not root.replicas
            assert root.children, "an empty root was kept"
            assert _claim_counts(root) == root.child_claims, "root child_claims out of date"
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            tokens += len(node.key)
            nodes += 1
            assert node.alive and node.key and node.replicas, "empty or dead node in tree"
            assert node.parent is not None and node.parent.children[node.key[0]] is node
            counts = _claim_counts(node)
            assert set(counts) <= set(node.replicas), "claims are not prefix-closed"
            assert counts == node.child_claims, "child_claims out of date"
            for replica in node.replicas:
                claims.setdefault(replica, set()).add(node)
            stack.extend(node.children.values())
        assert (tokens, nodes) == (self._total_tokens, self._num_nodes), "size counters drifted"
        assert claims == {r: c for r, c in self._claims.items() if c}, "claim sets drifted"
        for replica, owned in claims.items():
            assert sum(len(n.key) for n in owned) == self._replica_tokens[replica]


def _claim_counts(node: _Node) -> dict[str, int]:
    """Per replica, how many of `node`'s children it claims (what child_claims should hold)."""
    counts: dict[str, int] = {}
    for child in node.children.values():
        for replica in child.replicas:
            counts[replica] = counts.get(replica, 0) + 1
    return counts
