"""OpenAI response bodies and stream chunks, built from the engine's `OutputChunk`s.

`Sequences` folds the chunks of one or more engine requests (n > 1, or several prompts) into
per-choice state and usage; the functions below render that state in OpenAI's shapes for chat
and legacy completions, streaming or not. SGLang's native bodies come from workers/protocol.py.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.router.frontend.tokenizer import Tokenizer
from radixserve.workers.protocol import OutputChunk, TokenLogprob, add_to_native_result, native_result

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class Sequence:
    """One output choice as it accumulates."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: Any = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Sequences:
    """Choices of one HTTP request. Engine request `k` (prompt k) owns choices k*n .. k*n+n-1.

    With `native_rid`, each choice also keeps its SGLang /generate result (`native[i]`), built by
    the protocol's builder that the offline engine uses too.
    """

    def __init__(
        self,
        num_prompts: int,
        n: int,
        native_rid: str | None = None,
        token_text: Callable[[int], str] | None = None,
    ):
        self.n = n
        self.choices = [Sequence() for _ in range(num_prompts * n)]
        self.native = [native_result(native_rid) for _ in self.choices] if native_rid is not None else None
        self.token_text = token_text
        self._prompt_usage: dict[int, tuple[int, int]] = {}  # prompt -> (prompt, cached) tokens

    def choice_index(self, prompt: int, chunk: OutputChunk) -> int:
        return prompt * self.n + chunk.index

    def add(self, prompt: int, chunk: OutputChunk) -> int:
        """Fold one chunk in; returns its choice index."""
        i = self.choice_index(prompt, chunk)
        seq = self.choices[i]
        seq.text += chunk.text
        seq.token_ids.extend(chunk.token_ids)
        if chunk.logprobs:
            seq.logprobs.extend(chunk.logprobs)
        if chunk.finished:
            reason = chunk.finish_reason or {"type": "stop"}
            kind = str(reason.get("type"))
            seq.finish_reason = FINISH_REASONS.get(kind, kind)
            seq.matched_stop = reason.get("matched")
            # Every sequence of a request reports the same prompt; count it once (OpenAI does).
            self._prompt_usage[prompt] = (chunk.prompt_tokens, chunk.cached_tokens)
        if self.native is not None:
            add_to_native_result(self.native[i], chunk, self.token_text)
        return i

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.choices)

    def usage(self) -> Usage:
        u = Usage(completion_tokens=sum(len(s.token_ids) for s in self.choices))
        for prompt_tokens, cached in self._prompt_usage.values():
            u.prompt_tokens += prompt_tokens
            u.cached_tokens += cached
        return u


def chat_logprobs(tok: Tokenizer, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tok.token_text(token_id), "logprob": logprob, "bytes": tok.token_bytes(token_id)}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
        ]
    }


def completion_logprobs(tok: Tokenizer, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    tokens, offsets = [], []
    for lp in lps:
        offsets.append(offset)
        text = tok.token_text(lp.token_id)
        tokens.append(text)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{tok.token_text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_response(
    rid: str, model: str, seqs: Sequences, tok: Tokenizer, want_logprobs: bool
) -> dict[str, Any]:
    choices = []
    for i, s in enumerate(seqs.choices):
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": s.text},
                "logprobs": chat_logprobs(tok, s.logprobs) if want_logprobs else None,
                "finish_reason": s.finish_reason,
                "matched_stop": s.matched_stop,
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": seqs.usage().to_dict(),
    }


def completion_response(
    rid: str,
    model: str,
    seqs: Sequences,
    tok: Tokenizer,
    want_logprobs: bool,
    echo_texts: list[str] | None = None,
) -> dict[str, Any]:
    choices = []
    for i, s in enumerate(seqs.choices):
        prefix = echo_texts[i // seqs.n] if echo_texts else ""
        choices.append(
            {
                "index": i,
                "text": prefix + s.text,
                "logprobs": completion_logprobs(tok, s.logprobs, 0) if want_logprobs else None,
                "finish_reason": s.finish_reason,
                "matched_stop": s.matched_stop,
            }
        )
    return {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": seqs.usage().to_dict(),
    }


def _chunk(
    obj: str,
    rid: str,
    created: int,
    model: str,
    choice: dict[str, Any],
    finish_reason: str | None,
    matched_stop: Any,
) -> dict[str, Any]:
    choice["finish_reason"] = finish_reason
    if finish_reason is not None:
        choice["matched_stop"] = matched_stop
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": None}


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict | None = None,
    matched_stop: Any = None,
) -> dict[str, Any]:
    return _chunk(
        "chat.completion.chunk",
        rid,
        created,
        model,
        {"index": index, "delta": delta, "logprobs": logprobs},
        finish_reason,
        matched_stop,
    )


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None = None,
    logprobs: dict | None = None,
    matched_stop: Any = None,
) -> dict[str, Any]:
    return _chunk(
        "text_completion",
        rid,
        created,
        model,
        {"index": index, "text": text, "logprobs": logprobs},
        finish_reason,
        matched_stop,
    )


def usage_chunk(rid: str, created: int, model: str, obj: str, usage: Usage) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, only usage."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.to_dict(),
    }
