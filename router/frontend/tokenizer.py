"""The ingress's tokenizer: rebuilt from the files a replica sent (`ModelCard.tokenizer_files`).

The ingress tokenizes and applies the chat template itself (the router needs token ids to pick a
replica); text coming back is detokenized by the engine, so this class only encodes, and renders
single tokens for logprobs.
"""

from __future__ import annotations

import os
import tempfile
from functools import lru_cache
from typing import Any

from transformers import AutoTokenizer

from radixserve.workers.protocol import InvalidRequest, ModelCard


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
        # lru_cache on a bound method would pin self; a per-instance cache does not.
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is out of range [0, {self.vocab_size})", "tokens")
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # a template that raises on these messages (e.g. role order)
            raise InvalidRequest(f"the chat template rejected the messages: {e}", "messages") from None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template already writes any BOS it wants; adding special tokens would double it.
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def check_ids(self, ids: list[int], param: str) -> None:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequest(f"token id {t!r} is out of range [0, {self.vocab_size})", param)

    def _token_text(self, token_id: int) -> str:
        """One token as text on its own (OpenAI's `token`); may hold a partial UTF-8 sequence."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's raw bytes (OpenAI's `bytes`), exact even for a partial UTF-8 character."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and all(ch in _BYTE_OF_CHAR for ch in piece):
            return [_BYTE_OF_CHAR[ch] for ch in piece]  # byte-level BPE (GPT-2 / Llama-3 / SmolLM)
        return list(self.token_text(token_id).encode("utf-8"))


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character; this maps them back."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_OF_CHAR = _byte_level_alphabet()
