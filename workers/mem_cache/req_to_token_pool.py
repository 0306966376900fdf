"""The per-request table of KV slots that attention kernels read (one row per running request)."""

from __future__ import annotations

from collections import deque

import torch


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
