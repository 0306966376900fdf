"""The tensor-parallel wire: how the scheduling rank (0) drives its followers between and during
batches, over the group's broadcasts.

Every exchange starts with one header, six int64s: [code, batch size, tokens, kv width, logits
rows, lora] (the rows: one per sequence, and any more for prompt logprobs; lora 1: the batch's
tokens have LoRA adapter slots, sent after its other fields). The code
is a batch's kind (`_KIND_CODES`), or one of three signals that carry no batch:

  stop       rank 0 ends the followers' loop (`broadcast_batch(group, None)`)
  keepalive  rank 0 is idle, but alive (`broadcast_keepalive`)
  control    one order for the followers' own state follows (`broadcast_control`: an Order of
             executor/tp_orders.py, as JSON)

A batch's header is followed by one int64 tensor of all its fields; a control header by the
order's bytes and a closing sum over the group (how many followers failed it, and their answers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from radixserve.workers.batch_kind import BatchKind
from radixserve.workers.distributed.group import CommGroup
from radixserve.workers.executor.tp_orders import Order, decode_order, encode_order
from radixserve.workers.models.forward_batch import ForwardBatch

logger = logging.getLogger("radixserve.engine")

# Fixed here, not taken from the enum's order: both ends of the wire read them.
_KIND_CODES = {BatchKind.PREFILL: 0, BatchKind.DECODE: 1}
_CODE_KINDS = {code: kind for kind, code in _KIND_CODES.items()}
_STOP = -1
_KEEPALIVE = -2
_CONTROL = -3


def _header(group: CommGroup, code: int) -> torch.Tensor:
    return torch.tensor([code, 0, 0, 0, 0, 0], dtype=torch.int64, device=group.device)


def broadcast_keepalive(group: CommGroup) -> None:
    """From the scheduling rank (0) while it has no batch to send: the followers, waiting in
    `broadcast_batch`, see it and wait again. Sent often enough, it keeps their wait under the
    group's collective timeout, so that only a rank that is gone or stuck times them out."""
    if group.world_size > 1:
        group.broadcast(_header(group, _KEEPALIVE))


def broadcast_control(group: CommGroup, order: Order) -> tuple[int, int]:
    """From the scheduling rank (0) between batches: one order that every follower decodes and
    hands to the `on_control` of its `broadcast_batch` before the next batch. Returns once every
    rank has acted on it (a closing sum over the group): how many followers failed it (an order a
    follower cannot decode counts as failed), and the sum of the others' `on_control` answers."""
    if group.world_size == 1:
        return 0, 0
    group.broadcast(_header(group, _CONTROL))
    group.broadcast_object(encode_order(order))
    failed, total = group.all_reduce(torch.zeros(2, dtype=torch.int64, device=group.device)).tolist()
    return int(failed), int(total)


def _follow_control(group: CommGroup, src: int, on_control: Callable[[Order], int | None] | None) -> None:
    data = group.broadcast_object(None, src)
    failed = count = 0
    try:
        order = decode_order(data)
        if on_control is None:
            raise RuntimeError(f"this rank takes no orders, got {order.op!r}")
        count = int(on_control(order) or 0)
    except Exception:
        logger.exception("tensor-parallel rank %d: an order of rank %d failed", group.rank, src)
        failed = 1
    group.all_reduce(torch.tensor([failed, count], dtype=torch.int64, device=group.device))


def broadcast_batch(
    group: CommGroup,
    batch: ForwardBatch | None = None,
    src: int = 0,
    on_control: Callable[[Order], int | None] | None = None,
) -> ForwardBatch | None:
    """Rank `src`'s batch on every rank of `group`: two broadcasts (the header, then one int64
    tensor of every field; the tensors land on the group's device). The other ranks pass nothing;
    `src` passing None tells them to stop (they get None); keepalives (`broadcast_keepalive`) and
    orders (`broadcast_control`, handed to `on_control`) between batches are consumed here:

        while (batch := broadcast_batch(group)) is not None:   # a following rank's loop
            model(batch, kv_pool)
    """
    if group.world_size == 1:
        return batch
    header = _header(group, _STOP)
    if group.rank == src and batch is not None:
        sizes = [batch.batch_size, batch.num_tokens, batch.kv_indices.shape[1], batch.logits_indices.shape[0]]
        header.copy_(torch.tensor([_KIND_CODES[batch.kind], *sizes, int(batch.lora is not None)]))
    code, b, t, width, rows, lora = group.broadcast(header, src).tolist()
    while code in (_KEEPALIVE, _CONTROL) and group.rank != src:
        if code == _CONTROL:
            _follow_control(group, src, on_control)
        header.fill_(_STOP)
        code, b, t, width, rows, lora = group.broadcast(header, src).tolist()
    if code == _STOP:
        return None
    # input_ids, positions, out_slots, seq_lens, extend, kv, logits, the tokens' adapter slots
    sizes = [t, t, t, b, b, b * width, rows, t if lora else 0]
    if group.rank == src and batch is not None:
        fields = (batch.input_ids, batch.positions, batch.out_slots, batch.seq_lens, batch.extend_lens)
        device = batch.input_ids.device
        extra = []
        if batch.lora is not None:
            extra.append(torch.tensor(batch.lora.token_slots, dtype=torch.int64, device=device))
        flat = torch.cat([f.reshape(-1) for f in (*fields, batch.kv_indices, batch.logits_indices)] + extra)
        group.broadcast(flat.to(device=group.device, dtype=torch.int64), src)
        return batch
    flat = group.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=group.device), src)
    ids, pos, slots, seq_lens, extend, kv, logits, lora_slots = flat.split(sizes)
    return ForwardBatch(
        kind=_CODE_KINDS[code],
        input_ids=ids,
        positions=pos,
        out_slots=slots,
        seq_lens=seq_lens,
        extend_lens=extend,
        kv_indices=kv.view(b, width),
        logits_indices=logits,
        seq_lens_list=seq_lens.tolist(),
        extend_lens_list=extend.tolist(),
        # The tokens' slots as a list: the follower's LoRA manager makes its LoRABatch of them.
        lora=lora_slots.tolist() if lora else None,
    )
