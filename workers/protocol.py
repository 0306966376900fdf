"""The only contract between the router and the workers.

Every message that crosses a process boundary (ingress <-> replica, prefill <-> decode) is one of
these dataclasses, with one codec to and from plain JSON-compatible dicts (never pickled user
objects), so a replica can be upgraded independently of the ingress and a malformed message
fails loudly at the boundary. A call that carries one message type uses that type's `to_dict` /
`from_dict` (a `GenerateRequest` in; a `ModelCard`, `ReplicaStats` or `CacheSummary` back). A
replica's stream carries several (`StreamEvent`): each event travels tagged with its type
(`encode_event` / `decode_event`), so its receiver matches on types and never tells events apart
by the keys they carry.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
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


def check_logprob_start_len(start: int, prompt_tokens: int, param: str = "logprob_start_len") -> None:
    """Prompt logprobs start inside the prompt: the ingress and the engine both apply it."""
    if start >= prompt_tokens:
        raise InvalidRequest(
            f"'logprob_start_len' ({start}) must be less than the prompt's length ({prompt_tokens} tokens)",
            param,
        )


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
# Bounds on what a request makes the engine thread do at every token: stop strings are matched
# on the text held back for them (at most the longest one, each step: detokenizer._held_suffix),
# and logit_bias entries are applied to the request's row at every step.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024
# A grammar's text, and the nesting of a JSON schema in it (the outermost object included). Compile
# time grows with both, superlinearly with nesting; the ingress checks tool schemas against them
# before any compile, the compile worker checks every grammar.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_JSON_DEPTH = 64
# The constraint kinds, each also the SamplingParams field (and request field) it comes from.
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
_TOKEN_ID = re.compile(r"0|[1-9][0-9]*", re.ASCII)


def parse_logit_bias(raw: Any) -> dict[int, float]:
    """logit_bias as token id -> bias. Keys are token ids: ints, or their canonical decimal
    spelling ("12"; not " 12 ", "012", "1_0", "１２"), so two keys never name one token."""
    if not isinstance(raw, dict):
        raise InvalidRequest("'logit_bias' must map token ids to numbers", "logit_bias")
    if len(raw) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"'logit_bias' may have at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if isinstance(key, str) and _TOKEN_ID.fullmatch(key):
            token = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            token = key
        else:
            raise InvalidRequest(
                f"'logit_bias' keys must be token ids in decimal, got {str(key)[:40]!r}", "logit_bias"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise InvalidRequest("'logit_bias' must map token ids to numbers", "logit_bias")
        out[token] = float(value)
    return out


def _finite(value: float) -> bool:
    """math.isfinite, False (not OverflowError) for a JSON integer past float's range."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class ReasoningFormat:
    """How a reasoning model writes its thinking: between `start` and `end`, before its answer.
    With `opened_by_prompt` the chat template already wrote `start`, so the output begins inside
    the thinking (a `start` the model writes anyway is part of it); otherwise the thinking is
    optional and, when present, the output begins with `start`. `off_switch` names the chat
    template variable that turns the thinking off (the template then writes an empty thinking
    block into the prompt, and the answer begins the output)."""

    start: str
    end: str
    opened_by_prompt: bool
    off_switch: str | None = None


