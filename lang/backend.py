"""What a program runs on, and the default one."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from radixserve.lang.calls import GenCall, GenResult, ScoreCall, ScoreResult
from radixserve.lang.chat_format import ChatFormat
from radixserve.lang.errors import LangError

# (index of the call in its batch, new text): how streamed text reaches the states.
OnDelta = Callable[[int, str], None]


class Backend(ABC):
    """A model behind an API. Every method may raise BackendError with the server's message.

    `generate` runs its calls as one batch where the API has batches, so that calls sharing a
    prefix (a fork's branches) are admitted together; results come in call order. With
    `on_delta`, text arrives as it is generated too."""

    @abstractmethod
    def generate(self, calls: list[GenCall], on_delta: OnDelta | None = None) -> list[GenResult]: ...

    @abstractmethod
    def score(self, calls: list[ScoreCall]) -> list[ScoreResult]: ...

    def chat_format(self) -> ChatFormat:
        """How role blocks are written (the model's chat template); LangError without one."""
        raise LangError(f"{type(self).__name__} has no chat template for role blocks")


_default: Backend | None = None
_lock = threading.Lock()


def set_default_backend(backend: Backend | None) -> None:
    """The backend of every run that names none."""
    global _default
    with _lock:
        _default = backend


def default_backend() -> Backend:
    with _lock:
        if _default is None:
            raise LangError("no backend: pass backend= to run, or call set_default_backend first")
        return _default
