"""Continuous batching over a paged KV pool with a prefix cache.

The scheduler is pure bookkeeping over slot indices: it decides which requests run next, allocates
their KV slots (evicting cached prefixes or retracting running requests when memory runs out) and
returns a plan; the model runner turns the plan into tensors.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from radixserve.workers.engine.request import Req, ReqStatus
from radixserve.workers.engine.schedule_policy import InBatchDedup, SchedulePolicy, match_key
from radixserve.workers.executor.plan import BatchKind, ScheduledBatch
from radixserve.workers.protocol import EngineLoad

if TYPE_CHECKING:  # annotations only: the config's module reaches torch through the parallel layout
    from radixserve.workers.engine.config import EngineConfig

# Memory reserved for the future tokens of running requests is an estimate: each running request
# is assumed to need `ratio * min(remaining max_new_tokens, CLIP)` more slots. The ratio decays
# while decoding goes well and jumps back after a retraction (SGLang's new_token_ratio).
CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class Scheduler:
    def __init__(self, config: EngineConfig, pool: Any, req_pool: Any, cache: Any):
        self.config = config
        self.pool = pool
        self.req_pool = req_pool
        self.cache = cache
        self.policy = SchedulePolicy(config.schedule_policy, cache)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0
        # Cached-prefix lengths of the waiting requests, by key, as the last admission round saw
        # them (empty when the policy does not match prefixes): `load` counts the tokens past them.
        self.match_lens: dict[str, int] = {}

    # Queue -----------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_aborted(self) -> list[Req]:
        """Remove requests flagged `aborted` from the queue and the batch, releasing their KV."""
        out = [r for r in self.waiting if r.aborted]
        if out:
            self.waiting = deque(r for r in self.waiting if not r.aborted)
            for r in out:
                r.status = ReqStatus.FINISHED
        gone = [r for r in self.running if r.aborted]
        if gone:
            self.running = [r for r in self.running if not r.aborted]
            for r in gone:
                self.release(r)
        return out + gone

    def load(self) -> EngineLoad:
        """The load signals of the queue, the batch and the pool, in one pass over the queue.
        `queued_sequences` counts only this queue (the engine knows what waits elsewhere)."""
        lens = self.match_lens
        queued = sum(max(r.seq_len - lens.get(r.key, 0), 0) for r in self.waiting)
        queued += sum(r.remaining_prefill for r in self.running if r.remaining_prefill > 1)
        held = self.pool.size - self.pool.available() - self.cache.evictable_size()
        return EngineLoad(
            queued_prompt_tokens=queued,
            running_sequences=len(self.running),
            queued_sequences=len(self.waiting),
            kv_usage=held / self.pool.size if self.pool.size else 0.0,
        )

    # Planning --------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        return batch

    def _token_budget(self) -> int:
        chunk = self.config.chunk_size
        return min(self.config.max_prefill_tokens, chunk) if chunk else self.config.max_prefill_tokens

    def _reserved_for_running(self) -> int:
        return int(
            sum(min(r.max_new_remaining, CLIP_MAX_NEW_TOKENS) for r in self.running) * self.new_token_ratio
        )

    def _headroom(self) -> int:
        return self.pool.available() + self.cache.evictable_size() - self._reserved_for_running()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self._token_budget()
        plan = ScheduledBatch(BatchKind.PREFILL, [], [], [], [])
        # Chunked prefills in progress continue first.
        for req in [r for r in self.running if r.remaining_prefill > 1]:
            if budget <= 0:
                break
            if req.status is not ReqStatus.RUNNING:
                continue  # retracted while making room for an earlier one
            n = min(req.remaining_prefill, budget)
            if not self._make_room(req, n, plan):
                break
            self._plan(plan, req, n)
            budget -= n
        if self.waiting and budget > 0:
            self._admit(plan, budget)
        return plan if plan.reqs else None

    def _admit(self, plan: ScheduledBatch, budget: int) -> None:
        ordered, match_lens = self.policy.order(list(self.waiting))
        self.match_lens = match_lens
        dedup = InBatchDedup(self.config.schedule_policy == "lpm" and not self.config.disable_radix_cache)
        admitted: set[str] = set()
        chunk = self.config.chunk_size
        for req in ordered:
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if dedup.should_defer(req, match_lens.get(req.key, 0)):
                continue
            n = self._try_admit(req, budget, chunked=chunk is not None, first=not plan.reqs)
            if n is None:
                break  # out of memory or rows: later requests would not fit either
            self._plan(plan, req, n)
            admitted.add(req.key)
            budget -= n
        if admitted:
            self.waiting = deque(r for r in self.waiting if r.key not in admitted)

    def _try_admit(self, req: Req, budget: int, chunked: bool, first: bool) -> int | None:
        """Lock the request's cached prefix and allocate its first chunk; None if it must wait."""
        row = self.req_pool.alloc()
        if row is None:
            return None
        match = self.cache.match_prefix(match_key(req), req.namespace)
        self.cache.lock(match.node)
        need = req.seq_len - len(match.slots)
        room = self.pool.available() + self.cache.evictable_size() - self.pool.page_size
        n = min(need, budget, room) if chunked else need
        if n <= 0:
            n = None
        if not chunked and n > budget and not first:
            n = None  # an unchunked prompt over budget runs alone in a later round
        future = min(req.max_new_remaining, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
        if n is not None and need + future > self._headroom() and (self.running or not first):
            n = None
        if n is None:
            self.cache.unlock(match.node)
            self.req_pool.free(row)
            return None
        req.row, req.table_len = row, 0
        req.kv_slots = list(match.slots)
        req.cache_len, req.last_node = len(match.slots), match.node
        if req.cached_tokens is None:  # prompt tokens: a resumed sequence matches its output too
            req.cached_tokens = min(len(match.slots), len(req.origin_input_ids))
        if not self._extend(req, n):
            self.release(req, keep_waiting=True)
            return None
        req.status = ReqStatus.RUNNING
        self.running.append(req)
        return n

    def _schedule_decode(self) -> ScheduledBatch | None:
        reqs = [r for r in self.running if r.decode_ready]
        if not reqs:
            return None
        plan = ScheduledBatch(BatchKind.DECODE, [], [], [], [])
        # Newest requests are retracted first, so older ones keep their progress.
        for req in sorted(reqs, key=lambda r: r.arrival):
            if req.status is not ReqStatus.RUNNING:
                continue  # retracted to make room for an older request
            if self._make_room(req, 1, plan):
                self._plan(plan, req, 1)
            elif plan.reqs:
                self._retract(req)  # older requests hold the memory; this one resumes later
            else:
                # Every other sequence is retracted and the KV check at submission guarantees
                # that one sequence alone fits: reaching this is a bug, and the client is told.
                req.aborted = True
                req.error = "out of KV cache memory: the sequence does not fit in the KV pool even alone"
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        return plan if plan.reqs else None

    def _plan(self, plan: ScheduledBatch, req: Req, n: int) -> None:
        plan.reqs.append(req)
        plan.starts.append(req.num_computed - n)
        plan.extend_lens.append(n)
        plan.sample_mask.append(req.num_computed == req.seq_len)

    # Memory ----------------------------------------------------------------------------------
    def _extend(self, req: Req, n: int) -> bool:
        """Allocate n more slots for req (evicting cached prefixes if needed)."""
        last = req.kv_slots[-1] if req.kv_slots else None
        slots = self.pool.alloc(n, last)
        if slots is None:
            self.cache.evict(n + self.pool.page_size - self.pool.available())
            slots = self.pool.alloc(n, last)
            if slots is None:
                return False
        req.kv_slots.extend(slots)
        return True

    def _make_room(self, req: Req, n: int, plan: ScheduledBatch) -> bool:
        """Allocate n slots for req, retracting the newest unplanned requests if memory is short."""
        keep = {r.key for r in plan.reqs} | {req.key}
        while not self._extend(req, n):
            if not self._retract_one(keep):
                return False
        return True

    def _retract_one(self, keep: set[str]) -> bool:
        victims = [r for r in self.running if r.key not in keep]
        if not victims:
            return False
        self._retract(max(victims, key=lambda r: r.arrival))
        return True

    def _retract(self, victim: Req) -> None:
        """Preempt a running request: its KV goes to the cache (recomputed or re-matched later)."""
        self.running.remove(victim)
        self.release(victim, keep_waiting=True)
        victim.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(victim)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def after_step(self, batch: ScheduledBatch) -> None:
        """After a prefill, publish what was computed to the cache so that waiting requests sharing
        the prefix reuse it at once (not only when this request finishes)."""
        if batch.kind is not BatchKind.PREFILL:
            return
        for req in batch.reqs:
            if not req.aborted and req.status is ReqStatus.RUNNING and not req.kv_streaming:
                self._cache_progress(req)

    def _cache_progress(self, req: Req) -> None:
        key = req.fill_ids[: req.num_computed]
        match = self.cache.cache_unfinished(key, req.kv_slots, req.last_node, req.namespace)
        req.kv_slots = list(match.slots)
        req.last_node = match.node
        req.cache_len = len(match.slots) - (len(match.slots) % self.pool.page_size)
        req.table_len = 0  # tree slots may have replaced ours: rewrite the table row

    def finish(self, req: Req) -> None:
        """A sequence is done: hand its KV to the cache and leave the batch."""
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
        self.release(req)
        req.status = ReqStatus.FINISHED

    def release(self, req: Req, keep_waiting: bool = False) -> None:
        """Hand the sequence's KV to the cache (a failed one's only up to its cached prefix, the
        rest is freed) and its table row back."""
        if req.row is not None:
            n = req.cache_len if req.error is not None else req.num_computed
            self.cache.cache_finished(req.fill_ids[:n], req.kv_slots[:n], req.last_node, req.namespace)
            self.pool.free(req.kv_slots[n:])
            self.req_pool.free(req.row)
        req.kv_slots, req.cache_len, req.last_node = [], 0, None
        req.row, req.table_len = None, 0
        req.status = ReqStatus.WAITING if keep_waiting else ReqStatus.FINISHED
