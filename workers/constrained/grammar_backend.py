"""Constrained decoding on xgrammar: compile grammars off the engine thread, match them per request.

How the engine uses it (one replica has one `GrammarBackend`):

1. A request with `SamplingParams.grammar == (kind, text)` calls `backend.submit(kind, text)` and
   waits in a grammar queue until the future is done (never blocking the engine loop). A future
   that raises `InvalidRequest` finishes the request with that error (400 at the HTTP layer).
2. Otherwise `backend.new_matcher(future.result())` is the request's `Grammar` (`copy()` for each
   extra sequence when n > 1).
3. Every step, the sampler fills one bitmask row per constrained request (`fill_bitmask`) and
   calls `apply_bitmask(logits, bitmask, rows)` before temperature / top-k / top-p; rows of
   unconstrained requests are untouched.
4. After sampling, `accept_token(token)` advances the matcher; False means the sampler ignored the
   mask (a bug: abort the request). When `is_terminated()` the request finishes (reason "stop"),
   even with ignore_eos: the grammar admits nothing more.
5. Jump-forward: `jump_forward_tokens(tokenizer, grammar, last_token)` returns the forced tokens,
   already accepted by the grammar; the engine appends them and runs them as one extend step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from radixserve.workers.constrained.grammar import Grammar
from radixserve.workers.constrained.parser import GRAMMAR_KINDS, PARAM_OF_KIND, clean_error, parse_grammar
from radixserve.workers.constrained.vocab import tokenizer_infos
from radixserve.workers.protocol import InvalidRequest

CompiledGrammar = xgr.CompiledGrammar
_Key = tuple[str, str]


@dataclass(frozen=True)
class GrammarStats:
    compiles: int = 0  # compiles started (a cache miss that was not already in flight)
    cache_hits: int = 0  # submits answered from the cache (good or bad grammars)
    inflight_joins: int = 0  # submits that shared a compile already running or queued
    failures: int = 0  # compiles that ended in InvalidRequest (timeouts included)
    timeouts: int = 0
    cached: int = 0  # entries in the cache now


@dataclass
class _Job:
    key: _Key
    future: concurrent.futures.Future
    timer: threading.Timer | None = None


class GrammarBackend:
    """Compiles grammars once per distinct (kind, text) and makes per-request matchers.

    `submit` never blocks: compiles run on up to `max_threads` daemon threads (xgrammar releases
    the GIL). A compile running longer than `compile_timeout_s` resolves its future with
    InvalidRequest; its thread is abandoned (xgrammar cannot be interrupted) and its slot freed, so
    one pathological grammar never starves the others. Failures are cached too, so a repeated bad
    grammar is refused at once; a timeout is remembered for `timeout_memory_s` only, since it may
    have been caused by load rather than by the grammar.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int] | None = None,
        max_threads: int = 1,
        compile_timeout_s: float = 10.0,
        cache_size: int = 256,
        any_whitespace: bool = False,
        timeout_memory_s: float = 60.0,
    ):
        if stop_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no eos_token_id; pass stop_token_ids")
            stop_token_ids = [tokenizer.eos_token_id]
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(sorted(set(stop_token_ids)))
        self.any_whitespace = any_whitespace
        text_info, json_info = tokenizer_infos(tokenizer, vocab_size, self.stop_token_ids, any_whitespace)
        text_compiler, json_compiler = (
            xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
            for info in (text_info, json_info)
        )
        self._compilers = {
            "json_schema": json_compiler,
            "json_object": json_compiler,
            "regex": text_compiler,
            "ebnf": text_compiler,
        }
        self._max_threads = max_threads
        self._timeout_s = compile_timeout_s
        self._timeout_memory_s = timeout_memory_s
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # key -> (CompiledGrammar or InvalidRequest, monotonic expiry or None), oldest first.
        self._cache: collections.OrderedDict[_Key, tuple[object, float | None]] = collections.OrderedDict()
        self._inflight: dict[_Key, _Job] = {}
        self._pending: collections.deque[_Job] = collections.deque()
        self._running = 0
        self._counts = collections.Counter()

    # ---- compiling -------------------------------------------------------------------------

    def validate(self, kind: str, text: str) -> None:
        """Cheap synchronous check (parse only, no token masks): raises InvalidRequest if bad.

        Everything but a compile timeout is caught here, so the HTTP layer can answer 400 fast.
        """
        parse_grammar(kind, text, self.any_whitespace)

    def submit(self, kind: str, text: str) -> concurrent.futures.Future:
        """A future of the CompiledGrammar for (kind, text); it raises InvalidRequest if bad.

        Returns at once. Identical grammars share one compile and one future; do not cancel it
        (other requests may be waiting on it), just drop it.
        """
        key = _key(kind, text)
        with self._lock:
            hit = self._lookup(key)
            if hit is not None:
                self._counts["cache_hits"] += 1
                return _resolved(hit)
            job = self._inflight.get(key)
            if job is not None:
                self._counts["inflight_joins"] += 1
                return job.future
            job = _Job(key, concurrent.futures.Future())
            self._inflight[key] = job
            self._pending.append(job)
            self._counts["compiles"] += 1
            self._start_ready()
        return job.future

    def stats(self) -> GrammarStats:
        with self._lock:
            return GrammarStats(cached=len(self._cache), **self._counts)

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

    def _start_ready(self) -> None:
        # Called with the lock held.
        while self._pending and self._running < self._max_threads:
            job = self._pending.popleft()
            self._running += 1
            job.timer = threading.Timer(self._timeout_s, self._expire, (job,))
            job.timer.daemon = True
            threading.Thread(target=self._compile, args=(job,), daemon=True, name="grammar-compile").start()
            job.timer.start()

    def _compile(self, job: _Job) -> None:
        kind, text = job.key
        try:
            grammar = parse_grammar(kind, text, self.any_whitespace)
            result: object = self._compilers[kind].compile_grammar(grammar)
        except InvalidRequest as exc:
            result = exc
        except Exception as exc:  # xgrammar raises RuntimeError for what the parser let through
            result = InvalidRequest(
                f"{kind} failed to compile: {clean_error(exc)}", PARAM_OF_KIND[kind], "invalid_grammar"
            )
        self._finish(job, result, timed_out=False)

    def _expire(self, job: _Job) -> None:
        kind, _ = job.key
        error = InvalidRequest(
            f"the {kind} grammar took longer than {self._timeout_s:g}s to compile; simplify it",
            PARAM_OF_KIND[kind],
            "grammar_compile_timeout",
        )
        self._finish(job, error, timed_out=True)

    def _finish(self, job: _Job, result: object, timed_out: bool) -> None:
        with self._lock:
            if self._inflight.get(job.key) is not job:
                return  # the compile and its timer raced; the first one settled it
            del self._inflight[job.key]
            self._running -= 1
            if not timed_out:
                job.timer.cancel()
            expires = time.monotonic() + self._timeout_memory_s if timed_out else None
            self._cache[job.key] = (result, expires)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            if isinstance(result, InvalidRequest):
                self._counts["failures"] += 1
            self._counts["timeouts"] += timed_out
            self._start_ready()
        # Outside the lock: done-callbacks run here and may submit again.
        _settle(job.future, result)

    # ---- matching --------------------------------------------------------------------------

    def new_matcher(self, compiled: CompiledGrammar) -> Grammar:
        """A fresh per-request matcher at the grammar's start."""
        return Grammar(xgr.GrammarMatcher(compiled), self.stop_token_ids)

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """int32 [batch_size, ceil(vocab_size / 32)], bit set = token allowed. Reuse it per step."""
        bitmask = xgr.allocate_token_bitmask(batch_size, self.vocab_size)
        # Pinned, so that apply_bitmask's copy to the GPU is asynchronous (no sync in sampling).
        return bitmask.pin_memory() if torch.cuda.is_available() else bitmask


def _key(kind: str, text: str) -> _Key:
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")
    if kind == "json_object":
        return kind, ""  # the text carries nothing: any JSON object
    return kind, text


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
