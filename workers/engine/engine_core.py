"""The engine's state and one step of work; everything here runs on the engine thread except
`make_reqs` and the read-only helpers marked thread-safe (and, in overlap mode, the forward on
the ForwardWorker's thread).

A step has three parts: the forward and sampling (ForwardWorker), the token-level updates the next
schedule depends on (`_apply_tokens`), and the text-level work nothing in scheduling depends on
but stop strings (`_apply_text`: detokenization, stop strings, chunks). The overlap mode runs the
text of step N while the forward of step N+1 runs. A stop string found then finishes a sequence
that is already in step N+1: that step's token for it is dropped, and its KV is released at the
next step boundary, never while a forward that writes it is in flight.

Failures stay with the request that causes them where that can be known: its own part of a step
(sampling preparation, sampling, grammar matching, output processing, detokenization) failing
fails that request only; a failing forward fails the requests of its batch. Either way each of
them gets an EngineError on its stream, and the others keep running.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from radixserve.kernels import OPENMP_SPIN_UNSET
from radixserve.workers.distributed.device import resolve_device
from radixserve.workers.distributed.launch import RankLauncher
from radixserve.workers.engine.commands import (
    AbortRequest,
    AddRequest,
    CacheSummary,
    Command,
    FlushCache,
    RankTransfersOpen,
    RenewReservations,
    ReserveRequest,
    Stop,
)
from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.engine.grammar_queue import GrammarQueue
from radixserve.workers.engine.inflight import InflightRequests
from radixserve.workers.engine.kv_handoff import make_connector, rank_kv_spec
from radixserve.workers.engine.output_processor import OutputProcessor
from radixserve.workers.engine.request import Req, ReqStatus
from radixserve.workers.engine.request_builder import RequestBuilder
from radixserve.workers.engine.scheduler import Scheduler
from radixserve.workers.engine.step_stats import StepStats
from radixserve.workers.engine.token_latency import TokenLatency
from radixserve.workers.engine.watchdog import StepWatchdog
from radixserve.workers.executor.cpu_runtime import tune_malloc
from radixserve.workers.executor.forward_worker import ForwardJob, ForwardWorker
from radixserve.workers.executor.model_runner import ModelRunner
from radixserve.workers.executor.plan import BatchKind, ScheduledBatch
from radixserve.workers.executor.tp_kv import KVLayout, fingerprint_of
from radixserve.workers.executor.tp_leader import TPLeader
from radixserve.workers.executor.tp_orders import LoRASlotOrder
from radixserve.workers.lora.adapter import LoRAError, config_rank
from radixserve.workers.lora.manager import LoRAManager
from radixserve.workers.mem_cache.disk_tier import DiskTier
from radixserve.workers.mem_cache.host_tier import HostTier
from radixserve.workers.mem_cache.kv_pool import KVPool, pool_dtype
from radixserve.workers.mem_cache.memory import max_tokens_for_memory
from radixserve.workers.mem_cache.prefix_cache import NullCache
from radixserve.workers.mem_cache.radix_cache import RadixCache
from radixserve.workers.mem_cache.req_to_token_pool import ReqToTokenPool
from radixserve.workers.models.loader import load_model, resolve_quantization
from radixserve.workers.models.quant_weight import weight_nbytes
from radixserve.workers.protocol import (
    EngineError,
    EngineLoad,
    FinishKind,
    GenerateRequest,
    InvalidRequest,
)
from radixserve.workers.sampling.sampler import Sampler

logger = logging.getLogger("radixserve.engine")

# Without --mem-fraction-static or --max-total-tokens a CPU replica takes this share of memory for
# weights + KV (CPU hosts share memory with everything else); a GPU replica takes most of its GPU.
DEFAULT_CPU_MEM_FRACTION = 0.2
DEFAULT_GPU_MEM_FRACTION = 0.85
IDLE_POLL_S = 0.5
GRAMMAR_POLL_S = 0.002  # while only grammar compiles are pending
TRANSFER_POLL_S = 0.002  # while only KV transfers are pending
DEFAULT_MAX_LORA_RANK = 16  # the batch buffers' rank when no start-up adapter needs more


class EngineCore:
    def __init__(self, config: EngineConfig, rank_launcher: RankLauncher | None = None):
        """`rank_launcher` starts the other ranks at tp_size > 1 (default: local processes)."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        tune_malloc()
        self.device = resolve_device(config.device)  # a missing GPU fails here, before any rank starts
        if self.device.type == "cpu" and OPENMP_SPIN_UNSET:
            logger.warning(
                "torch was imported before radixserve, so OpenMP's idle workers keep spinning on the "
                "cores the kernels compute on (decode steps up to ~1.4x slower): import radixserve "
                "first, or set GOMP_SPINCOUNT=1000 in the environment"
            )
        dtype = None if config.dtype == "auto" else config.dtype
        # Resolved once here, so that every rank computes from the same form.
        quantization = resolve_quantization(
            config.quantization, config.model_path, dtype, self.device, config.deterministic
        )
        self.tp = TPLeader.start(
            config.parallel,
            config.model_path,
            dtype,
            config.attention_backend,
            config.num_threads,
            rank_launcher,
            kv=rank_kv_spec(config),
            device=self.device.type,
            lora=_lora_layout(config),
            quantization=quantization,
            quantized_activations=config.quantized_activations,
        )
        try:
            loaded = load_model(
                config.model_path,
                dtype,
                config.attention_backend,
                self.tp.parallel,
                self.device,
                deterministic=config.deterministic,
                quantization=quantization,
                quantized_activations=config.quantized_activations,
            )
            mc = loaded.config
            self.lora = _lora_manager(config, loaded.model, mc.dtype, self.device, self.tp)
            kv_dtype = pool_dtype(
                config.kv_cache_dtype,
                mc.dtype,
                str(loaded.model.backend.name),
                mc.head_dim,
                mc.num_heads // mc.num_kv_heads,
                self.device,
            )
            self.pool = loaded.kv_pool(
                self._pool_tokens(loaded, kv_dtype), kv_dtype, self.device, config.page_size
            )
            self.tp.share_pool(self.pool.size, config.page_size, kv_dtype)
        except BaseException as exc:
            self.tp.abort(f"rank 0 failed to start: {exc}")
            raise
        self.model_config = mc
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.model_path
        self.served_model_name = config.served_model_name or loaded.name
        self.context_length = config.context_cap(mc.context_length)
        self.req_pool = ReqToTokenPool(
            config.max_running_requests + 1, self.context_length + 1, device=self.device
        )
        self.disk_tier = _disk_tier(config)
        self.cache = (
            NullCache(self.pool, page_size=config.page_size)
            if config.disable_radix_cache
            else RadixCache(
                self.pool,
                page_size=config.page_size,
                eviction_policy=config.radix_eviction_policy,
                host_tier=HostTier.from_gb(self.pool, config.hicache_host_size),
                disk_tier=self.disk_tier,
            )
        )
        self.scheduler = Scheduler(config, self.pool, self.req_pool, self.cache, self.lora)
        self.attention_backend = str(loaded.model.backend.name)
        self.runner = ModelRunner(
            self.tp.wrap(loaded.model), self.pool, self.req_pool, self.device, self.lora
        )
        if self._use_cuda_graphs(loaded.model):
            self.runner.capture_decode_graphs(min(config.cuda_graph_max_bs, config.max_running_requests))
        self.vocab_size = len(self.tokenizer)
        self.sampler = Sampler(self.vocab_size, mc.eos_token_ids, self.device, seed=config.random_seed)
        self.outputs = OutputProcessor(
            self.tokenizer,
            mc.eos_token_ids,
            self.context_length,
            config.stream_interval,
            config.enable_jump_forward,
            config.stream_interval_ms / 1000.0,
        )
        self.overlap = config.overlap(self.device.type)
        self.worker = ForwardWorker(self.runner, self.sampler, threaded=self.overlap)
        self.requests = RequestBuilder(
            self.tokenizer, self.sampler, self.context_length, self.pool.size, lora=self.lora is not None
        )
        self.grammars = GrammarQueue(
            self.tokenizer,
            mc.vocab_size,
            mc.eos_token_ids,
            config.grammar_compile_timeout_s,
            config.max_running_requests + 1,
        )
        self._prev: ForwardJob | None = None  # overlap: the step whose text is still to do
        self._outbox: list[tuple[str, Any]] = []  # produced between steps, delivered by the next
        self.inflight = InflightRequests(self.outputs)
        self.connector = make_connector(
            config,
            self.scheduler,
            self.outputs,
            self.inflight,
            self.grammars,
            self.served_model_name,
            fingerprint_of(loaded),
            KVLayout.of(loaded, config.tp_size),
            self.tp.rank_transfers,
        )
        self.latency = TokenLatency()  # the load's TTFT and ITL
        self.timing = StepStats()
        self.watchdog = StepWatchdog(config.step_watchdog_s)
        self.counters = dict(computed_tokens_total=0)
        # Published at every step boundary, replaced whole (never mutated): any thread may read it.
        self.load = EngineLoad()

    def _pool_tokens(self, loaded: Any, kv_dtype: torch.dtype) -> int:
        mc = loaded.config
        if self.config.max_total_tokens:
            return self.config.max_total_tokens
        heads = loaded.local_kv_heads  # this rank's share: each rank sizes its own memory
        per_token = KVPool.bytes_per_token(mc.num_layers, heads, mc.head_dim, kv_dtype)
        if self.device.type == "cuda":
            # The fraction of the GPU's memory holds everything in use now (the weights, the CUDA
            # context, any other process) plus the pool; the rest is left to activations.
            free, total = torch.cuda.mem_get_info(self.device)
            fraction = self.config.mem_fraction_static or DEFAULT_GPU_MEM_FRACTION
            return max_tokens_for_memory(fraction, total - free, per_token, total)
        weight_bytes = weight_nbytes(loaded.model)
        if self.lora is not None:  # the batch slots' buffers, and the adapters kept in memory
            weight_bytes += self.lora.nbytes + self.lora.loaded_bytes_cap
        fraction = self.config.mem_fraction_static or DEFAULT_CPU_MEM_FRACTION
        return max_tokens_for_memory(fraction, weight_bytes, per_token)

    def _use_cuda_graphs(self, model: Any) -> bool:
        """CUDA graphs replay the decode forward of one rank: CUDA, tp_size 1, a model whose decode
        reads nothing back to the host (not MoE routing), and the Triton backend, which reads each
        row only up to its length (the torch backend would gather the graph's whole width: every
        row at the full context, every step). A prefill replica decodes no more than a first token
        per request: it captures none."""
        c = self.config
        if self.device.type != "cuda" or c.disable_cuda_graph or c.tp_size > 1 or not c.decodes:
            return False
        return getattr(model, "graph_capturable", False) and model.backend.name == "triton"

    # Thread-safe helpers ---------------------------------------------------------------------
    def make_reqs(self, request: GenerateRequest) -> list[Req]:
        """Validate a request and build its n sequences; raises InvalidRequest. Pure: it touches
        no engine state (the engine thread registers the request when it adds it)."""
        reqs = self.requests.build(request)
        self.connector.bind_tickets(reqs, request.kv_tickets)
        return reqs

    def num_running(self) -> int:
        """Sequences in the running batch."""
        return len(self.scheduler.running)

    def rank_failed(self) -> str | None:
        """Thread-safe: the failure that ended the tensor-parallel group, once one has."""
        return self.tp.failure

    def has_work(self) -> bool:
        return (
            self.scheduler.has_work()
            or bool(self.grammars)
            or self._prev is not None
            or bool(self._outbox)
            or self.connector.busy()
        )

    def stats(self) -> dict[str, Any]:
        sched = self.scheduler
        pd = self.connector.stats()
        graphs = self.runner.graphs
        return dict(
            role=self.config.role,
            tp_size=self.config.tp_size,
            device=str(self.device),
            attention_backend=self.attention_backend,
            kv_cache_dtype=str(self.pool.dtype).removeprefix("torch."),
            cuda_graph_replays=graphs.replayed if graphs is not None else 0,
            running=len(sched.running),
            queued=len(sched.waiting),
            kv_total=self.pool.size,
            kv_free=self.pool.available(),
            kv_evictable=self.cache.evictable_size(),
            kv_protected=self.cache.protected_size(),
            **self.cache.tier_stats(),
            num_retractions=sched.num_retractions,
            mixed_steps_total=sched.num_mixed_steps,
            watchdog_stalls_total=self.watchdog.stalls_total,
            watchdog_slow_total=self.watchdog.slow_total,
            **self.counters,
            **self.inflight.counters,
            **self.outputs.counters,
            **self.timing.summary(),
            **pd,
            **(self.lora.stats() if self.lora is not None else {}),
        )

    # Commands (engine thread, between steps) -------------------------------------------------
    def handle(self, cmd: Command) -> bool:
        """Run one command from the inbox; False when it says to stop."""
        match cmd:
            case AddRequest():
                self.add(cmd.reqs, cmd.stream)
            case ReserveRequest():
                self.connector.reserve(cmd, self._outbox)
            case RenewReservations():
                self.connector.renew(cmd.rids)
            case AbortRequest():
                self.abort(cmd.rid)
            case FlushCache():
                _answer(cmd.done, self.flush_cache)
            case CacheSummary():
                _answer(cmd.done, lambda: self.cache.cached_paths(cmd.max_tokens, cmd.lower))
            case RankTransfersOpen():
                _answer(cmd.done, self.rank_transfers_open)
            case Stop():
                return False
            case _:
                raise TypeError(f"not an engine command: {cmd!r}")
        return True

    def add(self, reqs: list[Req], stream: bool) -> None:
        rid = reqs[0].rid
        self.inflight.add(reqs, stream)
        if reqs[0].params.grammar is None:
            for r in reqs:
                self._schedule_new(r, self._outbox)
            return
        try:
            # The grammar is parsed and compiled off this thread; the request waits meanwhile.
            for r in reqs:
                r.status = ReqStatus.WAITING_FOR_GRAMMAR
            self.grammars.add(reqs)
        except Exception as exc:
            self.inflight.fail(
                rid, EngineError(f"starting the grammar compile failed: {exc!r}"), self._outbox
            )

    def _schedule_new(self, req: Req, out: list) -> None:
        """Hand a new sequence (its grammar compiled, if it has one) to the scheduler. A resumed
        one first replays the output its client has, as if it had generated it (the grammar,
        penalties, stop strings and counts see it); it then waits like a retracted sequence,
        whose prefill computes prompt + output and samples what comes next."""
        ids, req.resume_ids = req.resume_ids, []
        if ids:
            try:
                for token in ids:
                    self.outputs.append_token(req, token, None)
                self.outputs.detokenize(req)
                self.outputs.mark_sent(req)
            except Exception as exc:
                self.inflight.fail(
                    req.rid, EngineError(f"resuming from the tokens sent failed: {exc!r}"), out
                )
                return
            if req.finish_reason is not None:  # the output it has is complete already
                req.status = ReqStatus.FINISHED
                self.inflight.emit_final(req, out)
                return
        self.scheduler.add(req)

    def abort(self, rid: str) -> None:
        self.connector.abort(rid)
        for r in self.inflight.get(rid):
            if r.finish_reason is None:  # one that finished already keeps its reason
                r.aborted = True
                r.finish(FinishKind.ABORT, message="aborted by the client")

    def flush_cache(self) -> bool:
        """Between steps only; refused while any request is in flight. Sequences whose final chunk
        went out are released first (that normally waits for the next step boundary, and in overlap
        mode for the forward that still included them), so a client that got its answer can flush."""
        self._settle_ended(self._outbox)
        # inflight: a request still owes a chunk
        if self.inflight or self.scheduler.has_work() or self.connector.busy():
            return False
        return bool(self.cache.reset())

    def rank_transfers_open(self) -> int:
        """Between steps: the KV transfers the tensor-parallel followers hold open (0 at idle)."""
        return self.connector.open_rank_transfers()

    def rank_failure(self) -> str | None:
        """Between steps: why the tensor-parallel group can no longer serve, or None (always at
        tp_size 1). Sends the idle group its keepalives."""
        return self.tp.poll()

    def idle_timeout(self) -> float | None:
        """How long the loop may block for new commands: not at all while there is work."""
        if self._prev is None and not self._outbox and self.scheduler.only_loading():
            return TRANSFER_POLL_S  # disk reads run on the loader thread: poll, do not spin
        if self.scheduler.has_work() or self._prev is not None or self._outbox:
            return None
        if self.connector.busy():
            return TRANSFER_POLL_S
        return GRAMMAR_POLL_S if self.grammars else IDLE_POLL_S

    # One step --------------------------------------------------------------------------------
    def step(self, deliver: Callable[[list], None]) -> None:
        """Run one batch; hand (rid, OutputChunk | Exception) items to `deliver`.

        In overlap mode the previous batch's text is produced and delivered while this batch's
        forward runs, and this batch's text waits for the next call."""
        out, self._outbox = self._outbox, []
        t0 = time.perf_counter()
        job = self._begin(out)
        t1 = time.perf_counter()
        if not self.overlap:
            if job is not None:
                job = self._finish_forward(job, self.worker.run, out)
            if job is not None:
                self._apply_tokens(job, out)
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
            # What this finds goes to the outbox: delivered below, or by fail_all if the text raised.
            job = self._finish_forward(job, lambda _: self.worker.wait(), self._outbox)
        if job is not None:
            t3 = time.perf_counter()
            self._apply_tokens(job, self._outbox)
            self._prev = job
        late, self._outbox = self._outbox, []
        deliver(late)
        if job is None:
            self._record(None, host=t1 - t0, text=t2 - t1, hidden=0.0)
            return
        hidden = max(0.0, min(t2, job.ended_at) - job.launched_at)
        self._record(job, host=(t1 - t0) + (time.perf_counter() - t3), text=t2 - t1, hidden=hidden)

    def _finish_forward(self, job: ForwardJob | None, run: Callable, out: list) -> ForwardJob | None:
        """Run (or wait for) the job's forward; None if there was none or it failed."""
        if job is None:
            return None
        try:
            self.watchdog.enter("the model step (forward, sampling)", _rids(job.plan.reqs), warn_slow=False)
            run(job)
        except Exception as exc:
            self._fail_batch(job.plan, "the model step", exc, out)
            return None
        finally:
            self.watchdog.leave()
        return job

    def _record(self, job: ForwardJob | None, host: float, text: float, hidden: float) -> None:
        if job is None:
            self.timing.record_idle(host, text)
            return
        plan = job.plan
        self.scheduler.cost.observe(plan, job.forward_s + job.sample_s)
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
        if self.grammars:
            for req in self.grammars.poll(self.inflight, out):
                if not self.connector.grammar_ready(req):
                    self._schedule_new(req, out)
        self.connector.poll(out)
        self._settle_ended(out)
        plan = self.scheduler.schedule()
        self.load = dataclasses.replace(self.scheduler.load(), **self.latency.means())
        if plan is None:
            return None
        if plan.kind is BatchKind.PREFILL:
            self.counters["computed_tokens_total"] += plan.num_tokens
        try:
            self.watchdog.enter("preparing a step (tensors, grammar bitmasks)", _rids(plan.reqs))
            job = self.worker.prepare(plan, self.grammars.bitmask)
        except Exception as exc:
            self._fail_batch(plan, "preparing the model step", exc, out)
            return None
        finally:
            self.watchdog.leave()
        try:
            job.batch.layer_done = self.connector.before_forward(plan)
        except Exception as exc:  # the tensor-parallel group is gone: the engine ends
            self._fail_batch(plan, "starting the batch's KV transfers", exc, out)
            return None
        return job

    def _settle_ended(self, out: list) -> None:
        """The scheduler lets go of what ended since the last boundary; aborted (or failed)
        sequences get their ending on their stream."""
        for req in self.scheduler.take_ended(self.connector.keeps_slots):
            if req.error is not None:
                self.inflight.fail(req.rid, EngineError(req.error), out)
            else:
                req.finish(FinishKind.ABORT, message="aborted")
                self.inflight.emit_final(req, out)

    def _apply_tokens(self, job: ForwardJob, out: list) -> None:
        """Token-level results of a step: what the next schedule depends on."""
        plan = job.plan
        for req, stage, exc in job.failed:
            self.inflight.fail(req.rid, EngineError(f"{stage} of a sequence failed: {exc!r}"), out)
        for req, position, values in job.input_logprobs or ():
            if req.error is None:
                req.add_input_logprobs(position, values)
        self.scheduler.after_step(plan)
        for req, m in zip(plan.reqs, plan.sample_mask):
            if m and req.params.max_new_tokens == 0:
                req.finish(FinishKind.LENGTH)
        for k, req in enumerate(job.reqs):
            if req.error is not None:
                continue  # failed: its token (a placeholder's) is dropped
            try:
                self.watchdog.enter("appending a sampled token (grammar, jump-forward)", (req.key,))
                self.worker.check_fault("tokens", req)
                self.outputs.append_sampled(req, job.tokens[k], job.logprobs[k] if job.logprobs else None)
                self.connector.after_token(req)
            except InvalidRequest as exc:  # the request's own grammar led nowhere: a 400, not a 500
                self.inflight.fail(req.rid, exc, out)
            except Exception as exc:
                self.inflight.fail(req.rid, EngineError(f"appending a sampled token failed: {exc!r}"), out)
            finally:
                self.watchdog.leave()
        self.latency.on_tokens(r for r in job.reqs if r.error is None)

    def _apply_text(self, job: ForwardJob | None, out: list) -> None:
        """Text-level results of a step: detokenize, match stop strings, build chunks."""
        if job is None:
            return
        for req, m in zip(job.plan.reqs, job.plan.sample_mask):
            if not m or not self.inflight.owes(req):
                continue  # mid-prefill, or ended meanwhile (its final chunk or error went out)
            try:
                self.watchdog.enter("detokenizing (stop strings)", (req.key,))
                self.worker.check_fault("text", req)
                self.outputs.detokenize(req)
                if req.finish_reason is not None:
                    self.inflight.emit_final(req, out)
                elif req.rid in self.inflight.streaming:
                    chunk = self.outputs.take_chunk(req)
                    if chunk is not None:
                        out.append((req.rid, chunk))
            except Exception as exc:
                self.inflight.fail(req.rid, EngineError(f"producing the output text failed: {exc!r}"), out)
            finally:
                self.watchdog.leave()

    # Failures --------------------------------------------------------------------------------
    def _fail_batch(self, plan: ScheduledBatch, what: str, exc: BaseException, out: list) -> None:
        """A step failed as a whole: every request with a sequence in it fails."""
        logger.error("%s failed for a batch of %d sequences", what, len(plan.reqs), exc_info=exc)
        for rid in dict.fromkeys(r.rid for r in plan.reqs):
            self.inflight.fail(rid, EngineError(f"{what} failed: {exc!r}"), out)

    def fail_all(self, message: str) -> list[tuple[str, Any]]:
        """End every request with an EngineError (after an unexpected error outside any request's
        own work, or at shutdown) and release all KV. Call with no forward in flight."""
        out, self._outbox = self._outbox, []
        prev, self._prev = self._prev, None
        try:
            self._apply_text(prev, out)  # sequences that did finish keep their real final chunk
        except Exception:
            logger.exception("producing the last outputs failed")
        for rid in list(self.inflight.by_rid):
            self.inflight.fail(rid, EngineError(message), out)
        self.connector.fail_all(message)  # no transfer touches a slot after this
        self.scheduler.clear()
        self.grammars.clear()
        return out

    def close(self) -> None:
        self.watchdog.close()
        self.worker.close()
        self.grammars.close()
        self.tp.stop()
        self.connector.close()
        self.cache.close()
        if self.disk_tier is not None:
            self.disk_tier.close()
        if self.lora is not None:
            self.lora.close()