# The conventions `--reasoning-parser` names: the ingress splits the output by them and the
# grammar of a constrained request lets the thinking through before constraining the answer.
REASONING_FORMATS = {
    "qwen3": ReasoningFormat("<think>", "</think>", opened_by_prompt=False, off_switch="enable_thinking"),
    "deepseek-r1": ReasoningFormat("<think>", "</think>", opened_by_prompt=True),
}


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
    # The prompt's logprobs too, of its tokens from this position on (SGLang's name; -1: none).
    # They come with the sequence's first chunk (OutputChunk.input_logprobs), with `top_logprobs`
    # alternatives each; the first prompt token has none (None).
    logprob_start_len: int = -1
    skip_special_tokens: bool = True
    # Constrained decoding: at most one of these.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # xgrammar's structural tag (JSON): tool calls
    # A REASONING_FORMATS name: the grammar above constrains only what follows the thinking.
    reasoning: str | None = None

    MAX_TOP_LOGPROBS = 20

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, vocab_size: int | None = None) -> SamplingParams:
        """Build from a user dict (SGLang's keys) and `validate` it (token ids against
        `vocab_size` where given); unknown keys are an error, not silently dropped."""
        try:
            params = cls(**_sampling_kwargs(d))
        except TypeError as e:  # a key or value of a type that no parameter takes
            raise InvalidRequest(f"invalid sampling parameters: {e}") from None
        params.validate(vocab_size)
        return params

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self, vocab_size: int | None = None) -> None:
        """The one check of every parameter's type and range (InvalidRequest naming the first
        offending one): the HTTP layer, the replica's decoding of a request and the engine (for
        requests built in process) all call it, so they refuse exactly the same values."""

        def bad(msg: str, param: str) -> None:
            raise InvalidRequest(msg, param)

        def number(name: str, value: Any, integer: bool = False) -> None:
            ok = isinstance(value, int) if integer else isinstance(value, (int, float))
            if not ok or isinstance(value, bool) or (not integer and not _finite(value)):
                bad(f"'{name}' must be {'an integer' if integer else 'a finite number'}", name)

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n", "top_logprobs", "logprob_start_len"):
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
        if self.logprob_start_len < -1:
            bad("'logprob_start_len' must be -1 (no prompt logprobs) or >= 0", "logprob_start_len")
        if self.seed is not None:
            if not isinstance(self.seed, int) or isinstance(self.seed, bool):
                bad("'seed' must be an integer", "seed")
            if not MIN_SEED <= self.seed <= MAX_SEED - (self.n - 1):
                bad(f"'seed' must be in [{MIN_SEED}, {MAX_SEED - (self.n - 1)}]", "seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("'stop' must be non-empty strings", "stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            bad(f"a stop string may be at most {MAX_STOP_CHARS} characters long", "stop")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad(f"invalid stop token id {t!r}", "stop_token_ids")
        if self.logit_bias:
            for t, v in self.logit_bias.items():
                if t < 0 or (vocab_size is not None and t >= vocab_size):
                    bad(f"logit_bias token id {t} is out of range", "logit_bias")
                if not -100 <= v <= 100:
                    bad("logit_bias values must be in [-100, 100]", "logit_bias")
        grammars = [g for g in GRAMMAR_KINDS if getattr(self, g) is not None]
        if len(grammars) > 1:
            bad(
                f"only one of {', '.join(GRAMMAR_KINDS)} may be given (got {', '.join(grammars)})",
                grammars[1],
            )
        for g in grammars:
            if not isinstance(getattr(self, g), str):
                bad(f"'{g}' must be a string", g)
        if self.reasoning is not None and (
            not isinstance(self.reasoning, str) or self.reasoning not in REASONING_FORMATS
        ):
            bad(f"'reasoning' must be one of {', '.join(REASONING_FORMATS)}", "reasoning")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: top_k 1, or a temperature below GREEDY_TEMPERATURE (never divided by)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def grammar(self) -> tuple[str, str, str | None] | None:
        """(kind, text, reasoning) of the constraint, or None."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text, self.reasoning
        return None


def _sampling_kwargs(d: dict[str, Any] | None) -> dict[str, Any]:
    """A user dict of sampling parameters as SamplingParams' keyword arguments."""
    d = dict(d or {})
    names = {f.name for f in dataclasses.fields(SamplingParams)}
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
        d["logit_bias"] = parse_logit_bias(d["logit_bias"])
    return d


# A request sent out again (its replica was lost before any output) or continued on another
# replica (a PD recompute) goes out under a fresh engine-side id, `<rid>\x1f<tag>`, so it never
# meets its earlier self, which a replica may still hold until its abort lands. Aborting `rid`
# aborts every attempt of it. Client request ids are printable (the API refuses control
# characters in them), so the separator never occurs in one.
ATTEMPT_SEP = "\x1f"


def attempt_rid(rid: str, tag: str) -> str:
    """The engine-side id of a further attempt of request `rid`."""
    return f"{rid}{ATTEMPT_SEP}{tag}"


def part_rid(rid: str, k: int) -> str:
    """The engine-side id of prompt k of request `rid` when it has several prompts: under the
    separator, so it never equals a client's id (`multi-1` is a client's), and aborting `rid`
    aborts every prompt of it (and each of their n sequences, which share their prompt's id)."""
    return f"{rid}{ATTEMPT_SEP}p{k}"


def is_attempt_of(key: str, rid: str) -> bool:
    """Whether engine-side id `key` is request `rid`, one of its further attempts or one of its
    prompts (`part_rid`)."""
    return key == rid or key.startswith(rid + ATTEMPT_SEP)


@dataclass(frozen=True)
class LoRARef:
    """The LoRA adapter a request runs with: its name and its directory, so that any replica can
    load it (one started after the adapter was loaded elsewhere included)."""

    name: str
    path: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "path": self.path}

    @classmethod
    def from_dict(cls, d: Any) -> LoRARef | None:
        if d is None:
            return None
        if (
            not isinstance(d, dict)
            or not isinstance(d.get("name"), str)
            or not isinstance(d.get("path"), str)
        ):
            raise InvalidRequest(f"lora must be {{name, path}} strings, got {d!r}")
        return cls(d["name"], d["path"])

    def namespace(self, tenant: str | None) -> str:
        """The cache namespace of this adapter's requests within a tenant's (or the shared one):
        the same prompt under two adapters, or two tenants, never shares KV."""
        return f"{tenant or ''}{LORA_NS}{self.name}\x1f{self.path}"

    @staticmethod
    def name_in(namespace: str | None) -> str | None:
        """The adapter name of a cache namespace `namespace` made; None for the base model's."""
        if namespace is None or LORA_NS not in namespace:
            return None
        return namespace.split(LORA_NS, 1)[1].split("\x1f", 1)[0]


