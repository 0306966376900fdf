"""A replica process's memory budget, enforced by the kernel (`limit_memory_growth`).

A request that makes its replica allocate without end (a library call that never returns, a
bound that is missing) must cost at most that replica, never the node's other processes: the
ingress, Serve's controller, the other replicas. Ray's memory monitor acts only once the whole
node is nearly full, and then may pick any of them. So an engine replica on CPU caps its own
address space (RLIMIT_AS) at its size after start-up plus a budget: past it an allocation fails
in the thread that asked (MemoryError in Python, bad_alloc in C++, a failed torch allocation),
which the engine turns into that request's error; nothing else on the node is touched.

Address space, not resident memory, is what the kernel limits: it counts what was reserved as
well as what was touched, which is why the budget is on growth beyond the start-up size (the
libraries' reservations are already in it). CUDA processes reserve address space by the
terabyte for unified memory, so a GPU replica sets no such limit (a cgroup on the node, which
Ray or the operator sets up, is the tool there).
"""

from __future__ import annotations

import logging
import os
import resource

logger = logging.getLogger(__name__)

# Without a configured budget a replica may grow by this share of the node's physical memory.
DEFAULT_BUDGET_SHARE = 0.5


def address_space_bytes() -> int:
    """This process's virtual size (VmSize)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_budget_bytes() -> int:
    return int(physical_memory_bytes() * DEFAULT_BUDGET_SHARE)


def limit_memory_growth(budget_bytes: int) -> int:
    """Cap this process's address space at its current size plus `budget_bytes` (never above a
    hard limit already set). Returns the limit. Call it once the process has started up."""
    if budget_bytes <= 0:
        raise ValueError("the memory budget must be > 0")
    limit = address_space_bytes() + budget_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    logger.info(
        "address space capped at %.1f GiB (%.1f GiB beyond start-up)", limit / 2**30, budget_bytes / 2**30
    )
    return limit
