"""Reasoning output: a model's thinking split from its answer (`--reasoning-parser`).

The conventions are the protocol's `REASONING_FORMATS`: qwen3 writes an optional
`<think>...</think>` block at the start of its output; deepseek-r1 starts inside the thinking
(its chat template opened `<think>`, a `<think>` it writes anyway is dropped) up to `</think>`.
Output without the end tag is all thinking (deepseek-r1) or, when it did not begin with the start
tag, all answer (qwen3).

`ReasoningParser` takes the text in whatever pieces it streams in: a tag may be split across any
number of pieces, so text that may still be the beginning of a tag is held back until the next
piece (or the end) decides it. `ReasoningSplit` adds the token count of the thinking per output.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.workers.protocol import REASONING_FORMATS, ReasoningFormat

REASONING_PARSERS = tuple(REASONING_FORMATS)


class _Phase(enum.Enum):
    OPENING = "opening"  # at the start: the output may begin with the start tag
    THINKING = "thinking"
    ANSWER = "answer"


@dataclass(frozen=True)
class Delta:
    reasoning: str = ""
    content: str = ""


def _held_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """One output's text in, its thinking and answer out, correct at any piece boundaries.

    `answer_at` is, after each `feed`, where the answer began in the text just fed (0 when it
    began in text held back from earlier pieces), or None while the answer has not begun.
    """

    def __init__(self, fmt: ReasoningFormat):
        self.fmt = fmt
        self._phase = _Phase.OPENING
        self._held = ""
        self.answer_at: int | None = None
        self.thought = False  # the output holds a thinking part (perhaps an empty one)

    @property
    def answering(self) -> bool:
        return self._phase is _Phase.ANSWER

    @property
    def opening(self) -> bool:
        """Still undecided whether the output begins with a thinking block."""
        return self._phase is _Phase.OPENING

    def feed(self, text: str) -> Delta:
        was_answering = self.answering
        held_before = len(self._held)
        buffer, self._held = self._held + text, ""
        reasoning, content = "", ""
        if self._phase is _Phase.OPENING:
            start = self.fmt.start
            if buffer.startswith(start):
                self._phase, buffer = _Phase.THINKING, buffer[len(start) :]
                held_before -= len(start)
            elif start.startswith(buffer):
                self._held, buffer = buffer, ""
            else:
                self._phase = _Phase.THINKING if self.fmt.opened_by_prompt else _Phase.ANSWER
        if self._phase is _Phase.THINKING:
            self.thought = True
            end = buffer.find(self.fmt.end)
            if end >= 0:
                reasoning, buffer = buffer[:end], buffer[end + len(self.fmt.end) :]
                held_before -= end + len(self.fmt.end)
                self._phase = _Phase.ANSWER
            else:
                keep = _held_suffix(buffer, self.fmt.end)
                reasoning, self._held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
                buffer = ""
        if self._phase is _Phase.ANSWER:
            content = buffer
        self.answer_at = None if was_answering or not self.answering else max(0, -held_before)
        return Delta(reasoning, content)

    def finish(self) -> Delta:
        """The held-back text at the end of the output: a tag's beginning that never completed."""
        held, self._held = self._held, ""
        if self._phase is _Phase.OPENING:
            self._phase = _Phase.THINKING if self.fmt.opened_by_prompt else _Phase.ANSWER
            self.thought = self.fmt.opened_by_prompt
        if self._phase is _Phase.ANSWER:
            return Delta(content=held)
        return Delta(reasoning=held)


class ReasoningSplit:
    """One output choice's thinking and answer, and how many of its tokens are thinking.

    The engine's chunks carry text and token ids together: a chunk wholly inside the thinking
    counts all its tokens, the chunk in which the answer begins counts its tokens up to there (by
    their texts' lengths), and the chunks of an undecided opening count once it is decided (as
    thinking, or not at all when the output has no thinking)."""

    def __init__(self, fmt: ReasoningFormat, token_text: Callable[[int], str]):
        self.parser = ReasoningParser(fmt)
        self._token_text = token_text
        self.reasoning = ""
        self.content = ""
        self.reasoning_tokens = 0
        self._undecided = 0  # tokens of the opening, not yet known to be thinking

    def add(self, text: str, token_ids: Sequence[int], finished: bool) -> Delta:
        was_answering = self.parser.answering
        delta = self.parser.feed(text)
        at = self.parser.answer_at
        if finished:
            tail = self.parser.finish()
            delta = Delta(delta.reasoning + tail.reasoning, delta.content + tail.content)
        if not was_answering:
            counted = len(token_ids) if at is None else self._tokens_within(token_ids, at)
            if self.parser.opening:
                self._undecided += counted
            else:
                if self.parser.thought:
                    self.reasoning_tokens += self._undecided + counted
                self._undecided = 0
        self.reasoning += delta.reasoning
        self.content += delta.content
        return delta

    def _tokens_within(self, token_ids: Sequence[int], chars: int) -> int:
        """How many of the leading tokens it takes to cover `chars` characters of their text."""
        counted, length = 0, 0
        while counted < len(token_ids) and length < chars:
            length += len(self._token_text(token_ids[counted]))
            counted += 1
        return counted


def thinking_of(parser: str | None, template_kwargs: dict[str, Any] | None) -> str | None:
    """The reasoning convention a request's grammar makes room for: the server's parser, unless
    the request turned the thinking off through the chat template (qwen3's `enable_thinking`:
    false), when the answer begins the output and its grammar the first token."""
    fmt = REASONING_FORMATS.get(parser) if parser is not None else None
    if fmt is None or (fmt.off_switch is not None and (template_kwargs or {}).get(fmt.off_switch) is False):
        return None
    return parser
