"""The typed messages between a program's executor and its backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.lang.choices import ChoiceLogprobs
from radixserve.lang.sampling import Sampling


@dataclass(frozen=True)
class GenCall:
    """`messages`: the conversation before, when the call opens an assistant message (a chat
    API generates that message from them)."""

    prompt: str
    sampling: Sampling
    messages: tuple[dict[str, str], ...] | None = None


@dataclass(frozen=True)
class Usage:
    """What the server reported for one request: `cached_tokens` of the prompt came from the
    radix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None = None  # stop, length, abort

    @classmethod
    def of_native(cls, meta: dict[str, Any]) -> Usage:
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        return cls(
            int(meta.get("prompt_tokens") or 0),
            int(meta.get("completion_tokens") or 0),
            int(meta.get("cached_tokens") or 0),
            None if kind is None else str(getattr(kind, "value", kind)),
        )


@dataclass(frozen=True)
class GenResult:
    text: str
    usage: Usage


@dataclass(frozen=True)
class ScoreCall:
    """The logprobs of each choice as a continuation of `prompt` (and of `unconditional_context`
    when it is set)."""

    prompt: str
    choices: tuple[str, ...]
    unconditional_context: str | None = None
    messages: tuple[dict[str, str], ...] | None = None  # as GenCall's


@dataclass(frozen=True)
class ScoreResult:
    choices: list[ChoiceLogprobs]
    usage: list[Usage]  # the scoring requests' own
