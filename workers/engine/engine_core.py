"""The engine's state and one step of work; everything here runs on the engine thread except the
read-only helpers marked thread-safe (and, in overlap mode, the forward on the ForwardWorker's).

A step has three parts: the forward and sampling (ForwardWorker), the token-level updates the next
schedule depends on (`_apply_tokens`), and the text-level work nothing in scheduling depends on
but stop strings (`_apply_text`: detokenization, stop strings, chunks). The overlap mode runs the
text of step N while the forward of step N+1 runs. A stop string found then finishes a sequence
that is already in step N+1: that step's token for it is dropped, and its KV is released at the
next step boundary, never while a forward that writes it is in flight.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from radixserve.workers.constrained.grammar_backend import GrammarBackend
from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.engine.detokenizer import IncrementalDetokenizer
from radixserve.workers.engine.output_processor import OutputProcessor
from radixserve.workers.engine.request import Req, ReqStatus
from radixserve.workers.engine.scheduler import Scheduler
from radixserve.workers.engine.step_stats import StepStats
from radixserve.workers.executor.cpu_runtime import tune_malloc
from radixserve.workers.executor.forward_worker import ForwardJob, ForwardWorker
from radixserve.workers.executor.model_runner import ModelRunner
from radixserve.workers.executor.plan import BatchKind
from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.mem_cache.memory import max_tokens_for_memory
from radixserve.workers.mem_cache.prefix_cache import NullCache
from radixserve.workers.mem_cache.radix_cache import RadixCache
from radixserve.workers.mem_cache.req_to_token_pool import ReqToTokenPool
from radixserve.workers.models.loader import load_model
from radixserve.workers.protocol import GenerateRequest, InvalidRequest, check_context_length
from radixserve.workers.sampling.sampler import Sampler

logger = logging.getLogger("radixserve.engine")

# Without --mem-fraction-static or --max-total-tokens a CPU replica takes this share of memory for
# weights + KV (GPU servers default higher; CPU hosts share memory with everything else).
DEFAULT_CPU_MEM_FRACTION = 0.2
IDLE_POLL_S = 0.5
GRAMMAR_POLL_S = 0.002  # while only grammar compiles are pending


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        tune_malloc()
        loaded = load_model(
            config.model_path,
            dtype=None if config.dtype == "auto" else config.dtype,
            attention_backend=config.attention_backend,
        )
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.model_path
        self.served_model_name = config.served_model_name or loaded.name
        self.context_length = config.context_cap(mc.context_length)
        self.pool = KVPool(
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            self._pool_tokens(loaded),
            dtype=mc.dtype,
            page_size=config.page_size,
        )
        self.req_pool = ReqToTokenPool(config.max_running_requests + 1, self.context_length + 1)
        self.cache = (
            NullCache(self.pool, page_size=config.page_size)
            if config.disable_radix_cache
            else RadixCache(
                self.pool, page_size=config.page_size, eviction_policy=config.radix_eviction_policy
            )
        )
        self.scheduler = Scheduler(config, self.pool, self.req_pool, self.cache)
        self.runner = ModelRunner(loaded.model, self.pool, self.req_pool)
        self.vocab_size = len(self.tokenizer)
        self.sampler = Sampler(self.vocab_size, mc.eos_token_ids, seed=config.random_seed)
        self.outputs = OutputProcessor(
            self.tokenizer,
            mc.eos_token_ids,
            self.context_length,
            config.stream_interval,
            config.enable_jump_forward,
        )
        self.overlap = config.overlap
        self.worker = ForwardWorker(self.runner, self.sampler, threaded=self.overlap)
        self._prev: ForwardJob | None = None  # overlap: the step whose text is still to do
        self._grammars: GrammarBackend | None = None
        self._bitmask: torch.Tensor | None = None
        self.grammar_wait: list[tuple[Any, list[Req]]] = []  # (compile future, sequences)
        self.streaming: set[str] = set()
        self.by_rid: dict[str, list[Req]] = {}
        self.unsent: set[str] = set()  # keys of sequences whose final chunk has not gone out
        self.timing = StepStats()
        self.counters = dict(
            prompt_tokens_total=0,
            cached_tokens_total=0,
            computed_tokens_total=0,
            num_requests_total=0,
            num_aborted_total=0,
        )

    @property
    def grammars(self) -> GrammarBackend:
        """Built on first use: making xgrammar's view of the vocabulary takes a moment."""
        if self._grammars is None:
            self._grammars = GrammarBackend(
                self.tokenizer,
                self.model_config.vocab_size,
                self.model_config.eos_token_ids,
                compile_timeout_s=self.config.grammar_compile_timeout_s,
            )
            self._bitmask = self._grammars.allocate_bitmask(self.config.max_running_requests + 1)
        return self._grammars

    def _pool_tokens(self, loaded: Any) -> int:
        mc = loaded.config
        if self.config.max_total_tokens:
            return self.config.max_total_tokens
        weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        per_token = KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype)
        fraction = self.config.mem_fraction_static or DEFAULT_CPU_MEM_FRACTION
        return max_tokens_for_memory(fraction, weight_bytes, per_token)

    # Thread-safe helpers ---------------------------------------------------------------------
    def make_reqs(self, request: GenerateRequest) -> list[Req]:
        """Validate a request and build its n sequences (does not touch engine state)."""
        ids, p = request.input_ids, request.sampling_params
        p.validate(self.vocab_size)
        if not ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequest(f"input_ids must be integers in [0, {self.vocab_size})", "input_ids")
        check_context_length(len(ids), p.max_new_tokens, self.context_length)
        if len(ids) >= self.pool.size:
            raise InvalidRequest(
                f"the prompt ({len(ids)} tokens) does not fit in the KV cache ({self.pool.size} tokens)",
                "prompt",
                code="context_length_exceeded",
            )
        if p.grammar is not None:
            self.grammars.validate(*p.grammar)  # malformed grammars: 400 before queueing
        reqs = []
        for i in range(p.n):
            req = Req(request.rid, i, list(ids), p, request.namespace)
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens, p.stop)
            if p.seed is not None:
                req.generator = self.sampler.make_generator(p.seed + i)
            reqs.append(req)
        if request.stream:
            self.streaming.add(request.rid)
        return reqs

    def num_running(self) -> int:
        return len({r.rid for r in self.scheduler.running})

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.grammar_wait) or self._prev is not None

    def stats(self) -> dict[str, Any]:
        sched = self.scheduler
        return dict(
            running=len(sched.running),
            queued=len(sched.waiting),
            kv_total=self.pool.size,
            kv_free=self.pool.available(),
            kv_evictable=self.cache.evictable_size(),
            kv_protected=self.cache.protected_size(),
            num_retractions=sched.num_retractions,
            **self.counters,
            **self.outputs.counters,
            **self.timing.summary(),
        )

    # Engine thread ---------------------------------------------------------------------------
    def add(self, reqs: list[Req]) -> None:
        self.by_rid[reqs[0].rid] = reqs
        self.unsent.update(r.key for r in reqs)
        grammar = reqs[0].params.grammar
        if grammar is not None:
            # Compiles run off this thread; the request waits in the grammar queue meanwhile.
            self.grammar_wait.append((self.grammars.submit(*grammar), reqs))
            return
        for r in reqs:
            self.scheduler.add(r)

    def idle_timeout(self) -> float | None:
        """How long the loop may block for new commands: not at all while there is work."""
        if self.scheduler.has_work() or self._prev is not None:
            return None
        return GRAMMAR_POLL_S if self.grammar_wait else IDLE_POLL_S

    def _poll_grammars(self, out: list) -> None:
        still = []
        for fut, reqs in self.grammar_wait:
            if all(r.aborted for r in reqs):
                for r in reqs:
                    r.status = ReqStatus.FINISHED
                    self._emit_final(r, out)
            elif not fut.done():
                still.append((fut, reqs))
            elif fut.exception() is not None:
                for r in reqs:
                    r.status = ReqStatus.FINISHED
                    self.unsent.discard(r.key)
                self.by_rid.pop(reqs[0].rid, None)
                self.streaming.discard(reqs[0].rid)
                out.append((reqs[0].rid, fut.exception()))
            else:
                first = self.grammars.new_matcher(fut.result())
                for i, r in enumerate(reqs):
                    r.grammar = first if i == 0 else first.copy()
                    self.scheduler.add(r)
        self.grammar_wait = still

    def abort(self, rid: str) -> None:
        for r in self.by_rid.get(rid, ()):
            if r.finish_reason is None:  # one that finished already keeps its reason
                r.aborted = True
                r.finish("abort", message="aborted by the client")

    def flush_cache(self) -> bool:
        """Between steps only; refused while any request is in flight. Sequences whose final chunk
        went out are released first (that normally waits for the next step boundary, and in overlap
        mode for the forward that still included them), so a client that got its answer can flush."""
        self._release_finished()
        if self.by_rid or self.scheduler.has_work():  # by_rid: a request still owes a chunk
            return False
        return bool(self.cache.reset())

    def step(self, deliver: Callable[[list], None]) -> None:
        """Run one batch; hand (rid, OutputChunk | Exception) items to `deliver` once.

        In overlap mode the previous batch's text is produced and delivered while this batch's
        forward runs, and this batch's text waits for the next call."""
        out: list[tuple[str, Any]] = []
        t0 = time.perf_counter()
        job = self._begin(out)
        t1 = time.perf_counter()
        if not self.overlap:
            if job is not None:
                self.worker.run(job)
                self._apply_tokens(job)
            t2 = time.perf_counter()
            self._apply_text(job, out)
            deliver(out)
            tokens_s = t2 - job.ended_at if job is not None else 0.0
            self._record(job, host=(t1 - t0) + tokens_s, text=time.perf_counter() - t2, hidden=0.0)
            return
        if job is not None:
            self.worker.launch(job)
        prev, self._prev = self._prev, None
        try:
            self._apply_text(prev, out)
            deliver(out)
        finally:
            t2 = time.perf_counter()
            self.worker.wait()
        if job is None:
            self._record(None, host=t1 - t0, text=t2 - t1, hidden=0.0)
            return
        t3 = time.perf_counter()
        self._apply_tokens(job)
        self._prev = job
        hidden = max(0.0, min(t2, job.ended_at) - job.launched_at)
        self._record(job, host=(t1 - t0) + (time.perf_counter() - t3), text=t2 - t1, hidden=hidden)

    def _record(self, job: ForwardJob | None, host: float, text: float, hidden: float) -> None:
        if job is None:
            self.timing.record_idle(host, text)
            return
        plan = job.plan
        self.timing.record(
            plan.kind.value,
            len(plan.reqs),
            plan.num_tokens,
            schedule=host,
            forward=job.forward_s,
            sample=job.sample_s,
            text=text,
            hidden=hidden,
        )

    def _begin(self, out: list) -> ForwardJob | None:
        """Step-boundary housekeeping (nothing is in flight), then the next plan and its tensors."""
        if self.grammar_wait:
            self._poll_grammars(out)
        for req in self.scheduler.take_aborted():
            req.finish("abort", message="aborted")
            self._emit_final(req, out)
        self._release_finished()
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        if plan.kind is BatchKind.PREFILL:
            self.counters["computed_tokens_total"] += plan.num_tokens
        return self.worker.prepare(plan, self._bitmask)

    def _release_finished(self) -> None:
        """Free the KV of sequences that finished since the last boundary (their final chunk may
        have gone out already). A stop string can finish a retracted sequence: it leaves the queue."""
        for req in [r for r in self.scheduler.running if r.finish_reason is not None]:
            self.scheduler.finish(req)
        if any(r.finish_reason is not None for r in self.scheduler.waiting):
            for req in [r for r in self.scheduler.waiting if r.finish_reason is not None]:
                req.status = ReqStatus.FINISHED
            self.scheduler.waiting = deque(r for r in self.scheduler.waiting if r.finish_reason is None)

    def _apply_tokens(self, job: ForwardJob) -> None:
        """Token-level results of a step: what the next schedule depends on."""
        plan = job.plan
        self.scheduler.after_step(plan)
        for req, m in zip(plan.reqs, plan.sample_mask):
            if m and req.params.max_new_tokens == 0:
                req.finish("length")
        self.outputs.append_sampled(job.reqs, job.tokens, job.logprobs)

    def _apply_text(self, job: ForwardJob | None, out: list) -> None:
        """Text-level results of a step: detokenize, match stop strings, build chunks."""
        if job is None:
            return
        for req, m in zip(job.plan.reqs, job.plan.sample_mask):
            if not m or req.key not in self.unsent:
                continue  # mid-prefill, or aborted meanwhile (its final chunk went out)
            self.outputs.detokenize(req)
            if req.finish_reason is not None:
                self._emit_final(req, out)
            elif req.rid in self.streaming:
                chunk = self.outputs.take_chunk(req)
                if chunk is not None:
                    out.append((req.rid, chunk))

    def _emit_final(self, req: Req, out: list) -> None:
        """Emit a finished sequence's final chunk (once); its KV is released separately."""
        if req.key not in self.unsent:
            return
        self.unsent.discard(req.key)
        out.append((req.rid, self.outputs.take_chunk(req)))
        self.counters["prompt_tokens_total"] += len(req.origin_input_ids)
        self.counters["cached_tokens_total"] += req.cached_tokens or 0
        self.counters["num_requests_total"] += req.index == 0
        if req.finish_reason and req.finish_reason["type"] == "abort":
            self.counters["num_aborted_total"] += req.index == 0
        if not any(r.key in self.unsent for r in self.by_rid.get(req.rid, ())):
            self.by_rid.pop(req.rid, None)
            self.streaming.discard(req.rid)

    def fail_all(self, message: str) -> list[tuple[str, Any]]:
        """Finish every request with an abort (after an internal error or at shutdown). Call with
        no forward in flight."""
        out: list[tuple[str, Any]] = []
        prev, self._prev = self._prev, None
        try:
            self._apply_text(prev, out)  # sequences that did finish keep their real final chunk
        except Exception:
            logger.exception("producing the last outputs failed")
        for req in list(self.scheduler.running):
            req.finish("abort", message=message)
            self.scheduler.finish(req)
        for reqs in list(self.by_rid.values()):
            for req in reqs:
                if req.key in self.unsent:
                    req.finish("abort", message=message)
                    if req.status is not ReqStatus.FINISHED:
                        self.scheduler.release(req)
                    self._emit_final(req, out)
        self.scheduler.waiting.clear()
        self.grammar_wait.clear()
        return out

    def close(self) -> None:
        self.worker.close()
