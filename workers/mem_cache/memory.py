"""How much memory a replica may use: the machine's (or its cgroup's) memory, and the KV capacity
that a static memory fraction leaves after the weights."""

from __future__ import annotations

import os


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (cgroup v2 unlimited) -> None


def _cgroup_limit_bytes() -> int | None:
    """The tightest cgroup v2/v1 memory limit that applies to this process, if any."""
    candidates = ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "" and path != "/":
                    candidates.append(f"/sys/fs/cgroup{path}/memory.max")
                elif "memory" in controllers.split(",") and path != "/":
                    candidates.append(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
    except OSError:
        pass
    limits = [v for v in map(_read_int, candidates) if v is not None]
    # cgroup v1 reports "unlimited" as a huge page-rounded number; min() with MemTotal absorbs it.
    return min(limits) if limits else None


def machine_memory_bytes() -> int:
    """MemTotal from /proc/meminfo, lowered to the cgroup memory limit when that is tighter."""
    total = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if total is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_limit_bytes()
    return min(total, limit) if limit else total


def max_tokens_for_memory(
    mem_fraction_static: float, weight_bytes: int, bytes_per_token: int, total_bytes: int | None = None
) -> int:
    """KV token capacity when `mem_fraction_static` of memory holds the weights plus the KV pool.

    SGLang semantics: the static fraction covers weights and KV together; activations and
    everything else live in the remaining 1 - fraction. `total_bytes` defaults to the machine's
    memory (see machine_memory_bytes). Raises ValueError when the fraction cannot hold the weights.
    """
    if not 0.0 < mem_fraction_static <= 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}")
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    total = machine_memory_bytes() if total_bytes is None else int(total_bytes)
    budget = int(total * mem_fraction_static)
    if budget < weight_bytes:
        raise ValueError(
            f"mem_fraction_static={mem_fraction_static} of {total / 2**30:.2f} GiB is "
            f"{budget / 2**30:.2f} GiB, too small to hold the model weights "
            f"({weight_bytes / 2**30:.2f} GiB); raise mem_fraction_static or use a smaller model"
        )
    return (budget - weight_bytes) // bytes_per_token
