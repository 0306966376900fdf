"""The prefix-cache interface the scheduler uses, and the disabled implementation.

A prefix cache speaks token ids and slot indices, never requests. `RadixCache` (radix_cache.py) is
the real one; `NullCache` is what `--disable-radix-cache` swaps in, so no caller checks a flag.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.workers.mem_cache.kv_pool import KVPool


@dataclass
class MatchResult:
    slots: list[int]  # KV slots of the matched prefix (len == matched tokens, page-aligned)
    node: object  # handle to lock/unlock; valid only while locked
    # A tiered cache: how many tokens past `slots` the tree holds in host memory or on disk, and
    # the deepest node of them (what `load_back` brings onto the device). 0 / None otherwise.
    lower_tokens: int = 0
    lower_node: object = None


class PrefixCache(ABC):
    """What the scheduler needs from a prefix cache; `NullCache` is the disabled implementation."""

    @abstractmethod
    def match_prefix(self, key: list[int], namespace: Hashable | None = None) -> MatchResult: ...
    def load_back(self, match: MatchResult, from_disk: bool = True) -> MatchResult:
        """Bring the part of a match held in lower tiers onto the device; the new match (a
        cache without tiers has nothing below the device and returns it unchanged)."""
        return match

    prefetches = False  # whether `prefetch` ever starts anything (a disk tier)

    def prefetch(self, match: MatchResult) -> list:
        """Start moving the disk part of a match closer off the calling thread; what the match
        now waits for (objects with a `settled` flag). A cache without a disk tier has none."""
        return []

    def poll_prefetches(self) -> int:
        """Settle finished prefetches; how many still run."""
        return 0

    def close(self) -> None:  # noqa: B027 - most caches run no thread: nothing to stop
        """Stop any thread the cache runs."""

    def tier_stats(self) -> dict[str, int | float]:
        """Per-tier counters for metrics (a cache without tiers has none)."""
        return {}

    @abstractmethod
    def lock(self, node) -> None: ...
    @abstractmethod
    def unlock(self, node) -> None: ...
    @abstractmethod
    def cache_finished(self, key, slots, node, namespace=None) -> None: ...
    @abstractmethod
    def cache_unfinished(self, key, slots, node, namespace=None) -> MatchResult: ...
    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...
    @abstractmethod
    def evictable_size(self) -> int: ...
    @abstractmethod
    def protected_size(self) -> int: ...
    @abstractmethod
    def check_integrity(self) -> None: ...
    @abstractmethod
    def reset(self) -> bool: ...
    @abstractmethod
    def cached_paths(self, max_tokens: int, lower: bool = False) -> list[tuple[Hashable | None, list[int]]]:
        """(namespace, token path) of the cached leaves, most recently used first, until the
        paths' lengths add up to max_tokens: what a router needs to correct its view. `lower`:
        the paths that end in a lower tier (host memory, disk) instead of the device's."""

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    def all_locks_released(self) -> bool:
        return self.protected_size() == 0


def kv_invariant_ok(pool, cache: PrefixCache) -> bool:
    """The idle invariant: every slot is free or in the tree, and nothing is locked."""
    return (
        pool.available() + cache.evictable_size() + cache.protected_size() == pool.size
        and cache.all_locks_released()
    )


class NullCache(PrefixCache):
    """The disabled prefix cache: nothing is ever shared; finished requests free their slots."""

    def __init__(self, pool: KVPool, page_size: int | None = None):
        self.pool = pool

    def match_prefix(self, key, namespace=None) -> MatchResult:
        return MatchResult([], None)

    def lock(self, node) -> None:
        pass

    def unlock(self, node) -> None:
        pass

    def cache_finished(self, key, slots, node, namespace=None) -> None:
        self.pool.free(_as_list(slots))

    def cache_unfinished(self, key, slots, node, namespace=None) -> MatchResult:
        return MatchResult(_as_list(slots), node)

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def check_integrity(self) -> None:
        pass

    def cached_paths(self, max_tokens: int, lower: bool = False) -> list[tuple[Hashable | None, list[int]]]:
        return []

    def reset(self) -> bool:
        return True


def _as_list(xs) -> list[int]:
    return xs.tolist() if hasattr(xs, "tolist") else list(xs)
