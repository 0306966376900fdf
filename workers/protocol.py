"""The only contract between the router and the workers.

Every message that crosses a process boundary (ingress <-> replica, prefill <-> decode) is one of
these dataclasses. They travel as plain JSON-compatible dicts through one codec (`encode` /
`decode`), never as pickled user objects, so a replica can be upgraded independently of the
ingress and a malformed message fails loudly at the boundary.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# One HTTP request may ask for several prompts, each with n samples; every one of those sequences
# is scheduled like a request of its own, so their product is capped (400 beyond it).
MAX_SEQUENCES_PER_REQUEST = 256


class InvalidRequest(ValueError):
    """A request parameter is invalid. `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def check_context_length(
    prompt_tokens: int,
    max_new_tokens: int,
    context_length: int,
    param: str = "max_tokens",
    *,
    prompt_at_least: bool = False,
) -> None:
    """Refuse a request whose prompt plus completion budget exceeds the model's context length
    (OpenAI's `context_length_exceeded`). The ingress and the engine both apply it.

    `prompt_at_least`: `prompt_tokens` is a lower bound known before tokenizing (a prompt of n
    bytes has at least n / longest-token tokens), so the ingress can refuse a huge prompt without
    scanning it; then `max_new_tokens` is 1, the least a request can ask for."""
    total = prompt_tokens + max_new_tokens
    if total <= context_length:
        return
    if prompt_at_least:
        detail = f"your prompt is at least {prompt_tokens} tokens long. Please reduce the prompt."
    else:
        detail = (
            f"you requested {total} tokens ({prompt_tokens} in the prompt, {max_new_tokens} for the "
            "completion). Please reduce the prompt or the completion length."
        )
    raise InvalidRequest(
        f"This model's maximum context length is {context_length} tokens. However, {detail}",
        param,
        code="context_length_exceeded",
    )


# Temperatures below this sample greedily (as SGLang does): dividing logits by a tiny temperature
# overflows float32 (1e-45 is a denormal; 30 / 1e-45 is inf), and the result is the argmax anyway.
GREEDY_TEMPERATURE = 1e-6
# The repetition penalty divides positive logits: 1 / 0.01 scales a logit by at most 100, so even a
# logit of 1e4 divided by the smallest sampled temperature stays far below float32's 3.4e38, while a
# value like 1e-45 turns every repeated token's logit into inf. Below 0.01 nothing changes in what
# is sampled (repeated tokens already dominate every other), so that is the lower bound.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
# What torch.Generator.manual_seed accepts; sequence i of a request uses seed + i.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1


def _finite(value: float) -> bool:
    """math.isfinite, False (not OverflowError) for a JSON integer past float's range."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, named as SGLang names them."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: bool = False  # return the sampled token's logprob
    top_logprobs: int = 0  # and this many alternatives per position
    skip_special_tokens: bool = True
    # Constrained decoding: at most one of these.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    MAX_TOP_LOGPROBS = 20

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a user dict (SGLang's keys); unknown keys are an error, not silently dropped."""
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(unknown)}", unknown[0])
        if isinstance(d.get("stop"), str):
            d["stop"] = (d["stop"],)
        for key in ("stop", "stop_token_ids"):
            if d.get(key) is None:
                d.pop(key, None)
            elif not isinstance(d[key], (list, tuple)):
                raise InvalidRequest(f"'{key}' must be a list", key)
            else:
                d[key] = tuple(d[key])
        if d.get("logit_bias") is not None:
            try:
                d["logit_bias"] = {int(k): float(v) for k, v in dict(d["logit_bias"]).items()}
            except (TypeError, ValueError, OverflowError):  # OverflowError: an int past float's range
                raise InvalidRequest("'logit_bias' must map token ids to numbers", "logit_bias") from None
        params = cls(**d)
        params.validate()
        return params

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(msg: str, param: str) -> None:
            raise InvalidRequest(msg, param)

        def number(name: str, value: Any, integer: bool = False) -> None:
            ok = isinstance(value, int) if integer else isinstance(value, (int, float))
            if not ok or isinstance(value, bool) or (not integer and not _finite(value)):
                bad(f"'{name}' must be {'an integer' if integer else 'a finite number'}", name)

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n", "top_logprobs"):
            number(name, getattr(self, name), integer=True)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            number(name, getattr(self, name))
        if self.max_new_tokens < 0:
            bad("'max_new_tokens' must be >= 0", "max_new_tokens")
        if not 0 <= self.min_new_tokens:
            bad("'min_new_tokens' must be >= 0", "min_new_tokens")
        if self.min_new_tokens > self.max_new_tokens:
            bad(
                f"'min_new_tokens' ({self.min_new_tokens}) must not exceed 'max_new_tokens' "
                f"({self.max_new_tokens})",
                "min_new_tokens",
            )
        if self.temperature < 0:
            bad("'temperature' must be >= 0", "temperature")
        if not 0 < self.top_p <= 1:
            bad("'top_p' must be in (0, 1]", "top_p")
        if self.top_k == 0 or self.top_k < -1:
            bad("'top_k' must be -1 (disabled) or >= 1", "top_k")
        if not 0 <= self.min_p <= 1:
            bad("'min_p' must be in [0, 1]", "min_p")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad(
                f"'repetition_penalty' must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]",
                "repetition_penalty",
            )
        if not -2 <= self.frequency_penalty <= 2:
            bad("'frequency_penalty' must be in [-2, 2]", "frequency_penalty")
        if not -2 <= self.presence_penalty <= 2:
            bad("'presence_penalty' must be in [-2, 2]", "presence_penalty")
        if not 1 <= self.n <= 128:
            bad("'n' must be in [1, 128]", "n")
        if not 0 <= self.top_logprobs <= self.MAX_TOP_LOGPROBS:
            bad(f"'top_logprobs' must be in [0, {self.MAX_TOP_LOGPROBS}]", "top_logprobs")
        if self.seed is not None:
            if not isinstance(self.seed, int) or isinstance(self.seed, bool):
                bad("'seed' must be an integer", "seed")
            if not MIN_SEED <= self.seed <= MAX_SEED - (self.n - 1):
                bad(f"'seed' must be in [{MIN_SEED}, {MAX_SEED - (self.n - 1)}]", "seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("'stop' must be non-empty strings", "stop")
        if len(self.stop) > 16:
            bad("at most 16 stop strings are allowed", "stop")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad(f"invalid stop token id {t!r}", "stop_token_ids")
        if self.logit_bias:
            for t, v in self.logit_bias.items():
                if t < 0 or (vocab_size is not None and t >= vocab_size):
                    bad(f"logit_bias token id {t} is out of range", "logit_bias")
                if not -100 <= v <= 100:
                    bad("logit_bias values must be in [-100, 100]", "logit_bias")
        grammars = [g for g in ("json_schema", "regex", "ebnf") if getattr(self, g) is not None]
        if len(grammars) > 1:
            bad(f"only one of json_schema, regex, ebnf may be given (got {', '.join(grammars)})", grammars[1])
        for g in grammars:
            if not isinstance(getattr(self, g), str):
                bad(f"'{g}' must be a string", g)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: top_k 1, or a temperature below GREEDY_TEMPERATURE (never divided by)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the constraint, or None."""
        for kind in ("json_schema", "regex", "ebnf"):
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None


# A request sent out again (its replica was lost before any output) or continued on another
# replica (a PD recompute) goes out under a fresh engine-side id, `<rid>\x1f<tag>`, so it never
# meets its earlier self, which a replica may still hold until its abort lands. Aborting `rid`
# aborts every attempt of it. Client request ids are printable (the API refuses control
# characters in them), so the separator never occurs in one.
ATTEMPT_SEP = "\x1f"


def attempt_rid(rid: str, tag: str) -> str:
    """The engine-side id of a further attempt of request `rid`."""
    return f"{rid}{ATTEMPT_SEP}{tag}"


def is_attempt_of(key: str, rid: str) -> bool:
    """Whether engine-side id `key` is request `rid` or one of its further attempts."""
    return key == rid or key.startswith(rid + ATTEMPT_SEP)


@dataclass
class GenerateRequest:
    """One generation request as the router hands it to a replica (tokenized already)."""

    input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    namespace: str | None = None  # cache isolation key (tenant salt; LoRA id later)
    stream: bool = False
    # PD mode, to a prefill replica: one decode replica's `KVReservation.tickets` (one per
    # sequence). The replica computes the prompt, streams the first token and sends the KV there.
    kv_tickets: list[dict[str, Any]] | None = None
    # Resuming (PD recompute): per sequence, the output tokens a client got already. The engine
    # computes prompt + those tokens and continues from there, as if it had generated them (the
    # grammar, penalties, stop strings and counts see them); they are not sent again.
    output_prefix: list[list[int]] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "input_ids": list(self.input_ids),
            "sampling_params": self.sampling_params.to_dict(),
            "rid": self.rid,
            "namespace": self.namespace,
            "stream": self.stream,
        }
        if self.kv_tickets is not None:
            d["kv_tickets"] = self.kv_tickets
        if self.output_prefix is not None:
            d["output_prefix"] = [list(ids) for ids in self.output_prefix]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerateRequest:
        return cls(
            input_ids=list(d["input_ids"]),
            sampling_params=SamplingParams.from_dict(d.get("sampling_params")),
            rid=d["rid"],
            namespace=d.get("namespace"),
            stream=bool(d.get("stream")),
            kv_tickets=d.get("kv_tickets"),
            output_prefix=d.get("output_prefix"),
        )


# The roles of an engine replica: one that does it all, or one side of prefill/decode (PD)
# disaggregation.
ROLES = ("unified", "prefill", "decode")
# What the ingress does when the decode side of a PD request fails after its prefill: recompute
# the rest of it on one engine (the default), or end it with an error.
PD_ON_FAILURE = ("recompute", "error")
# How KV moves from prefill to decode replicas (workers/disaggregation): auto = nccl for CUDA
# pools, gloo otherwise.
KV_TRANSFER_CHOICES = ("auto", "gloo", "nccl", "ray")


@dataclass
class KVReservation:
    """A decode replica's answer to a PD request, before any output: one KV transfer ticket per
    sequence (opaque to the router: it hands them to the prefill replica in
    `GenerateRequest.kv_tickets`). The decode replica holds the slots until the KV arrived, the
    request ended, or the transfer timed out."""

    rid: str
    tickets: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"kv_reservation": {"rid": self.rid, "tickets": self.tickets}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVReservation:
        r = d["kv_reservation"]
        return cls(rid=str(r["rid"]), tickets=list(r["tickets"]))

    @staticmethod
    def is_one(d: dict[str, Any]) -> bool:
        return "kv_reservation" in d


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class OutputChunk:
    """A piece of one output sequence. `index` is the sequence number within the request (n > 1).

    Streaming chunks carry only what is new since the previous chunk; the final chunk has
    `finished=True`, the finish reason and the usage counters.
    """

    rid: str
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    # {"type": "stop" | "length" | "abort", "matched": str | int | None, "message": str?}
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    e2e_latency: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.logprobs is not None:
            d["logprobs"] = [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in self.logprobs]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OutputChunk:
        d = dict(d)
        if d.get("logprobs") is not None:
            d["logprobs"] = [TokenLogprob(t, lp, [tuple(x) for x in top]) for t, lp, top in d["logprobs"]]
        return cls(**d)


def native_result(rid: str) -> dict[str, Any]:
    """One sequence's result in SGLang's /generate shape, before any output arrived.

    Both `Engine.generate` (offline) and the HTTP `/generate` build their results with this and
    `add_to_native_result`, so the two always agree.
    """
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": rid,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "finish_reason": None,
            "e2e_latency": None,
        },
    }


def add_to_native_result(
    result: dict[str, Any], chunk: OutputChunk, token_text: Callable[[int], str] | None = None
) -> None:
    """Fold one chunk of the sequence into `result` (from `native_result`).

    Logprobs, when the request asked for them, are SGLang's triples: `output_token_logprobs` is
    `[logprob, token_id, text]` per output token, `output_top_logprobs` (present when alternatives
    were asked for) a list of such triples per output token, best first. `text` is
    `token_text(token_id)`, or None without `token_text`.
    """
    result["text"] += chunk.text
    result["output_ids"].extend(chunk.token_ids)
    meta = result["meta_info"]
    meta["completion_tokens"] = len(result["output_ids"])
    if chunk.logprobs is not None:

        def triple(token_id: int, logprob: float) -> list[Any]:
            return [logprob, token_id, token_text(token_id) if token_text else None]

        meta.setdefault("output_token_logprobs", []).extend(
            triple(lp.token_id, lp.logprob) for lp in chunk.logprobs
        )
        if any(lp.top for lp in chunk.logprobs):
            meta.setdefault("output_top_logprobs", []).extend(
                [triple(t, v) for t, v in lp.top] for lp in chunk.logprobs
            )
    if chunk.finished:
        meta.update(
            prompt_tokens=chunk.prompt_tokens,
            completion_tokens=chunk.completion_tokens,
            cached_tokens=chunk.cached_tokens,
            finish_reason=chunk.finish_reason,
            e2e_latency=chunk.e2e_latency,
        )


@dataclass
class ReplicaStats:
    """A replica's load and cache state, as `/get_server_info` and the router see it."""

    replica_id: str = ""
    role: str = "unified"  # one of ROLES
    tp_size: int = 1  # ranks of this replica's tensor-parallel group
    running: int = 0
    queued: int = 0
    kv_total: int = 0
    kv_free: int = 0
    kv_evictable: int = 0
    kv_protected: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    computed_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_requests_total: int = 0
    num_aborted_total: int = 0
    # PD: K/V payload bytes this replica sent (prefill) or received (decode), and the bytes of the
    # pages a transfer did not move because the decode replica already held them.
    pd_bytes_sent_total: int = 0
    pd_bytes_received_total: int = 0
    pd_bytes_saved_total: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplicaStats:
        """Fields this version does not know (a newer replica's, mid rolling update) are left out."""
        return cls(**{k: v for k, v in d.items() if k in _REPLICA_STATS_FIELDS})


_REPLICA_STATS_FIELDS = frozenset(f.name for f in dataclasses.fields(ReplicaStats))


@dataclass(frozen=True)
class EngineLoad:
    """A replica's load signals, as its `record_autoscaling_stats` reports them to Serve: each
    field is one autoscaling metric (name and number), read back by the policies in
    cluster/autoscaling.py."""

    # Tokens still to be prefilled: waiting sequences' tokens past their cached prefix (the whole
    # prompt where the match is not known), plus what chunked prefills in progress have left.
    queued_prompt_tokens: float = 0
    running_sequences: float = 0
    queued_sequences: float = 0  # submitted, not yet running (what max_queued_requests limits)
    kv_usage: float = 0.0  # 1 - (free + evictable) / total: the share of the KV pool held by requests

    def to_metrics(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_metrics(cls, metrics: dict[str, float]) -> EngineLoad:
        """From one replica's metrics; a metric it has not reported yet counts as 0. (The engine
        reports whole counts; Serve's window averages make them fractional.)"""
        return cls(**{f.name: metrics.get(f.name, 0) for f in dataclasses.fields(cls)})


class QueueFull(RuntimeError):
    """The replica's waiting queue is at `max_queued_requests`: the HTTP layer answers 503."""


class EngineError(RuntimeError):
    """The engine failed to serve a request through no fault of the request (a failed step, a
    replica going away). The message is for the server log; clients get a generic 500 (or an
    in-band error event once a stream has started) that carries only `request_id`."""


class TransferFailed(EngineError):
    """PD mode: a request's KV never arrived at its decode replica (the prefill side failed, the
    transfer broke or timed out). The decode replica freed its slots; the ingress may recompute."""


@dataclass
class ModelCard:
    """What the ingress needs to know about a replica's model, sent once at ingress start.

    The tokenizer travels as its files' text (tokenizer.json, tokenizer_config.json, the chat
    template ...) so the ingress tokenizes exactly as the replica does, on any node, without
    importing engine code or finding the model on its own disk.
    """

    served_model_name: str
    model_path: str | None
    context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer_files: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelCard:
        return cls(**d)


def encode_error(exc: Exception) -> dict[str, Any]:
    """A replica's refusal or failure (InvalidRequest / QueueFull / EngineError) as a message:
    `{"error": {...}}`."""
    if isinstance(exc, InvalidRequest):
        return {
            "error": {"kind": "invalid_request", "message": exc.message, "param": exc.param, "code": exc.code}
        }
    if isinstance(exc, QueueFull):
        return {"error": {"kind": "queue_full", "message": str(exc) or "queue full"}}
    if isinstance(exc, TransferFailed):
        return {"error": {"kind": "transfer_failed", "message": str(exc) or "KV transfer failed"}}
    if isinstance(exc, EngineError):
        return {"error": {"kind": "engine_error", "message": str(exc) or "engine error"}}
    raise TypeError(f"not a protocol error: {type(exc).__name__}")


def decode_error(d: dict[str, Any]) -> Exception:
    """The exception that `encode_error` encoded (to be raised by the receiver)."""
    err = d["error"]
    if err["kind"] == "invalid_request":
        return InvalidRequest(err["message"], err.get("param"), err.get("code"))
    if err["kind"] == "queue_full":
        return QueueFull(err["message"])
    if err["kind"] == "engine_error":
        return EngineError(err["message"])
    if err["kind"] == "transfer_failed":
        return TransferFailed(err["message"])
    raise ValueError(f"unknown error kind {err['kind']!r}")
