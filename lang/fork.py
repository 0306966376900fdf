"""The branches of a fork."""

from __future__ import annotations

from typing import Any

from radixserve.lang.state import ProgramState


class Fork(list[ProgramState]):
    """`s.fork(n)`: a list of n states. Reading any branch (`forks[i]["name"]`) or `join()` runs
    the queued calls of all branches together, one batch per step."""

    def join(self) -> Fork:
        if self:
            self[0].sync()
        return self

    def values(self, name: str) -> list[Any]:
        """`name`'s value in every branch, in order."""
        self.join()
        return [branch[name] for branch in self]
