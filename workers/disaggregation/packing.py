"""Moving a transfer's K/V between a KV pool and one contiguous payload.

A payload holds layers [l0, l1) x tokens [t0, t1) x KV heads [h0, h1) of a transfer as one tensor
of shape (l1 - l0, 2, t1 - t0, h1 - h0, head_dim): K then V per layer, tokens in slot-list order.
The sender gathers it from its pool (index_select over its slots), the receiver scatters it into
its own slots (index_copy_); nothing outside the listed slots and heads is read or written.

Head indices are the model's (global): a tensor-parallel rank's pool holds heads [lo, hi) of them
(`PoolView.kv_heads`), and a transfer between replicas of different degrees moves, per pair of
ranks, the heads both hold (executor/tp_kv.py plans which).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from radixserve.workers.mem_cache.kv_pool import KVPool

_ROW_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@dataclass(frozen=True)
class Piece:
    """One payload's extent within a transfer."""

    layer_begin: int
    layer_end: int
    token_begin: int
    token_end: int
    # The model's KV heads [head_begin, head_end) it carries; (0, 0): every head of the pool.
    head_begin: int = 0
    head_end: int = 0

    @property
    def heads(self) -> tuple[int, int] | None:
        return (self.head_begin, self.head_end) if self.head_end else None

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_begin

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_begin