LORA_NS = "\x1flora\x1f"


@dataclass
class GenerateRequest:
    """One generation request as the router hands it to a replica (tokenized already)."""

    input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    namespace: str | None = None  # cache isolation key (tenant salt, LoRA adapter: LoRARef.namespace)
    stream: bool = False
    lora: LoRARef | None = None  # None: the base model
    # PD mode, to a prefill replica: one decode replica's `KVReservation.tickets` (one per
    # sequence). The replica computes the prompt, streams the first token and sends the KV there.
    kv_tickets: list[KVTicket] | None = None
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
            d["kv_tickets"] = [t.to_dict() for t in self.kv_tickets]
        if self.output_prefix is not None:
            d["output_prefix"] = [list(ids) for ids in self.output_prefix]
        if self.lora is not None:
            d["lora"] = self.lora.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerateRequest:
        tickets = d.get("kv_tickets")
        return cls(
            input_ids=list(d["input_ids"]),
            sampling_params=SamplingParams.from_dict(d.get("sampling_params")),
            rid=d["rid"],
            namespace=d.get("namespace"),
            stream=bool(d.get("stream")),
            kv_tickets=None if tickets is None else [KVTicket.from_dict(t) for t in tickets],
            output_prefix=d.get("output_prefix"),
            lora=LoRARef.from_dict(d.get("lora")),
        )


class Role(enum.StrEnum):
    """The role of an engine replica: one that does it all, or one side of prefill/decode (PD)
    disaggregation. A str (configs, YAML and messages carry the value)."""

    UNIFIED = "unified"
    PREFILL = "prefill"
    DECODE = "decode"


ROLES = tuple(r.value for r in Role)
# What the ingress does when the decode side of a PD request fails after its prefill: recompute
# the rest of it on one engine (the default), or end it with an error.
PD_ON_FAILURE = ("recompute", "error")
# How KV moves from prefill to decode replicas (workers/disaggregation): auto = nccl for CUDA
# pools, gloo otherwise.
KV_TRANSFER_CHOICES = ("auto", "gloo", "nccl", "ray")


@dataclass(frozen=True)
class KVEndpoint:
    """Where a receiving replica listens. `address` is "host:port" of its TCPStore for gloo/nccl,
    "namespace/actor_name" of its inbox actor for ray."""

    transport: str
    replica_id: str
    address: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVEndpoint:
        return cls(transport=str(d["transport"]), replica_id=str(d["replica_id"]), address=str(d["address"]))


