"""After a step: append sampled tokens, decide who finished, and build the chunks to stream.

The work is split in two so that the overlap loop can run the second part while the next forward
runs: `append_token` does the token-level work the next schedule depends on (output ids, grammar,
EOS / stop_token_ids / length), `detokenize` and `take_chunk` the text-level work nothing in
scheduling depends on except stop strings (incremental detokenization, stop-string matching,
chunks).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from radixserve.workers.constrained.grammar import jump_forward_tokens
from radixserve.workers.engine.request import Req
from radixserve.workers.protocol import FinishKind, InvalidRequest, OutputChunk, TokenLogprob


def dead_end(req: Req) -> InvalidRequest:
    """The error of a request whose grammar admits no next token (and has not ended)."""
    kind = next(
        (k for k in ("json_schema", "regex", "ebnf") if getattr(req.params, k) is not None), "grammar"
    )
    return InvalidRequest(
        f"the {kind} admits no continuation after {len(req.output_ids)} generated token(s): no string it "
        "matches starts with the output so far (a rule that can never end?)",
        kind,
        code="grammar_dead_end",
    )


def _stopped_at_flush(req: Req) -> None:
    """A stop string that only the held-back text completes (one containing U+FFFD, which an
    unfinished character decodes to at the end) ends the sequence as a stop, not a length."""
    matched = req.detokenizer.stop_matched if req.detokenizer is not None else None
    if matched is not None and req.finish_reason is not None and req.finish_reason["type"] != "abort":
        req.finish_reason = {"type": "stop", "matched": matched}


class PendingOutput:
    """What a sequence produced since its last chunk was sent."""

    __slots__ = ("token_ids", "text", "logprobs", "undecoded")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprob] | None = None
        self.undecoded = 0  # trailing token_ids not yet fed to the detokenizer


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        context_length: int,
        stream_interval: int = 1,
        jump_forward: bool = True,
        stream_interval_s: float = 0.0,
    ):
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.context_length = context_length
        self.stream_interval = stream_interval
        self.stream_interval_s = stream_interval_s
        self.jump_forward = jump_forward
        self.pending: dict[str, PendingOutput] = {}
        self.counters = dict(generation_tokens_total=0, jump_forward_tokens_total=0, dropped_tokens_total=0)

    def append_sampled(self, req: Req, token: int, logprob: TokenLogprob | None) -> None:
        """One sequence's sampled token of a step, then the tokens its grammar forces after it."""
        if req.finish_reason is not None:
            # Overlap mode: a stop string ended it while this step ran. The token is dropped
            # (never appended, counted or streamed), as if the step had not included it.
            self.counters["dropped_tokens_total"] += 1
            return
        self.append_token(req, token, logprob)
        self.counters["generation_tokens_total"] += 1
        if req.kv_ticket is not None:
            # PD prefill: the first token is all this replica samples; the decode replica goes on
            # from the same state, and takes the tokens a grammar forces after it (`take_forced`).
            req.finish(FinishKind.HANDOFF)
            return
        # Jump-forward appends several tokens at once; a stop string among them must cut the
        # output where it ends, so these sequences are detokenized token by token here.
        if req.grammar is not None and bool(req.params.stop):
            self.detokenize(req)
        self.take_forced(req)

    def take_forced(self, req: Req) -> None:
        """After a sequence's latest token (sampled here, or by a PD prefill replica): the tokens
        its grammar forces next, with jump-forward on. Call after that token's `detokenize` where
        the sequence has stop strings and a grammar."""
        if req.grammar is not None and req.finish_reason is None and self.jump_forward:
            self._jump_forward(req, eager=bool(req.params.stop))

    def _jump_forward(self, req: Req, eager: bool) -> None:
        """Append the tokens the grammar forces; the next step computes them all in one extend
        instead of one decode step each."""
        forced = jump_forward_tokens(self.tokenizer, req.grammar, req.output_ids[-1], req.max_new_remaining)
        for token in forced:
            self.append_token(req, token, None, accepted=True)
            self.counters["jump_forward_tokens_total"] += 1
            if eager:
                self.detokenize(req)
            if req.finish_reason is not None:
                break

    def append_token(
        self, req: Req, token: int, logprob: TokenLogprob | None, accepted: bool = False
    ) -> None:
        """Record one sampled token and finish the sequence if a token-level stop condition holds.
        The token's text is produced later, by `detokenize`."""
        if req.grammar is not None and not accepted and not req.grammar.accept_token(token):
            if not req.grammar.allows_any_token():
                raise dead_end(req)  # the sampler had nothing to choose from: the grammar's fault
            raise RuntimeError(f"sampled token {token} violates the request's grammar")
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.output_ids.append(token)
        out = self.pending.setdefault(req.key, PendingOutput())
        out.token_ids.append(token)
        out.undecoded += 1
        if logprob is not None:
            if out.logprobs is None:
                out.logprobs = []
            out.logprobs.append(logprob)
        self._check_token_finish(req, token)

    def _check_token_finish(self, req: Req, token: int) -> None:
        p = req.params
        n_out = len(req.output_ids)
        if n_out >= p.min_new_tokens:
            if token in p.stop_token_ids:
                req.finish(FinishKind.STOP, token)
                return
            if token in self.eos and not p.ignore_eos:
                req.finish(FinishKind.STOP, token)
                return
        if req.grammar is not None and req.grammar.is_terminated():
            req.finish(FinishKind.STOP, None)
        elif n_out >= p.max_new_tokens or req.seq_len >= self.context_length:
            req.finish(FinishKind.LENGTH)

    def detokenize(self, req: Req) -> bool:
        """Turn the tokens appended since the last call into text, one at a time; True if a stop
        string matched (the sequence is then finished with reason "stop")."""
        out = self.pending.get(req.key)
        if out is None or not out.undecoded:
            return False
        new = out.token_ids[len(out.token_ids) - out.undecoded :]
        out.undecoded = 0
        for token in new:
            text, matched = req.detokenizer.add([token])
            out.text += text
            if matched is not None:
                req.finish(FinishKind.STOP, matched)
                return True
        return False

    def take_chunk(self, req: Req) -> OutputChunk | None:
        """The chunk to send now, if any: streaming sends every `stream_interval` tokens but no
        sooner than `stream_interval_s` after the sequence's previous chunk (its first chunk goes
        at once), the final chunk always goes, and a non-streaming request gets one chunk at the
        end. Detokenizes what is still undecoded first."""
        self.detokenize(req)
        out = self.pending.get(req.key)
        final = req.finish_reason is not None
        if final:
            out = self.pending.pop(req.key, None) or PendingOutput()
            # A PD prefill keeps back what its detokenizer holds: the decode replica, which
            # replays the first token, sends it when (and if) it is due.
            if req.detokenizer is not None and req.kv_ticket is None:
                out.text += req.detokenizer.flush()
                _stopped_at_flush(req)
        elif out is None or len(out.token_ids) < self.stream_interval or not self._chunk_due(req):
            return None
        else:
            del self.pending[req.key]
        chunk = OutputChunk(
            rid=req.rid,
            index=req.index,
            token_ids=out.token_ids,
            text=out.text,
            logprobs=out.logprobs,
            finished=final,
            finish_reason=req.finish_reason if final else None,
            input_logprobs=req.input_logprobs,
        )
        req.input_logprobs = None  # sent with the first chunk only
        if final:
            chunk.prompt_tokens = len(req.origin_input_ids)
            chunk.completion_tokens = len(req.output_ids)
            chunk.cached_tokens = req.cached_tokens or 0
            chunk.e2e_latency = time.monotonic() - req.arrival
        return chunk

    def _chunk_due(self, req: Req) -> bool:
        """Whether a streaming chunk of `req` may leave now (and if so, its time is recorded)."""
        now = time.monotonic()
        if req.last_chunk_at is not None and now - req.last_chunk_at < self.stream_interval_s:
            return False
        req.last_chunk_at = now
        return True

    def mark_sent(self, req: Req) -> None:
        """What the sequence produced so far went out from another replica (PD: the prefill
        replica sent the first token): forget it unsent. Call after `detokenize`, so that the
        detokenizer's state includes it."""
        self.pending.pop(req.key, None)

    def drop(self, req: Req) -> None:
        """Forget what a failed sequence produced and did not send: it is never sent."""
        self.pending.pop(req.key, None)
