"""TPLeader: the scheduling rank's side of a tensor-parallel engine (rank 0 of the group).

Rank 0 is the engine: the scheduler, the radix cache, the sampler and the grammars live there only.
It serves the group's TCPStore, has a `RankLauncher` start ranks 1..N-1 (executor/tp_follower.py;
local processes offline, Ray actors in a replica), joins the group, and, once its own pool is
sized, publishes the pool layout and waits until every rank is ready. Then every batch is
broadcast before rank 0's own forward (`wrap` puts that in front of the model), and `poll`, called
by the engine loop between steps, sends a keepalive when no batch went out for KEEPALIVE_S and
checks every LIVENESS_POLL_S that each rank is still running.

A rank that ends (killed, crashed) is a failure of the whole engine: a collective in flight fails
at once (Gloo sees the closed connection), and `poll` reports it within LIVENESS_POLL_S while idle;
a rank that hangs fails the next collective after STEP_TIMEOUT_S. The error names the rank. After
a failure nothing more is sent to the group; `stop` ends what is left of it.

At tp_size 1 (`TPLeader.single()`) nothing is started and every call is a no-op.

One process holds at most one group (torch.distributed's default group): one tensor-parallel
engine per process.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from radixserve.workers.distributed.device import comm_backend
from radixserve.workers.distributed.group import CommGroup
from radixserve.workers.distributed.launch import LocalLauncher, RankHandle, RankLauncher
from radixserve.workers.distributed.parallel import Parallel, ParallelConfig
from radixserve.workers.executor.tp_follower import POOL_KEY, FollowerSpec, follow, rank_key
from radixserve.workers.executor.tp_kv import RankKVSpec, RankTransfers
from radixserve.workers.executor.tp_orders import Order
from radixserve.workers.executor.tp_wire import broadcast_batch, broadcast_control, broadcast_keepalive
from radixserve.workers.models.forward_batch import ForwardBatch
from radixserve.workers.models.loader import read_config, resolve_dtype, resolve_model_dir
from radixserve.workers.protocol import Role

logger = logging.getLogger("radixserve.engine")

START_TIMEOUT_S = 600.0  # ranks starting: a process or actor, then loading a shard
STEP_TIMEOUT_S = 120.0  # any one collective once serving
KEEPALIVE_S = 5.0
LIVENESS_POLL_S = 1.0
FAILURE_GRACE_S = 2.0  # after a failed collective, how long a dead rank may take to show as ended
JOIN_TIMEOUT_S = 10.0  # a rank told to stop, before it is killed


class RankFailed(RuntimeError):
    """A rank of the tensor-parallel group ended or stopped answering: the engine cannot go on."""


class TPLeader:
    def __init__(
        self,
        parallel: Parallel,
        store: dist.Store | None = None,
        handles: list[RankHandle] | None = None,
        threads: int | None = None,
    ):
        self.parallel = parallel
        self.store = store
        self.handles = handles or []
        self.threads = threads  # each rank's torch threads
        self.failure: str | None = None
        self._last_sent = self._last_checked = time.monotonic()
        self._stopped = False

    @classmethod
    def single(cls) -> TPLeader:
        return cls(Parallel.single())

    @property
    def group(self) -> CommGroup:
        return self.parallel.group

    @property
    def world_size(self) -> int:
        return self.parallel.tp_size

    @classmethod
    def start(
        cls,
        config: ParallelConfig,
        model_path: str | None,
        dtype: str | None,
        attention_backend: str,
        num_threads: int | None,
        launcher: RankLauncher | None = None,
        kv: RankKVSpec | None = None,
        device: str = "cpu",
        lora: tuple[int, int, int] | None = None,
        quantization: str = "none",
        quantized_activations: str = "float",
    ) -> TPLeader:
        """Check the model's layout over `config`, start ranks 1..N-1 and join them as rank 0.
        Raises ValueError for a layout the model does not have (before anything starts) and
        RuntimeError naming the rank that failed to start. `kv`: the ranks of a prefill or decode
        replica each move their own heads' KV (executor/tp_kv.py). `device`: "cpu" or "cuda", rank
        0's (already set as this process's current device); the group runs gloo or NCCL on it."""
        if config.tp_size == 1:
            return cls.single()
        model_dir, _ = resolve_model_dir(model_path)  # converts a GGUF once, here
        mc = read_config(model_dir, resolve_dtype(dtype, device))
        config.check_model(mc.num_heads, mc.num_kv_heads, mc.moe.num_experts if mc.moe else 0)
        if dist.is_initialized():
            raise RuntimeError("this process holds a tensor-parallel group already (one per process)")
        launcher = launcher or LocalLauncher()
        if (
            device == "cuda"
            and isinstance(launcher, LocalLauncher)
            and torch.cuda.device_count() < config.tp_size
        ):
            # NCCL refuses two ranks on one GPU; local rank r takes GPU r.
            raise ValueError(
                f"tp_size {config.tp_size} on CUDA needs {config.tp_size} GPUs; this host sees "
                f"{torch.cuda.device_count()}"
            )
        threads = num_threads or launcher.threads_per_rank(config.tp_size)
        torch.set_num_threads(threads)  # rank 0's own forwards
        timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
        store = dist.TCPStore(launcher.host, 0, config.tp_size, True, timeout=timeout, wait_for_workers=False)
        spec = FollowerSpec(
            host=launcher.host,
            port=store.port,
            world_size=config.tp_size,
            ep_size=config.ep_size,
            model_path=model_path,
            dtype=str(mc.dtype).removeprefix("torch."),
            attention_backend=attention_backend,
            num_threads=threads,
            start_timeout_s=START_TIMEOUT_S,
            step_timeout_s=STEP_TIMEOUT_S,
            kv=kv,
            device=device,
            lora=lora,
            quantization=quantization,
            quantized_activations=quantized_activations,
        )
        handles = launcher.start(follow, range(1, config.tp_size), spec)
        leader = cls(Parallel.single(), store, handles, threads)
        try:
            leader._wait_for("joined")
            backend = comm_backend(torch.device(device))
            group = CommGroup.init(store, 0, config.tp_size, backend=backend, timeout_s=STEP_TIMEOUT_S)
        except BaseException as exc:
            leader.abort(f"start-up failed: {exc}")
            raise
        leader.parallel = Parallel(config, group)
        logger.info("tensor-parallel group of %d ranks joined (ep_size %d)", config.tp_size, config.ep_size)
        return leader

    def share_pool(self, num_slots: int, page_size: int, dtype: torch.dtype) -> None:
        """Publish rank 0's pool layout; return once every rank has its shard and its pool."""
        if self.store is None:
            return
        layout = {"num_slots": num_slots, "page_size": page_size, "dtype": str(dtype).removeprefix("torch.")}
        self.store.set(POOL_KEY, json.dumps(layout))
        self._wait_for("ready")
        self._last_sent = time.monotonic()

    def _wait_for(self, stage: str) -> None:
        assert self.store is not None, "a group of several ranks has a store"
        pending = {h.rank: h for h in self.handles}
        deadline = time.monotonic() + START_TIMEOUT_S
        while pending:
            for rank, handle in list(pending.items()):
                if self.store.check([rank_key("failed", rank)]):
                    message = self.store.get(rank_key("failed", rank)).decode()
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {message}")
                if self.store.check([rank_key(stage, rank)]):
                    del pending[rank]
                elif (reason := handle.exit_reason()) is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} {reason} while starting")
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel ranks {sorted(pending)} did not start within {START_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.05)

    # Serving ---------------------------------------------------------------------------------
    def wrap(self, model: Any) -> Any:
        """The model as the engine calls it: at tp_size > 1 each batch goes to the other ranks
        first, and a failed forward that a lost rank explains raises RankFailed."""
        return model if self.world_size == 1 else _BroadcastingModel(model, self)

    def poll(self) -> str | None:
        """Between steps (no forward in flight): a keepalive if due, a liveness check if due.
        The failure that ended the group (a sentence), or None while every rank runs."""
        if self.world_size == 1 or self.failure is not None:
            return self.failure
        now = time.monotonic()
        if now - self._last_checked >= LIVENESS_POLL_S:
            self._last_checked = now
            self.failure = self._lost_rank()
        if self.failure is None and now - self._last_sent >= KEEPALIVE_S:
            try:
                broadcast_keepalive(self.group)
                self._last_sent = now
            except Exception as exc:
                self.failure = self.explain(exc)
        return self.failure

    def control(self, order: Order) -> tuple[int, int]:
        """Between steps: an order every follower acts on before the next batch (KV transfers);
        how many failed it, and the sum of the others' answers. Raises RankFailed if the group is
        gone."""
        if self.failure is not None:
            raise RankFailed(self.failure)
        try:
            answer = broadcast_control(self.group, order)
        except Exception as exc:
            raise RankFailed(self.explain(exc)) from exc
        self._last_sent = time.monotonic()
        return answer

    def rank_transfers(self, role: Role) -> RankTransfers | None:
        """Rank 0's handle on the followers' KV transfers (None at tp_size 1). Once the group
        is ready: a decode follower's endpoint is published by then."""
        if self.world_size == 1:
            return None
        assert self.store is not None, "a group of several ranks has a store"
        if role is Role.DECODE:
            return RankTransfers.for_decode(self.world_size, self.control, self.store)
        return RankTransfers(self.world_size, self.control, self.store)

    def explain(self, exc: BaseException) -> str:
        """Why a collective failed: the rank that ended, if one did within FAILURE_GRACE_S."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        while (lost := self._lost_rank()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.failure = lost or f"the tensor-parallel group failed: {exc}"
        return self.failure

    def _lost_rank(self) -> str | None:
        for h in self.handles:
            reason = h.exit_reason()
            if reason is not None:
                return f"tensor-parallel rank {h.rank} of {self.world_size} {reason}"
        return None

    def abort(self, reason: str) -> None:
        """End the group now: the ranks are killed, not asked (rank 0 failed to start, say)."""
        self.failure = self.failure or reason
        self.stop()

    def stop(self) -> None:
        """Tell the ranks to stop (if the group still works), wait for them, kill the stragglers."""
        if self._stopped or (self.world_size == 1 and not self.handles):
            return
        self._stopped = True
        if self.failure is None and self.group.world_size > 1:
            try:
                broadcast_batch(self.group, None)
            except Exception:
                logger.warning("telling the tensor-parallel ranks to stop failed", exc_info=True)
        wait = JOIN_TIMEOUT_S if self.failure is None else 0.0
        for h in self.handles:
            h.join(wait)
            h.kill()  # a straggler; or an actor whose call returned, so that its bundle frees
        self.group.destroy()


class _BroadcastingModel:
    """At tp_size > 1 any failed forward ends the engine, whatever raised: the ranks' collectives
    are out of step after it."""

    def __init__(self, model: Any, leader: TPLeader):
        self.model, self.leader = model, leader

    def __call__(self, batch: ForwardBatch, kv_pool: Any) -> torch.Tensor:
        leader = self.leader
        if leader.failure is not None:
            raise RankFailed(leader.failure)
        try:
            broadcast_batch(leader.group, batch)
            leader._last_sent = time.monotonic()
            return self.model(batch, kv_pool)
        except Exception as exc:
            raise RankFailed(leader.explain(exc)) from exc
