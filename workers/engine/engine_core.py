"""The engine's state and one step of work; everything here runs on the engine thread except the
read-only helpers marked thread-safe."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Optional

import torch

from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.engine.detokenizer import IncrementalDetokenizer
from radixserve.workers.engine.grammar import GrammarBackend, apply_bitmask, jump_forward_tokens
from radixserve.workers.engine.kv_pool import KVPool, ReqToTokenPool, max_tokens_for_memory
from radixserve.workers.engine.model_runner import ModelRunner
from radixserve.workers.engine.output_processor import OutputProcessor
from radixserve.workers.engine.radix_cache import NullCache, RadixCache
from radixserve.workers.engine.request import Req, ReqStatus
from radixserve.workers.engine.sampler import Sampler, SamplerRow
from radixserve.workers.engine.scheduler import BatchKind, Scheduler
from radixserve.workers.engine.step_stats import StepStats
from radixserve.workers.models.loader import load_model
from radixserve.workers.protocol import GenerateRequest, InvalidRequest, OutputChunk

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
        loaded = load_model(config.model_path, dtype=None if config.dtype == "auto" else config.dtype,
                            attention_backend=config.attention_backend)
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.model_path
        self.served_model_name = config.served_model_name or loaded.name
        self.context_length = min(config.context_length or mc.context_length, mc.context_length) \
            if config.context_length else mc.context_length
        self.pool = KVPool(mc.num_layers, mc.num_kv_heads, mc.head_dim, self._pool_tokens(loaded),
                           dtype=mc.dtype, page_size=config.page_size)
        self.req_pool = ReqToTokenPool(config.max_running_requests + 1, self.context_length + 1)
        cache_cls = NullCache if config.disable_radix_cache else RadixCache
        self.cache = cache_cls(self.pool, page_size=config.page_size)
        self.scheduler = Scheduler(config, self.pool, self.req_pool, self.cache)
        self.runner = ModelRunner(loaded.model, self.pool, self.req_pool)
        self.vocab_size = len(self.tokenizer)
        self.sampler = Sampler(self.vocab_size, mc.eos_token_ids, seed=config.random_seed)
        self.outputs = OutputProcessor(mc.eos_token_ids, self.context_length, config.stream_interval)
        self._grammars: Optional[GrammarBackend] = None
        self.grammar_wait: list[tuple[Any, list[Req]]] = []  # (compile future, sequences)
        self.streaming: set[str] = set()
        self.by_rid: dict[str, list[Req]] = {}
        self.timing = StepStats()
        self.counters = dict(prompt_tokens_total=0, cached_tokens_total=0, computed_tokens_total=0,
                             generation_tokens_total=0, num_requests_total=0, num_aborted_total=0,
                             jump_forward_tokens_total=0)

    @property
    def grammars(self) -> GrammarBackend:
        """Built on first use: making xgrammar's view of the vocabulary takes a moment."""
        if self._grammars is None:
            self._grammars = GrammarBackend(
                self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids,
                compile_timeout_s=self.config.grammar_compile_timeout_s)
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
        if len(ids) + p.max_new_tokens > self.context_length:
            raise InvalidRequest(
                f"This model's maximum context length is {self.context_length} tokens. However, you "
                f"requested {len(ids) + p.max_new_tokens} tokens ({len(ids)} in the prompt, "
                f"{p.max_new_tokens} for the completion). Please reduce the prompt or max tokens.",
                "max_tokens", code="context_length_exceeded")
        if len(ids) >= self.pool.size:
            raise InvalidRequest(f"the prompt ({len(ids)} tokens) does not fit in the KV cache "
                                 f"({self.pool.size} tokens)", "prompt", code="context_length_exceeded")
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
        return self.scheduler.has_work() or bool(self.grammar_wait)

    def stats(self) -> dict[str, Any]:
        sched = self.scheduler
        return dict(running=len(sched.running), queued=len(sched.waiting), kv_total=self.pool.size,
                    kv_free=self.pool.available(), kv_evictable=self.cache.evictable_size(),
                    kv_protected=self.cache.protected_size(), num_retractions=sched.num_retractions,
                    **self.counters, **self.timing.summary())

    # Engine thread ---------------------------------------------------------------------------
    def add(self, reqs: list[Req]) -> None:
        self.by_rid[reqs[0].rid] = reqs
        grammar = reqs[0].params.grammar
        if grammar is not None:
            # Compiles run off this thread; the request waits in the grammar queue meanwhile.
            self.grammar_wait.append((self.grammars.submit(*grammar), reqs))
            return
        for r in reqs:
            self.scheduler.add(r)

    def idle_timeout(self) -> Optional[float]:
        """How long the loop may block for new commands: not at all while there is work."""
        if self.scheduler.has_work():
            return None
        return GRAMMAR_POLL_S if self.grammar_wait else IDLE_POLL_S

    def _poll_grammars(self, out: list) -> None:
        still = []
        for fut, reqs in self.grammar_wait:
            if all(r.aborted for r in reqs):
                for r in reqs:
                    r.status = ReqStatus.FINISHED
                    self._finish(r, out)
            elif not fut.done():
                still.append((fut, reqs))
            elif fut.exception() is not None:
                for r in reqs:
                    r.status = ReqStatus.FINISHED
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
            if not r.finished:
                r.aborted = True
                r.finish("abort", message="aborted by the client")

    def flush_cache(self) -> bool:
        if self.scheduler.has_work():
            return False
        return bool(self.cache.reset())

    def step(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        t0 = time.perf_counter()
        if self.grammar_wait:
            self._poll_grammars(out)
        for req in self.scheduler.take_aborted():
            req.finish("abort", message="aborted")
            self._finish(req, out)
        plan = self.scheduler.schedule()
        if plan is None:
            return out
        t1 = time.perf_counter()
        batch = self.runner.prepare(plan)
        logits = self.runner.forward(batch)
        t2 = time.perf_counter()
        sampled = [(i, r) for i, (r, m) in enumerate(zip(plan.reqs, plan.sample_mask))
                   if m and r.params.max_new_tokens > 0]
        tokens, logprobs = self._sample(logits, [i for i, _ in sampled], [r for _, r in sampled])
        t3 = time.perf_counter()
        self.scheduler.after_step(plan)
        if plan.kind is BatchKind.PREFILL:
            self.counters["computed_tokens_total"] += plan.num_tokens
        for req, m in zip(plan.reqs, plan.sample_mask):
            if m and req.params.max_new_tokens == 0:
                req.finish("length")
        for k, (_, req) in enumerate(sampled):
            self.outputs.append_token(req, tokens[k], logprobs[k] if logprobs else None)
            if req.grammar is not None and req.finish_reason is None and self.config.enable_jump_forward:
                self._jump_forward(req)
        self.counters["generation_tokens_total"] += len(sampled)
        for req, m in zip(plan.reqs, plan.sample_mask):
            if req.finish_reason is not None and req.status is ReqStatus.RUNNING:
                self._finish(req, out)
            elif m and req.rid in self.streaming:
                chunk = self.outputs.take_chunk(req)
                if chunk is not None:
                    out.append((req.rid, chunk))
        t4 = time.perf_counter()
        self.timing.record(plan.kind.value, len(plan.reqs), plan.num_tokens,
                           schedule=(t1 - t0) + (t4 - t3), forward=t2 - t1, sample=t3 - t2)
        return out

    def _sample(self, logits: torch.Tensor, rows: list[int], reqs: list[Req]):
        if not rows:
            return [], None
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows)]
        constrained = [k for k, r in enumerate(reqs) if r.grammar is not None]
        if constrained:
            for k in constrained:
                reqs[k].grammar.fill_bitmask(self._bitmask, k)
            apply_bitmask(logits, self._bitmask, constrained)
        # A grammar decides when the output may end: min_new_tokens must not mask the stop tokens
        # it allows (that could leave a row with nothing to sample).
        batch = self.sampler.prepare([
            SamplerRow(replace(r.params, min_new_tokens=0) if r.grammar is not None and
                       r.params.min_new_tokens else r.params,
                       r.origin_input_ids, r.output_ids, r.generator) for r in reqs])
        result = self.sampler.sample(logits, batch)
        return result.token_ids, result.logprobs

    def _jump_forward(self, req: Req) -> None:
        """Append the tokens the grammar forces; the next step computes them all in one extend
        instead of one decode step each."""
        forced = jump_forward_tokens(self.tokenizer, req.grammar, req.output_ids[-1])
        for token in forced[:req.max_new_remaining]:
            self.outputs.append_token(req, token, None, accepted=True)
            self.counters["jump_forward_tokens_total"] += 1
            if req.finish_reason is not None:
                break

    def _finish(self, req: Req, out: list) -> None:
        """Release a finished or aborted sequence and emit its final chunk."""
        if req.status is not ReqStatus.FINISHED:
            self.scheduler.finish(req)
        chunk = self.outputs.take_chunk(req)
        out.append((req.rid, chunk))
        self.counters["prompt_tokens_total"] += len(req.origin_input_ids)
        self.counters["cached_tokens_total"] += req.cached_tokens or 0
        self.counters["num_requests_total"] += req.index == 0
        if req.finish_reason and req.finish_reason["type"] == "abort":
            self.counters["num_aborted_total"] += req.index == 0
        siblings = self.by_rid.get(req.rid, ())
        if all(r.finished for r in siblings):
            self.by_rid.pop(req.rid, None)
            self.streaming.discard(req.rid)

    def fail_all(self, message: str) -> list[tuple[str, Any]]:
        """Finish every request with an abort (after an internal error or at shutdown)."""
        out: list[tuple[str, Any]] = []
        for reqs in list(self.by_rid.values()):
            for req in reqs:
                if not req.finished:
                    req.finish("abort", message=message)
                    if req.status is ReqStatus.RUNNING:
                        self.scheduler.running.remove(req)
                    if req.status is not ReqStatus.FINISHED:
                        self.scheduler.release(req)
                    self._finish(req, out)
        self.scheduler.waiting.clear()
        self.grammar_wait.clear()
        return out
