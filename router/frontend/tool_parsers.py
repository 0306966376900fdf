"""Tool calls in a model's output, per model family, parsed as the text streams in.

A `ToolCallParser` is fed the output text in whatever pieces it arrives and returns what can be
told so far: content text, and tool calls as OpenAI's stream deltas (a call's first delta has its
index, id, type and function name; the next ones carry fragments of its arguments). Its decisions
depend only on the characters seen, never on where the pieces were cut, so the same text fed
whole or one character at a time gives the same content and calls. Text that may still turn into
a call (a prefix of a call's opening marker, whitespace next to a call) is held back until the
next piece or `finish` decides it.

The families:

- `hermes` (Hermes, Qwen 2.5 / 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, content around them.
- `llama3`: the whole message is calls: `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any content.

A call whose JSON breaks before its name is known falls back to content; one that breaks after
it (possible only without a grammar) keeps the arguments as they were written.
"""

from __future__ import annotations

import functools
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.router.frontend.call_object import CallObject

PARSERS = ("hermes", "qwen", "llama3", "mistral")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text, as the model wrote it

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Delta:
    """What one piece of text adds: content, and per call (index) its opening or arguments."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def extend(self, other: Delta) -> None:
        self.content += other.content
        self.calls += other.calls


class ToolCallParser:
    """The parser of one output (one choice). `feed` each piece of text, then `finish` once.

    States: "content" (watching for `opener`), "object_open" (between a marker and the call's
    `{`), "object" (inside a call), then what the family reads between calls.
    """

    opener = ""  # the marker that opens a call (or a list of calls)
    arg_keys: tuple[str, ...] = ("arguments",)
    markers: tuple[str, ...] = ()  # what the model writes around calls (kept in the output text)

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.content = ""
        self._state = "content"
        self._held = ""  # text not yet told: whitespace, a prefix of a marker
        self._obj: CallObject | None = None
        self._told = False  # the call being read has had its first delta
        self._raw = ""  # the call's text so far, marker included: content again if it fails
        self._skip_space = False  # whitespace right after a call is dropped
        self._out = Delta()

    def feed(self, text: str) -> Delta:
        for c in text:
            getattr(self, f"_in_{self._state}")(c)
        return self._take()

    def finish(self) -> Delta:
        """The end of the output: a call cut short is kept if its name was told, else it is
        content; held text is content, unless calls were made and it is only whitespace."""
        if self._obj is not None and self._told:
            self._obj = None
        elif self._raw:
            self._emit_content(self._raw)
        if self._state == "close":
            self._held = ""  # a closing tag cut short
        if self._held and not (self.calls and self._held.isspace()):
            self._emit_content(self._held)
        self._held = self._raw = ""
        self._obj = None
        self._state = "done"
        return self._take()

    # ---- states ----------------------------------------------------------------------------

    def _in_content(self, c: str) -> None:
        if self._skip_space and c.isspace():
            return
        self._skip_space = False
        self._held += c
        if self.opener and self._held.endswith(self.opener):
            before = self._held[: -len(self.opener)]
            if not before.isspace():
                self._emit_content(before)
            self._held, self._raw = "", self.opener
            self._state = "object_open"
            return
        keep = _held_back(self._held, self.opener)
        told = self._held[: len(self._held) - keep]
        if told:
            self._emit_content(told)
            self._held = self._held[len(told) :]

    def _in_done(self, c: str) -> None:
        self._emit_content(c)

    def _in_object_open(self, c: str) -> None:
        self._raw += c
        if not c.isspace():
            self._obj, self._told, self._state = CallObject(self.arg_keys), False, "object"
            self._read_object(c)

    def _in_object(self, c: str) -> None:
        self._raw += c
        self._read_object(c)

    def _read_object(self, c: str) -> None:
        obj = self._obj
        assert obj is not None
        fragment = obj.feed(c)
        if obj.name is not None and not self._told:
            self._told = True
            self.calls.append(ToolCall(new_call_id(), obj.name))
            call = self.calls[-1]
            self._out.calls.append(
                {
                    "index": len(self.calls) - 1,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name},
                }
            )
            fragment = obj.args  # what came before the name
        if fragment and self._told:
            self._add_arguments(fragment)
        if obj.failed and not self._told:
            self._obj = None
            self._emit_content(self._raw)  # not a call after all
            self._raw, self._state = "", "content"
        elif obj.failed or obj.done:
            self._obj, self._raw = None, ""
            self._after_call()

    def _after_call(self) -> None:
        self._state, self._skip_space = "content", True

    # ---- output ----------------------------------------------------------------------------

    def _add_arguments(self, fragment: str) -> None:
        k = len(self.calls) - 1
        self.calls[k].arguments += fragment
        last = self._out.calls[-1] if self._out.calls else None
        if last is not None and last["index"] == k:
            fn = last["function"]
            fn["arguments"] = fn.get("arguments", "") + fragment
        else:
            self._out.calls.append({"index": k, "function": {"arguments": fragment}})

    def _emit_content(self, text: str) -> None:
        if text:
            self.content += text
            self._out.content += text

    def _take(self) -> Delta:
        out, self._out = self._out, Delta()
        return out


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` must wait: trailing whitespace (it may precede a
    call) and a proper prefix of `marker`."""
    keep = 0
    if marker:
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                keep = n
                break
    rest = text[: len(text) - keep]
    return keep + len(rest) - len(rest.rstrip())