def _lora_layout(config: EngineConfig) -> tuple[int, int, int] | None:
    """(adapters per batch, the buffers' rank, adapters kept in memory), None without LoRA."""
    if not config.lora_enabled:
        return None
    rank = config.max_lora_rank
    if rank is None:
        rank = max([DEFAULT_MAX_LORA_RANK, *(config_rank(p) for p in config.lora_adapters.values())])
    return config.max_loras_per_batch, rank, config.loaded_loras_cap


def _lora_manager(
    config: EngineConfig, model: Any, dtype: torch.dtype, device: torch.device, tp: TPLeader
) -> LoRAManager | None:
    """The engine's adapters, the start-up ones loaded (a bad one fails the start, naming it).
    At tp_size > 1 every slot rank 0 fills, the other ranks fill with their shards."""
    layout = _lora_layout(config)
    if layout is None:
        return None
    manager = LoRAManager(model, *layout, dtype, device)
    if tp.world_size > 1:

        def fill_ranks(slot: int, key: tuple[str, str]) -> str | None:
            failed, _ = tp.control(LoRASlotOrder(slot, *key))
            return f"{failed} other rank(s) could not read it (see their log)" if failed else None

        manager.on_fill = fill_ranks
    adapters = config.lora_adapters
    for name, path in adapters.items():
        try:
            manager.register(name, path)
        except LoRAError as exc:
            manager.close()
            raise LoRAError(f"LoRA adapter {name!r}: {exc}") from None
    return manager


def _disk_tier(config: EngineConfig) -> DiskTier | None:
    """The disk tier in a directory of this engine's own under --hicache-disk-dir (replicas on one
    node share the parent), or None."""
    if not config.hicache_disk_dir:
        return None
    os.makedirs(config.hicache_disk_dir, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="radixserve-kv-", dir=config.hicache_disk_dir)
    return DiskTier(directory, int(config.hicache_disk_size * (1 << 30)))


def _rids(reqs: list[Req]) -> list[str]:
    return list(dict.fromkeys(r.key for r in reqs))


def _answer(fut: Future, fn: Callable[[], Any]) -> None:
    try:
        fut.set_result(fn())
    except Exception as exc:  # the caller re-raises it; the engine carries on
        fut.set_exception(exc)
