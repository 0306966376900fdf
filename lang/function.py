"""`@function`: a prompt program, run on a backend one at a time or in parallel batches."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixserve.lang.backend import Backend, default_backend
from radixserve.lang.sampling import Sampling
from radixserve.lang.state import ProgramState

MAX_BATCH_THREADS = 64


class Function:
    """A program `fn(s, *args, **kwargs)` writing into its state `s`."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(
        self,
        *args: Any,
        backend: Backend | None = None,
        stream: bool = False,
        sampling: Sampling | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program to its end and return its state; its errors raise here. `sampling`
        holds the defaults of its gens. With `stream=True` the program runs on a thread and
        this returns at once: read `s.text_iter(name)`, or any value (which waits for the end)."""
        s = ProgramState(backend or default_backend(), _sampling(sampling), stream)
        if not stream:
            self._execute(s, args, kwargs)
            return s
        s.runner = threading.Thread(
            target=self._execute, args=(s, args, kwargs, False), name="radixserve-lang", daemon=True
        )
        s.runner.start()
        return s

    def _execute(self, s: ProgramState, args: tuple, kwargs: dict[str, Any], reraise: bool = True) -> None:
        try:
            s.ret = self.fn(s, *args, **kwargs)
            s.sync()
        except BaseException as e:
            s.finish(e)
            if reraise:
                raise
            return
        s.finish()

    def run_batch(
        self,
        batch: list[dict[str, Any]],
        backend: Backend | None = None,
        num_threads: int | None = None,
        sampling: Sampling | dict[str, Any] | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Run the program once per dict of arguments, `num_threads` at a time (default: all,
        up to 64), and return their states in order. A failed program raises its error once all
        have run, or with `return_exceptions` stands in its place in the list."""
        chosen = backend or default_backend()
        threads = max(1, min(num_threads or len(batch) or 1, MAX_BATCH_THREADS))

        def one(kwargs: dict[str, Any]) -> Any:
            try:
                return self.run(backend=chosen, sampling=sampling, **kwargs)
            except Exception as e:
                return e

        with ThreadPoolExecutor(max_workers=threads) as pool:
            out = list(pool.map(one, batch))
        if not return_exceptions:
            for r in out:
                if isinstance(r, Exception):
                    raise r
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def function(fn: Callable[..., Any]) -> Function:
    """Decorate `def program(s, ...)` to make it runnable: `program.run(...)`."""
    return Function(fn)


def _sampling(given: Sampling | dict[str, Any] | None) -> Sampling:
    if given is None:
        return Sampling()
    return given if isinstance(given, Sampling) else Sampling.of(**given)
