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
which gives the same ids. Every string of a message is protected so, not only its content: names,
tool calls (their arguments are objects here, keys included), and the tool definitions too.

A request's `chat_template_kwargs` (extra variables of the template, such as `enable_thinking`)
are user text too: their strings are hidden and revealed as message contents are, and names the
template or its renderer already give a meaning to are refused.
"""

from __future__ import annotations

import inspect
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from radixserve.workers.protocol import InvalidRequest

MAX_TEMPLATE_KWARGS_DEPTH = 16  # objects and arrays in chat_template_kwargs, itself included
# The template's own variables: what it renders from (messages, tools ...) and how it is called.
_TEMPLATE_VARIABLES = {"messages", "tools", "documents", "add_generation_prompt", "raise_exception"}


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
        # Names a request's template kwargs may not take: the template's variables, the
        # renderer's parameters and the special tokens it passes to the template.
        renderer = inspect.signature(hf.apply_chat_template).parameters
        self.reserved = (
            _TEMPLATE_VARIABLES
            | {n for n, p in renderer.items() if p.kind is not p.VAR_KEYWORD}
            | set(getattr(hf, "special_tokens_map", {}))
        )

    def check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        """Refuse template kwargs that would replace the template's own variables, or nest too
        deep (InvalidRequest on `chat_template_kwargs`)."""
        clash = sorted(set(kwargs) & self.reserved)
        if clash:
            raise InvalidRequest(
                f"'chat_template_kwargs' may not set {', '.join(map(repr, clash))}: the chat "
                "template's own variables",
                "chat_template_kwargs",
            )
        if _depth(kwargs) > MAX_TEMPLATE_KWARGS_DEPTH:
            raise InvalidRequest(
                f"'chat_template_kwargs' nests objects and arrays more than {MAX_TEMPLATE_KWARGS_DEPTH} "
                "levels deep",
                "chat_template_kwargs",
            )

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
        kwargs = dict(template_kwargs or {})
        self.check_kwargs(kwargs)
        try:
            return self.hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as e:  # a template that raises on these messages (e.g. role order)
            raise InvalidRequest(f"the chat template rejected the messages: {e}", "messages") from None

    def encode(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of the rendered chat; special-token text inside contents (and inside the
        template kwargs' strings) stays text."""
        kwargs = template_kwargs or {}
        self.check_kwargs(kwargs)  # first: the walks below assume a bounded depth
        user_texts = _strings([messages, tools, list(kwargs.values())])
        if self.special_re is None or not any(self.special_re.search(t) for t in user_texts):
            # The template already writes any BOS it wants; adding special tokens would double it.
            rendered = self.render(messages, add_generation_prompt, template_kwargs, tools)
            return list(self.hf.encode(rendered, add_special_tokens=False))
        return self.encode_spliced(messages, template_kwargs, tools, add_generation_prompt)

    def encode_spliced(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        assert self.special_re is not None
        special_re = self.special_re
        marker = f"\ue000{uuid.uuid4().hex}"  # a private-use prefix no content can contain by chance
        texts = sorted(self.special_ids)
        index = {t: k for k, t in enumerate(texts)}

        def hide(text: str) -> str:
            return special_re.sub(lambda s: f"{marker}{index[s[0]]}\ue001", text)

        hidden = [{k: v if k == "role" else _map_strings(v, hide) for k, v in m.items()} for m in messages]
        kwargs = {name: _map_strings(v, hide) for name, v in (template_kwargs or {}).items()}
        rendered = self.render(hidden, add_generation_prompt, kwargs, _map_strings(tools, hide))
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


def _depth(value: Any) -> int:
    """Nesting depth of dicts and lists (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in node)
    return deepest


def _strings(value: Any) -> list[str]:
    """Every string in a JSON value, keys included (depth already bounded by check_kwargs)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [k, *_strings(v)]]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """The JSON value with `fn` applied to every string in it, keys included."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {fn(k): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value
