"""Programs on any OpenAI-compatible server, for what its API can express.

A gen that opens an assistant message is a chat completion of the messages before it (with
`json_schema` as `response_format`); any other gen is a completion of the text so far (the calls
of one step that ask the same settings go as one request with a list of prompts). A select is
scored from a completion that echoes each prompt + choice with its logprobs (`echo`,
`logprobs`, one token generated), where the server gives those; a select inside a chat message
cannot be scored through the chat API and is a LangError. The API has no regex and no top_k:
a gen that asks for them is a LangError. Streaming delivers each call's text when it is done.
A completion of several prompts reports the request's total usage for each of its calls.
In the state's text, role blocks are written as "role: content" lines (the server renders the
real template from the messages)."""

from __future__ import annotations

import json
from typing import Any

from radixserve.lang.backend import Backend, OnDelta
from radixserve.lang.calls import GenCall, GenResult, ScoreCall, ScoreResult, Usage
from radixserve.lang.chat_format import ChatFormat, RoleFormat
from radixserve.lang.choices import ChoiceLogprobs
from radixserve.lang.errors import LangError
from radixserve.lang.http_client import HttpClient
from radixserve.lang.sampling import Sampling

_DISPLAY = ChatFormat({r: RoleFormat(f"{r}: ", f"{r}: ", "\n") for r in ("system", "user", "assistant")})


class OpenAI(Backend):
    """`OpenAI(base_url="http://127.0.0.1:30000/v1", api_key=..., model=None)` (None: the
    server's first model)."""

    def __init__(
        self, base_url: str, api_key: str | None = None, model: str | None = None, timeout_s: float = 600.0
    ):
        self.http = HttpClient(base_url, api_key, timeout_s)
        self._model = model

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = str(self.http.get("/models")["data"][0]["id"])
        return self._model

    def chat_format(self) -> ChatFormat:
        return _DISPLAY

    def generate(self, calls: list[GenCall], on_delta: OnDelta | None = None) -> list[GenResult]:
        results: dict[int, GenResult] = {}
        plain: dict[Sampling, list[int]] = {}
        for i, c in enumerate(calls):
            if c.messages is not None:
                results[i] = self._chat(c)
            else:
                plain.setdefault(c.sampling, []).append(i)
        for sampling, idx in plain.items():
            body = {
                "model": self.model,
                "prompt": [calls[i].prompt for i in idx],
                **_fields(sampling, chat=False),
            }
            answer = self.http.post("/completions", body)
            usage = _usage(answer)
            for choice in answer["choices"]:
                i = idx[int(choice["index"])]
                results[i] = GenResult(
                    choice["text"], Usage(usage[0], usage[1], usage[2], choice.get("finish_reason"))
                )
        out = [results[i] for i in range(len(calls))]
        if on_delta is not None:
            for i, r in enumerate(out):
                on_delta(i, r.text)
        return out

    def _chat(self, call: GenCall) -> GenResult:
        assert call.messages is not None
        body = {"model": self.model, "messages": list(call.messages), **_fields(call.sampling, chat=True)}
        answer = self.http.post("/chat/completions", body)
        choice = answer["choices"][0]
        p, c, cached = _usage(answer)
        return GenResult(
            choice["message"].get("content") or "", Usage(p, c, cached, choice.get("finish_reason"))
        )

    def score(self, calls: list[ScoreCall]) -> list[ScoreResult]:
        if any(c.messages is not None for c in calls):
            raise LangError(
                "the chat API gives no prompt logprobs: select inside a chat message cannot be scored"
            )
        texts: list[str] = []
        for c in calls:
            texts += [c.prompt + ch for ch in c.choices]
            if c.unconditional_context is not None:
                texts += [c.unconditional_context + ch for ch in c.choices]
        body = {
            "model": self.model,
            "prompt": texts,
            "echo": True,
            "logprobs": 0,
            "max_tokens": 1,
            "temperature": 0,
        }
        answer = self.http.post("/completions", body)
        logprobs = {int(ch["index"]): ch["logprobs"] for ch in answer["choices"]}
        out, k = [], 0
        for c in calls:
            cond = [_after(logprobs[k + j], len(c.prompt), ch) for j, ch in enumerate(c.choices)]
            k += len(c.choices)
            uncond: list[list[float] | None] = [None] * len(c.choices)
            if c.unconditional_context is not None:
                n = len(c.unconditional_context)
                uncond = [_after(logprobs[k + j], n, ch) for j, ch in enumerate(c.choices)]
                k += len(c.choices)
            out.append(ScoreResult([ChoiceLogprobs(a, b) for a, b in zip(cond, uncond)], []))
        return out


def _fields(s: Sampling, chat: bool) -> dict[str, Any]:
    if s.regex is not None or s.top_k is not None:
        raise LangError("the OpenAI API takes no regex and no top_k")
    if s.json_schema is not None and not chat:
        raise LangError("the OpenAI API constrains JSON on chat only: put the gen in rl.assistant(...)")
    out: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        if getattr(s, name) is not None:
            out[name] = getattr(s, name)
    if s.stop is not None:
        out["stop"] = list(s.stop)
    if s.json_schema is not None:
        schema = {"name": "output", "schema": json.loads(s.json_schema), "strict": True}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    return out


def _usage(answer: dict[str, Any]) -> tuple[int, int, int]:
    """The request's usage (the API reports one total for all its prompts)."""
    u = answer.get("usage") or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0)), int(cached)


def _after(lp: dict[str, Any], boundary: int, choice: str) -> list[float]:
    """The logprobs of the echoed tokens that end past `boundary` (a token across it counts),
    up to the end of the choice (the one token generated after it is not the choice's)."""
    end = boundary + len(choice)
    picked = [
        v
        for tok, off, v in zip(lp["tokens"], lp["text_offset"], lp["token_logprobs"])
        if off + len(tok) > boundary and off < end
    ]
    if not picked or any(v is None for v in picked):
        raise LangError(f"the choice {choice!r} adds no token the server scored after this prompt")
    return [float(v) for v in picked]
