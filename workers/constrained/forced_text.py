"""The text a grammar forces next, searched with a bound (`ForcedText`).

xgrammar's own search (`find_jump_forward_string`) has no limit: a grammar whose continuation is
forced forever, such as `root ::= "a" root` or a JSON schema whose required property is the root
again, makes it loop and allocate until the process runs out of memory. Such a state cannot be
refused up front: it may arise only after some output (`root ::= "x" | "y" a`, `a ::= "a" a`), so
the search itself is bounded, byte by byte, on a fork of the matcher:

- a byte is forced when every token the grammar allows next starts with it (tokens with no text,
  stop tokens among them, allow an end or something unknown: the search stops there);
- the search stops after `max_bytes` bytes; the caller sizes that from the request's remaining
  tokens, under `MAX_JUMP_BYTES`. Forced text past the bound is taken on the next step, so a
  forced-forever grammar is served like any other, a bounded jump at a time, until its length
  limit: the same tokens as without jump-forward, never an unbounded call.

Each byte costs one bitmask fill and a few vector operations over the vocabulary's bit words
(about 10 us for a 49k vocabulary); at most MAX_JUMP_BYTES of them per sequence and step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xgrammar as xgr

# At most this many forced bytes per search: one sequence's jump-forward costs at most ~5 ms of
# engine-thread time per step, whatever its grammar.
MAX_JUMP_BYTES = 512
# Forced bytes searched per token the request may still generate (tokens average ~4 bytes of
# English or JSON): a request near its length limit searches only what it can still use.
JUMP_BYTES_PER_TOKEN = 8
_NO_TEXT = 256  # first-byte value of tokens without text


class ForcedText:
    """Per-vocabulary tables for the bounded forced-text search; shared by a backend's grammars.

    `decoded_vocab[t]` is token t's bytes (b"" for special tokens and padding). Tables: for each
    byte value b, the bit words of the tokens that do NOT start with b (a token allowed there
    means the next byte is not forced to be b)."""

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int):
        self.vocab_size = vocab_size
        words = (vocab_size + 31) // 32
        first = np.full(words * 32, _NO_TEXT, dtype=np.int16)
        for token_id, text in enumerate(decoded_vocab[:vocab_size]):
            if text:
                first[token_id] = text[0]
        self._first = first
        bits = first[None, :] != np.arange(256, dtype=np.int16)[:, None]  # [256, words * 32]
        self._others = np.packbits(bits, axis=1, bitorder="little").view(np.uint32)

    def search(self, matcher: xgr.GrammarMatcher, max_bytes: int) -> str:
        """The forced text after `matcher`'s state, at most `max_bytes` bytes, cut to whole UTF-8
        characters ("" when it would start inside one). The matcher itself is not changed."""
        if max_bytes <= 0 or matcher.is_terminated():
            return ""
        probe = matcher.fork()
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        words = bitmask.numpy().view(np.uint32)[0]
        forced = bytearray()
        while len(forced) < max_bytes and not probe.is_terminated():
            probe.fill_next_token_bitmask(bitmask, 0)
            nonzero = np.flatnonzero(words)
            if nonzero.size == 0:
                break
            w = int(nonzero[0])
            low = int(words[w])
            byte = int(self._first[w * 32 + (low & -low).bit_length() - 1])
            if byte == _NO_TEXT or np.bitwise_and(words, self._others[byte]).any():
                break
            if not probe.accept_string(bytes([byte])):
                break
            forced.append(byte)
        return _whole_characters(bytes(forced))


def _whole_characters(data: bytes) -> str:
    if data and 0x80 <= data[0] < 0xC0:
        return ""  # the state is inside a character the model began: it finishes it
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return data[: exc.start].decode("utf-8")
