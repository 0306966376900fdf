"""A following rank of a tensor-parallel engine: its shard of the model and its KV pool, running
whatever batch the scheduling rank (rank 0) broadcasts, until rank 0 says stop.

    follow(rank, spec)   # in the rank's own process (a spawned process, a Ray actor)

Start-up goes through the TCPStore that rank 0 serves (spec.host, spec.port), so that rank 0 can
tell a rank that is still loading from one that failed or died: the rank announces it has joined,
joins the group, loads its shard, reads the pool layout rank 0 publishes (slot count and page
size), allocates its pool and announces it is ready; a failure on the way is published with its
message. A rank of a prefill or decode replica also starts a KV transfer engine of its own
(executor/tp_kv.py) and acts on rank 0's transfer orders between batches. Then it loops on
`broadcast_batch`. A collective that fails (rank 0 gone, or silent past
the group's timeout: rank 0 sends keepalives while idle) ends the loop and the process.

The follower holds no allocator state: its KVPool has the slot count of rank 0's and this rank's
own KV heads, but it never allocates or frees a slot. Which slots a batch reads and writes comes
with the batch; the free lists, the radix tree and the request table that decide them live on
rank 0 only.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from radixserve.workers.distributed.device import comm_backend, resolve_device
from radixserve.workers.distributed.group import CommGroup
from radixserve.workers.distributed.parallel import Parallel, ParallelConfig
from radixserve.workers.executor.cpu_runtime import freeze_startup_heap, tune_malloc
from radixserve.workers.executor.tp_kv import FollowerTransfers, RankKVSpec
from radixserve.workers.executor.tp_orders import LoRASlotOrder, Order
from radixserve.workers.executor.tp_wire import broadcast_batch
from radixserve.workers.lora.manager import LoRAManager
from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.models.loader import load_model

logger = logging.getLogger("radixserve.engine")

POOL_KEY = "tp/pool"  # rank 0's pool layout, JSON: {"num_slots": ..., "page_size": ...}


def rank_key(stage: str, rank: int) -> str:
    """The store key a rank sets at a stage of its start-up: joined, ready, failed."""
    return f"tp/{stage}/{rank}"


@dataclass(frozen=True)
class FollowerSpec:
    """What every following rank needs to start (picklable: it crosses to spawned processes and
    Ray actors)."""

    host: str  # rank 0's store
    port: int
    world_size: int
    ep_size: int
    # As rank 0 got it: each rank resolves it on its own node (rank 0 has converted a GGUF into
    # its node's cache first, so ranks beside it find it there).
    model_path: str | None
    dtype: str | None
    attention_backend: str
    num_threads: int
    start_timeout_s: float
    step_timeout_s: float  # the group's collective timeout
    kv: RankKVSpec | None = None  # a prefill or decode replica's: this rank's own KV transfers
    device: str = "cpu"  # rank 0's device kind: "cpu" or "cuda" (rank r takes its own GPU)
    # LoRA (max adapters per batch, max rank, max kept in memory): this rank holds its shard of
    # each adapter in its own batch slots, filled as rank 0 orders (LoRASlotOrder).
    lora: tuple[int, int, int] | None = None
    quantization: str = "none"  # rank 0's: each rank quantizes (or cuts) its own slice
    quantized_activations: str = "float"


def follow(rank: int, spec: FollowerSpec) -> None:
    """Run following rank `rank` until rank 0 broadcasts the stop (or the group fails)."""
    torch.set_num_threads(spec.num_threads)
    torch.set_grad_enabled(False)
    tune_malloc()
    timeout = datetime.timedelta(seconds=spec.start_timeout_s)
    store = dist.TCPStore(spec.host, spec.port, spec.world_size, False, timeout=timeout)
    try:
        device = resolve_device(spec.device, rank)
    except BaseException as exc:
        store.set(rank_key("failed", rank), f"{type(exc).__name__}: {exc}")
        raise
    store.set(rank_key("joined", rank), str(os.getpid()))
    backend = comm_backend(device)
    group = CommGroup.init(store, rank, spec.world_size, backend=backend, timeout_s=spec.step_timeout_s)
    transfers: FollowerTransfers | None = None
    lora: LoRAManager | None = None
    try:
        try:
            loaded, pool = _load(spec, group, store, device)
            if spec.kv is not None:
                transfers = FollowerTransfers.start(rank, spec.kv, pool, loaded, store)
            if spec.lora is not None:
                lora = LoRAManager(loaded.model, *spec.lora, loaded.config.dtype, device)
        except BaseException as exc:
            store.set(rank_key("failed", rank), f"{type(exc).__name__}: {exc}")
            raise
        freeze_startup_heap()  # no full collection stalls this rank's steps (cpu_runtime.py)
        store.set(rank_key("ready", rank), "1")
        model = loaded.model

        def on_control(order: Order) -> int | None:
            if isinstance(order, LoRASlotOrder):
                assert lora is not None, "a LoRA order to a rank without LoRA"
                lora.fill(order.slot, (order.name, order.path))
                return None
            if transfers is None:
                raise RuntimeError(f"this rank moves no KV, got {order.op!r}")
            return transfers.on_control(order)

        try:
            with torch.inference_mode():
                while (batch := broadcast_batch(group, on_control=on_control)) is not None:
                    if lora is not None and batch.lora is not None:
                        lora.ctx.batch = lora.batch(batch.lora, device)
                    if transfers is not None:
                        batch.layer_done = transfers.begin_batch()
                    model(batch, pool)
                    if transfers is not None:
                        transfers.end_batch()
                    if lora is not None:
                        lora.ctx.batch = None
        except RuntimeError as exc:  # the group broke: rank 0 is gone or stuck
            logger.error("tensor-parallel rank %d stops: its group failed: %s", rank, exc)
            return
    finally:
        if transfers is not None:
            transfers.close()
        if lora is not None:
            lora.close()
        group.destroy()


def _load(
    spec: FollowerSpec, group: CommGroup, store: dist.Store, device: torch.device
) -> tuple[Any, KVPool]:
    parallel = Parallel(ParallelConfig(spec.world_size, spec.ep_size), group)
    loaded = load_model(
        spec.model_path,
        spec.dtype,
        spec.attention_backend,
        parallel,
        device,
        quantization=spec.quantization,
        quantized_activations=spec.quantized_activations,
    )
    layout = json.loads(store.get(POOL_KEY))  # waits: rank 0 publishes it once its own pool is sized
    # The model's dtype, int8 or fp8 (kv_cache_dtype); an fp8 pool's scales are the checkpoint's.
    pool = loaded.kv_pool(
        int(layout["num_slots"]), getattr(torch, layout["dtype"]), device, int(layout["page_size"])
    )
    return loaded, pool
