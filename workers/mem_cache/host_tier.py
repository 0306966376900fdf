"""HostTier: a second home in host memory for KV that the device pool gives up.

It owns a host-side `KVPool` with the device pool's layout (layers, KV heads, head dim, dtype,
page size) and the copies between the two: `write_back` takes device slots' K/V into freshly
allocated host slots, `load` copies host slots' K/V into device slots the caller allocated.
Slot bookkeeping stays with the pools (whole pages, O(1) free lists); what a host slot holds is
the caller's to track. On CUDA the host buffers are pinned (faster transfers); copies are synchronous.

Contract: `write_back` either copies every slot or allocates nothing and returns None (the host
tier is full); `load` never allocates; host slots are valid until `free`. `NullHostTier` is the
tier that is not there: it holds nothing and every write-back is refused.
"""

from __future__ import annotations

import torch

from radixserve.workers.mem_cache.kv_pool import KVPool, raw


class HostTier:
    def __init__(self, device_pool: KVPool, num_slots: int):
        k0 = device_pool.k_buffers[0] if device_pool.k_buffers else None
        heads, head_dim = (k0.shape[1], device_pool.head_dim) if k0 is not None else (1, 1)
        self.device_pool = device_pool
        self.pool = KVPool(
            len(device_pool.k_buffers),
            heads,
            head_dim,
            num_slots,
            dtype=device_pool.dtype,
            device="cpu",
            page_size=device_pool.page_size,
        )
        if device_pool.device.type == "cuda":
            self.pool.k_buffers = [b.pin_memory() for b in self.pool.k_buffers]
            self.pool.v_buffers = [b.pin_memory() for b in self.pool.v_buffers]
        self.token_bytes = KVPool.bytes_per_token(
            len(device_pool.k_buffers), heads, head_dim, device_pool.dtype
        )
        self.bytes_written = 0
        self.bytes_loaded = 0

    @classmethod
    def from_gb(cls, device_pool: KVPool, gb: float) -> HostTier | NullHostTier:
        """A tier of `gb` GiB of host memory (whole pages), or the null tier when gb <= 0."""
        if gb <= 0:
            return NullHostTier()
        k0 = device_pool.k_buffers[0]
        token_bytes = KVPool.bytes_per_token(
            len(device_pool.k_buffers), k0.shape[1], device_pool.head_dim, device_pool.dtype
        )
        return cls(device_pool, int(gb * (1 << 30)) // token_bytes)

    @property
    def size(self) -> int:
        return self.pool.size

    def available(self) -> int:
        return self.pool.available()

    def write_back(self, device_slots: list[int]) -> list[int] | None:
        """Copy the K/V of `device_slots` into new host slots (same page offsets); None: full."""
        host = self.pool.alloc(len(device_slots))
        if host is None:
            return None
        self._copy(self.device_pool, device_slots, self.pool, host)
        self.bytes_written += len(host) * self.token_bytes
        return host

    def load(self, host_slots: list[int], device_slots: list[int]) -> None:
        """Copy the K/V of `host_slots` into `device_slots` (which the caller owns)."""
        if len(host_slots) != len(device_slots):
            raise ValueError(f"{len(host_slots)} host slots for {len(device_slots)} device slots")
        self._copy(self.pool, host_slots, self.device_pool, device_slots)
        self.bytes_loaded += len(host_slots) * self.token_bytes

    def free(self, host_slots: list[int]) -> None:
        self.pool.free(host_slots)

    @staticmethod
    def _copy(src: KVPool, src_slots: list[int], dst: KVPool, dst_slots: list[int]) -> None:
        if not src_slots:
            return
        s = torch.tensor(src_slots, dtype=torch.long, device=src.device)
        d = torch.tensor(dst_slots, dtype=torch.long, device=dst.device)
        for sb, db in zip(src.k_buffers + src.v_buffers, dst.k_buffers + dst.v_buffers):
            raw(db).index_copy_(0, d, raw(sb).index_select(0, s).to(dst.device))


class NullHostTier:
    """No host tier: nothing is written back, nothing is held, so nothing is ever loaded."""

    size = 0
    bytes_written = 0
    bytes_loaded = 0

    def available(self) -> int:
        return 0

    def write_back(self, device_slots: list[int]) -> list[int] | None:
        return None

    def load(self, host_slots: list[int], device_slots: list[int]) -> None:
        if host_slots:
            raise AssertionError("the null host tier holds no slots to load")

    def free(self, host_slots: list[int]) -> None:
        if host_slots:
            raise AssertionError("the null host tier holds no slots to free")
