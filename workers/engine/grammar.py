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
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import xgrammar as xgr

from radixserve.workers.engine.grammar_parser import (GRAMMAR_KINDS, PARAM_OF_KIND, clean_error,
                                                      parse_grammar)
from radixserve.workers.engine.grammar_vocab import tokenizer_infos
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
    timer: Optional[threading.Timer] = None


class GrammarBackend:
    """Compiles grammars once per distinct (kind, text) and makes per-request matchers.

    `submit` never blocks: compiles run on up to `max_threads` daemon threads (xgrammar releases
    the GIL). A compile running longer than `compile_timeout_s` resolves its future with
    InvalidRequest; its thread is abandoned (xgrammar cannot be interrupted) and its slot freed, so
    one pathological grammar never starves the others. Failures are cached too, so a repeated bad
    grammar is refused at once; a timeout is remembered for `timeout_memory_s` only, since it may
    have been caused by load rather than by the grammar.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Optional[Sequence[int]] = None,
                 max_threads: int = 1, compile_timeout_s: float = 10.0, cache_size: int = 256,
                 any_whitespace: bool = False, timeout_memory_s: float = 60.0):
        if stop_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no eos_token_id; pass stop_token_ids")
            stop_token_ids = [tokenizer.eos_token_id]
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(sorted(set(stop_token_ids)))
        self.any_whitespace = any_whitespace
        text_info, json_info = tokenizer_infos(tokenizer, vocab_size, self.stop_token_ids,
                                               any_whitespace)
        text_compiler, json_compiler = (
            xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
            for info in (text_info, json_info))
        self._compilers = {"json_schema": json_compiler, "json_object": json_compiler,
                           "regex": text_compiler, "ebnf": text_compiler}
        self._max_threads = max_threads
        self._timeout_s = compile_timeout_s
        self._timeout_memory_s = timeout_memory_s
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # key -> (CompiledGrammar or InvalidRequest, monotonic expiry or None), oldest first.
        self._cache: collections.OrderedDict[_Key, tuple[object, Optional[float]]] = \
            collections.OrderedDict()
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

    def _lookup(self, key: _Key) -> Optional[object]:
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
            threading.Thread(target=self._compile, args=(job,), daemon=True,
                             name="grammar-compile").start()
            job.timer.start()

    def _compile(self, job: _Job) -> None:
        kind, text = job.key
        try:
            grammar = parse_grammar(kind, text, self.any_whitespace)
            result: object = self._compilers[kind].compile_grammar(grammar)
        except InvalidRequest as exc:
            result = exc
        except Exception as exc:  # xgrammar raises RuntimeError for what the parser let through
            result = InvalidRequest(f"{kind} failed to compile: {clean_error(exc)}",
                                    PARAM_OF_KIND[kind], "invalid_grammar")
        self._finish(job, result, timed_out=False)

    def _expire(self, job: _Job) -> None:
        kind, _ = job.key
        error = InvalidRequest(f"the {kind} grammar took longer than {self._timeout_s:g}s to "
                               f"compile; simplify it", PARAM_OF_KIND[kind],
                               "grammar_compile_timeout")
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

    def new_matcher(self, compiled: CompiledGrammar) -> "Grammar":
        """A fresh per-request matcher at the grammar's start."""
        return Grammar(xgr.GrammarMatcher(compiled), self.stop_token_ids)

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """int32 [batch_size, ceil(vocab_size / 32)], bit set = token allowed. Reuse it per step."""
        bitmask = xgr.allocate_token_bitmask(batch_size, self.vocab_size)
        # Pinned, so that apply_bitmask's copy to the GPU is asynchronous (no sync in sampling).
        return bitmask.pin_memory() if torch.cuda.is_available() else bitmask


class Grammar:
    """One sequence's position in its grammar. Used from the engine thread only."""

    def __init__(self, matcher: xgr.GrammarMatcher, stop_token_ids: Sequence[int]):
        self._matcher = matcher
        self._stop_token_ids = tuple(stop_token_ids)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row]; only stop tokens once terminated."""
        if self._matcher.is_terminated():
            bitmask[row].zero_()
            for token_id in self._stop_token_ids:
                bitmask[row, token_id // 32] |= _bit(token_id % 32)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (jump-forward retokenization, speculation)."""
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """True once a stop token was accepted at an end of the grammar: the request is done."""
        return self._matcher.is_terminated()

    def jump_forward(self) -> str:
        """The text the grammar forces next, whatever the model would say ("" if none)."""
        return self._matcher.find_jump_forward_string()

    def copy(self) -> "Grammar":
        """An independent matcher in the same state (for the n > 1 siblings of a request)."""
        return Grammar(self._matcher.fork(), self._stop_token_ids)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: Optional[list[int]] = None) -> None:
    """Set logits[r, t] = -inf where bitmask[r] disallows t, for r in rows (None: every row).

    bitmask row r belongs to logits row r; a longer (preallocated) bitmask is fine. Logit columns
    beyond the bitmask's width (vocab padding) are disallowed on the constrained rows.
    """
    if rows is not None and not rows:
        return
    bitmask = bitmask[: logits.shape[0]]
    width = bitmask.shape[-1] * 32
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows,
                                    vocab_size=min(width, logits.shape[-1]))
    if logits.shape[-1] > width:
        logits[rows if rows is not None else slice(None), width:] = float("-inf")


def jump_forward_tokens(tokenizer, grammar: Grammar, last_token: Optional[int] = None) -> list[int]:
    """Tokens for the text the grammar forces next, accepted into `grammar`; [] if none.

    Boundaries are where a naive encode of the forced text goes wrong:
    - before it, the last generated token may merge with the text's first characters in the
      tokenizer's canonical encoding; the text is encoded after `last_token` and used only if that
      reproduces `last_token` (else the text alone is encoded: valid, just not canonical);
    - after it, the last forced token may merge with what the model writes next (` "` + `}`),
      so it is held back and left to ordinary sampling.
    A token the grammar rejects (a tokenizer that adds a prefix space, a special token spelled in
    the text) ends the jump there; the tokens before it stay accepted and are returned.
    """
    text = grammar.jump_forward()
    if not text:
        return []
    ids = _encode_after(tokenizer, text, last_token)[:-1]
    special = set(tokenizer.all_special_ids)
    accepted: list[int] = []
    for token_id in ids:
        if token_id in special or not grammar.accept_token(token_id):
            break
        accepted.append(token_id)
    return accepted


def _encode_after(tokenizer, text: str, last_token: Optional[int]) -> list[int]:
    if last_token is not None:
        joined = tokenizer.encode(tokenizer.decode([last_token]) + text, add_special_tokens=False)
        if joined and joined[0] == last_token:
            return joined[1:]
    return tokenizer.encode(text, add_special_tokens=False)


def _key(kind: str, text: str) -> _Key:
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")
    if kind == "json_object":
        return kind, ""  # the text carries nothing: any JSON object
    return kind, text


def _bit(index: int) -> int:
    return 1 << index if index < 31 else -(1 << 31)  # bit 31 is the int32 sign bit


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
