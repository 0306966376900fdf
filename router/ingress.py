"""The Serve ingress deployment: owns the tokenizer, the metrics and the handle to the engine
replicas, and serves the FastAPI app that router/api.py builds around it.

Replica traffic is protocol dicts only. A request's replica is chosen by `route` (the seam for the
cache-aware policy; today Serve's own routing picks among the replicas behind the handle).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Optional

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from radixserve.router.metrics import Metrics, RequestTimer
from radixserve.router.tokenizer import Tokenizer
from radixserve.workers.protocol import (GenerateRequest, ModelCard, OutputChunk, ReplicaStats,
                                         decode_error)

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 30.0


class ReplicaStream:
    """The chunks of one request from its replica. Cancelling it aborts the request there."""

    def __init__(self, gen: DeploymentResponseGenerator, rid: str, timer: RequestTimer):
        self.gen = gen
        self.rid = rid
        self.timer = timer
        self.done = False
        self.first: Optional[OutputChunk] = None

    async def next(self) -> Optional[OutputChunk]:
        """The next chunk, None at the end; raises a replica's refusal as its exception."""
        try:
            d = await self.gen.__anext__()
        except StopAsyncIteration:
            self.done = True
            return None
        if "error" in d:
            self.done = True
            raise decode_error(d)
        chunk = OutputChunk.from_dict(d)
        self.timer.tokens(len(chunk.token_ids))
        return chunk

    async def __aiter__(self) -> AsyncIterator[OutputChunk]:
        try:
            if self.first is not None:
                yield self.first
            while not self.done and (chunk := await self.next()) is not None:
                yield chunk
            self.timer.finished()
        finally:
            self.cancel()

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.gen.cancel()


class Ingress:
    async def __init__(self, replicas: DeploymentHandle, server_args: dict[str, Any]):
        self.replicas = replicas
        self.server_args = dict(server_args)
        self.api_key: Optional[str] = server_args.get("api_key")
        self.max_request_bytes: int = int(server_args.get("max_request_bytes") or 16 << 20)
        logging.getLogger("radixserve").setLevel(str(server_args.get("log_level") or "info").upper())
        card = await self.replicas.model_card.remote()
        self.card = ModelCard.from_dict(card)
        self.tokenizer = await asyncio.to_thread(Tokenizer, self.card)
        self.model_name = self.card.served_model_name
        self.metrics = Metrics(self.model_name)

    def __serve_build_asgi_app__(self):
        from radixserve.router.api import build_api

        return build_api(self)

    def route(self, req: GenerateRequest) -> DeploymentHandle:
        """The handle that will serve `req`: the seam where a replica-choosing policy plugs in."""
        return self.replicas

    async def open(self, req: GenerateRequest) -> ReplicaStream:
        """Send `req` to a replica; returns once its first output is there.

        Raises InvalidRequest / QueueFull (as the replica's engine refused it) before any output,
        so the HTTP layer can still answer with a status code.
        """
        timer = self.metrics.timer()
        gen = self.route(req).options(stream=True).generate.remote(req.to_dict())
        stream = ReplicaStream(gen, req.rid, timer)
        try:
            if await stream.next() is None:  # the acceptance (an empty chunk)
                raise RuntimeError("the replica closed the stream without output")
            timer.admitted()
            stream.first = await stream.next()
        except BaseException:
            stream.cancel()
            raise
        return stream

    async def replica_stats(self) -> list[ReplicaStats]:
        results = await self.replicas.broadcast("stats").results_async(timeout_s=CONTROL_TIMEOUT_S)
        stats = [ReplicaStats.from_dict(r) for r in results]
        return sorted(stats, key=lambda s: s.replica_id)

    async def engine_stats(self) -> list[dict[str, Any]]:
        results = await self.replicas.broadcast("engine_stats").results_async(
            timeout_s=CONTROL_TIMEOUT_S)
        return sorted(results, key=lambda r: r["replica_id"])

    async def flush_cache(self) -> bool:
        results = await self.replicas.broadcast("flush_cache").results_async(
            timeout_s=CONTROL_TIMEOUT_S)
        return all(results)

    async def abort(self, rid: str) -> bool:
        results = await self.replicas.broadcast("abort", rid).results_async(
            timeout_s=CONTROL_TIMEOUT_S)
        return any(results)


IngressDeployment = serve.deployment(name="Ingress", max_ongoing_requests=4096)(
    serve.ingress()(Ingress))
