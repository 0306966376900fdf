"""Constrained decoding on xgrammar: compile grammars in worker processes, match them per request.

How the engine uses it (one replica has one `GrammarBackend`):

1. A request with `SamplingParams.grammar == (kind, text, reasoning)` calls
   `backend.submit(kind, text, reasoning)` (reasoning: the answer follows thinking) and
   waits in a grammar queue until the future is done (never blocking the engine loop: `submit`
   does no parsing). A future that raises `InvalidRequest` finishes the request with that error
   (400 at the HTTP layer), `QueueFull` with a 503.
2. Otherwise `backend.new_matcher(future.result())` is the request's `Grammar` (`copy()` for each
   extra sequence when n > 1).
3. Every step, the sampler fills one bitmask row per constrained request (`fill_bitmask`) and
   calls `apply_bitmask(logits, bitmask, rows)` before temperature / top-k / top-p; rows of
   unconstrained requests are untouched.
4. After sampling, `accept_token(token)` advances the matcher; False means the sampler ignored the
   mask (a bug: abort the request). When `is_terminated()` the request finishes (reason "stop"),
   even with ignore_eos: the grammar admits nothing more.
5. Jump-forward: `jump_forward_tokens(tokenizer, grammar, last_token, max_tokens)` returns the
   forced tokens (from a bounded search: forced_text),
   already accepted by the grammar; the engine appends them and runs them as one extend step.
6. At shutdown, `backend.close()` stops the worker processes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from radixserve.workers.constrained.compile_worker import (
    CompileJob,
    CompileTimeout,
    CompileWorker,
    WorkerGone,
    WorkerSetup,
)
from radixserve.workers.constrained.forced_text import ForcedText
from radixserve.workers.constrained.grammar import Grammar
from radixserve.workers.constrained.parser import check_text
from radixserve.workers.constrained.vocab import tokenizer_infos
from radixserve.workers.protocol import REASONING_FORMATS, EngineError, InvalidRequest, QueueFull

logger = logging.getLogger(__name__)

CompiledGrammar = xgr.CompiledGrammar
_Key = tuple[str, str, str | None]
_FOREVER, _NOT_KEPT = None, 0.0  # how long a result is remembered
_COUNTED = {"grammar_compile_timeout": "timeouts", "grammar_compile_failed": "worker_deaths"}


@dataclass(frozen=True)
class GrammarStats:
    compiles: int = 0  # compiles queued (a cache miss that was not already in flight)
    cache_hits: int = 0  # submits answered from the cache (good or bad grammars)
    inflight_joins: int = 0  # submits that shared a compile already running or queued
    failures: int = 0  # compiles that ended in InvalidRequest (timeouts included)
    timeouts: int = 0  # compiles killed at the timeout (their worker with them)
    worker_deaths: int = 0  # workers that died during a compile (out of memory, a crash)
    refused: int = 0  # submits refused because max_pending compiles were queued already
    workers_started: int = 0  # worker processes started, replacements included
    pending: int = 0  # compiles queued now
    running: int = 0  # compiles running now
    cached: int = 0  # entries in the cache now


@dataclass
class _Job:
    key: _Key
    future: concurrent.futures.Future


class GrammarBackend:
    """Compiles grammars once per distinct (kind, text) and makes per-request matchers.

    `submit` never blocks: parsing, checks and compiles run in `max_workers` worker processes,
    each driven by a thread here; at most `max_pending` distinct compiles wait for a worker, more
    are refused with QueueFull. A compile running longer than `compile_timeout_s` resolves its
    future with InvalidRequest and its worker is killed (freeing the core) and replaced. Failures
    are cached too, so a repeated bad grammar is refused at once; a timeout or a worker's death is
    remembered for `timeout_memory_s` only, since it may have been caused by load rather than by
    the grammar. `close()` stops the workers; they also exit on their own if this process dies.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int] | None = None,
        max_workers: int = 1,
        max_pending: int = 64,
        compile_timeout_s: float = 10.0,
        cache_size: int = 256,
        any_whitespace: bool = False,
        timeout_memory_s: float = 60.0,
    ):
        if stop_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no eos_token_id; pass stop_token_ids")
            stop_token_ids = [tokenizer.eos_token_id]
        if max_workers < 1 or max_pending < 0:
            raise ValueError("max_workers must be >= 1 and max_pending >= 0")
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(sorted(set(stop_token_ids)))
        text_info, json_info = tokenizer_infos(tokenizer, vocab_size, self.stop_token_ids, any_whitespace)
        self._infos = {"json": json_info, "text": text_info}
        self._forced = ForcedText(text_info.decoded_vocab, vocab_size)
        setup = WorkerSetup(text_info.serialize_json(), json_info.serialize_json(), any_whitespace)
        self._timeout_s = compile_timeout_s
        self._timeout_memory_s = timeout_memory_s
        self._cache_size = cache_size
        self._max_pending = max_pending
        self._cond = threading.Condition()
        # key -> (CompiledGrammar or InvalidRequest, monotonic expiry or None), oldest first.
        self._cache: collections.OrderedDict[_Key, tuple[object, float | None]] = collections.OrderedDict()
        self._inflight: dict[_Key, _Job] = {}
        self._pending: collections.deque[_Job] = collections.deque()
        self._running = 0
        self._closed = False
        self._counts: collections.Counter[str] = collections.Counter()
        self._workers = [CompileWorker(setup) for _ in range(max_workers)]
        self._drivers = [
            threading.Thread(target=self._drive, args=(w,), name="grammar-compile", daemon=True)
            for w in self._workers
        ]
        for thread in self._drivers:
            thread.start()

    def submit(self, kind: str, text: str, reasoning: str | None = None) -> concurrent.futures.Future:
        """A future of the CompiledGrammar for (kind, text), constraining what follows the
        thinking of the `reasoning` convention where one is named; it raises InvalidRequest if
        bad, QueueFull if too many compiles are waiting. ValueError (at once) for an unknown kind
        or convention.

        Returns at once. Identical grammars share one compile and one future; do not cancel it
        (other requests may be waiting on it), just drop it.
        """
        try:
            check_text(kind, text)  # O(1): an oversized text is not worth shipping to a worker
        except InvalidRequest as exc:
            return _resolved(exc)
        if reasoning is not None and reasoning not in REASONING_FORMATS:
            raise ValueError(
                f"unknown reasoning format {reasoning!r}; expected one of {list(REASONING_FORMATS)}"
            )
        key = (kind, text, reasoning)
        with self._cond:
            if self._closed:
                return _resolved(EngineError("the grammar backend is closed"))
            hit = self._lookup(key)
            if hit is not None:
                self._counts["cache_hits"] += 1
                return _resolved(hit)
            job = self._inflight.get(key)
            if job is not None:
                self._counts["inflight_joins"] += 1
                return job.future
            if len(self._pending) >= self._max_pending:
                self._counts["refused"] += 1
                message = f"{len(self._pending)} grammars are already waiting to compile; retry later"
                return _resolved(QueueFull(message))
            job = _Job(key, concurrent.futures.Future())
            self._inflight[key] = job
            self._pending.append(job)
            self._counts["compiles"] += 1
            self._cond.notify()
        return job.future

    def _lookup(self, key: _Key) -> object | None:
        entry = self._cache.get(key)
        if entry is None:
            return None
        value, expires = entry
        if expires is not None and time.monotonic() >= expires:
            del self._cache[key]
            return None
        self._cache.move_to_end(key)
        return value

    def stats(self) -> GrammarStats:
        with self._cond:
            return GrammarStats(
                workers_started=sum(w.starts for w in self._workers),
                pending=len(self._pending),
                running=self._running,
                cached=len(self._cache),
                **self._counts,
            )

    def worker_pids(self) -> list[int]:
        """The live worker processes (for monitoring: each may keep a core busy while it compiles)."""
        return [pid for pid in (w.pid for w in self._workers) if pid is not None]

    def close(self) -> None:
        """Kill the workers and fail whatever is queued or running (EngineError). Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            queued = list(self._pending)
            self._pending.clear()
            for job in queued:
                del self._inflight[job.key]
            self._cond.notify_all()
        for worker in self._workers:
            worker.close()
        for job in queued:
            _settle(job.future, EngineError("the grammar backend is closed"))
        for thread in self._drivers:
            thread.join(timeout=10)

    def __enter__(self) -> GrammarBackend:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- the driver threads ----------------------------------------------------------------

    def _drive(self, worker: CompileWorker) -> None:
        while (job := self._take(worker)) is not None:
            try:
                result, keep_s = self._run(worker, job)
            except Exception as exc:  # a bug here must not strand the requests waiting on the job
                logger.exception("grammar compile driver failed")
                result, keep_s = EngineError(f"compiling the grammar failed: {exc}"), _NOT_KEPT
            self._finish(job, result, keep_s)

    def _take(self, worker: CompileWorker) -> _Job | None:
        try:
            worker.start()  # warm before the next job arrives, so its timeout is all compile
        except WorkerGone as exc:
            if not self._closed:
                logger.warning("grammar compile worker: %s", exc)
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            self._running += 1
            return self._pending.popleft()

    def _run(self, worker: CompileWorker, job: _Job) -> tuple[object, float | None]:
        """(CompiledGrammar or the error for the job, how long to remember it)."""
        kind, text, reasoning = job.key
        try:
            worker.start()
        except WorkerGone as exc:
            return EngineError(f"no grammar compile worker: {exc}"), _NOT_KEPT
        try:
            compile_job = CompileJob(kind, text, reasoning)
            result = worker.compile(compile_job, self._timeout_s)
        except CompileTimeout:
            message = f"the {kind} grammar took longer than {self._timeout_s:g}s to compile; simplify it"
            return InvalidRequest(message, kind, "grammar_compile_timeout"), self._timeout_memory_s
        except WorkerGone as exc:
            if self._closed:
                return EngineError("the grammar backend is closed"), _NOT_KEPT
            logger.warning("grammar compile worker died compiling a %s: %s", kind, exc)
            message = f"compiling this {kind} killed the grammar compiler (exit code {exc.exitcode})"
            return InvalidRequest(message, kind, "grammar_compile_failed"), self._timeout_memory_s
        error = result.error()
        if error is not None:
            return error, _FOREVER
        # Releases the GIL: 65 ms for a 5 MB grammar, during which the engine thread runs on.
        info = self._infos["text" if compile_job.free_text else "json"]
        return CompiledGrammar.deserialize_json(result.grammar_json, info), _FOREVER

    def _finish(self, job: _Job, result: object, keep_s: float | None) -> None:
        with self._cond:
            del self._inflight[job.key]
            self._running -= 1
            if keep_s != _NOT_KEPT:
                expires = None if keep_s is _FOREVER else time.monotonic() + keep_s
                self._cache[job.key] = (result, expires)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            if isinstance(result, InvalidRequest):
                self._counts["failures"] += 1
                if result.code in _COUNTED:
                    self._counts[_COUNTED[result.code]] += 1
        # Outside the lock: done-callbacks run here and may submit again.
        _settle(job.future, result)

    # ---- matching --------------------------------------------------------------------------

    def new_matcher(self, compiled: CompiledGrammar) -> Grammar:
        """A fresh per-request matcher at the grammar's start."""
        return Grammar(xgr.GrammarMatcher(compiled), self.stop_token_ids, self.vocab_size, self._forced)

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """int32 [batch_size, ceil(vocab_size / 32)], bit set = token allowed. Reuse it per step."""
        return xgr.allocate_token_bitmask(batch_size, self.vocab_size)


def _resolved(value: object) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    _settle(future, value)
    return future


def _settle(future: concurrent.futures.Future, value: object) -> None:
    try:
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass  # a caller cancelled it despite the contract; nobody is waiting