class HermesParser(ToolCallParser):
    """`<tool_call>{...}</tool_call>`, any number, content around them."""

    opener = "<tool_call>"
    closer = "</tool_call>"
    markers = (opener, closer)

    def _after_call(self) -> None:
        self._state, self._held = "close", ""

    def _in_close(self, c: str) -> None:
        """Whitespace, then the closing tag; anything else goes back to content."""
        if not self._held and c.isspace():
            return
        self._held += c
        if self.closer.startswith(self._held):
            if self._held == self.closer:
                self._held = ""
                super()._after_call()
            return
        text, self._held = self._held, ""
        self._state = "content"
        for ch in text:
            self._in_content(ch)


class Llama3Parser(ToolCallParser):
    """The message is calls, `{"name": ..., "parameters": ...}` separated by `;`, optionally
    after `<|python_tag|>`; a message that starts otherwise is content."""

    tag = "<|python_tag|>"
    arg_keys = ("parameters", "arguments")
    markers = (tag,)

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"

    def _in_start(self, c: str) -> None:
        if not self._held and c.isspace():
            self._raw += c
            return
        if c == "{" and not self._held:
            self._state = "object_open"
            self._in_object_open(c)
            return
        self._held += c
        if self.tag.startswith(self._held):
            if self._held == self.tag:
                self._raw += self._held
                self._held, self._state = "", "object_open"
            return
        text, self._held = self._raw + self._held, ""
        self._raw, self._state = "", "done"  # not a call: all of it is content
        self._emit_content(text)

    def _after_call(self) -> None:
        self._state = "between"

    def _in_between(self, c: str) -> None:
        if c.isspace() or c == ";":
            return
        if c == "{":
            self._state = "object_open"
            self._in_object_open(c)
        else:
            self._state = "done"
            self._emit_content(c)


class MistralParser(ToolCallParser):
    """`[TOOL_CALLS]` then a JSON list of calls, after any content."""

    opener = "[TOOL_CALLS]"
    markers = (opener,)

    def _in_object_open(self, c: str) -> None:
        # After the marker: the list's `[`, then its calls.
        self._raw += c
        if c.isspace():
            return
        if c == "[":
            self._state = "list"
        else:
            self._emit_content(self._raw)
            self._raw, self._state = "", "content"

    def _in_list(self, c: str) -> None:
        self._raw += c
        if c.isspace() or c == ",":
            return
        if c == "{":
            self._obj, self._told, self._state = CallObject(self.arg_keys), False, "object"
            self._read_object(c)
            return
        self._raw = ""
        super()._after_call()  # the list ends (at its `]`, or at whatever is not a call)
        if c != "]":
            self._in_content(c)

    def _after_call(self) -> None:
        self._state = "list"


_FAMILIES: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
}


def parser_class(name: str) -> type[ToolCallParser]:
    return _FAMILIES[name]


@functools.lru_cache(maxsize=16)  # per template text (a str caches its hash)
def infer_parser(chat_template: str | None) -> str | None:
    """The family a chat template writes calls in, when it says so unambiguously; "hermes" for a
    template that knows no tools at all (the prompt then follows the Hermes convention)."""
    if not chat_template:
        return None
    found = [
        name
        for name, marks in (
            ("hermes", ("<tool_call>",)),
            ("mistral", ("[TOOL_CALLS]",)),
            ("llama3", ("<|python_tag|>", '"parameters": ')),
        )
        if any(m in chat_template for m in marks)
    ]
    if len(found) == 1:
        return found[0]
    if not found and not re.search(r"\btools\b|tool_calls", chat_template):
        return "hermes"
    return None


def parse_all(parser: ToolCallParser, text: str) -> ToolCallParser:
    """`parser` fed the whole text and finished (a non-streamed output)."""
    parser.feed(text)
    parser.finish()
    return parser