@dataclass(frozen=True)
class KVTicket:
    """One expected transfer: the receiver's slots for tokens `held_tokens ..` of the request.

    The receiver already holds the first `held_tokens` tokens (its radix cache matched them), so
    only the rest moves; `dst_slots` are in token order and were allocated before the ticket was
    issued. Valid until the receiver's deadline for it passes.

    A tensor-parallel receiver's KV is spread over its ranks' pools (each its own heads, at the
    same slots): `endpoint` is rank 0's, `rank_endpoints` ranks 1..N-1's (`for_rank`). The
    receiver expects its KV from a sender of `sender_tp_size` ranks (0: of its own degree), each
    moving the heads the plan of executor/tp_kv.py gives it.
    """

    transfer_id: str
    endpoint: KVEndpoint
    dst_slots: tuple[int, ...]
    held_tokens: int = 0
    rank_endpoints: tuple[KVEndpoint, ...] = ()
    sender_tp_size: int = 0

    @property
    def tp_size(self) -> int:
        """The receiving replica's tensor-parallel degree."""
        return 1 + len(self.rank_endpoints)

    @property
    def sender_tp(self) -> int:
        """The sending replica's degree the receiver planned its parts for."""
        return self.sender_tp_size or self.tp_size

    def for_rank(self, rank: int) -> KVTicket:
        """The ticket rank `rank` of the sender uses: the same transfer, into its peer rank."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"transfer {self.transfer_id!r} has {self.tp_size} rank(s), not a rank {rank}")
        endpoint = self.endpoint if rank == 0 else self.rank_endpoints[rank - 1]
        return dataclasses.replace(self, endpoint=endpoint, rank_endpoints=())

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "transfer_id": self.transfer_id,
            "endpoint": self.endpoint.to_dict(),
            "dst_slots": list(self.dst_slots),
            "held_tokens": self.held_tokens,
        }
        if self.rank_endpoints:
            d["rank_endpoints"] = [e.to_dict() for e in self.rank_endpoints]
        if self.sender_tp_size:
            d["sender_tp_size"] = self.sender_tp_size
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVTicket:
        return cls(
            transfer_id=str(d["transfer_id"]),
            endpoint=KVEndpoint.from_dict(d["endpoint"]),
            dst_slots=tuple(int(s) for s in d["dst_slots"]),
            held_tokens=int(d.get("held_tokens", 0)),
            rank_endpoints=tuple(KVEndpoint.from_dict(e) for e in d.get("rank_endpoints", ())),
            sender_tp_size=int(d.get("sender_tp_size", 0)),
        )


@dataclass
class KVReservation:
    """A decode replica's answer to a PD request, before any output: one KV transfer ticket per
    sequence, which the router hands to the prefill replica in `GenerateRequest.kv_tickets`. The
    decode replica holds the slots until the KV arrived, the request ended, or the transfer timed
    out."""

    rid: str
    tickets: list[KVTicket]

    def to_dict(self) -> dict[str, Any]:
        return {"rid": self.rid, "tickets": [t.to_dict() for t in self.tickets]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVReservation:
        return cls(rid=str(d["rid"]), tickets=[KVTicket.from_dict(t) for t in d["tickets"]])


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


class FinishKind(enum.StrEnum):
    """How a sequence ended: `OutputChunk.finish_reason["type"]`."""

    STOP = "stop"  # an EOS token, a stop token or a stop string ("matched" says which)
    LENGTH = "length"  # max_new_tokens, or the end of the context
    ABORT = "abort"  # the client went away, or the engine failed it ("message" says why)
    HANDOFF = "handoff"  # PD prefill: its first token is out; a decode replica continues it


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
    # The prompt's logprobs from `SamplingParams.logprob_start_len` on, in the sequence's first
    # chunk only; None for the first prompt token (nothing predicts it).
    input_logprobs: list[TokenLogprob | None] | None = None
    finished: bool = False
    # {"type": FinishKind, "matched": str | int | None, "message": str?}
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    e2e_latency: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.logprobs is not None:
            d["logprobs"] = [_encode_logprob(lp) for lp in self.logprobs]
        if self.input_logprobs is not None:
            d["input_logprobs"] = [None if lp is None else _encode_logprob(lp) for lp in self.input_logprobs]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OutputChunk:
        d = dict(d)
        if d.get("logprobs") is not None:
            d["logprobs"] = [_decode_logprob(x) for x in d["logprobs"]]
        if d.get("input_logprobs") is not None:
            d["input_logprobs"] = [None if x is None else _decode_logprob(x) for x in d["input_logprobs"]]
        return cls(**d)


def _encode_logprob(lp: TokenLogprob) -> list[Any]:
    return [lp.token_id, lp.logprob, [list(t) for t in lp.top]]


def _decode_logprob(x: list[Any]) -> TokenLogprob:
    token_id, logprob, top = x
    return TokenLogprob(token_id, logprob, [tuple(t) for t in top])


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
    result: dict[str, Any],
    chunk: OutputChunk,
    token_text: Callable[[int], str | None] | None = None,
    input_ids: list[int] | None = None,
) -> None:
    """Fold one chunk of the sequence into `result` (from `native_result`).

    Logprobs, when the request asked for them, are SGLang's triples: `output_token_logprobs` is
    `[logprob, token_id, text]` per output token, `output_top_logprobs` (present when alternatives
    were asked for) a list of such triples per output token, best first. `text` is
    `token_text(token_id)`, or None without `token_text`. The prompt's (a chunk's
    `input_logprobs`) go to `input_token_logprobs` and `input_top_logprobs` alike, the prompt
    token ids `input_ids` naming the tokens (the first prompt token's logprob is None).
    """
    result["text"] += chunk.text
    result["output_ids"].extend(chunk.token_ids)
    meta = result["meta_info"]
    meta["completion_tokens"] = len(result["output_ids"])

    def triple(token_id: int, logprob: float | None) -> list[Any]:
        return [logprob, token_id, token_text(token_id) if token_text else None]

    if chunk.input_logprobs is not None and input_ids is not None:
        start = len(input_ids) - len(chunk.input_logprobs)
        meta["input_token_logprobs"] = [
            triple(input_ids[start + j], None if lp is None else lp.logprob)
            for j, lp in enumerate(chunk.input_logprobs)
        ]
        meta["input_top_logprobs"] = [
            None if lp is None else [triple(t, v) for t, v in lp.top] for lp in chunk.input_logprobs
        ]
    if chunk.logprobs is not None:
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
    role: Role = Role.UNIFIED
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
    # Cache tiers (--hicache-*): tokens held below the device, tokens moved down and loaded back,
    # what fell out of the last tier, and the seconds loads took.
    kv_host_total: int = 0
    kv_host_cached_tokens: int = 0
    kv_disk_cached_tokens: int = 0
    kv_disk_used_bytes: int = 0
    tier_device_to_host_tokens: int = 0
    tier_host_to_disk_tokens: int = 0
    tier_dropped_tokens: int = 0
    tier_host_loaded_tokens: int = 0
    tier_disk_loaded_tokens: int = 0
    tier_disk_prefetched_tokens: int = 0  # read from disk into host memory on the loader thread
    tier_host_load_seconds: float = 0.0
    tier_disk_load_seconds: float = 0.0
    tier_disk_load_failures: int = 0
    # Engine steps (engine/step_stats.py): how many forwards ran, and the engine thread's seconds
    # in each part of a step: scheduling and tensor building, the forward, sampling, text work.
    step_steps: int = 0
    step_schedule_s: float = 0.0
    step_forward_s: float = 0.0
    step_sample_s: float = 0.0
    step_text_s: float = 0.0
    # LoRA: the adapters this replica serves by name ({name: path}), and those in its memory
    # (which the router's adapter affinity prefers: no read of the adapter first).
    lora_adapters: dict[str, str] = field(default_factory=dict)
    lora_loaded: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplicaStats:
        """Fields this version does not know (a newer replica's, mid rolling update) are left out."""
        known = {k: v for k, v in d.items() if k in _REPLICA_STATS_FIELDS}
        if "role" in known:
            known["role"] = Role(known["role"])
        return cls(**known)


_REPLICA_STATS_FIELDS = frozenset(f.name for f in dataclasses.fields(ReplicaStats))


@dataclass
class CacheSummary:
    """What the router's correction reads from a replica in one call (`cache_summary`): its
    `ReplicaStats`, and its cached prefixes as (cache namespace, token path), most recently used
    first (the path's tokens within the replica's token budget; shared prefixes count once per
    path): `paths` on the device, `lower_paths` those ending in its host or disk tier."""

    stats: ReplicaStats
    paths: list[tuple[str | None, list[int]]] = field(default_factory=list)
    lower_paths: list[tuple[str | None, list[int]]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stats": self.stats.to_dict(),
            "prefixes": [list(p) for _, p in self.paths],
            "namespaces": [n for n, _ in self.paths],
            "lower_prefixes": [list(p) for _, p in self.lower_paths],
            "lower_namespaces": [n for n, _ in self.lower_paths],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheSummary:
        """A replica of an older version (mid rolling update) sends no lower paths."""
        return cls(
            ReplicaStats.from_dict(d["stats"]),
            _paths(d["prefixes"], d["namespaces"]),
            _paths(d.get("lower_prefixes", []), d.get("lower_namespaces", [])),
        )


def _paths(prefixes: list, namespaces: list) -> list[tuple[str | None, list[int]]]:
    if len(prefixes) != len(namespaces):
        raise ProtocolError(f"a cache summary of {len(prefixes)} prefixes and {len(namespaces)} namespaces")
    return [(n, list(p)) for n, p in zip(namespaces, prefixes)]


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
    # Mean seconds over the engine's recent window (engine/token_latency.py; 0 without samples):
    # from a sequence's arrival to its first token (prefill and unified replicas), and between two
    # tokens of a sequence (decode and unified replicas).
    ttft_s: float = 0.0
    itl_s: float = 0.0

    def to_metrics(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_metrics(cls, metrics: dict[str, float]) -> EngineLoad:
        """From one replica's metrics; a metric it has not reported yet counts as 0. (The engine
        reports whole counts; Serve's window averages make them fractional.)"""
        return cls(**{f.name: metrics.get(f.name, 0) for f in dataclasses.fields(cls)})


class QueueFull(RuntimeError):
    """The replica's waiting queue is at `max_queued_requests`, or (PD) a decode replica has no
    room for a reservation: the HTTP layer answers 503. `report` is the refusing replica's
    `ReplicaStats` where it sent them (a refused reservation), so that the router learns at once
    that this replica has no room and tries another."""

    def __init__(self, message: str = "", report: ReplicaStats | None = None):
        super().__init__(message)
        self.report = report


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


class ProtocolError(ValueError):
    """A message that its channel does not carry: an unknown type tag, or an event where the
    stream's protocol has another one due."""


def _encode_exception(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, InvalidRequest):
        return {"kind": "invalid_request", "message": exc.message, "param": exc.param, "code": exc.code}
    if isinstance(exc, QueueFull):
        err: dict[str, Any] = {"kind": "queue_full", "message": str(exc) or "queue full"}
        if exc.report is not None:
            err["report"] = exc.report.to_dict()
        return err
    if isinstance(exc, TransferFailed):
        return {"kind": "transfer_failed", "message": str(exc) or "KV transfer failed"}
    if isinstance(exc, EngineError):
        return {"kind": "engine_error", "message": str(exc) or "engine error"}
    raise TypeError(f"not a protocol error: {type(exc).__name__}")


def _decode_exception(err: dict[str, Any]) -> Exception:
    if err["kind"] == "invalid_request":
        return InvalidRequest(err["message"], err.get("param"), err.get("code"))
    if err["kind"] == "queue_full":
        report = err.get("report")
        return QueueFull(err["message"], ReplicaStats.from_dict(report) if report is not None else None)
    if err["kind"] == "engine_error":
        return EngineError(err["message"])
    if err["kind"] == "transfer_failed":
        return TransferFailed(err["message"])
    raise ProtocolError(f"unknown error kind {err['kind']!r}")


# The events of a replica's stream (`EngineReplica.generate` / `reserve`), in their order:
# `generate`: Accepted, then OutputChunk ...; `reserve`: KVReservation, then OutputChunk ... (from
# each sequence's second token on). A Failure ends either stream, at any point.


@dataclass(frozen=True)
class Accepted:
    """The replica's engine took the request: its queue had room and the request was valid.
    Sent once, before any output, so the caller can still answer a refusal with a status code."""

    rid: str

    def to_dict(self) -> dict[str, Any]:
        return {"rid": self.rid}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Accepted:
        return cls(rid=str(d["rid"]))


@dataclass(frozen=True)
class Failure:
    """A replica's refusal or failure of the request (InvalidRequest, QueueFull, TransferFailed,
    EngineError); the receiver raises `error`. It ends the stream, before or after acceptance (a
    grammar fails to compile when scheduled; a step fails)."""

    error: Exception

    def to_dict(self) -> dict[str, Any]:
        return _encode_exception(self.error)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Failure:
        return cls(_decode_exception(d))


StreamEvent = Accepted | KVReservation | OutputChunk | Failure
_EVENT_TYPES: dict[str, type[StreamEvent]] = {
    "accepted": Accepted,
    "reservation": KVReservation,
    "chunk": OutputChunk,
    "error": Failure,
}
_EVENT_TAGS = {t: tag for tag, t in _EVENT_TYPES.items()}


def encode_event(event: StreamEvent) -> dict[str, Any]:
    """The one wire form of a stream event: `{"type": tag, "body": event.to_dict()}`."""
    return {"type": _EVENT_TAGS[type(event)], "body": event.to_dict()}


def decode_event(d: Any) -> StreamEvent:
    """The event that `encode_event` encoded; ProtocolError for anything else."""
    tag = d.get("type") if isinstance(d, dict) else None
    kind = _EVENT_TYPES.get(tag) if isinstance(tag, str) else None
    if kind is None:
        raise ProtocolError(f"not a replica stream event: type {tag!r}")
    return kind.from_dict(d["body"])
