"""Tokenization and chat templating off the ingress's event loop.

A multi-megabyte prompt takes seconds to tokenize; on the event loop that would stall every
stream and health check of the replica. The work runs on a few threads of the pool's own (not the
loop's default executor, which Starlette and Ray use), and inputs above `SMALL_INPUT_CHARS` may
hold all threads but one: a client sending big prompts delays other big prompts, never the
tokenization of everyone's ordinary requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# Below this many characters tokenizing takes well under a millisecond.
SMALL_INPUT_CHARS = 16 * 1024


class TokenizerPool:
    def __init__(self, threads: int):
        if threads < 2:
            raise ValueError("the tokenizer pool needs at least 2 threads (one is kept for small inputs)")
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="radixserve-tokenize")
        self.large = asyncio.Semaphore(threads - 1)

    async def run(self, num_chars: int, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a pool thread; `num_chars` is the size of the input it works on."""
        loop = asyncio.get_running_loop()
        if num_chars <= SMALL_INPUT_CHARS:
            return await loop.run_in_executor(self.executor, fn, *args)
        await self.large.acquire()
        try:
            fut = self.executor.submit(fn, *args)
        except BaseException:
            self.large.release()
            raise
        # Released when the work ends, not when its caller stops waiting (a client that left
        # does not stop a running tokenization).
        fut.add_done_callback(lambda _: _call_soon(loop, self.large.release))
        return await asyncio.wrap_future(fut, loop=loop)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], object]) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass
