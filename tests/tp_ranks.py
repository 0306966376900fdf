"""What each rank runs in the tensor / expert parallel tests (distributed/launch.run_ranks)."""

from __future__ import annotations

from typing import Any

import torch

from radixserve.workers.batch_kind import BatchKind
from radixserve.workers.distributed.group import CommGroup
from radixserve.workers.distributed.parallel import Parallel, ParallelConfig
from radixserve.workers.executor import tp_wire
from radixserve.workers.executor.tp_orders import SEND, CancelOrder, CountOrder
from radixserve.workers.executor.tp_wire import broadcast_batch, broadcast_control
from radixserve.workers.models.loader import load_model
from tests.model_driver import ModelDriver, make_batch


def greedy_on_rank(
    group: CommGroup,
    path: str | None,
    tp: int,
    ep: int,
    prompts: list[list[int]],
    new_tokens: int,
    dtype: str = "float32",
    quantization: str = "none",
) -> dict[str, Any]:
    """This rank's shard of the model: the first prompt's logits (and the collectives of that one
    forward), greedy tokens batched, and batched with chunked prefill."""
    from radixserve.workers.models.linear import Linear

    parallel = Parallel(ParallelConfig(tp, ep), group)
    loaded = load_model(path, dtype=dtype, parallel=parallel, quantization=quantization)
    driver = ModelDriver(loaded.model, loaded.config, num_slots=1024)
    group.stats.reset()
    logits = driver.logits_of(prompts[0])
    calls = dict(group.stats.calls)
    return {
        "logits": logits,
        "calls": calls,
        "tokens": driver.greedy(prompts, new_tokens),
        "chunked": driver.greedy(prompts, new_tokens, chunk=5),
        "kv_heads": loaded.model.local_kv_heads,
        "params": sum(p.numel() for p in loaded.model.parameters()),
        "packed": any(getattr(m, "packed", False) for m in loaded.model.modules()),
        "quantized": sorted(
            name
            for name, m in loaded.model.named_modules()
            if isinstance(m, Linear) and m.quantized is not None
        ),
    }


def collectives_on_rank(group: CommGroup) -> dict[str, Any]:
    """Every CommGroup operation once, on values that depend on the rank."""
    r, n = group.rank, group.world_size
    out: dict[str, Any] = {}
    out["all_reduce"] = group.all_reduce(torch.full((3,), float(r + 1))).tolist()
    out["all_gather"] = group.all_gather(torch.full((2, 1), float(r)), dim=-1).tolist()
    out["reduce_scatter"] = group.reduce_scatter(torch.arange(2.0 * n) * (r + 1)).tolist()
    # Rank r sends r + d + 1 rows of value 10 r + d to rank d.
    sends = [r + d + 1 for d in range(n)]
    rows = torch.cat([torch.full((count, 2), 10.0 * r + d) for d, count in enumerate(sends)])
    received = group.all_to_all(rows, sends, [s + r + 1 for s in range(n)])
    out["all_to_all"] = received[:, 0].tolist()
    out["broadcast"] = group.broadcast(torch.full((2,), float(r)), src=1).tolist()
    out["object"] = group.broadcast_object({"step": 7, "ids": [1, 2]} if r == 0 else None)
    batch = make_batch(BatchKind.PREFILL, [[5, 6, 7], [8]], [2, 0], [[1, 2, 3, 4, 5], [9]])
    got = broadcast_batch(group, batch if r == 0 else None)
    assert got is not None
    out["stopped"] = broadcast_batch(group, None) is None  # rank 0 ends the followers' loop
    out["batch"] = {
        name: getattr(got, name).tolist()
        for name in (
            "input_ids",
            "positions",
            "out_slots",
            "seq_lens",
            "extend_lens",
            "kv_indices",
            "logits_indices",
        )
    } | {"kind": got.kind.value, "lists": (got.seq_lens_list, got.extend_lens_list)}
    out["calls"] = dict(group.stats.calls)
    return out


def orders_on_rank(group: CommGroup) -> dict[str, Any]:
    """Rank 0 gives orders between batches; each follower's `broadcast_batch` hands them, decoded,
    to its `on_control` (which fails a cancel), and fails an order it cannot read."""
    if group.rank == 0:
        answers = [
            broadcast_control(group, CountOrder()),
            broadcast_control(group, CancelOrder(SEND, ("req-1",), "aborted")),
        ]
        # What a rank 0 of another version could send: an op this one does not know.
        group.broadcast(torch.tensor([tp_wire._CONTROL, 0, 0, 0], dtype=torch.int64))
        group.broadcast_object({"op": "rewind"})
        answers.append(tuple(group.all_reduce(torch.zeros(2, dtype=torch.int64)).tolist()))
        answers.append(broadcast_control(group, CountOrder()))
        broadcast_batch(group, None)
        return {"answers": answers}
    seen: list[Any] = []

    def on_control(order: Any) -> int:
        seen.append(order)
        if isinstance(order, CancelOrder):
            raise RuntimeError("this rank cannot cancel")
        return 10 + group.rank

    stopped = broadcast_batch(group, on_control=on_control) is None
    return {"seen": seen, "stopped": stopped}


class _Leader:
    """The scheduling rank's model: every batch goes to the other ranks before it runs here."""

    def __init__(self, model, group: CommGroup):
        self.model, self.group = model, group
        self.local_kv_heads = model.local_kv_heads

    def __call__(self, batch, kv_pool):
        broadcast_batch(self.group, batch)
        return self.model(batch, kv_pool)


def scheduled_greedy_on_rank(
    group: CommGroup, path: str, prompts: list[list[int]], new_tokens: int
) -> list[list[int]] | None:
    """Rank 0 schedules (builds every batch) and broadcasts it; the others only follow: the loop a
    tensor-parallel engine runs. Returns rank 0's greedy tokens."""
    parallel = Parallel(ParallelConfig(group.world_size), group)
    loaded = load_model(path, dtype="float32", parallel=parallel)
    model, config = loaded.model, loaded.config
    if group.rank == 0:
        tokens = ModelDriver(_Leader(model, group), config, num_slots=512).greedy(
            prompts, new_tokens, chunk=7
        )
        broadcast_batch(group, None)
        return tokens
    pool = ModelDriver(model, config, num_slots=512).pool  # the same pool shape as the leader's
    while (batch := broadcast_batch(group)) is not None:
        model(batch, pool)
    return None
