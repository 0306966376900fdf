"""DiskTier: KV pages spilled from a host pool to files on local disk, under a byte budget.

`spill(pool, slots)` writes the K/V of a pool's slots (every layer) to one file and returns its
key; `fetch(key, pool, slots)` reads it back into slots the caller owns; `drop(key)` deletes it.
Each file carries a SHA-256 of its payload and its length, checked on every read. Which runs to
spill or drop, and in which order, is the caller's (the tree that indexes them keeps the LRU);
the tier only refuses a spill past its budget.

Failure contract: the disk never makes a wrong token. A spill that cannot be written (budget
spent, disk full, directory gone) returns None and leaves no file; a fetch whose file is missing,
short or fails its checksum returns False and forgets the key. Both log one warning line, and the
caller recomputes instead.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import struct

import torch

from radixserve.workers.mem_cache.kv_pool import KVPool, raw

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<32sQ")  # sha256 of the payload, payload length
READ_ERRORS = (OSError, ValueError, struct.error)


class DiskTier:
    def __init__(self, directory: str, max_bytes: int):
        self.directory = directory
        self.max_bytes = max_bytes
        os.makedirs(directory, exist_ok=True)
        self._sizes: dict[int, int] = {}
        self._ids = itertools.count(1)
        self.used_bytes = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.failures = 0

    def _path(self, key: int) -> str:
        return os.path.join(self.directory, f"{key}.kv")

    @staticmethod
    def file_bytes(pool: KVPool, num_slots: int) -> int:
        """The size of the file that spilling `num_slots` of `pool` writes (header included)."""
        bufs = pool.k_buffers + pool.v_buffers
        return _HEADER.size + num_slots * sum(b[0].numel() * b.element_size() for b in bufs)

    def spill(self, pool: KVPool, slots: list[int]) -> int | None:
        """Write the K/V of `slots` to a new file: its key, or None when it cannot be written."""
        idx = torch.tensor(slots, dtype=torch.long)
        parts = [
            buf.index_select(0, idx.to(buf.device)).cpu().contiguous().view(torch.uint8)
            for buf in pool.k_buffers + pool.v_buffers
        ]
        payload = b"".join(p.numpy().tobytes() for p in parts)
        size = _HEADER.size + len(payload)
        if self.used_bytes + size > self.max_bytes:
            return None
        key = next(self._ids)
        tmp = self._path(key) + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(hashlib.sha256(payload).digest(), len(payload)))
                f.write(payload)
            os.replace(tmp, self._path(key))
        except OSError as e:
            self.failures += 1
            log.warning("disk tier: spill of %d tokens failed (%s); they will be recomputed", len(slots), e)
            _remove(tmp)
            return None
        self._sizes[key] = size
        self.used_bytes += size
        self.bytes_written += size
        return key

    def fetch(self, key: int, pool: KVPool, slots: list[int], offset: int = 0) -> bool:
        """Read file `key` (its tokens from `offset` on) into `slots` of `pool`; False (key
        forgotten) if it is not intact."""
        if key not in self._sizes:
            return False
        try:
            self.read(self._path(key), pool, slots, offset)
        except READ_ERRORS as e:
            self.failed(key, e)
            return False
        self.bytes_read += self._sizes[key]
        return True

    def path(self, key: int) -> str:
        return self._path(key)

    @staticmethod
    def read(path: str, pool: KVPool, slots: list[int], offset: int = 0) -> None:
        """Read tokens offset .. offset + len(slots) of the file at `path` into `slots` of `pool`
        (the whole file is checked); raises one of READ_ERRORS if it is missing, short or fails
        its checksum. Touches no state of the tier, so a loader thread may run it while the
        engine thread spills and drops (`slots` must be the caller's alone)."""
        with open(path, "rb") as f:
            data = f.read()
        digest, length = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        if len(payload) != length or hashlib.sha256(payload).digest() != digest:
            raise ValueError("checksum mismatch")
        bufs = pool.k_buffers + pool.v_buffers
        row = bufs[0][0].numel() * bufs[0].element_size()
        tokens, rest = divmod(length, len(bufs) * row)
        if rest or offset < 0 or offset + len(slots) > tokens:
            raise ValueError(f"{length} bytes for tokens {offset}..{offset + len(slots)}")
        idx = torch.tensor(slots, dtype=torch.long)
        per_buf, start, end = tokens * row, offset * row, (offset + len(slots)) * row
        for i, buf in enumerate(bufs):
            part = payload[i * per_buf + start : i * per_buf + end]
            got = torch.frombuffer(bytearray(part), dtype=torch.uint8)
            dst = raw(buf)
            src = got.view(dst.dtype).view(len(slots), *buf.shape[1:])
            dst.index_copy_(0, idx.to(buf.device), src.to(buf.device))

    def read_done(self, key: int) -> None:
        """Count a `read` of file `key` that succeeded off the engine thread."""
        self.bytes_read += self._sizes.get(key, 0)

    def failed(self, key: int, error: BaseException) -> None:
        """A read of file `key` failed: log it, count it and forget the file."""
        self.read_failed(key, error)
        self.drop(key)

    def read_failed(self, key: int, error: BaseException) -> None:
        """Log and count a failed read of file `key` (its owner forgets it)."""
        self.failures += 1
        log.warning("disk tier: file %d unreadable (%s); its tokens will be recomputed", key, error)

    def drop(self, key: int) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size
            _remove(self._path(key))

    def keys(self) -> list[int]:
        return list(self._sizes)

    def close(self) -> None:
        """Delete every file and the directory, if nothing else was put in it."""
        for key in list(self._sizes):
            self.drop(key)
        try:
            os.rmdir(self.directory)
        except OSError:
            pass


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
