"""Role blocks as the model's chat template writes them.

The template renders whole conversations; a program writes one message at a time, with model
calls inside. The format is read off the template by rendering probe conversations around a
marker: what comes before the marker is a role's opening, what follows its closing. The
assistant's opening is the template's generation prompt (what a chat request generates after),
so `assistant(gen(...))` generates exactly where a chat completion would."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.lang.errors import LangError

# render(messages, add_generation_prompt) -> text
Renderer = Callable[[list[dict[str, Any]], bool], str]
MARK = "QXZMARKQXZ"  # plain text no template rewrites


@dataclass(frozen=True)
class RoleFormat:
    first_prefix: str  # when the message opens the conversation (a BOS, a default system prompt)
    prefix: str
    suffix: str


class ChatFormat:
    def __init__(self, roles: dict[str, RoleFormat]):
        self.roles = roles

    def begin(self, role: str, first: bool) -> str:
        f = self.roles[role]
        return f.first_prefix if first else f.prefix

    def end(self, role: str) -> str:
        return self.roles[role].suffix

    @classmethod
    def from_renderer(cls, render: Renderer) -> ChatFormat:
        def msg(role: str, content: str) -> dict[str, Any]:
            return {"role": role, "content": content}

        def around(ctx: list[dict[str, Any]], role: str) -> tuple[str, str]:
            base = render(ctx, False) if ctx else ""
            text = render([*ctx, msg(role, MARK)], False)
            if not text.startswith(base) or text.count(MARK) != 1:
                raise LangError(f"the chat template does not write a {role} message as an appended block")
            at = text.index(MARK)
            return text[len(base) : at], text[at + len(MARK) :]

        turn = [msg("user", "Y"), msg("assistant", "Z")]
        first_user, _ = around([], "user")
        first_system, system_suffix = around([], "system")
        user_prefix, user_suffix = around(turn, "user")
        asked = [msg("user", "Y")]
        gen_prompt = render(asked, True)[len(render(asked, False)) :]
        _, assistant_suffix = around(asked, "assistant")
        try:
            system_prefix, _ = around(turn, "system")
        except Exception:  # a template that takes a system message first only
            system_prefix = first_system
        return cls(
            {
                "system": RoleFormat(first_system, system_prefix, system_suffix),
                "user": RoleFormat(first_user, user_prefix, user_suffix),
                "assistant": RoleFormat(gen_prompt, gen_prompt, assistant_suffix),
            }
        )
