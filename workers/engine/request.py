"""One sequence being generated: plain counters and token lists, no tensors (the scheduler
and the prefix caches are torch-free bookkeeping: an import-linter contract)."""

from __future__ import annotations

import enum
import time
from typing import Any

from radixserve.workers.protocol import FinishKind, SamplingParams, TokenLogprob


class ReqStatus(enum.Enum):
    """Where a sequence is; the scheduler's queues hold the states between WAITING and
    SENDING_KV (engine/scheduler.py), and skip what is not ready to run."""

    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its grammar compiles off the engine thread
    WAITING = "waiting"  # queued for admission: new, resumed or retracted
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # PD decode: slots reserved, the KV on its way
    RUNNING = "running"  # in the batch: prefilling in chunks, or decoding
    SENDING_KV = "sending_kv"  # PD prefill: done here, its slots locked until its KV send settles
    FINISHED = "finished"  # its slots released; `finish_reason` says how it ended


class Req:
    """A sequence: its prompt, what it generated, and which KV slots hold its computed positions.

    `kv_slots[i]` is the pool slot of position i for i < num_computed. The first `cache_len` of them
    belong to the radix tree (shared, protected by the lock on `last_node`); the rest are this
    request's own until it hands them to the cache at the end.
    """

    def __init__(
        self,
        rid: str,
        index: int,
        input_ids: list[int],
        params: SamplingParams,
        namespace: str | None = None,
        arrival: float | None = None,
    ):
        self.rid = rid  # the user's request id; n > 1 sequences share it
        self.index = index  # sequence number within the request
        self.key = f"{rid}#{index}"
        self.origin_input_ids = input_ids
        self.output_ids: list[int] = []
        self.params = params
        self.namespace = namespace
        self.lora: tuple[str, str] | None = None  # (name, path) of its LoRA adapter; None: the base model
        self.lora_slot: int | None = None  # the adapter's batch slot while running (lora/manager.py)
        self.status = ReqStatus.WAITING
        self.finish_reason: dict[str, Any] | None = None
        # KV state
        self.kv_slots: list[int] = []
        self.cache_len = 0  # leading kv_slots owned by the radix tree
        self.last_node: Any = None  # locked tree node covering kv_slots[:cache_len]
        self.row: int | None = None  # ReqToTokenPool row while running
        self.table_len = 0  # how many kv_slots are written into that row
        # Accounting
        self.cached_tokens: int | None = None  # prompt tokens reused at first admission
        self.disk_reads = 0  # times admission waited for a disk read of its prefix (cache tiers)
        self.num_retractions = 0
        self.arrival = arrival if arrival is not None else time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None  # when the engine last appended a token (TokenLatency)
        self.last_chunk_at: float | None = None  # when its last streaming chunk was taken
        # Per-sequence helpers attached by the engine (generator, detokenizer, grammar).
        self.generator: Any = None
        self.detokenizer: Any = None
        self.grammar: Any = None
        self.aborted = False
        # PD, prefill side: where this sequence's KV goes (a KVTicket) once its first token is
        # sampled; the sequence stops there.
        self.kv_ticket: Any = None
        # ... and once its transfer has begun (with its last prefill chunk), its prompt enters the
        # tree only when the send settled: the pair reads these very slots until then.
        self.kv_streaming = False
        # Resuming: output tokens the client has already (GenerateRequest.output_prefix), replayed
        # by the engine thread before the sequence is first scheduled.
        self.resume_ids: list[int] = []
        # Why the engine failed this sequence (the client gets an EngineError). Its KV past the
        # cached prefix is then freed, never published: the step that failed may not have written it.
        self.error: str | None = None
        # The prompt's logprobs from params.logprob_start_len on, filled chunk by chunk of the
        # prefill (`add_input_logprobs`) and sent with the first output chunk.
        self.input_logprobs: list[TokenLogprob | None] | None = None

    # Derived lengths -----------------------------------------------------------------------
    @property
    def num_computed(self) -> int:
        return len(self.kv_slots)

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the sequence needs: prompt + output (the last output token's KV is
        computed by the next decode step)."""
        return self.origin_input_ids + self.output_ids

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return self.seq_len - self.num_computed

    @property
    def decode_ready(self) -> bool:
        """Only the last token is uncomputed: one decode step samples the next token."""
        return self.remaining_prefill == 1

    @property
    def input_logprob_from(self) -> int | None:
        """The first position whose logits the sequence still needs for its prompt's logprobs
        (the logits at p give token p + 1's: max(logprob_start_len - 1, 0)), or None when it
        needs none: it asked for none, or its prompt is computed (a token was sampled)."""
        start = self.params.logprob_start_len
        if start < 0 or self.output_ids:
            return None
        return max(start - 1, 0)

    def input_logprob_span(self, start: int, end: int) -> tuple[int, int]:
        """The positions [lo, hi) among [start, end) whose logits give prompt logprobs that the
        sequence still needs (empty: lo == hi)."""
        first = self.input_logprob_from
        if first is None:
            return start, start
        lo = max(start, first)
        return lo, max(lo, min(end, len(self.origin_input_ids) - 1))

    def add_input_logprobs(self, position: int, values: list[TokenLogprob]) -> None:
        """The logprobs of prompt tokens position + 1, position + 2, ... (a recomputed span, after
        a retraction, overwrites what it had)."""
        start = self.params.logprob_start_len
        if self.input_logprobs is None:
            self.input_logprobs = [None] * (len(self.origin_input_ids) - start)
        first = position + 1 - start
        self.input_logprobs[first : first + len(values)] = values

    @property
    def max_new_remaining(self) -> int:
        return max(self.params.max_new_tokens - len(self.output_ids), 0)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def finish(self, kind: FinishKind, matched: Any = None, message: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = {"type": FinishKind(kind), "matched": matched}
            if message:
                self.finish_reason["message"] = message

    def __repr__(self) -> str:
        return (
            f"Req({self.key}, prompt={len(self.origin_input_ids)}, out={len(self.output_ids)}, "
            f"computed={self.num_computed}, cache_len={self.cache_len}, {self.status.value})"
        )