class PoolView:
    """A pool's K/V buffers seen as payload shapes and byte counts. The pool holds the model's KV
    heads `kv_heads` = [lo, hi) (all of them, [0, n), without tensor parallelism)."""

    def __init__(self, pool: KVPool, kv_heads: tuple[int, int] | None = None):
        self.pool = pool
        self.num_layers = len(pool.k_buffers)
        _, self.num_kv_heads, self.head_dim = pool.k_buffers[0].shape
        self.kv_heads = kv_heads or (0, self.num_kv_heads)
        if self.kv_heads[1] - self.kv_heads[0] != self.num_kv_heads or self.kv_heads[0] < 0:
            raise ValueError(f"KV heads {self.kv_heads} for a pool of {self.num_kv_heads} heads")
        self.num_slots = pool.k_buffers[0].shape[0]  # a transfer moves at most this many tokens
        self.dtype = pool.dtype
        self.device = pool.k_buffers[0].device
        self.elem_bytes = torch.empty((), dtype=self.dtype).element_size()
        # K and V of one token in one layer, every head of the pool.
        self.token_layer_bytes = 2 * self.num_kv_heads * self.head_dim * self.elem_bytes
        self._rows_of: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor], torch.dtype]] = {}
        self.row_dtype = self._head_rows(self.kv_heads)[2]

    def heads_of(self, piece: Piece) -> tuple[int, int]:
        """The model's KV heads a piece carries: its own range, else every head of this pool."""
        return piece.heads or self.kv_heads

    def check_heads(self, heads: tuple[int, int]) -> None:
        lo, hi = heads
        if not self.kv_heads[0] <= lo < hi <= self.kv_heads[1]:
            raise ValueError(
                f"KV heads [{lo}, {hi}) are not all in this pool's [{self.kv_heads[0]}, {self.kv_heads[1]})"
            )

    def payload_shape(self, piece: Piece) -> tuple[int, ...]:
        lo, hi = self.heads_of(piece)
        return (piece.num_layers, 2, piece.num_tokens, hi - lo, self.head_dim)

    def payload_bytes(self, piece: Piece) -> int:
        lo, hi = self.heads_of(piece)
        return piece.num_layers * piece.num_tokens * 2 * (hi - lo) * self.head_dim * self.elem_bytes

    def _head_rows(
        self, heads: tuple[int, int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.dtype]:
        """Each layer's K and V buffers narrowed to `heads`, one integer row per token. Rows move
        as the widest integer that divides them (and their offset in the pool's row): index_copy_
        over int64 rows beats it over bfloat16 elements (about 5.6 vs 7.5 ms for 1k tokens x 30
        layers of SmolLM2's KV on one thread here); index_select is the same either way."""
        rows = self._rows_of.get(heads)
        if rows is None:
            self.check_heads(heads)
            lo, hi = heads[0] - self.kv_heads[0], heads[1] - self.kv_heads[0]
            unit = self.head_dim * self.elem_bytes  # one head of one token
            sizes = ((hi - lo) * unit, lo * unit, self.num_kv_heads * unit)  # row, offset, stride
            dtype = next(d for n, d in _ROW_DTYPES if all(b % n == 0 for b in sizes))

            def narrow(b: torch.Tensor) -> torch.Tensor:
                return b[:, lo:hi].view(b.shape[0], -1).view(dtype)

            rows = ([narrow(b) for b in self.pool.k_buffers], [narrow(b) for b in self.pool.v_buffers], dtype)
            self._rows_of[heads] = rows
        return rows

    def slot_index(self, slots) -> torch.Tensor:
        """Slots as the int64 index tensor on the pool's device that gather/scatter take."""
        idx = torch.as_tensor(slots, dtype=torch.int64)
        if idx.dim() != 1:
            raise ValueError("a slot list must be one-dimensional")
        if idx.numel() and (
            int(idx.min()) < self.pool.page_size or int(idx.max()) >= self.pool.k_buffers[0].shape[0]
        ):
            raise ValueError("slot list reaches the reserved page or past the end of the pool")
        return idx.to(self.device)

    def gather(self, slots: torch.Tensor, piece: Piece, out: torch.Tensor) -> torch.Tensor:
        """Copy `piece` of the transfer whose slots are `slots` into `out` (payload-shaped)."""
        idx = slots[piece.token_begin : piece.token_end]
        k_rows, v_rows, dtype = self._head_rows(self.heads_of(piece))
        for i, layer in enumerate(range(piece.layer_begin, piece.layer_end)):
            torch.index_select(k_rows[layer], 0, idx, out=_rows(out[i, 0], dtype))
            torch.index_select(v_rows[layer], 0, idx, out=_rows(out[i, 1], dtype))
        return out

    def scatter(self, slots: torch.Tensor, piece: Piece, payload: torch.Tensor) -> None:
        """Write a payload into the slots of `piece`; the inverse of `gather`."""
        idx = slots[piece.token_begin : piece.token_end]
        k_rows, v_rows, dtype = self._head_rows(self.heads_of(piece))
        for i, layer in enumerate(range(piece.layer_begin, piece.layer_end)):
            k_rows[layer].index_copy_(0, idx, _rows(payload[i, 0], dtype))
            v_rows[layer].index_copy_(0, idx, _rows(payload[i, 1], dtype))

    def split(self, piece: Piece, max_bytes: int) -> Iterator[Piece]:
        """`piece` cut into payloads of at most `max_bytes` (at least one token of one layer each):
        whole layers while they fit, token ranges of one layer when a single layer is too big."""
        token_layer = self.payload_bytes(
            dataclasses.replace(piece, layer_end=piece.layer_begin + 1, token_end=piece.token_begin + 1)
        )
        per_layer = piece.num_tokens * token_layer
        if per_layer <= max_bytes:
            step = max(1, max_bytes // max(per_layer, 1))
            for lb in range(piece.layer_begin, piece.layer_end, step):
                yield dataclasses.replace(piece, layer_begin=lb, layer_end=min(lb + step, piece.layer_end))
            return
        tokens = max(1, max_bytes // token_layer)
        for layer in range(piece.layer_begin, piece.layer_end):
            for tb in range(piece.token_begin, piece.token_end, tokens):
                yield dataclasses.replace(
                    piece,
                    layer_begin=layer,
                    layer_end=layer + 1,
                    token_begin=tb,
                    token_end=min(tb + tokens, piece.token_end),
                )


def _rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous [tokens, heads, dim] payload tensor as one integer row per token."""
    return t.view(t.shape[0], -1).view(dtype)


class StagingBuffer:
    """A reusable byte buffer that payloads are viewed from: one per pair side, since a pair's
    payloads are packed or unpacked one at a time on that pair's thread."""

    def __init__(self, view: PoolView):
        self._view = view
        self._buf = torch.empty(0, dtype=torch.uint8, device=view.device)

    def payload(self, piece: Piece) -> torch.Tensor:
        n = self._view.payload_bytes(piece)
        if self._buf.numel() < n:
            self._buf = torch.empty(n, dtype=torch.uint8, device=self._view.device)
        return self._buf[:n].view(self._view.dtype).view(self._view.payload_shape(piece))
