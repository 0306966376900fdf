"""The model's chat template, rendered so that message contents are only ever text.

A template writes role markers as special tokens (`<|im_start|>`, `<|im_end|>` ...). Tokenizing the
rendered string as a whole would also turn those markers into control tokens where a user merely
typed them ("<|im_end|><|im_start|>system ..."), letting message contents forge turns. Here the
template's own markers become special tokens and everything else is tokenized as text.

How: a Hugging Face tokenizer first splits its input at added tokens, then tokenizes each piece
between them on its own. So the rendered string is split at the markers the template wrote (the
special-token texts that remain after those inside contents were swapped for sentinels before
rendering), each piece is tokenized with special tokens read as text, and the marker ids go in
between. A chat whose contents hold no special-token text takes the plain path (one `encode`),
which gives the same ids.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from radixserve.workers.protocol import InvalidRequest


class ChatTemplate:
    def __init__(self, hf: Any):
        self.hf = hf
        special = {t.content: i for i, t in hf.added_tokens_decoder.items() if t.special and t.content}
        self.special_ids = special
        # Longest first: at one position the longest marker wins, as the tokenizer's own matcher does.
        alternatives = sorted(special, key=len, reverse=True)
        self.special_re = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        # A private copy that reads special-token text as text (the shared tokenizer must never be
        # switched back and forth: it is used from several threads).
        self.text_tokenizer = BackendTokenizer.from_str(hf.backend_tokenizer.to_str())
        self.text_tokenizer.encode_special_tokens = True

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # a template that raises on these messages (e.g. role order)
            raise InvalidRequest(f"the chat template rejected the messages: {e}", "messages") from None

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the rendered chat; special-token text inside contents stays text."""
        if self.special_re is None or not any(self.special_re.search(m["content"]) for m in messages):
            # The template already writes any BOS it wants; adding special tokens would double it.
            return list(self.hf.encode(self.render(messages), add_special_tokens=False))
        return self.encode_spliced(messages)

    def encode_spliced(self, messages: list[dict[str, Any]]) -> list[int]:
        assert self.special_re is not None
        marker = f"\ue000{uuid.uuid4().hex}"  # a private-use prefix no content can contain by chance
        texts = sorted(self.special_ids)
        index = {t: k for k, t in enumerate(texts)}
        hidden = [
            {**m, "content": self.special_re.sub(lambda s: f"{marker}{index[s[0]]}\ue001", m["content"])}
            for m in messages
        ]
        rendered = self.render(hidden)
        revealed = re.compile(re.escape(marker) + r"(\d+)\ue001")
        ids: list[int] = []
        pos = 0
        for match in self.special_re.finditer(rendered):
            ids += self._text_ids(revealed.sub(lambda s: texts[int(s[1])], rendered[pos : match.start()]))
            ids.append(self.special_ids[match[0]])
            pos = match.end()
        ids += self._text_ids(revealed.sub(lambda s: texts[int(s[1])], rendered[pos:]))
        return ids

    def _text_ids(self, text: str) -> list[int]:
        return self.text_tokenizer.encode(text, add_special_tokens=False).ids if text else []
