"""Turns one sequence's token stream into text deltas that are safe to send.

Decoding token by token is wrong twice over: a byte-level BPE token can end in the middle of a UTF-8
character, and a tokenizer may render a token differently at the start of a text than after another
token (leading spaces). So, like vLLM's prefix_offset/read_offset technique, each step decodes only a
short window: the tokens already emitted since the last boundary (`prefix`) and the window plus the
new tokens; the difference is the new text, held back while it ends in an incomplete character.

Stop strings are matched on the text; anything that could still become a stop string is held back,
so a stop string never leaks partially into a stream, and nothing after a match is ever emitted.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded before the first output token, for its leading space
# Undecoded tokens held while the text ends in U+FFFD. A character has at most 4 bytes and a token
# at least one, so once this many wait, all but the last 3 can never complete a character: their
# text is released as it decodes (U+FFFD for bytes that are no character). This bounds each step's
# window (and its cost) for output that never forms a character, such as a run of lone UTF-8
# continuation bytes, which would otherwise widen the window at every token.
MAX_HELD_TOKENS = 4


class IncrementalDetokenizer:
    """One per output sequence; `add` runs in the engine loop, so each call decodes a few tokens only.

    For normal text, the concatenation of every delta returned by `add` and `flush` equals
    `tokenizer.decode(output_ids, skip_special_tokens=...)`, cut before the first stop string.
    (Bytes that form no character are released after MAX_HELD_TOKENS tokens: there the number of
    U+FFFD may differ from one decode of the whole.) A stop string is matched on the emitted text
    too when it holds U+FFFD: `flush` reports a match in `stop_matched`.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._special = _special_ids(tokenizer) if skip_special_tokens else frozenset()
        # Skipped special tokens are left out of the window altogether: decode() drops them before
        # joining bytes, so the text is the same, and a run of them never widens the window.
        self._ids = [t for t in prompt_ids if t not in self._special][-_PROMPT_CONTEXT:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._pending = ""  # decoded but not yet emitted (a possible stop-string prefix)
        self._chunks: list[str] = []  # emitted text
        self.stop_matched: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    @property
    def stopped(self) -> bool:
        return self.stop_matched is not None

    def add(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Feed newly generated tokens. Returns (text safe to emit now, stop string matched now or None).
        After a match every further call returns ("", None)."""
        if self.stopped:
            return "", None
        for t in token_ids:
            if t not in self._special:
                self._ids.append(t)
                self._pending += self._decode_step()
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of generation: emit what was held back (an unfinished character decodes as
        U+FFFD, as decode() renders it; a stop-string prefix that never completed is real output)."""
        if self.stopped:
            return ""
        if self._read_offset < len(self._ids):
            prefix = self._decode(self._prefix_offset, self._read_offset)
            self._pending += self._decode(self._prefix_offset, len(self._ids))[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(final=True)[0]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _decode_step(self) -> str:
        """New text up to the last token, or "" while it ends in an unfinished character (for at
        most MAX_HELD_TOKENS tokens)."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix) :]
        if len(self._ids) - self._read_offset < MAX_HELD_TOKENS:
            return ""
        settled = len(self._ids) - (MAX_HELD_TOKENS - 1)
        text = self._decode(self._prefix_offset, settled)
        self._prefix_offset, self._read_offset = self._read_offset, settled
        return text[len(prefix) :]

    def _release(self, final: bool) -> tuple[str, str | None]:
        """Move pending text to the output, up to a stop match or a possible stop prefix."""
        pending = self._pending
        match_at, match = _first_match(pending, self._stops)
        if match is not None:
            self._pending = ""
            self.stop_matched = match
            return self._emit(pending[:match_at]), match
        keep = 0 if final else _held_suffix(pending, self._stops, self._max_stop)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return self._emit(pending[: len(pending) - keep]), None

    def _emit(self, s: str) -> str:
        if s:
            self._chunks.append(s)
        return s


def _first_match(text: str, stops: tuple[str, ...]) -> tuple[int, str | None]:
    """Earliest stop string in text; on a tie the shorter one (it completed first)."""
    best_at, best = len(text) + 1, None
    for s in stops:
        at = text.find(s)
        if at != -1 and (at < best_at or (at == best_at and best is not None and len(s) < len(best))):
            best_at, best = at, s
    return best_at, best


def _held_suffix(text: str, stops: tuple[str, ...], max_stop: int) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string.

    Emitted text never contains the start of a match, so pending text stays shorter than the
    longest stop string and this costs O(len(stop)^2) per call, independent of the output length."""
    for n in range(min(len(text), max_stop - 1), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0


_SPECIAL_CACHE: dict[int, tuple[Any, frozenset[int]]] = {}


def _special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that decode(skip_special_tokens=True) drops, computed once per tokenizer."""
    cached = _SPECIAL_CACHE.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(i)
    result = frozenset(ids)
    _SPECIAL_CACHE[id(tokenizer)] = (tokenizer, result)
    return result
