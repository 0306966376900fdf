"""Constrained requests waiting for their grammar, and the engine's one grammar backend.

Used from the engine thread only. Parsing and compiling run off it (`GrammarBackend.submit`); a
request waits here, out of the scheduler, until its compile settles. The backend itself (xgrammar's
view of the vocabulary, about a second to build) is created here at the first constrained request,
so a replica that never sees one never pays for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from radixserve.workers.constrained.grammar_backend import GrammarBackend
from radixserve.workers.engine.inflight import InflightRequests
from radixserve.workers.engine.request import Req, ReqStatus
from radixserve.workers.protocol import EngineError, InvalidRequest, QueueFull


class GrammarQueue:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        compile_timeout_s: float,
        max_rows: int,
    ):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._compile_timeout_s = compile_timeout_s
        self._max_rows = max_rows
        self._backend: GrammarBackend | None = None
        self.bitmask: torch.Tensor | None = None  # one row per sampled sequence of a step
        self.waiting: list[tuple[Future, list[Req]]] = []  # (compile, the request's sequences)

    def __len__(self) -> int:
        return len(self.waiting)

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = GrammarBackend(
                self._tokenizer,
                self._vocab_size,
                self._eos_token_ids,
                compile_timeout_s=self._compile_timeout_s,
            )
            self.bitmask = self._backend.allocate_bitmask(self._max_rows)
        return self._backend

    def add(self, reqs: list[Req]) -> None:
        """Start (or join) the compile of the request's grammar; never blocks."""
        grammar = reqs[0].params.grammar
        if grammar is None:
            raise ValueError(f"request {reqs[0].rid} has no grammar to wait for")
        self.waiting.append((self.backend.submit(*grammar), reqs))

    def poll(self, inflight: InflightRequests, out: list[tuple[str, Any]]) -> list[Req]:
        """Settle the entries whose compile is done or whose sequences were all aborted; return
        the sequences now ready to schedule (each with its own matcher). A grammar that does not
        compile ends its request with the compile's InvalidRequest (400 at the HTTP layer)."""
        ready: list[Req] = []
        still = []
        for entry in self.waiting:  # a compile may finish meanwhile: decide once per entry
            fut, reqs = entry
            if all(r.aborted for r in reqs):
                for r in reqs:
                    r.status = ReqStatus.FINISHED
                    inflight.emit_final(r, out)
            elif not fut.done():
                still.append(entry)
            elif fut.exception() is not None:
                error = fut.exception()
                if not isinstance(error, (InvalidRequest, QueueFull)):  # 400 / 503 as they are
                    error = EngineError(f"the grammar compile failed: {error!r}")
                inflight.fail(reqs[0].rid, error, out)
            else:
                try:
                    self._attach(reqs, fut.result())
                except Exception as exc:
                    inflight.fail(
                        reqs[0].rid, EngineError(f"creating a grammar matcher failed: {exc!r}"), out
                    )
                    continue
                ready.extend(reqs)
        self.waiting = still
        return ready

    def _attach(self, reqs: list[Req], compiled: Any) -> None:
        first = self.backend.new_matcher(compiled)
        for i, r in enumerate(reqs):
            r.grammar = first if i == 0 else first.copy()

    def clear(self) -> None:
        self.waiting.clear()

    def close(self) -> None:
        """Stop the compile workers (engine shutdown); queued compiles fail with EngineError."""
        if self._backend is not None:
            self._backend.close()
