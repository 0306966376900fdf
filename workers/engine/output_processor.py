"""After a step: append sampled tokens, decide who finished, and build the chunks to stream."""

from __future__ import annotations

import time
from typing import Optional

from radixserve.workers.engine.request import Req
from radixserve.workers.protocol import OutputChunk, TokenLogprob


class PendingOutput:
    """What a sequence produced since its last chunk was sent."""

    __slots__ = ("token_ids", "text", "logprobs")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: Optional[list[TokenLogprob]] = None


class OutputProcessor:
    def __init__(self, eos_token_ids: list[int], context_length: int, stream_interval: int = 1):
        self.eos = frozenset(eos_token_ids)
        self.context_length = context_length
        self.stream_interval = stream_interval
        self.pending: dict[str, PendingOutput] = {}

    def append_token(self, req: Req, token: int, logprob: Optional[TokenLogprob],
                     accepted: bool = False) -> None:
        """Record one sampled token and finish the sequence if a token-level stop condition holds."""
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.output_ids.append(token)
        out = self.pending.setdefault(req.key, PendingOutput())
        out.token_ids.append(token)
        if logprob is not None:
            if out.logprobs is None:
                out.logprobs = []
            out.logprobs.append(logprob)
        if req.grammar is not None and not accepted and not req.grammar.accept_token(token):
            req.finish("abort", message=f"internal error: token {token} violates the grammar")
        self._check_token_finish(req, token)
        text, matched = req.detokenizer.add([token])
        out.text += text
        if matched is not None:
            req.finish("stop", matched)

    def _check_token_finish(self, req: Req, token: int) -> None:
        p = req.params
        n_out = len(req.output_ids)
        if n_out >= p.min_new_tokens:
            if token in p.stop_token_ids:
                req.finish("stop", token)
                return
            if token in self.eos and not p.ignore_eos:
                req.finish("stop", token)
                return
        if req.grammar is not None and req.grammar.is_terminated():
            req.finish("stop", None)
        elif n_out >= p.max_new_tokens or req.seq_len >= self.context_length:
            req.finish("length")

    def take_chunk(self, req: Req, force: bool = False) -> Optional[OutputChunk]:
        """The chunk to send now, if any: streaming sends every `stream_interval` tokens, the final
        chunk always goes, and a non-streaming request gets one chunk at the end."""
        out = self.pending.get(req.key)
        final = req.finish_reason is not None
        if final:
            out = self.pending.pop(req.key, None) or PendingOutput()
            out.text += req.detokenizer.flush() if req.detokenizer is not None else ""
        elif out is None or not force and len(out.token_ids) < self.stream_interval:
            return None
        else:
            del self.pending[req.key]
        chunk = OutputChunk(rid=req.rid, index=req.index, token_ids=out.token_ids, text=out.text,
                            logprobs=out.logprobs, finished=final,
                            finish_reason=req.finish_reason if final else None)
        if final:
            chunk.prompt_tokens = len(req.origin_input_ids)
            chunk.completion_tokens = len(req.output_ids)
            chunk.cached_tokens = req.cached_tokens or 0
            chunk.e2e_latency = time.monotonic() - req.arrival
        return chunk

    def drop(self, req: Req) -> None:
        self.pending.pop(req.key, None)

