"""The requests an engine has accepted and still owes an answer. Engine thread only.

Every request ends exactly once on its stream: with a final chunk per sequence, or with one error
in their place (`fail`): an EngineError when the engine failed it, an InvalidRequest when it is
refused after acceptance (a grammar that does not compile).
"""

from __future__ import annotations

import logging
from typing import Any

from radixserve.workers.engine.output_processor import OutputProcessor
from radixserve.workers.engine.request import Req
from radixserve.workers.protocol import EngineError, FinishKind

logger = logging.getLogger("radixserve.engine")


class InflightRequests:
    def __init__(self, outputs: OutputProcessor):
        self.outputs = outputs
        self.by_rid: dict[str, list[Req]] = {}
        self.unsent: set[str] = set()  # keys of sequences whose final chunk has not gone out
        self.streaming: set[str] = set()  # rids that get chunks as they come
        self.counters = dict(
            prompt_tokens_total=0,
            cached_tokens_total=0,
            num_requests_total=0,
            num_aborted_total=0,
            num_failed_total=0,
        )

    def __bool__(self) -> bool:
        return bool(self.by_rid)

    def add(self, reqs: list[Req], stream: bool) -> None:
        rid = reqs[0].rid
        self.by_rid[rid] = reqs
        self.unsent.update(r.key for r in reqs)
        if stream:
            self.streaming.add(rid)

    def get(self, rid: str) -> list[Req]:
        return self.by_rid.get(rid, [])

    def owes(self, req: Req) -> bool:
        """Whether the sequence's final chunk has yet to go out (and no error ended its request)."""
        return req.key in self.unsent

    def emit_final(self, req: Req, out: list[tuple[str, Any]]) -> None:
        """Emit a finished sequence's final chunk (once); its KV is released separately."""
        if req.key not in self.unsent:
            return
        try:
            chunk = self.outputs.take_chunk(req)
        except Exception as exc:
            self.fail(req.rid, EngineError(f"producing the final output failed: {exc!r}"), out)
            return
        self.unsent.discard(req.key)
        out.append((req.rid, chunk))
        self.counters["prompt_tokens_total"] += len(req.origin_input_ids)
        self.counters["cached_tokens_total"] += req.cached_tokens or 0
        self.counters["num_requests_total"] += req.index == 0
        if req.finish_reason and req.finish_reason["type"] == "abort":
            self.counters["num_aborted_total"] += req.index == 0
        if not any(r.key in self.unsent for r in self.by_rid.get(req.rid, ())):
            self.by_rid.pop(req.rid, None)
            self.streaming.discard(req.rid)

    def fail(self, rid: str, error: Exception, out: list[tuple[str, Any]]) -> None:
        """End a request with `error` on its stream in place of its final chunks. Its sequences
        are flagged (aborted, with `Req.error` set) and leave the engine at the next step boundary."""
        reqs = self.by_rid.pop(rid, None)
        if reqs is None:
            return  # ended already
        if isinstance(error, EngineError):
            logger.error("request %s failed: %s", rid, error)
            self.counters["num_failed_total"] += 1
        for r in reqs:
            if r.key not in self.unsent:
                continue  # its final chunk went out; it ends (or ended) as it would have
            self.unsent.discard(r.key)
            self.outputs.drop(r)
            r.error = str(error)
            r.aborted = True
            r.finish(FinishKind.ABORT, message=str(error))
        self.streaming.discard(rid)
        out.append((rid, error))
