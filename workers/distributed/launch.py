"""Run a function on N ranks as N local processes joined by one group (one machine, no Ray):
tests, benchmarks, and single-host runs.

    results = run_ranks(fn, world_size, *args)   # fn(group, *args) on every rank -> [result per rank]

The parent serves the TCPStore on a port the OS picks (no free-port race); each spawned process
joins the default process group through it, runs fn with `threads` torch threads, and hands its
result back through a file (torch.save; results are trusted, they come from our own children). A
rank that fails fails the whole run with its traceback.
"""

from __future__ import annotations

import datetime
import tempfile
from pathlib import Path
from typing import Any

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
