"""KV memory of one replica: token slots for K/V tensors, and the per-request slot table.

Pure bookkeeping over integer slot ids plus the raw K/V buffers; it knows nothing about requests
or the radix tree. Free lists are FIFO deques (O(1) per page): a fresh pool hands out slots in
ascending order and freed pages go to the back of the queue, so reuse order is deterministic:
everything never-used is handed out before anything freed, and freed pages come back in the
order they were freed.
"""

from __future__ import annotations

import os
from collections import deque

import torch


class KVPool:
    """Per-layer K and V tensors over token slots.

    Slot 0 (the whole first page) is reserved as a dummy/padding slot: it is never allocated, so
    kernels may point padding entries at it and write garbage there. Allocation is by pages of
    `page_size` slots; slot s lives in page s // page_size, and a request always owns whole pages.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int,
                 dtype=torch.bfloat16, device="cpu", page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.size = self.num_pages * page_size
        self.dtype = dtype
        self.device = torch.device(device)
        # torch.empty: the OS maps pages lazily, so an oversized pool costs nothing until touched.
        shape = (num_slots + page_size, num_kv_heads, head_dim)
        self.k_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Padding entries point at the dummy page and are masked out, but a masked NaN still
        # poisons `probs @ V` (0 * NaN): keep the dummy page finite.
        for buf in self.k_buffers + self.v_buffers:
            buf[:page_size].zero_()
        # Page 0 is the reserved dummy page; pages 1..num_pages are allocatable.
        self._free_pages: deque[int] = deque(range(1, self.num_pages + 1))
        self._page_free = bytearray(self.num_pages + 1)
        self._page_free[1:] = b"\x01" * self.num_pages

    def alloc(self, n: int, last_slot: int | None = None) -> list[int] | None:
        """Return `n` new slots for one request, or None (allocating nothing) if not enough free.

        With page_size > 1 and `last_slot` the request's current last slot, the rest of that slot's
        page is used first (it already belongs to the request), then whole fresh pages. Position i
        of a request therefore sits at page offset i % page_size when its first slot starts a page.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        p = self.page_size
        head: list[int] = []
        if p > 1 and last_slot is not None and (last_slot + 1) % p != 0:
            if self._page_free[last_slot // p] or last_slot < p:
                raise AssertionError(f"last_slot {last_slot} is not in an allocated page")
            head = list(range(last_slot + 1, min(last_slot + 1 + n, (last_slot // p + 1) * p)))
        rest = n - len(head)
        need = -(-rest // p)
        if need > len(self._free_pages):
            return None
        out = head
        for _ in range(need):
            page = self._free_pages.popleft()
            self._page_free[page] = 0
            start = page * p
            out.extend(range(start, start + min(p, n - len(out))))
        return out

    def free(self, slots) -> None:
        """Return the pages that `slots` live in (a list or 1-D tensor) to the back of the queue.

        The caller owns those pages whole. Double free and freeing the reserved page raise.
        """
        if isinstance(slots, torch.Tensor):
            slots = slots.tolist()
        p = self.page_size
        pages = slots if p == 1 else dict.fromkeys(s // p for s in slots)
        page_free = self._page_free
        for page in pages:
            if page <= 0 or page > self.num_pages:
                raise AssertionError(f"freeing slot page {page}: reserved or out of range")
            if page_free[page]:
                raise AssertionError(f"double free of page {page} (slot {page * p})")
            page_free[page] = 1
            self._free_pages.append(page)

    def available(self) -> int:
        """Free slots (free pages * page_size)."""
        return len(self._free_pages) * self.page_size

    def is_free(self, slot: int) -> bool:
        """Whether `slot`'s page is on the free list (used by integrity checks)."""
        return bool(self._page_free[slot // self.page_size])

    @staticmethod
    def bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) -> int:
        """Bytes one token's K and V take across all layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * elem


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


def max_tokens_for_memory(mem_fraction_static: float, weight_bytes: int, bytes_per_token: int,
                          total_bytes: int | None = None) -> int:
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
            f"({weight_bytes / 2**30:.2f} GiB); raise mem_fraction_static or use a smaller model")
    return (budget - weight_bytes) // bytes_per_token


class ReqToTokenPool:
    """Table [max_reqs, max_context] int64 of KV slots per running request (row = request).

    Rows are handed out FIFO: ascending when fresh, freed rows go to the back.
    """

    def __init__(self, max_reqs: int, max_context: int, device="cpu"):
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.table = torch.zeros((max_reqs, max_context), dtype=torch.int64, device=device)
        self._free_rows: deque[int] = deque(range(max_reqs))
        self._row_free = bytearray(b"\x01" * max_reqs)

    def alloc(self) -> int | None:
        """A free row, or None when every row is in use."""
        if not self._free_rows:
            return None
        row = self._free_rows.popleft()
        self._row_free[row] = 0
        return row

    def free(self, row: int) -> None:
        if not 0 <= row < self.max_reqs:
            raise AssertionError(f"row {row} out of range [0, {self.max_reqs})")
        if self._row_free[row]:
            raise AssertionError(f"double free of row {row}")
        self._row_free[row] = 1
        self._free_rows.append(row)

    def available(self) -> int:
        return len(self._free_rows)
