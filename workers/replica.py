"""EngineReplica: one engine as a Ray Serve deployment replica, in one of three roles (its
`EngineConfig.role`): unified (prefill + decode), or one side of PD disaggregation: a prefill
replica (`generate` with KV tickets: the prompt, the first token, then the KV sent on) or a decode
replica (`reserve`: slots and tickets first, then the rest of the output once the KV is in).

Everything crossing the handle is a protocol message in its codec's form: requests in as
`GenerateRequest.to_dict()`, the streams' events out as `encode_event(...)` (`Accepted`,
`KVReservation`, `OutputChunk`, `Failure`), answers as their `to_dict()`. The deployment options
(replica count, CPUs, requests in flight, request router) are set by cluster/app.py, not here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import tempfile
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.protocol import (
    Accepted,
    CacheSummary,
    EngineError,
    Failure,
    GenerateRequest,
    InvalidRequest,
    KVReservation,
    ModelCard,
    QueueFull,
    ReplicaStats,
    encode_event,
)

logger = logging.getLogger(__name__)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (direct use in a test or a script)
        return f"local-{os.getpid()}"


def tokenizer_files(tokenizer: Any) -> dict[str, str]:
    """A Hugging Face tokenizer as {file name: text}, for `ModelCard.tokenizer_files`."""
    with tempfile.TemporaryDirectory(prefix="radixserve-tok-") as d:
        tokenizer.save_pretrained(d)
        files = {}
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), encoding="utf-8") as f:
                files[name] = f.read()
    return files


# A replica whose engine stopped (a rank died) fails its next health checks: Serve replaces it
# after three in a row. The check reads a flag, so checking often costs nothing.
@serve.deployment(
    name="EngineReplica",
    health_check_period_s=3,
    health_check_timeout_s=60,
    graceful_shutdown_timeout_s=5,
)
class EngineReplica:
    def __init__(self, config: EngineConfig, memory_budget_bytes: int | None = None):
        """`memory_budget_bytes`: how far this process may grow past its start-up size on CPU
        (None: executor/memory_limit.py's default share of the node's memory)."""
        from radixserve.workers.engine.engine import Engine  # heavy: torch + the model
        from radixserve.workers.executor.cpu_runtime import freeze_startup_heap
        from radixserve.workers.executor.memory_limit import default_budget_bytes, limit_memory_growth

        self.config = config
        self.replica_id = _replica_id()
        launcher = None
        if config.tp_size > 1:  # ranks 1..tp_size-1: actors in this replica's placement group
            from radixserve.workers.rank_actor import RayLauncher

            launcher = RayLauncher(f"EngineRank::{self.replica_id}")
        self.engine = Engine(**dataclasses.asdict(config), rank_launcher=launcher)
        if self.engine.core.device.type == "cpu":
            limit_memory_growth(memory_budget_bytes or default_budget_bytes())
        frozen = freeze_startup_heap()
        logger.info(
            "engine replica %s ready: %s (%d start-up objects kept out of the garbage collector)",
            self.replica_id,
            self.engine.served_model_name,
            frozen,
        )

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream one request's events: `Accepted` once the engine took it, then its chunks.

        A refusal (invalid request, full queue) is sent as a `Failure`, even after the
        acceptance (a grammar fails to compile when scheduled); so is an `EngineError` that
        ended the request mid-way. If the caller goes away (Serve cancels this generator) the
        request is aborted, so its KV is released.
        """
        try:
            req = GenerateRequest.from_dict(request)
            stream = self.engine.submit(req)
        except (InvalidRequest, QueueFull) as e:
            yield encode_event(Failure(e))
            return
        finished = False
        try:
            yield encode_event(Accepted(req.rid))
            async for chunk in stream:
                yield encode_event(chunk)
            finished = True
        except (InvalidRequest, QueueFull, EngineError) as e:
            finished = True  # the engine already dropped it
            yield encode_event(Failure(e))
        finally:
            if not finished:
                self.engine.abort(req.rid)

    def check_health(self) -> None:
        """Serve's health check: raises once the engine has stopped on its own (a tensor-parallel
        rank died), so that Serve replaces this replica."""
        self.engine.check_health()

    async def reserve(self, request: dict[str, Any], wait_s: float = 0.0) -> AsyncIterator[dict[str, Any]]:
        """PD, decode role: stream one request whose prompt a prefill replica computes. First a
        `KVReservation` (the tickets for the prefill replica) once the slots are reserved (within
        `wait_s` seconds where there is no room now), then the request's chunks from its second
        token on (the first one is the prefill replica's to send). Refusals and failures as in
        `generate` (`TransferFailed` when the KV never came); a refusal for want of room carries
        this replica's stats, so the router tries one with room next. The caller renews the
        reservation's lease (`renew`) until its prefill begins. A caller that goes away aborts
        the request and frees its slots."""
        try:
            req = GenerateRequest.from_dict(request)
            stream, done = self.engine.reserve(req, float(wait_s))
        except (InvalidRequest, QueueFull) as e:
            yield encode_event(Failure(self._with_report(e)))
            return
        finished = False
        try:
            try:
                tickets = await asyncio.wrap_future(done)
            except (InvalidRequest, QueueFull) as e:
                finished = True  # refused on the engine thread: nothing was kept
                yield encode_event(Failure(self._with_report(e)))
                return
            yield encode_event(KVReservation(req.rid, tickets))
            async for chunk in stream:
                yield encode_event(chunk)
            finished = True
        except (InvalidRequest, QueueFull, EngineError) as e:
            finished = True
            yield encode_event(Failure(e))
        finally:
            if not finished:
                self.engine.abort(req.rid)

    def _with_report(self, error: Exception) -> Exception:
        """A want of room, with this replica's stats (what the router's policy weighs)."""
        if not isinstance(error, QueueFull):
            return error
        return QueueFull(str(error), self._stats())

    def _stats(self) -> ReplicaStats:
        s = self.engine.replica_stats()
        s.replica_id = self.replica_id
        return s

    async def renew(self, rids: list[str]) -> int:
        """PD, decode role: the prefill of these requests (any ingress's; ids this replica does
        not serve are ignored) is still on its way: their reservations' leases start again."""
        return self.engine.renew([str(r) for r in rids])

    async def model_card(self) -> dict[str, Any]:
        cfg = self.engine.model_config
        return ModelCard(
            served_model_name=self.engine.served_model_name,
            model_path=self.config.model_path,
            context_length=self.engine.context_length,
            vocab_size=len(self.engine.tokenizer),
            eos_token_ids=[int(t) for t in cfg.eos_token_ids],
            # Written to and read back from a temporary directory: disk work, off the event loop.
            tokenizer_files=await asyncio.to_thread(tokenizer_files, self.engine.tokenizer),
        ).to_dict()

    async def stats(self) -> dict[str, Any]:
        self.engine.check_health()  # a stopped engine is no replica to count (/ready) until replaced
        return self._stats().to_dict()

    async def cache_summary(self, max_tokens: int) -> dict[str, Any]:
        """What the router's correction needs, read together (a `CacheSummary`): this replica's
        `ReplicaStats` and its cached prefixes, up to `max_tokens` tokens in all."""
        paths = await asyncio.to_thread(self.engine.cache_summary, int(max_tokens))
        lower = []
        if self.engine.config.hicache_host_size and max_tokens:
            lower = await asyncio.to_thread(self.engine.cache_summary, int(max_tokens), True)
        return CacheSummary(self._stats(), paths, lower).to_dict()

    async def load_lora_adapter(self, name: str, path: str) -> str | None:
        """Serve the adapter at `path` as `name`; None, or why it cannot be served (the reason
        goes back to the client: an adapter it named is at fault, not this replica)."""
        try:
            await asyncio.to_thread(self.engine.load_lora_adapter, str(name), str(path))
        except ValueError as exc:  # LoRAError, InvalidRequest: the adapter or the settings
            return str(exc)
        return None

    async def unload_lora_adapter(self, name: str) -> bool:
        return self.engine.unload_lora_adapter(str(name))

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (`EngineLoad` fields), which the policies of
        cluster/autoscaling.py scale on. Serve calls it on this event loop every few seconds
        (with a 10 s timeout): it only reads what the engine thread published, never waits for it."""
        return self.engine.load().to_metrics()

    async def engine_stats(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, **self.engine.stats()}

    async def flush_cache(self) -> bool:
        # The engine answers between steps; waiting for that must not hold up this event loop.
        return bool(await asyncio.to_thread(self.engine.flush_cache))

    async def abort(self, rid: str) -> bool:
        return bool(self.engine.abort(rid))

    def __del__(self) -> None:
        engine: Any | None = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
