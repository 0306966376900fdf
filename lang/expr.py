"""The expressions a program adds to its state: text, role blocks, and (gen.py, select.py) calls
of the model. `a + b` concatenates; `s += expr` runs them in order."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("system", "user", "assistant")


class Expr:
    """A piece of a program. `atoms()` is its flat sequence of Text, RoleBegin, RoleEnd, Gen and
    Select, in the order they run."""

    def atoms(self) -> list[Expr]:
        return [self]

    def __add__(self, other: Expr | str) -> Concat:
        return Concat([self, as_expr(other)])

    def __radd__(self, other: Expr | str) -> Concat:
        return Concat([as_expr(other), self])


@dataclass(eq=False)
class Text(Expr):
    text: str


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


class Concat(Expr):
    def __init__(self, parts: list[Expr]):
        self.parts = parts

    def atoms(self) -> list[Expr]:
        return [a for p in self.parts for a in p.atoms()]


def as_expr(value: Expr | str) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"a program adds text or expressions, not {type(value).__name__}")


def role(name: str, content: Expr | str | None = None) -> Expr:
    """A message of `name` (system, user or assistant) written in the model's chat template;
    `content` may hold gen and select calls."""
    if name not in ROLES:
        raise ValueError(f"unknown role {name!r}: one of {', '.join(ROLES)}")
    inner = [] if content is None else [as_expr(content)]
    return Concat([RoleBegin(name), *inner, RoleEnd(name)])


def system(content: Expr | str | None = None) -> Expr:
    return role("system", content)


def user(content: Expr | str | None = None) -> Expr:
    return role("user", content)


def assistant(content: Expr | str | None = None) -> Expr:
    return role("assistant", content)
