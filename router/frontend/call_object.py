"""One tool call's JSON object, read a character at a time as a model writes it.

The reader knows only what it has seen: the call's name once its string closes, the raw text of
its arguments as each character arrives (so a stream can pass them on before the call ends), and
whether the object can still be a call. Its verdict at the closing brace is `json.loads`'s.
"""

from __future__ import annotations

import json


class CallObject:
    """One call's JSON object read a character at a time: the string under "name", and the raw
    text of the object under one of `arg_keys` (other keys are skipped). `done` once the object
    closes; `failed` once it cannot be a call (the whole text is checked with `json.loads`)."""

    def __init__(self, arg_keys: tuple[str, ...]):
        self.arg_keys = arg_keys
        self.text = ""
        self.name: str | None = None
        self.args = ""
        self.args_done = False
        self.done = self.failed = False
        self._depth = 0
        self._in_str = self._escape = False
        self._want_key = True  # at depth 1: the next token is a key (else a value)
        self._key = ""
        self._token_start = -1  # where the top-level string or value being read starts
        self._value_key = ""  # whose value is being read ("" between values)

    def feed(self, c: str) -> str:
        """Consume one character; returns what it adds to the arguments."""
        if self.done or self.failed:
            self.failed = True
            return ""
        pos = len(self.text)
        self.text += c
        if self._in_str:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_str = False
                if self._depth == 1:
                    return self._top_string_end()
            return self._args_char(c)
        if c in " \t\r\n":
            return self._args_char(c) if self._depth > 1 else ""
        if self._depth == 0:
            self.failed = c != "{"
            self._depth = 1
            return ""
        if self._depth == 1:
            return self._top_char(c, pos)
        out = self._args_char(c)
        if c == '"':
            self._in_str = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1:  # a compound value ends
                if self._value_key in self.arg_keys:
                    self.args_done = True
                self._value_key = ""
        return out

    def _top_char(self, c: str, pos: int) -> str:
        """A character outside any string at the object's own level."""
        if c == '"':
            self._in_str = True
            self._token_start = pos
            if not self._want_key:
                self._value_key = self._key
            return ""
        if c == ":":
            self._want_key = False
            return ""
        if c in ",}":
            self._want_key, self._value_key = True, ""
            if c == "}":
                self._close()
            return ""
        if self._want_key:
            self.failed = True
            return ""
        self._value_key = self._key
        if c in "{[":
            self._depth += 1
            if self._key in self.arg_keys and c == "{" and not self.args_done and not self.args:
                self.args = c
                return c
        elif self._key in self.arg_keys:
            self.failed = True  # the arguments must be an object
        return ""

    def _top_string_end(self) -> str:
        """A top-level key or string value ends; arguments written as a JSON string of an object
        (as some models do) are taken whole here."""
        token = self.text[self._token_start :]
        try:
            value = json.loads(token)
        except ValueError:
            self.failed = True
            return ""
        self._value_key = ""
        if self._want_key:
            self._key = value
        elif self._key == "name":
            self.name = value if self.name is None else self.name
        elif self._key in self.arg_keys and not self.args_done and _is_object_text(value):
            self.args, self.args_done = value, True
            return value
        return ""

    def _args_char(self, c: str) -> str:
        if self._value_key in self.arg_keys and self.args and not self.args_done:
            self.args += c
            return c
        return ""

    def _close(self) -> None:
        self.done = True
        try:
            obj = json.loads(self.text)
        except ValueError:
            obj = None
        ok = isinstance(obj, dict) and isinstance(obj.get("name"), str) and self.args_done
        self.failed = not ok


def _is_object_text(value: str) -> bool:
    try:
        return isinstance(json.loads(value), dict)
    except (ValueError, RecursionError):
        return False
