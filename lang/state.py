"""A program's state: its text so far, the values its calls produced, its messages.

`s += expr` queues the expression; model calls run when a value is needed (`s[name]`,
`s.text()`, a fork, the end of the run), and then every queued call of the state's cohort (a
fork's branches) at the same point runs in one batch. Errors of those calls raise there."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.lang.backend import Backend
from radixserve.lang.calls import Usage
from radixserve.lang.errors import LangError
from radixserve.lang.expr import Expr, RoleBegin, RoleEnd, Text, as_expr
from radixserve.lang.sampling import Sampling

if TYPE_CHECKING:
    from radixserve.lang.fork import Fork


@dataclass
class Meta:
    """What the server said of a named call: its usage (for a select, the scoring requests') and
    a select's scores per choice."""

    usage: list[Usage]
    scores: list[float] | None = None


@dataclass
class Cohort:
    """States whose calls run together: a root state alone, or the branches of one fork."""

    states: list[ProgramState] = field(default_factory=list)


class ProgramState:
    def __init__(self, backend: Backend, defaults: Sampling, stream: bool = False):
        self.backend = backend
        self.defaults = defaults
        self.streaming = stream
        self._text = ""
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, Meta] = {}
        self._messages: list[dict[str, str]] = []
        self._role: tuple[str, int] | None = None  # the open role block and where its content starts
        self.pending: list[Expr] = []
        self.cohort = Cohort([self])
        self._cond = threading.Condition()
        self._chunks: dict[str | None, list[str]] = {}  # text as written, per gen name (None: all)
        self._streamed: set[str | None] = set()  # calls whose text is arriving in deltas
        self._done: set[str | None] = set()  # named calls that have run
        self.ret: Any = None  # what the program returned
        self.runner: threading.Thread | None = None  # the program's thread, when it streams
        self.finished = False
        self.error: BaseException | None = None

    # What a program writes -----------------------------------------------------------------
    def __iadd__(self, expr: Expr | str) -> ProgramState:
        self.pending.extend(as_expr(expr).atoms())
        return self

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self._vars:
            raise KeyError(f"no gen or select named {name!r} has run in this state")
        return self._vars[name]

    def get(self, name: str, default: Any = None) -> Any:
        self.sync()
        return self._vars.get(name, default)

    def meta(self, name: str) -> Meta:
        self.sync()
        return self._meta[name]

    def text(self) -> str:
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        """The role blocks closed so far, as chat messages."""
        self.sync()
        return [dict(m) for m in self._messages]

    def fork(self, n: int) -> Fork:
        """n copies of this state, whose calls run as one batch: the text so far is their shared
        prefix, computed once."""
        from radixserve.lang.fork import Fork

        if n < 1:
            raise ValueError("fork takes n >= 1")
        self.sync()
        cohort = Cohort()
        for _ in range(n):
            child = ProgramState(self.backend, self.defaults, self.streaming)
            child._text, child._role = self._text, self._role
            child._vars, child._meta = dict(self._vars), dict(self._meta)
            child._messages = [dict(m) for m in self._messages]
            child.cohort = cohort
            cohort.states.append(child)
        return Fork(cohort.states)

    def sync(self) -> None:
        """Run what is queued. From outside a streaming program's thread: wait for its end."""
        from radixserve.lang.executor import run_cohort

        runner = self.runner
        if runner is not None and runner is not threading.current_thread():
            runner.join()
            if self.error is not None:
                raise self.error
            return
        run_cohort(self.cohort.states)

    # The executor's side ------------------------------------------------------------------
    def prompt(self) -> str:
        return self._text

    def chat_context(self) -> tuple[dict[str, str], ...] | None:
        """The closed messages, when the next call opens an assistant message with nothing else
        written since the last message closed."""
        if self._role is None or self._role[0] != "assistant" or self._role[1] != len(self._text):
            return None
        return tuple(dict(m) for m in self._messages)

    def apply_text_atoms(self) -> None:
        """Run queued text and role atoms up to the next model call."""
        while self.pending and isinstance(self.pending[0], Text | RoleBegin | RoleEnd):
            atom = self.pending.pop(0)
            if isinstance(atom, Text):
                self._append(atom.text)
            elif isinstance(atom, RoleBegin):
                if self._role is not None:
                    raise LangError(f"a {atom.role} block cannot open inside a {self._role[0]} block")
                first = not self._messages and not self._text
                self._append(self.backend.chat_format().begin(atom.role, first))
                self._role = (atom.role, len(self._text))
            elif isinstance(atom, RoleEnd):
                assert self._role is not None
                content = self._text[self._role[1] :]
                self._append(self.backend.chat_format().end(atom.role))
                self._messages.append({"role": atom.role, "content": content})
                self._role = None

    def record(self, name: str | None, value: str, meta: Meta, stored: Any = None) -> None:
        """A call's result: `value` is appended to the text, `stored` (default: value) is s[name]."""
        self._text += value
        with self._cond:
            if name not in self._streamed:
                self._push(name, value)
            self._streamed.discard(name)
            self._done.add(name)
            self._cond.notify_all()
        if name is not None:
            self._vars[name] = value if stored is None else stored
            self._meta[name] = meta

    def delta(self, name: str | None, text: str) -> None:
        """Text of a streamed call as it arrives (its `record` follows)."""
        with self._cond:
            self._streamed.add(name)
            self._push(name, text)
            self._cond.notify_all()

    def _append(self, text: str) -> None:
        self._text += text
        with self._cond:
            self._push(None, text)
            self._cond.notify_all()

    def _push(self, name: str | None, text: str) -> None:
        self._chunks.setdefault(None, []).append(text)
        if name is not None:
            self._chunks.setdefault(name, []).append(text)

    def finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self.finished = True
            self.error = error
            self._cond.notify_all()

    # Streaming ------------------------------------------------------------------------------
    def text_iter(self, name: str | None = None, timeout_s: float = 600.0) -> Iterator[str]:
        """The text as it is written (`run(stream=True)`): all of it, or one named gen's. The
        program's error, if it failed, raises at the end."""
        seen = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(functools.partial(self._more, name, seen), timeout=timeout_s):
                    raise TimeoutError(f"no text within {timeout_s} s")
                chunks = self._chunks.get(name, [])[seen:]
                over = not chunks and (self.finished or (name is not None and name in self._done))
                error = self.error if self.finished else None
            seen += len(chunks)
            yield from (c for c in chunks if c)
            if over:
                if error is not None:
                    raise error
                return

    def _more(self, name: str | None, seen: int) -> bool:
        return (
            len(self._chunks.get(name, [])) > seen
            or self.finished
            or (name is not None and name in self._done)
        )
