"""`gen`: text the model writes into the program, stored under a name."""

from __future__ import annotations

from typing import Any

from radixserve.lang.expr import Expr
from radixserve.lang.sampling import Sampling


class Gen(Expr):
    """Generate text at this point of the state; `s[name]` is the text written."""

    def __init__(self, name: str | None, sampling: Sampling):
        self.name = name
        self.sampling = sampling


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    regex: str | None = None,
    json_schema: dict[str, Any] | str | None = None,
    choices: list[str] | None = None,
) -> Expr:
    """Generation under the given settings (unset ones: the run's defaults, then the server's).
    `regex` or `json_schema` constrain the text; `choices` makes it a `select`."""
    if choices is not None:
        from radixserve.lang.select import select

        return select(name, choices)
    return Gen(name, Sampling.of(max_tokens, stop, temperature, top_p, top_k, seed, regex, json_schema))
