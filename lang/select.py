"""`select`: the model picks one of given choices by their logprobs after the prompt."""

from __future__ import annotations

from radixserve.lang.choices import ChoicesMethod, token_length_normalized
from radixserve.lang.expr import Expr


class Select(Expr):
    """Append the chosen choice to the state; `s[name]` is it, `s.meta(name).scores` the
    scores of all choices."""

    def __init__(self, name: str | None, choices: list[str], method: ChoicesMethod):
        if not choices or any(not isinstance(c, str) or not c for c in choices):
            raise ValueError("select takes a non-empty list of non-empty strings")
        self.name = name
        self.choices = list(choices)
        self.method = method


def select(name: str | None, choices: list[str], method: ChoicesMethod = token_length_normalized) -> Select:
    return Select(name, choices, method)
