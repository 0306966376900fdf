"""Runs one planned batch through the model and the sampler, inline or on a thread of its own.

The overlap loop launches step N+1 here and, while it runs, turns step N's tokens into text on the
engine thread. What the engine thread may do meanwhile is the contract below.

Failures are kept to the sequences that cause them where that can be known: a sequence whose
sampling preparation or sampling fails is reported in `ForwardJob.failed` and sampled as a
placeholder row whose token nobody uses; a failing forward fails the whole batch (`run` raises).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from radixserve.workers.constrained.grammar import apply_bitmask
from radixserve.workers.executor.input_logprobs import InputLogprobRows
from radixserve.workers.executor.model_runner import ModelRunner
from radixserve.workers.executor.plan import ScheduledBatch
from radixserve.workers.models.forward_batch import ForwardBatch
from radixserve.workers.protocol import SamplingParams
from radixserve.workers.sampling.sampler import Sampler, SamplerRow, SamplingBatch

if TYPE_CHECKING:
    from radixserve.workers.engine.request import Req

logger = logging.getLogger("radixserve.engine")

# A test hook: called as hook(stage, req) for every sequence at each stage of a step ("prepare",
# "forward", "sample" here; "tokens", "text" in the engine); what it raises is that stage failing
# for that sequence. Settable from Python only (ForwardWorker.fault_hook), never from a request.
FaultHook = Callable[[str, "Req"], None]

# Sampled in place of a sequence whose preparation failed, so that the batch keeps its shape.
_PLACEHOLDER = SamplerRow(SamplingParams(temperature=0.0), [], [], None)


@dataclass
class ForwardJob:
    """One step: the plan, its tensors, and (after `run`) the sampled tokens."""

    plan: ScheduledBatch
    batch: ForwardBatch
    rows: list[int]  # logits rows that are sampled (plan positions with a token to sample)
    reqs: list[Req]  # the sequence of each sampled row
    sampling: SamplingBatch | None
    bitmask: torch.Tensor | None  # filled for the constrained rows, None if there are none
    constrained: list[int]
    # Sequences that failed their own part of the step, with the stage and the error; their rows
    # are sampled as placeholders and their tokens must be dropped.
    failed: list[tuple[Req, str, BaseException]] = field(default_factory=list)
    launched_at: float = 0.0
    input_rows: InputLogprobRows | None = None  # the extra logits rows for prompt logprobs
    # Results, written by `run`
    tokens: list[int] = field(default_factory=list)
    logprobs: list | None = None
    # Per sequence that wanted prompt logprobs: (sequence, first position, its logprobs)
    input_logprobs: list[tuple[Req, int, list]] | None = None
    forward_s: float = 0.0
    sample_s: float = 0.0
    ended_at: float = 0.0


class ForwardWorker:
    """`prepare` runs on the engine thread; `run` (inline, on a thread set up by `init_thread`) or
    `launch` + `wait` (threaded) do the forward and the sampling.

    Between `launch` and `wait` the engine thread must not allocate or free KV slots, write the
    request-to-token table, touch the bitmask or the sampler, or change the planned requests'
    token lists: the forward reads and writes them. Grammar matchers are only used by `prepare`.
    """

    def __init__(self, runner: ModelRunner, sampler: Sampler, threaded: bool):
        self.runner = runner
        self.sampler = sampler
        # torch's intra-op thread count is per thread (OpenMP): a thread starts with its creator's
        # count and misses later changes made elsewhere, so forward threads set it explicitly.
        self.num_threads = torch.get_num_threads()
        self._jobs: queue.SimpleQueue | None = None
        self._inflight: tuple[ForwardJob, Future] | None = None
        self.fault_hook: FaultHook | None = None  # tests only; see FaultHook
        if threaded:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, name="radixserve-forward", daemon=True).start()

    def check_fault(self, stage: str, req: Req) -> None:
        if self.fault_hook is not None:
            self.fault_hook(stage, req)

    def prepare(self, plan: ScheduledBatch, bitmask: torch.Tensor | None) -> ForwardJob:
        """Host-side tensors for the model and the sampler; fills the grammar bitmask. Raises only
        for what concerns the whole batch (its tensors)."""
        picked = [
            (i, r)
            for i, (r, m) in enumerate(zip(plan.reqs, plan.sample_mask))
            if m and r.params.max_new_tokens > 0
        ]
        reqs = [r for _, r in picked]
        rows: list[SamplerRow] = []
        constrained: list[int] = []
        failed: list[tuple[Req, str, BaseException]] = []
        for k, r in enumerate(reqs):
            try:
                self.check_fault("prepare", r)
                if r.grammar is not None:
                    r.grammar.fill_bitmask(bitmask, k)
                    constrained.append(k)
                rows.append(_sampler_row(r))
            except Exception as exc:
                failed.append((r, "prepare", exc))
                rows.append(_PLACEHOLDER)
        input_rows = InputLogprobRows.from_plan(plan)
        return ForwardJob(
            plan,
            self.runner.prepare(plan, input_rows.token_rows if input_rows is not None else None),
            [i for i, _ in picked],
            reqs,
            self._prepare_sampling(rows, reqs, failed) if reqs else None,
            bitmask if constrained else None,
            constrained,
            failed,
            input_rows=input_rows,
        )

    def _prepare_sampling(self, rows: list[SamplerRow], reqs: list[Req], failed: list) -> SamplingBatch:
        try:
            return self.sampler.prepare(rows)
        except Exception:
            logger.warning("preparing the sampling batch failed; checking its rows one by one", exc_info=True)
        # Find the rows that fail on their own; the others are still sampled together.
        for k, (row, r) in enumerate(zip(rows, reqs)):
            if row is _PLACEHOLDER:
                continue
            try:
                self.sampler.prepare([row])
            except Exception as exc:
                failed.append((r, "prepare", exc))
                rows[k] = _PLACEHOLDER
        return self.sampler.prepare(rows)

    @torch.inference_mode()
    def run(self, job: ForwardJob) -> ForwardJob:
        """The forward and the sampling. Raises if the forward fails (the whole batch fails).
        In inference mode: the logits are inference tensors, which the bitmask and the sampler
        update in place."""
        t0 = time.perf_counter()
        for r in job.plan.reqs:
            self.check_fault("forward", r)
        logits = self.runner.forward(job.batch)
        if job.input_rows is not None:
            b = job.batch.batch_size
            job.input_logprobs = job.input_rows.compute(logits[b:])
            logits = logits[:b]
        t1 = time.perf_counter()
        if job.rows:
            if len(job.rows) != logits.shape[0]:
                logits = logits[torch.tensor(job.rows, device=logits.device)]
            if job.constrained:
                assert job.bitmask is not None, "constrained rows come with their bitmask"
                apply_bitmask(logits, job.bitmask, job.constrained)
            self._sample(logits, job)
        job.ended_at = time.perf_counter()
        job.forward_s, job.sample_s = t1 - t0, job.ended_at - t1
        return job

    def _sample(self, logits: torch.Tensor, job: ForwardJob) -> None:
        skip = {r.key for r, _, _ in job.failed}
        try:
            for r in job.reqs:
                if r.key not in skip:
                    self.check_fault("sample", r)
            assert job.sampling is not None, "a job with rows to sample has their sampling batch"
            result = self.sampler.sample(logits, job.sampling)
            job.tokens, job.logprobs = result.token_ids, result.logprobs
            return
        except Exception:
            logger.warning("sampling the batch failed; sampling its rows one by one", exc_info=True)
        # Each row alone: the rows are independent, so only the failing ones lose their token.
        tokens: list[int] = []
        logprobs: list = []
        for k, r in enumerate(job.reqs):
            tokens.append(-1)
            logprobs.append(None)
            if r.key in skip:
                continue
            try:
                self.check_fault("sample", r)
                one = self.sampler.sample(logits[k : k + 1], self.sampler.prepare([_sampler_row(r)]))
            except Exception as exc:
                job.failed.append((r, "sample", exc))
                continue
            tokens[k] = one.token_ids[0]
            logprobs[k] = one.logprobs[0] if one.logprobs else None
        job.tokens = tokens
        job.logprobs = logprobs if any(lp is not None for lp in logprobs) else None

    # Threaded mode ---------------------------------------------------------------------------
    def launch(self, job: ForwardJob) -> None:
        assert self._jobs is not None and self._inflight is None, "one job at a time, threaded only"
        fut: Future = Future()
        job.launched_at = time.perf_counter()
        self._inflight = (job, fut)
        self._jobs.put((job, fut))

    def wait(self) -> ForwardJob | None:
        """The launched job once it has run (re-raises its error); None if nothing is in flight."""
        if self._inflight is None:
            return None
        job, fut = self._inflight
        try:
            fut.result()
        finally:
            self._inflight = None
        return job

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)

    def init_thread(self) -> None:
        """Set up the calling thread to run forwards (grad mode and thread count are per thread)."""
        torch.set_grad_enabled(False)
        torch.set_num_threads(self.num_threads)
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)  # the current device is per thread

    def init_engine_thread(self) -> None:
        """Set up the engine thread: it runs the forwards inline, or in threaded mode only small
        host-side ops, kept serial so that the forward thread owns the process's one OpenMP team
        (see cpu_runtime.on_short_lived_thread)."""
        self.init_thread()
        if self._jobs is not None:
            torch.set_num_threads(1)

    def _serve(self) -> None:
        self.init_thread()
        jobs = self._jobs
        assert jobs is not None, "the forward thread runs only in overlap mode"
        while True:
            item: Any = jobs.get()
            if item is None:
                return
            job, fut = item
            try:
                self.run(job)
                fut.set_result(job)
            except BaseException as exc:  # handed to the engine thread, which fails the requests
                fut.set_exception(exc)


def _sampler_row(r: Req) -> SamplerRow:
    # A grammar decides when the output may end: min_new_tokens must not mask the stop tokens
    # it allows (that could leave a row with nothing to sample).
    params = (
        replace(r.params, min_new_tokens=0) if r.grammar is not None and r.params.min_new_tokens else r.params
    )
    return SamplerRow(params, r.origin_input_ids, r.output_ids, r.generator)
