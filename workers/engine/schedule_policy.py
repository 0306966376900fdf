"""The order in which waiting requests are considered for admission."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from radixserve.workers.engine.request import Req

# Matching every waiting prompt against the tree each step costs O(queue x prompt); past this
# queue length the prefix-aware policies fall back to arrival order (SGLang does the same).
MAX_QUEUE_FOR_PREFIX_POLICY = 128
# In-batch de-duplication: a request whose uncached part starts with the same this-many tokens as
# one already admitted in this round waits one round, so the first one warms the shared prefix.
DEDUP_PREFIX_TOKENS = 32


def match_key(req: Req) -> list[int]:
    """The cache lookup key: every token with KV to compute, minus the last (hits stop at len-1).

    A sequence that wants its prompt's logprobs matches no further than the first position whose
    logits they need (`Req.input_logprob_from`): logits are computed only by a forward, so every
    position from there on is recomputed, even where the tree holds its KV. Capping the key (not
    the match afterwards) keeps admission order, the queue's load and the lock agreeing on it."""
    key = req.fill_ids[:-1]
    first = req.input_logprob_from
    return key if first is None else key[:first]


class SchedulePolicy:
    def __init__(self, policy: str, cache: Any):
        self.policy = policy
        self.cache = cache

    def order(self, waiting: list[Req]) -> tuple[list[Req], dict[str, int]]:
        """Return waiting requests in admission order and their cached-prefix lengths (by key)."""
        if self.policy == "fcfs" or len(waiting) > MAX_QUEUE_FOR_PREFIX_POLICY:
            return list(waiting), {}
        matches = {r.key: self.cache.match_prefix(match_key(r), r.namespace) for r in waiting}
        lens = {k: len(m.slots) for k, m in matches.items()}
        if self.policy == "lpm":
            # Stable sort: equal matches keep arrival order. Retracted requests go first.
            ordered = sorted(waiting, key=lambda r: (r.num_retractions == 0, -lens[r.key]))
            return ordered, lens
        return self._dfs_weight(waiting, matches), lens

    def _dfs_weight(self, waiting: list[Req], matches: dict[str, Any]) -> list[Req]:
        """SGLang's dfs-weight: walk the tree depth first, visiting the subtree with the most waiting
        requests first, so requests sharing a prefix run back to back while it is hot.

        A match without a tree node (the null cache keeps no tree) shares nothing with anyone:
        those requests come after the tree's, in arrival order."""
        at_node: dict[int, list[Req]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        roots: dict[int, Any] = {}
        rootless: list[Req] = []
        for r in waiting:
            node = matches[r.key].node
            if node is None:
                rootless.append(r)
                continue
            at_node[id(node)].append(r)
            while True:
                weight[id(node)] += 1
                if node.parent is None:
                    roots[id(node)] = node
                    break
                node = node.parent
        out: list[Req] = []
        stack = sorted(roots.values(), key=lambda n: weight[id(n)])
        while stack:
            node = stack.pop()
            out.extend(at_node.get(id(node), ()))
            kids = [c for c in node.children.values() if id(c) in weight]
            stack.extend(sorted(kids, key=lambda n: weight[id(n)]))
        return out + rootless


class InBatchDedup:
    """Tracks the uncached prefixes admitted in one scheduling round."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.seen: set[tuple] = set()

    def should_defer(self, req: Req, cached_len: int) -> bool:
        """Whether `req` waits a round: another request of this round computes the same tokens
        from the same position (admitted before it, or a chunked prefill that continues)."""
        key = self._key(req, cached_len)
        if key is None:
            return False
        if key in self.seen:
            return True
        self.seen.add(key)
        return False

    def continuing(self, req: Req, start: int) -> None:
        """`req` computes its next chunk from `start` this round: a waiting request whose match
        ends there (at the chunks published so far) would compute that chunk a second time."""
        key = self._key(req, start)
        if key is not None:
            self.seen.add(key)

    def _key(self, req: Req, start: int) -> tuple | None:
        if not self.enabled:
            return None
        head = tuple(req.fill_ids[start : start + DEDUP_PREFIX_TOKENS])
        if len(head) < DEDUP_PREFIX_TOKENS:
            return None
        return (req.namespace, start, head)
