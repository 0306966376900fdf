"""What one forward pass needs: built by the model runner, read by the model and attention kernels."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.workers.distributed.group import CommGroup


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill of new tokens after a (possibly empty) cached prefix
    DECODE = "decode"  # exactly one new token per sequence


@dataclass
class ForwardBatch:
    """Tensors for one step over B sequences and T new tokens (T == B in decode).

    New tokens of sequence i occupy rows [cu_extend[i], cu_extend[i+1]) of input_ids/positions.
    `kv_indices[i, :seq_lens[i]]` are the KV pool slots of every position of sequence i, the new
    tokens included (their K/V are written to `out_slots` before attention reads them); entries past
    `seq_lens[i]` are arbitrary valid slots and must be masked out.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: where each new token's K/V is written
    seq_lens: torch.Tensor  # [B] int64: KV length after this step (prefix + new)
    extend_lens: torch.Tensor  # [B] int64: new tokens per sequence
    kv_indices: torch.Tensor  # [B, max(seq_lens)] int64
    logits_indices: torch.Tensor  # [B] int64: row of T whose logits are returned
    seq_lens_list: list[int] = field(default_factory=list)
    extend_lens_list: list[int] = field(default_factory=list)
    # Scratch space an attention backend fills once per batch (masks, offsets) and reuses
    # across layers.
    attn_metadata: Any | None = None
    # Called with i once decoder layer i has run, its K/V for this batch written (queued, on a
    # device) to the pool: PD's prefill side starts sending that layer while the next ones run.
    layer_done: Callable[[int], None] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prefix_lens_list(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens_list, self.extend_lens_list)]

    @property
    def cu_extend(self) -> list[int]:
        out = [0]
        for n in self.extend_lens_list:
            out.append(out[-1] + n)
        return out


_STOP = -1  # the header's mode when the scheduling rank ends the followers' loop
_KEEPALIVE = -2  # a header with no batch: the scheduling rank is idle, but alive
_CONTROL = -3  # a header followed by one JSON order for the followers' own state (KV transfers)

logger = logging.getLogger("radixserve.engine")


def broadcast_keepalive(group: CommGroup) -> None:
    """From the scheduling rank (0) while it has no batch to send: the followers, waiting in
    `broadcast_batch`, see it and wait again. Sent often enough, it keeps their wait under the
    group's collective timeout, so that only a rank that is gone or stuck times them out."""
    if group.world_size > 1:
        group.broadcast(torch.tensor([_KEEPALIVE, 0, 0, 0], dtype=torch.int64, device=group.device))


def broadcast_control(group: CommGroup, order: dict[str, Any]) -> tuple[int, int]:
    """From the scheduling rank (0) between batches: one JSON order that every follower hands to
    the `on_control` of its `broadcast_batch` before the next batch. Returns once every rank has
    acted on it (a closing sum over the group): how many followers failed it, and the sum of the
    counts the others' `on_control` returned."""
    if group.world_size == 1:
        return 0, 0
    group.broadcast(torch.tensor([_CONTROL, 0, 0, 0], dtype=torch.int64, device=group.device))
    group.broadcast_object(order)
    failed, total = group.all_reduce(torch.zeros(2, dtype=torch.int64, device=group.device)).tolist()
    return int(failed), int(total)


def _follow_control(
    group: CommGroup, src: int, on_control: Callable[[dict[str, Any]], int | None] | None
) -> None:
    order = group.broadcast_object(None, src)
    failed = count = 0
    try:
        if on_control is None:
            raise RuntimeError(f"this rank takes no orders, got {order.get('op')!r}")
        count = int(on_control(order) or 0)
    except Exception:
        logger.exception("tensor-parallel rank %d: an order of rank %d failed", group.rank, src)
        failed = 1
    group.all_reduce(torch.tensor([failed, count], dtype=torch.int64, device=group.device))


def broadcast_batch(
    group: CommGroup,
    batch: ForwardBatch | None = None,
    src: int = 0,
    on_control: Callable[[dict[str, Any]], int | None] | None = None,
) -> ForwardBatch | None:
    """Rank `src`'s batch on every rank of `group`: two broadcasts (the sizes, then one int64 tensor
    of every field; the tensors land on the group's device). The other ranks pass nothing; `src`
    passing None tells them to stop (they get None); keepalives (`broadcast_keepalive`) and orders
    (`broadcast_control`, handed to `on_control`) between batches are consumed here:

        while (batch := broadcast_batch(group)) is not None:   # a following rank's loop
            model(batch, kv_pool)
    """
    if group.world_size == 1:
        return batch
    header = torch.full((4,), _STOP, dtype=torch.int64, device=group.device)
    if group.rank == src and batch is not None:
        mode = list(ForwardMode).index(batch.mode)
        header.copy_(torch.tensor([mode, batch.batch_size, batch.num_tokens, batch.kv_indices.shape[1]]))
    mode, b, t, width = group.broadcast(header, src).tolist()
    while mode in (_KEEPALIVE, _CONTROL) and group.rank != src:
        if mode == _CONTROL:
            _follow_control(group, src, on_control)
        header.fill_(_STOP)
        mode, b, t, width = group.broadcast(header, src).tolist()
    if mode == _STOP:
        return None
    sizes = [t, t, t, b, b, b * width, b]  # input_ids, positions, out_slots, seq_lens, extend, kv, logits
    if group.rank == src and batch is not None:
        fields = (batch.input_ids, batch.positions, batch.out_slots, batch.seq_lens, batch.extend_lens)
        flat = torch.cat([f.reshape(-1) for f in (*fields, batch.kv_indices, batch.logits_indices)])
        group.broadcast(flat.to(device=group.device, dtype=torch.int64), src)
        return batch
    flat = group.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=group.device), src)
    ids, pos, slots, seq_lens, extend, kv, logits = flat.split(sizes)
    return ForwardBatch(
        mode=list(ForwardMode)[mode],
        input_ids=ids,
        positions=pos,
        out_slots=slots,
        seq_lens=seq_lens,
        extend_lens=extend,
        kv_indices=kv.view(b, width),
        logits_indices=logits,
        seq_lens_list=seq_lens.tolist(),
        extend_lens_list=extend.tolist(),
    )
