"""Continuous batching over a paged KV pool with a prefix cache.

The scheduler is pure bookkeeping over slot indices: it decides which requests run next, has the
KV cache manager allocate their slots (evicting cached prefixes, or retracting running requests
when memory runs out) and returns a plan; the model runner turns the plan into tensors.

It alone owns its queues and each request's status on them: `waiting` (WAITING: new or
retracted), `running` (RUNNING), `remote` (WAITING_FOR_REMOTE_KV: slots reserved for a prompt a
prefill replica computes, then admitted straight into the batch by `start_arrived`) and `sending`
(SENDING_KV: finished, its slots locked while a peer still reads them). A request outside all of
them is WAITING_FOR_GRAMMAR (the engine's grammar queue) or FINISHED. The schedule skips what is
not ready; the transfer itself is the KV connector's (engine/kv_handoff.py), never the scheduler's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixserve.workers.engine.kv_cache_manager import KVCacheManager
from radixserve.workers.engine.request import Req, ReqStatus
from radixserve.workers.engine.schedule_policy import InBatchDedup, SchedulePolicy
from radixserve.workers.engine.step_cost import StepCost
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
# Prompt logprobs take one vocab-sized float32 logits row per position (and as much again for their
# log-softmax): a step computes at most this many, chunking the prefills that want more.
MAX_INPUT_LOGPROB_ROWS = 256


class Scheduler:
    def __init__(self, config: EngineConfig, pool: Any, req_pool: Any, cache: Any, lora: Any = None):
        self.config = config
        self.lora = lora  # the LoRAManager when the engine serves adapters (workers/lora/)
        self.kv = KVCacheManager(pool, req_pool, cache)
        self.pool = pool
        self.cache = cache
        self.policy = SchedulePolicy(config.schedule_policy, cache)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.remote: dict[str, Req] = {}  # WAITING_FOR_REMOTE_KV, by sequence key
        self.sending: dict[str, Req] = {}  # SENDING_KV, by sequence key
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0
        self.num_mixed_steps = 0  # prefill steps that carried the running decodes
        # The steps' times (fed by the engine after each forward) size a mixed step's prefill.
        self.cost = StepCost(config.mixed_step_ratio)
        # Cached-prefix lengths of the waiting requests, by key, as the last admission round saw
        # them (empty when the policy does not match prefixes): `load` counts the tokens past them.
        self.match_lens: dict[str, int] = {}

    # Queue -----------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)
        self.kv.prefetch(req)
        if self.lora is not None:
            self.lora.prepare(req)

    def only_loading(self) -> bool:
        """Whether every sequence waits for a read (its prefix from disk, its LoRA adapter) and
        nothing else runs."""
        return (
            not (self.running or self.remote or self.sending)
            and bool(self.waiting)
            and all(self.kv.loading(r) or self._adapter_loading(r) for r in self.waiting)
        )

    def _adapter_loading(self, req: Req) -> bool:
        return self.lora is not None and self.lora.waiting_for(req) == "loading"

    def adapter_wait(self, req: Req) -> str | None:
        """None when the request's adapter (if any) is in memory with a batch slot for it;
        "wait" while it is read or every slot holds another adapter; otherwise the error its
        load ended with (the request cannot run)."""
        if self.lora is None or req.lora is None:
            return None
        wait = self.lora.waiting_for(req)
        if wait == "loading":
            return "wait"
        if wait is not None:
            return wait
        return self.lora.place(req)

    def has_work(self) -> bool:
        """Sequences to schedule, or holding slots while their KV moves."""
        return bool(self.waiting or self.running or self.remote or self.sending)

    def load(self) -> EngineLoad:
        """The load signals of the queue, the batch and the pool, in one pass over the queue.
        `queued_sequences` counts only this queue (the engine knows what waits elsewhere)."""
        lens = self.match_lens
        queued = sum(max(r.seq_len - lens.get(r.key, 0), 0) for r in self.waiting)
        queued += sum(r.remaining_prefill for r in self.running if r.remaining_prefill > 1)
        held = self.kv.held()
        return EngineLoad(
            queued_prompt_tokens=queued,
            running_sequences=len(self.running),
            queued_sequences=len(self.waiting),
            kv_usage=held / self.pool.size if self.pool.size else 0.0,
        )

    # Planning --------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next step: prefill work first (chunks in progress, then admissions), else a
        decode step of every decode-ready sequence. With enable_mixed_chunk a prefill step also
        carries those decodes, one token each, and as many prefill tokens as keep the step near
        `mixed_step_ratio` decode steps' time (StepCost)."""
        self.kv.poll()
        decodes = [r for r in self.running if r.decode_ready] if self.config.enable_mixed_chunk else []
        budget = self._token_budget()
        if decodes:
            budget = self.cost.mixed_budget(len(decodes), max(budget - len(decodes), 1))
        batch = self._schedule_prefill(budget)
        if batch is None:
            return self._schedule_decode()
        if decodes:
            self._add_decodes(batch, decodes)
            self.num_mixed_steps += 1
        return batch

    def _token_budget(self) -> int:
        chunk = self.config.chunk_size
        return min(self.config.max_prefill_tokens, chunk) if chunk else self.config.max_prefill_tokens

    def _reserved_for_running(self) -> int:
        return int(
            sum(min(r.max_new_remaining, CLIP_MAX_NEW_TOKENS) for r in self.running) * self.new_token_ratio
        )

    def _headroom(self) -> int:
        return self.kv.room() - self._reserved_for_running()

    def _schedule_prefill(self, budget: int) -> ScheduledBatch | None:
        plan = ScheduledBatch(BatchKind.PREFILL, [], [], [], [])
        dedup = InBatchDedup(self.config.schedule_policy == "lpm" and not self.config.disable_radix_cache)
        # Chunked prefills in progress continue first.
        for req in [r for r in self.running if r.remaining_prefill > 1]:
            if budget <= 0:
                break
            if req.status is not ReqStatus.RUNNING:
                continue  # retracted while making room for an earlier one
            n = _cap_input_logprob_rows(req, min(req.remaining_prefill, budget), plan)
            if n == 0:
                continue
            if not self._make_room(req, n, plan):
                break
            dedup.continuing(req, req.num_computed - n)  # the slots are allocated: n from here
            self._plan(plan, req, n)
            budget -= n
        if self.waiting and budget > 0:
            self._admit(plan, budget, dedup)
        return plan if plan.reqs else None

    def _admit(self, plan: ScheduledBatch, budget: int, dedup: InBatchDedup) -> None:
        ordered, match_lens = self.policy.order(list(self.waiting))
        self.match_lens = match_lens
        admitted: set[str] = set()
        chunk = self.config.chunk_size
        for req in ordered:
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if dedup.should_defer(req, match_lens.get(req.key, 0)):
                continue
            if self.kv.loading(req) or self.kv.prefetch(req):
                continue  # its prefix is being read from disk: admitted once it is in host memory
            wait = self.adapter_wait(req)
            if wait is not None:  # its adapter is being read, or every batch slot holds another
                if wait != "wait":
                    req.aborted, req.error = True, wait
                continue
            n = self._try_admit(req, budget, plan, chunked=chunk is not None)
            if n is None:
                break  # out of memory or rows: later requests would not fit either
            self._plan(plan, req, n)
            admitted.add(req.key)
            budget -= n
        if admitted:
            self.waiting = deque(r for r in self.waiting if r.key not in admitted)

    def _try_admit(self, req: Req, budget: int, plan: ScheduledBatch, chunked: bool) -> int | None:
        """Lock the request's cached prefix and allocate its first chunk; None if it must wait."""
        first = not plan.reqs
        if not self.kv.open(req):
            return None
        need = req.seq_len - req.cache_len
        room = self.kv.room() - self.kv.page_size
        n = min(need, budget, room) if chunked else need
        if n <= 0:
            n = None
        if not chunked and n > budget and not first:
            n = None  # an unchunked prompt over budget runs alone in a later round
        if n is not None:
            n = _cap_input_logprob_rows(req, n, plan) or None
        future = min(req.max_new_remaining, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
        if n is not None and need + future > self._headroom() and (self.running or not first):
            n = None
        if n is None:
            self.kv.drop(req)
            return None
        if req.cached_tokens is None:  # prompt tokens: a resumed sequence matches its output too
            req.cached_tokens = min(req.cache_len, len(req.origin_input_ids))
        if not self.kv.allocate(req, n):
            self.kv.release(req)
            return None
        req.status = ReqStatus.RUNNING
        self.running.append(req)
        if self.lora is not None:
            self.lora.acquire(req)
        return n

    def _schedule_decode(self) -> ScheduledBatch | None:
        reqs = [r for r in self.running if r.decode_ready]
        if not reqs:
            return None
        plan = ScheduledBatch(BatchKind.DECODE, [], [], [], [])
        self._add_decodes(plan, reqs)
        return plan if plan.reqs else None

    def _add_decodes(self, plan: ScheduledBatch, reqs: list[Req]) -> None:
        """One token for each decode-ready sequence; room for it retracts the newest first, so
        older ones keep their progress (never a sequence the plan holds already)."""
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

    def _plan(self, plan: ScheduledBatch, req: Req, n: int) -> None:
        plan.reqs.append(req)
        plan.starts.append(req.num_computed - n)
        plan.extend_lens.append(n)
        plan.sample_mask.append(req.num_computed == req.seq_len)
        lo, hi = req.input_logprob_span(req.num_computed - n, req.num_computed)
        plan.input_logprob_rows += hi - lo

    # Memory ----------------------------------------------------------------------------------
    def _make_room(self, req: Req, n: int, plan: ScheduledBatch) -> bool:
        """Allocate n slots for req, retracting the newest unplanned requests if memory is short."""
        keep = {r.key for r in plan.reqs} | {req.key}
        while not self.kv.allocate(req, n):
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
        self.kv.release(victim)
        if self.lora is not None:
            self.lora.release(victim)
        victim.status = ReqStatus.WAITING
        victim.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(victim)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def after_step(self, batch: ScheduledBatch) -> None:
        """After a prefill, publish what was computed to the cache so that waiting requests sharing
        the prefix reuse it at once (not only when this request finishes)."""
        if batch.kind is not BatchKind.PREFILL:
            return
        for req, n in zip(batch.reqs, batch.extend_lens):
            if n == 1 and req.output_ids:
                continue  # a decode in a mixed step: its sequence enters the tree when it ends
            if not req.aborted and req.status is ReqStatus.RUNNING and not req.kv_streaming:
                self._cache_progress(req)

    def _cache_progress(self, req: Req) -> None:
        self.kv.publish(req, req.num_computed)

    # Endings ---------------------------------------------------------------------------------
    def finish(self, req: Req) -> None:
        """A sequence is done: hand its KV to the cache and leave whichever queue holds it."""
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is ReqStatus.SENDING_KV:
            del self.sending[req.key]
        if req.status is ReqStatus.WAITING_FOR_REMOTE_KV:
            del self.remote[req.key]
            self.kv.drop(req)  # its KV never (fully) arrived: nothing of it is published
        else:
            self.kv.release(req)
        if self.lora is not None:
            self.lora.release(req)
        req.status = ReqStatus.FINISHED

    def take_ended(self, keeps_slots: Callable[[Req], bool]) -> list[Req]:
        """At a step boundary: the sequences of the queue and the batch that were aborted (or
        failed) since the last one, released and returned; then those that finished meanwhile
        (their final chunk may have gone out already) leave the batch, their KV to the cache,
        except that one for which `keeps_slots(req)` says a peer still reads its slots waits in
        `sending` (SENDING_KV) until `finish`. A stop string can finish a retracted sequence: it
        leaves the queue."""
        gone = [r for r in self.waiting if r.aborted]
        if gone:
            self.waiting = deque(r for r in self.waiting if not r.aborted)
            for req in gone:
                req.status = ReqStatus.FINISHED  # a waiting sequence holds no slots
        for req in [r for r in self.running if r.aborted]:
            self.finish(req)
            gone.append(req)
        for req in [r for r in self.running if r.finish_reason is not None]:
            if keeps_slots(req):
                self.running.remove(req)
                req.status = ReqStatus.SENDING_KV
                self.sending[req.key] = req
            else:
                self.finish(req)
        if any(r.finish_reason is not None for r in self.waiting):
            for req in [r for r in self.waiting if r.finish_reason is not None]:
                req.status = ReqStatus.FINISHED
            self.waiting = deque(r for r in self.waiting if r.finish_reason is None)
        return gone

    def clear(self) -> None:
        """Release every sequence this scheduler holds (the engine failed them all)."""
        for req in [*self.running, *self.waiting, *self.remote.values(), *self.sending.values()]:
            self.finish(req)

    # Remote KV (PD) --------------------------------------------------------------------------
    def reserve_remote(self, req: Req) -> list[int] | str:
        """Slots for the prompt past its cached prefix, whose KV a peer computes and sends: the
        sequence waits in `remote` (WAITING_FOR_REMOTE_KV) until `start_arrived` or `finish`.
        Returns the slots to receive into, or why there is no room (nothing held then)."""
        slots = self.kv.reserve_external(req)
        if isinstance(slots, list):
            req.status = ReqStatus.WAITING_FOR_REMOTE_KV
            self.remote[req.key] = req
            if self.lora is not None:
                self.lora.prepare(req)  # read while the prompt's KV is on its way
        return slots

    def start_arrived(self, req: Req) -> None:
        """The prompt's KV arrived (and its grammar is compiled, and `adapter_wait` says its
        adapter has a slot): the tree takes the prompt, and the sequence joins the running batch,
        ready to decode from the first token."""
        del self.remote[req.key]
        self.kv.publish(req, len(req.origin_input_ids))
        req.status = ReqStatus.RUNNING
        self.running.append(req)
        if self.lora is not None:
            self.lora.acquire(req)


def _cap_input_logprob_rows(req: Req, n: int, plan: ScheduledBatch) -> int:
    """The most of the next n positions the sequence may compute in this step without its prompt
    logprob rows taking the plan past MAX_INPUT_LOGPROB_ROWS (0: none, it waits for the next)."""
    start = req.num_computed
    lo, hi = req.input_logprob_span(start, start + n)
    left = MAX_INPUT_LOGPROB_ROWS - plan.input_logprob_rows
    if hi - lo <= left:
        return n
    return max(lo - start + left, 0)
