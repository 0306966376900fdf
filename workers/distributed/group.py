"""CommGroup: one process's handle on a group of ranks, over torch.distributed.

The same code runs Gloo on CPU and NCCL on CUDA. A group is made from an explicit store: nothing is
read from environment variables. The launcher serves a TCPStore (rank 0's host, port 0: the OS
picks a free port, `store.port` tells which), hands host and port to the other ranks (a Ray call, a
spawn argument), and every rank calls `CommGroup.init` with its own client of that store
(distributed/launch.py does exactly this for local processes). A group of one
(`CommGroup.single()`) never touches torch.distributed and every collective returns its input, so
a model built for tensor parallelism runs unchanged at TP=1.

`stats` counts every collective that crossed ranks and the wall time it took (on CUDA, the launch
time only: NCCL work is asynchronous).
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class CommStats:
    calls: Counter[str] = field(default_factory=Counter)
    seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))

    def reset(self) -> None:
        self.calls.clear()
        self.seconds.clear()


def nccl_errors_raise() -> None:
    """Have a failed or timed-out NCCL operation raise in the thread that waits on it (communicators
    aborted) rather than end the process: a lost rank or peer must fail its requests or its replica,
    cleanly, as on Gloo. Read by torch when a NCCL group is created; a value set by the operator
    stays."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


class CommGroup:
    """This process's rank in a group of `world_size`. Every collective must be called by every
    rank of the group, in the same order, with tensors of matching shapes (as torch.distributed
    requires); a rank that stops calling stalls the others until the group's timeout."""

    def __init__(self, rank: int, world_size: int, pg=None, device: torch.device | None = None):
        if world_size > 1 and pg is None:
            raise ValueError("a group of several ranks needs a process group")
        self.rank, self.world_size = rank, world_size
        self.pg = pg
        self.device = device or torch.device("cpu")  # where object broadcasts stage their bytes
        self.stats = CommStats()

    @classmethod
    def single(cls) -> CommGroup:
        return cls(0, 1)

    @classmethod
    def init(
        cls,
        store: dist.Store,
        rank: int,
        world_size: int,
        backend: str = "auto",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> CommGroup:
        """Join the process's default group through `store` (one per process; every rank calls
        this with the same world_size). backend "auto": NCCL where CUDA is available, else Gloo."""
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        if world_size == 1:
            return cls(0, 1, device=device)
        if backend == "nccl":
            nccl_errors_raise()
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("radixserve", store),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        return cls(rank, world_size, dist.group.WORLD, device)

    def destroy(self) -> None:
        if self.pg is not None:
            dist.destroy_process_group()
        self.pg = None

    # Collectives -------------------------------------------------------------------------------

    def _timed(self, op: str, start: float) -> None:
        self.stats.calls[op] += 1
        self.stats.seconds[op] += time.perf_counter() - start

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns t."""
        if self.world_size > 1:
            start = time.perf_counter()
            dist.all_reduce(t, group=self.pg)
            self._timed("all_reduce", start)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's t (same shape on all) concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return t
        start = time.perf_counter()
        out = torch.empty((self.world_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_single(out, t.contiguous(), group=self.pg)
        self._timed("all_gather", start)
        return out if dim % t.dim() == 0 else torch.cat(out.chunk(self.world_size), dim=dim)

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of t [world_size * n, ...]; this rank gets rows [rank * n, (rank + 1) * n)."""
        if self.world_size == 1:
            return t
        start = time.perf_counter()
        out = torch.empty((t.shape[0] // self.world_size, *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.reduce_scatter_single(out, t.contiguous(), group=self.pg)
        self._timed("reduce_scatter", start)
        return out

    def all_to_all(self, t: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of t go to ranks in order, send_counts[r] to rank r; returns the rows received,
        recv_counts[r] from rank r, in rank order."""
        if self.world_size == 1:
            return t
        start = time.perf_counter()
        out = t.new_empty((sum(recv_counts), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv_counts, send_counts, group=self.pg)
        self._timed("all_to_all", start)
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place: every rank's t becomes rank `src`'s (same shape and dtype on all)."""
        if self.world_size > 1:
            start = time.perf_counter()
            dist.broadcast(t, src=src, group=self.pg)
            self._timed("broadcast", start)
        return t

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank `src`'s JSON-serializable object (dicts, lists, str, numbers, bools, None), on every
        rank (the others pass None). JSON, not pickle: a peer's bytes never become code here."""
        if self.world_size == 1:
            return obj
        payload = json.dumps(obj).encode() if self.rank == src else b""
        return json.loads(self.broadcast_bytes(payload, src).decode())

    def broadcast_bytes(self, payload: bytes, src: int = 0) -> bytes:
        """Rank `src`'s bytes on every rank: the length, then the bytes (two broadcasts)."""
        if self.world_size == 1:
            return payload
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self.broadcast(size, src)
        buf = torch.empty(int(size[0]), dtype=torch.uint8, device=self.device)
        if self.rank == src and payload:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(buf, src)
        return payload if self.rank == src else buf.cpu().numpy().tobytes()

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.pg)
