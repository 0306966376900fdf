"""The ingress's tokenizer: rebuilt from the files a replica sent (`ModelCard.tokenizer_files`).

The ingress tokenizes and applies the chat template itself (the router needs token ids to pick a
replica); text coming back is detokenized by the engine, so this class only encodes, and renders
single tokens for logprobs. Its methods are thread-safe: the ingress calls `encode` and
`encode_chat` on its tokenizer threads (router/frontend/tokenizer_pool.py).

`min_tokens` bounds a text's token count from its length alone, so a prompt too long for the
context is refused without tokenizing it: no token covers more characters than the longest
token's bytes (a character is at least one byte).
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from functools import lru_cache
from typing import Any

from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from radixserve.router.frontend.chat_template import ChatTemplate
from radixserve.workers.protocol import InvalidRequest, ModelCard

_SURROGATE = re.compile("[\ud800-\udfff]")
# Unicode normalization can merge characters (NFC: three Hangul jamo into one syllable); a
# normalized character stands for at most this many input characters.
_NORMALIZATION_MERGE = 4
_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
# Pre-tokenizers that keep every input character (Whitespace and friends drop some).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


class Tokenizer:
    def __init__(self, card: ModelCard):
        with tempfile.TemporaryDirectory(prefix="radixserve-tok-") as d:
            for name, text in card.tokenizer_files.items():
                if os.path.basename(name) != name:
                    raise ValueError(f"unsafe tokenizer file name {name!r}")
                with open(os.path.join(d, name), "w", encoding="utf-8") as f:
                    f.write(text)
            self.hf = AutoTokenizer.from_pretrained(d)
        self.vocab_size = card.vocab_size
        self.chat = ChatTemplate(self.hf)
        # lru_cache on a bound method would pin self; a per-instance cache does not.
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.max_chars_per_token = _max_chars_per_token(self.hf)

    def min_tokens(self, num_chars: int) -> int:
        """A lower bound on the token count of any text of `num_chars` characters (0: unknown)."""
        return math.ceil(num_chars / self.max_chars_per_token) if self.max_chars_per_token else 0

    def encode(self, text: str, add_special_tokens: bool = False, param: str = "prompt") -> list[int]:
        """Raw text: special-token text in it becomes those tokens (completions prompts are raw)."""
        _check_text(text, param)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is out of range [0, {self.vocab_size})", "tokens")
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        return self.chat.render(messages, add_generation_prompt, template_kwargs)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The chat as the model's template writes it (with the request's extra template
        variables, and the tools the model may call); message contents are text only."""
        for k, m in enumerate(messages):
            _check_text(m["content"], f"messages.{k}.content")
            for key, value in m.items():
                if key not in ("role", "content"):
                    _check_strings(value, f"messages.{k}.{key}")
        _check_strings(tools, "tools")
        return self.chat.encode(messages, template_kwargs, tools, add_generation_prompt)

    def check_ids(self, ids: list[int], param: str) -> None:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequest(f"token id {t!r} is out of range [0, {self.vocab_size})", param)

    def _token_text(self, token_id: int) -> str:
        """One token as text on its own (OpenAI's `token`); may hold a partial UTF-8 sequence."""
        return str(self.hf.decode([token_id], skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's raw bytes (OpenAI's `bytes`), exact even for a partial UTF-8 character."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and all(ch in _BYTE_OF_CHAR for ch in piece):
            return [_BYTE_OF_CHAR[ch] for ch in piece]  # byte-level BPE (GPT-2 / Llama-3 / SmolLM)
        return list(self.token_text(token_id).encode("utf-8"))


# Byte-level BPE (GPT-2, Llama-3, SmolLM) writes each byte as one printable character; this maps
# those characters back to their bytes.
_BYTE_OF_CHAR = {ch: b for b, ch in bytes_to_unicode().items()}


def _check_text(text: str, param: str) -> None:
    if not text.isascii() and _SURROGATE.search(text):
        raise InvalidRequest(f"'{param}' holds a lone UTF-16 surrogate, which is not valid Unicode", param)


def _check_strings(value: Any, param: str) -> None:
    """`_check_text` on every string in a JSON-like value, keys included, without recursion."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            _check_text(node, param)
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _max_chars_per_token(hf: Any) -> int | None:
    """Most characters one token can stand for, when the tokenizer's pipeline makes that bounded:
    a BPE model, no normalizer but Unicode normalization forms, no pre-tokenizer that drops text,
    no added token that swallows neighbouring whitespace. None: no bound is known."""
    spec = json.loads(hf.backend_tokenizer.to_str())
    if spec["model"]["type"] != "BPE" or not _keeps_every_char(spec.get("pre_tokenizer")):
        return None
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in spec.get("added_tokens", [])):
        return None
    normalizer = spec.get("normalizer")
    if normalizer is None:
        merge = 1
    elif _types(normalizer) <= _UNICODE_FORMS:
        merge = _NORMALIZATION_MERGE
    else:
        return None
    longest = max(
        len(piece) if all(ch in _BYTE_OF_CHAR for ch in piece) else len(piece.encode("utf-8"))
        for piece in hf.get_vocab()
    )
    return longest * merge


def _keeps_every_char(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    if pre["type"] == "Sequence":
        return all(_keeps_every_char(p) for p in pre["pretokenizers"])
    if pre["type"] == "Split":
        return pre.get("behavior") != "Removed"
    return pre["type"] in _KEEPING_PRE_TOKENIZERS


def _types(normalizer: dict[str, Any]) -> set[str]:
    if normalizer["type"] == "Sequence":
        return set().union(*(_types(n) for n in normalizer["normalizers"]))
    return {normalizer["type"]}
