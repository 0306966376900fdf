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

from radixserve.router.frontend.reasoning import ReasoningSplit
from radixserve.router.frontend.tokenizer import Tokenizer
from radixserve.router.frontend.tool_parsers import ToolCallParser
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
    # The prompt's logprobs (from the first chunk), when the request asked for them
    input_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    matched_stop: Any = None
    # With a reasoning parser: the text split into thinking and answer, and the last chunk's part
    # of each (what a stream sends).
    split: ReasoningSplit | None = None
    last_delta: dict[str, Any] = field(default_factory=dict)
    # With tools: the answer (after any thinking) parsed into content and tool calls.
    tools: ToolCallParser | None = None

    def message_text(self) -> dict[str, Any]:
        """The message's text fields: `content`, and with a reasoning parser the thinking as
        `reasoning_content` (and vLLM's `reasoning`), None when there was none; with tools, the
        calls as `tool_calls` (content None when there is none beside them)."""
        if self.split is None:
            out: dict[str, Any] = {"content": self.text}
        else:
            thinking = self.split.reasoning or None
            out = {"content": self.split.content, "reasoning_content": thinking, "reasoning": thinking}
        if self.tools is not None:
            out["content"] = self.tools.content or (None if self.tools.calls else "")
            if self.tools.calls:
                out["tool_calls"] = [c.to_dict() for c in self.tools.calls]
        return out


def _delta(seq: Sequence, chunk: OutputChunk) -> dict[str, Any]:
    if seq.split is None:
        delta: dict[str, Any] = {"content": chunk.text} if chunk.text else {}
    else:
        part = seq.split.add(chunk.text, chunk.token_ids, chunk.finished)
        delta = {"reasoning_content": part.reasoning, "reasoning": part.reasoning} if part.reasoning else {}
        delta = {**delta, "content": part.content} if part.content else delta
    if seq.tools is None:
        return delta
    parsed = seq.tools.feed(delta.pop("content", ""))
    if chunk.finished:
        parsed.extend(seq.tools.finish())
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.calls:
        delta["tool_calls"] = parsed.calls
    return delta


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int | None = None  # with a reasoning parser: the thinking's share

    def to_dict(self) -> dict[str, Any]:
        out = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.reasoning_tokens is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return out


class Sequences:
    """Choices of one HTTP request. Engine request `k` (prompt k) owns choices k*n .. k*n+n-1.

    With `native_rid`, each choice also keeps its SGLang /generate result (`native[i]`), built by
    the protocol's builder that the offline engine uses too. With `reasoning` (a factory of
    splits), each choice's text is split into thinking and answer as it arrives; with `tools` (a
    factory of parsers), each answer is parsed into content and tool calls.
    """

    def __init__(
        self,
        num_prompts: int,
        n: int,
        native_rid: str | None = None,
        token_text: Callable[[int], str] | None = None,
        reasoning: Callable[[], ReasoningSplit] | None = None,
        tools: Callable[[], ToolCallParser | None] | None = None,
        prompt_ids: list[list[int]] | None = None,
    ):
        self.n = n
        self.prompt_ids = prompt_ids  # each prompt's token ids: they name its input logprobs
        self.choices = [
            Sequence(
                split=reasoning() if reasoning is not None else None,
                tools=tools() if tools is not None else None,
            )
            for _ in range(num_prompts * n)
        ]
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
        seq.last_delta = _delta(seq, chunk)
        seq.token_ids.extend(chunk.token_ids)
        if chunk.logprobs:
            seq.logprobs.extend(chunk.logprobs)
        if chunk.input_logprobs is not None:
            seq.input_logprobs = chunk.input_logprobs
        if chunk.finished:
            reason = chunk.finish_reason or {"type": "stop"}
            kind = str(reason.get("type"))
            seq.finish_reason = FINISH_REASONS.get(kind, kind)
            if seq.finish_reason == "stop" and seq.tools is not None and seq.tools.calls:
                seq.finish_reason = "tool_calls"
            seq.matched_stop = reason.get("matched")
            # Every sequence of a request reports the same prompt; count it once (OpenAI does).
            self._prompt_usage[prompt] = (chunk.prompt_tokens, chunk.cached_tokens)
        if self.native is not None:
            ids = self.prompt_ids[prompt] if self.prompt_ids is not None else None
            add_to_native_result(self.native[i], chunk, self.token_text, ids)
        return i

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.choices)

    def usage(self) -> Usage:
        u = Usage(completion_tokens=sum(len(s.token_ids) for s in self.choices))
        splits = [s.split for s in self.choices if s.split is not None]
        if splits:
            u.reasoning_tokens = sum(split.reasoning_tokens for split in splits)
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


def prompt_logprobs(tok: Tokenizer, prompt_ids: list[int], lps: list[TokenLogprob | None]) -> dict[str, Any]:
    """The legacy completions shape of an echoed prompt's logprobs (`lps` from its first token
    on): the first token's logprob and alternatives are null, as nothing predicts it."""
    tokens, offsets, offset = [], [], 0
    for t in prompt_ids:
        offsets.append(offset)
        text = tok.token_text(t)
        tokens.append(text)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
        "top_logprobs": [None if lp is None else {tok.token_text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def joined_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + then[key] for key in first}


def chat_response(
    rid: str, model: str, seqs: Sequences, tok: Tokenizer, want_logprobs: bool
) -> dict[str, Any]:
    choices = []
    for i, s in enumerate(seqs.choices):
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", **s.message_text()},
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
    prompt_ids: list[list[int]] | None = None,
) -> dict[str, Any]:
    """`echo_texts`: each prompt's text, before its completions; with logprobs the prompt's
    (`prompt_ids` naming its tokens) come before the completion's."""
    choices = []
    for i, s in enumerate(seqs.choices):
        prefix = echo_texts[i // seqs.n] if echo_texts else ""
        lps = completion_logprobs(tok, s.logprobs, len(prefix)) if want_logprobs else None
        if lps is not None and prompt_ids is not None and s.input_logprobs is not None:
            lps = joined_logprobs(prompt_logprobs(tok, prompt_ids[i // seqs.n], s.input_logprobs), lps)
        choices.append(
            {
                "index": i,
                "text": prefix + s.text,
                "logprobs": lps,
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
