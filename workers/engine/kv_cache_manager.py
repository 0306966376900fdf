"""KVCacheManager: the one owner of a replica's KV slots. Engine thread only.

Every caller that gives a sequence KV slots goes through it: the scheduler's admission and the
chunks of a prefill after it, the decode side's reservation of a prompt whose KV a peer computes
(`reserve_external`), publishing what a prefill computed (`publish`), retraction and the end of a
sequence (`release`, `drop`), and the idle invariant (`idle`). It holds the request-to-token
table rows, the slot pool and the prefix cache together; the prefix cache beneath it stays
request-agnostic (it knows token paths and slots, never a Req).

The slot state of a sequence lives on its Req (`row`, `kv_slots`, `cache_len`, `last_node`):
`kv_slots[:cache_len]` belong to the tree (shared, protected by the lock on `last_node`), the rest
are the sequence's own until `release` hands them to the tree or `drop` frees them.
"""

from __future__ import annotations

from typing import Any

from radixserve.workers.engine.request import Req
from radixserve.workers.engine.schedule_policy import match_key
from radixserve.workers.mem_cache.prefix_cache import kv_invariant_ok

# Admission waits for a disk read of a sequence's prefix at most this often; then the part still on
# disk is recomputed (under pressure a prefix read into host memory may go back to disk before
# the sequence is admitted).
MAX_DISK_READS = 2


class KVCacheManager:
    def __init__(self, pool: Any, req_pool: Any, cache: Any):
        self.pool = pool
        self.req_pool = req_pool
        self.cache = cache
        self.page_size = pool.page_size
        self._waits: dict[str, list] = {}  # sequence key -> the disk prefetches it waits for

    # Reading ---------------------------------------------------------------------------------
    def room(self) -> int:
        """Slots that an allocation could get now: free ones and those eviction would free."""
        return self.pool.available() + self.cache.evictable_size()

    def held(self) -> int:
        """Slots in use by sequences (neither free nor evictable)."""
        return self.pool.size - self.room()

    def cached_prefix_len(self, req: Req) -> int:
        """How many of the sequence's tokens the tree holds now (nothing is locked)."""
        return len(self.cache.match_prefix(match_key(req), req.namespace).slots)

    def idle(self) -> bool:
        """The idle invariant: no row in use, no lock held, free + evictable == every slot."""
        return (
            self.req_pool.available() == self.req_pool.max_reqs
            and self.cache.protected_size() == 0
            and kv_invariant_ok(self.pool, self.cache)
        )

    # Lower cache tiers ------------------------------------------------------------------------
    def prefetch(self, req: Req) -> bool:
        """Start reading the part of the sequence's prefix that lies on disk into host memory
        off the engine thread (when it arrives, and again at admission if part of it went to
        disk meanwhile, at most MAX_DISK_READS times); whether it now waits for such a read. A
        cache without a disk tier does nothing."""
        if not self.cache.prefetches or req.disk_reads >= MAX_DISK_READS:
            return False
        waits = self.cache.prefetch(self.cache.match_prefix(match_key(req), req.namespace))
        if not waits:
            return False
        self._waits[req.key] = waits
        req.disk_reads += 1
        return True

    def loading(self, req: Req) -> bool:
        """Whether the sequence waits for a disk read of its prefix (admit it after)."""
        return any(not w.settled for w in self._waits.get(req.key, ()))

    def poll(self) -> None:
        """Settle the disk reads that are done (each step, before admission), and forget the
        waits that are over (an aborted sequence's too)."""
        if self.cache.prefetches:
            self.cache.poll_prefetches()
            self._waits = {k: ws for k, ws in self._waits.items() if any(not w.settled for w in ws)}

    # Allocation ------------------------------------------------------------------------------
    def open(self, req: Req) -> bool:
        """Give the sequence a table row and its cached prefix (locked). False: no row free.
        A prefix found in the host or disk tier is copied back onto the device first.

        The prefix is `match_key`'s: for a sequence that wants its prompt's logprobs it stops
        before the first position whose logits those need, so the prefill computes them all."""
        row = self.req_pool.alloc()
        if row is None:
            return False
        match = self.cache.match_prefix(match_key(req), req.namespace)
        match = self.cache.load_back(match, from_disk=False)  # disk reads run on the loader thread
        self.cache.lock(match.node)
        req.row, req.table_len = row, 0
        req.kv_slots = list(match.slots)
        req.cache_len, req.last_node = len(match.slots), match.node
        return True

    def allocate(self, req: Req, n: int) -> bool:
        """n more slots for an open sequence, evicting cached prefixes if the pool is short."""
        last = req.kv_slots[-1] if req.kv_slots else None
        slots = self.pool.alloc(n, last)
        if slots is None:
            self.cache.evict(n + self.page_size - self.pool.available())
            slots = self.pool.alloc(n, last)
            if slots is None:
                return False
        req.kv_slots.extend(slots)
        return True

    def reserve_external(self, req: Req) -> list[int] | str:
        """Open the sequence and allocate its prompt past the cached prefix, whose KV will come
        from elsewhere: the slots to receive it into, or why there is no room (nothing held)."""
        if not self.open(req):
            return "no table row"
        if not self.allocate(req, len(req.origin_input_ids) - req.cache_len):
            self.drop(req)
            return "no KV slots"
        return req.kv_slots[req.cache_len :]

    # Publishing and giving back --------------------------------------------------------------
    def publish(self, req: Req, num_tokens: int) -> None:
        """The sequence's first `num_tokens` are computed (or arrived): the tree takes them now,
        so that others sharing the prefix reuse them at once (its slots may replace ours)."""
        key = req.fill_ids[:num_tokens]
        match = self.cache.cache_unfinished(key, req.kv_slots, req.last_node, req.namespace)
        req.kv_slots, req.last_node = list(match.slots), match.node
        req.cache_len = len(match.slots) - (len(match.slots) % self.page_size)
        req.table_len = 0  # tree slots may have replaced ours: rewrite the table row

    def release(self, req: Req) -> None:
        """Hand the sequence's KV to the tree (a failed one's only up to its cached prefix: the
        step that failed may not have written the rest, which is freed) and its row back."""
        if req.row is not None:
            n = req.cache_len if req.error is not None else req.num_computed
            self.cache.cache_finished(req.fill_ids[:n], req.kv_slots[:n], req.last_node, req.namespace)
            self.pool.free(req.kv_slots[n:])
            self.req_pool.free(req.row)
        _clear(req)

    def drop(self, req: Req) -> None:
        """Give back slots that were never (fully) written: the cached prefix is unlocked, the
        slots past it are freed unread."""
        if req.row is not None:
            self.pool.free(req.kv_slots[req.cache_len :])
            self.cache.unlock(req.last_node)
            self.req_pool.free(req.row)
        _clear(req)


def _clear(req: Req) -> None:
    req.kv_slots, req.cache_len, req.last_node = [], 0, None
    req.row, req.table_len = None, 0
