"""Process-wide runtime settings that the model's hot path depends on.

glibc serves every allocation above its mmap threshold (dynamic, starting at 128 KiB) with a fresh
mmap and returns it with munmap on free. The engine allocates and frees megabyte-sized activations
dozens of times per step, so each op pays page faults on fresh memory; inside a VM a fault is
expensive, and measured on the 2-core dev VM this alone made a batch-16 decode attention ~8x
slower. Raising the mmap and trim thresholds keeps freed activation memory in the heap for reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit; larger blocks (weights, KV pool) still mmap
_TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of freed heap instead of returning it to the OS


@functools.lru_cache(maxsize=1)
def tune_malloc() -> bool:
    """Apply the glibc thresholds above once per process; False where glibc is not the allocator."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
    ok_trim = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    return ok_mmap and ok_trim


def freeze_startup_heap() -> int:
    """Move every object alive now (modules, the model, the tokenizer, Ray's and Serve's own
    state) out of the garbage collector's reach; returns how many. For server processes, once
    they are ready: a full collection walks every tracked object with the GIL held, and measured
    in an engine replica under load one took 211 ms over ~395k objects, a stall of every step
    and stream in the process; after the freeze it took 0.3 ms. What is frozen is never
    collected, so only a process that owns its heap calls this (not a library's caller)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def on_short_lived_thread(fn: Callable[..., T], *args: Any, name: str = "radixserve-load") -> T:
    """Run fn(*args) on a new thread that exits when it returns; re-raise its exception.

    libgomp keeps a team of worker threads for every thread that has run a parallel region, and
    once it manages more threads than there are CPUs its workers stop spinning between regions
    and sleep on a futex instead: every parallel op of a forward then pays thread wake-ups.
    Measured on the 2-core dev VM: a batch-16 decode forward took 41 ms on the thread that also
    loaded the model and 50 ms on another one (15k context switches per 40 forwards, against 200).
    The engine therefore does its multi-threaded torch work on one thread only: the model is
    loaded here, and this thread's team is released when it exits.
    """
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn(*args))
        except BaseException as exc:  # handed to the caller
            error.append(exc)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
