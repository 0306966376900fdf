"""Ranks as local processes (one machine, no Ray).

    results = run_ranks(fn, world_size, *args)   # fn(group, *args) on every rank -> [result per rank]

runs a function on N ranks joined by one group, for tests and benchmarks: the parent serves the
TCPStore on a port the OS picks (no free-port race); each spawned process joins the default process
group through it, runs fn with `threads` torch threads, and hands its result back through a file
(torch.save; results are trusted, they come from our own children). A rank that fails fails the
whole run with its traceback.

`LocalLauncher` starts the following ranks of a group whose rank 0 is the calling process (the
offline engine's tensor-parallel ranks): fn(rank, *args) in one spawned process per rank, watched
through `RankHandle`s. A `RankLauncher` elsewhere does the same with other processes (Ray actors).
"""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from radixserve.workers.distributed.group import CommGroup

TIMEOUT_S = 120.0


def _rank_main(
    rank: int, world_size: int, port: int, out_dir: str, threads: int, backend: str, fn, args
) -> None:
    torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    group = CommGroup.init(store, rank, world_size, backend=backend, timeout_s=TIMEOUT_S)
    try:
        result = fn(group, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        group.destroy()


def run_ranks(fn, world_size: int, *args: Any, threads: int = 1, backend: str = "gloo") -> list[Any]:
    """fn(group, *args) on `world_size` processes (fn must be importable: a module-level function).
    backend "nccl" puts rank r on CUDA device r."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timeout, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out_dir:
        args = (world_size, store.port, out_dir, threads, backend, fn, args)
        mp.spawn(_rank_main, args=args, nprocs=world_size)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


class RankHandle(Protocol):
    """One started rank, as the process that started it sees it."""

    rank: int

    def exit_reason(self) -> str | None:
        """None while the rank runs; once it has ended, how (a phrase: "was killed by signal 9")."""
        ...

    def join(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for the rank to end; whether it has."""
        ...

    def kill(self) -> None:
        """End the rank now (no-op if it has ended)."""
        ...


class RankLauncher(Protocol):
    """Starts ranks 1..N-1 of a group whose rank 0 is the calling process."""

    host: str  # where the started ranks reach a store this process serves

    def threads_per_rank(self, world_size: int) -> int:
        """torch threads for each rank when the user set none."""
        ...

    def start(self, fn: Callable[..., None], ranks: Sequence[int], *args: Any) -> list[RankHandle]:
        """fn(rank, *args) for each rank, each in a process of its own (fn importable)."""
        ...


class LocalProcess:
    """A rank in a spawned local process."""

    def __init__(self, rank: int, process: Any):
        self.rank, self.process = rank, process

    def exit_reason(self) -> str | None:
        code = self.process.exitcode
        if code is None:
            return None
        if code < 0:
            return f"was killed by signal {-code}"
        return "exited" if code == 0 else f"exited with code {code}"

    def join(self, timeout_s: float) -> bool:
        self.process.join(timeout_s)
        return self.process.exitcode is not None

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(10)


class LocalLauncher:
    """Following ranks as spawned processes of this machine (daemons: they never outlive a parent
    that exits normally; one that is killed closes their group's connections, which ends them)."""

    host = "127.0.0.1"

    def threads_per_rank(self, world_size: int) -> int:
        return max(1, (os.cpu_count() or 1) // world_size)

    def start(self, fn: Callable[..., None], ranks: Sequence[int], *args: Any) -> list[RankHandle]:
        ctx = mp.get_context("spawn")
        handles: list[RankHandle] = []
        for rank in ranks:
            process = ctx.Process(target=fn, args=(rank, *args), name=f"radixserve-rank{rank}", daemon=True)
            process.start()
            handles.append(LocalProcess(rank, process))
        return handles
