"""The Serve ingress deployment: owns the tokenizer, the metrics and the handle to the engine
replicas, and serves the FastAPI app that router/frontend/api.py builds around it.

Replica traffic is protocol messages only; a replica's stream is read through one
`ReplicaCall` (router/frontend/replica_call.py), which decodes its events. A request's replica is chosen by the routing policy, which
runs as the engine deployment's Serve request router inside this replica's handle
(router/routing/request_router.py); both meet in this process's RoutingState. The ingress keeps that
state honest: every `router_sync_interval_s` it pulls each replica's cached prefixes and load
(`EngineReplica.cache_summary`) and applies them.

In PD mode the ingress holds two engine pools, prefill and decode, each with its own request
router and routing state; a request is served by one replica of each (router/frontend/pd_stream.py).
Every `pd_lease_renew_s` it renews, on the decode replicas, the reservations of its requests
whose prefill is still on its way (`renew_leases`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
from typing import Any

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.handle import DeploymentHandle

from radixserve.router.frontend.config import IngressConfig
from radixserve.router.frontend.metrics import Metrics, RequestTimer
from radixserve.router.frontend.pd_stream import PDStream
from radixserve.router.frontend.proxy import on_process_transport
from radixserve.router.frontend.replica_call import ReplicaCall
from radixserve.router.frontend.tokenizer import Tokenizer
from radixserve.router.frontend.tokenizer_pool import TokenizerPool
from radixserve.router.routing.request_router import state_key
from radixserve.router.routing.routing_state import routing_state
from radixserve.workers.protocol import (
    CacheSummary,
    GenerateRequest,
    ModelCard,
    ReplicaStats,
    attempt_rid,
)

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 30.0
LORA_ASK_INTERVAL_S = 1.0
READ_LORAS_TIMEOUT_S = 5.0
# Token budget of one replica's prefix report (sum of its paths' lengths): enough for pools of
# tens of thousands of tokens whose leaves share long prefixes, small enough to send every few s.
SUMMARY_MAX_TOKENS = 1 << 18
# A replica that died (or whose node did) under a call: that call's errors.
REPLICA_LOST = (ActorDiedError, ActorUnavailableError)
OPEN_ATTEMPTS = 3


# What `Ingress.open` returns: a unified request's call, or a PD request's two.
Stream = ReplicaCall | PDStream


class Ingress:
    # Serve awaits an async constructor; mypy knows only synchronous ones.
    async def __init__(  # type: ignore[misc]
        self, replicas: DeploymentHandle, config: IngressConfig, decode: DeploymentHandle | None = None
    ):
        """`config.policy` is the routing policy that cluster/app.py also gives the engine
        deployment's request router. With `decode` (PD mode), `replicas` is the prefill pool
        and `decode` the decode pool (routed by `config.decode_policy`)."""
        replicas = on_process_transport(replicas)
        decode = None if decode is None else on_process_transport(decode)
        # How this ingress reaches the engine replicas (/get_server_info): "grpc" or "ray" (actor calls).
        self.transport = "ray" if getattr(replicas.handle_options, "_by_reference", True) else "grpc"
        self.replicas = replicas
        self.decode = decode
        self.config = config
        self.http = config.http
        logging.getLogger("radixserve").setLevel(config.http.log_level.upper())
        card = await self.replicas.model_card.remote()
        self.card = ModelCard.from_dict(card)
        self.tokenizer = await asyncio.to_thread(Tokenizer, self.card)
        self.tokenizer_pool = TokenizerPool(config.http.tokenizer_threads)
        self.model_name = self.card.served_model_name
        self.metrics = Metrics(self.model_name)
        key = state_key(replicas.deployment_id.app_name, replicas.deployment_id.name)
        self.routing = routing_state(key, config.policy)
        # Every engine pool with its routing state: the one pool, or prefill and decode.
        self.pools = [(replicas, self.routing)]
        if decode is not None:
            dkey = state_key(decode.deployment_id.app_name, decode.deployment_id.name)
            self.pools.append((decode, routing_state(dkey, config.decode_policy)))
        self._sync_task = asyncio.get_running_loop().create_task(self._sync_forever())
        # PD: requests between their reservation and their first token (pd_stream.py).
        self.held: set[str] = set()
        if decode is not None:
            self._renew_task = asyncio.get_running_loop().create_task(self._renew_forever())
        # LoRA adapters by name -> directory: the start-up ones, then what the replicas report.
        self.loras: dict[str, str] = dict(config.lora_adapters)
        self._loras_asked = 0.0  # when a request for an unknown name last made us ask the replicas
        self.draining = False  # set by `drain`; api.py's Drain then refuses new HTTP requests
        self.in_flight = 0  # HTTP requests being served here (a stream until its last byte)
        # The start-up heap (the tokenizer, FastAPI, Ray's and Serve's state) out of the garbage
        # collector's reach: under load a full collection over its ~300k objects held the GIL for
        # 164 ms, a stall of every stream this process relays (the engine replica freezes its own).
        gc.collect()
        gc.freeze()

    def __serve_build_asgi_app__(self):
        from radixserve.router.frontend.api import build_api

        return build_api(self)

    async def sync_routing(self) -> int:
        """Correct the routing state from every replica's own report; returns how many replicas
        answered. A replica that fails to answer is skipped (if it died, Serve's replica update
        removes it from the state)."""
        applied = 0
        loras: dict[str, str] = {}
        answered = False
        for handle, routing in self.pools:
            point = routing.sync_point()
            budget = SUMMARY_MAX_TOKENS if routing.uses_prefix_tree else 0
            reports = await self._broadcast_to(handle, "cache_summary", budget)
            answered = answered or bool(reports)
            for r in reports:
                summary = CacheSummary.from_dict(r)
                loras.update(summary.stats.lora_adapters)
                # The engine lists most recent first; the tree wants least recent first.
                prefixes = summary.paths[::-1] if budget else None
                lower = summary.lower_paths[::-1] if budget else None
                applied += routing.apply_report(summary.stats, prefixes, point, lower)
        if answered and self.config.lora_enabled:  # the adapters some replica of a pool serves
            self.loras = loras
        return applied

    async def lora(self, name: str) -> str | None:
        """The directory of the adapter served as `name`, None if no replica serves one. A name
        this ingress does not know is asked of the replicas (another ingress may have loaded it),
        at most once a second."""
        if name in self.loras or not self.config.lora_enabled:
            return self.loras.get(name)
        now = asyncio.get_running_loop().time()
        if now - self._loras_asked >= LORA_ASK_INTERVAL_S:
            self._loras_asked = now
            merged: dict[str, str] = {}
            for s in await self.replica_stats(timeout_s=READ_LORAS_TIMEOUT_S):
                merged.update(s.lora_adapters)
            self.loras = merged
        return self.loras.get(name)

    async def load_lora(self, name: str, path: str) -> str | None:
        """Every replica loads the adapter (checking it); None, or the first refusal's reason
        (then no replica keeps it)."""
        refusals = [r for r in await self._broadcast("load_lora_adapter", name, path) if r]
        if refusals:
            await self._broadcast("unload_lora_adapter", name)
            return refusals[0]
        self.loras[name] = path
        return None

    async def unload_lora(self, name: str) -> bool:
        known = self.loras.pop(name, None) is not None
        return any(await self._broadcast("unload_lora_adapter", name)) or known

    async def _sync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sync_interval_s)
            try:
                await self.sync_routing()
            except Exception:  # the next round retries; routing goes on with what it knows
                logger.exception("routing correction failed")

    async def renew_leases(self) -> int:
        """PD: ask every decode replica to renew the reservations of the requests in `held`
        (each renews those it holds); returns how many replicas answered. A replica that does
        not answer renews nothing: two renewals in a row may be lost within a lease."""
        if self.decode is None or not self.held:
            return 0
        timeout = self.config.pd_lease_renew_s
        return len(await self._broadcast_to(self.decode, "renew", sorted(self.held), timeout_s=timeout))

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.pd_lease_renew_s)
            try:
                await self.renew_leases()
            except Exception:  # the next round renews again; a missed one costs nothing yet
                logger.exception("renewing the decode reservations failed")

    def router_snapshot(self) -> dict[str, Any]:
        snap = self.routing.snapshot()
        if self.decode is not None:
            snap["decode"] = self.pools[1][1].snapshot()
        return snap

    async def open(self, req: GenerateRequest) -> Stream:
        """Send `req` to a replica; returns once its first output is there.

        Raises InvalidRequest / QueueFull (as the replica's engine refused it) before any output,
        so the HTTP layer can still answer with a status code.

        A replica lost before its first output (its node went away after Serve chose it: Serve
        does not send a call again once it went out) is not the client's failure, and nothing
        reached the client yet: the request goes out again, and Serve's router, which now skips
        the unreachable replica, places it on another, up to OPEN_ATTEMPTS times in all. Each
        resend goes out under a fresh engine-side id (`attempt_rid`): the earlier attempt's
        cancel may not have reached a replica that still holds it (in PD mode, the decode side's
        reservation), and the two must not meet.
        """
        timer = self.metrics.timer()
        for attempt in range(1, OPEN_ATTEMPTS + 1):
            sent = req if attempt == 1 else dataclasses.replace(req, rid=attempt_rid(req.rid, str(attempt)))
            try:
                if self.decode is not None:
                    return await self._open_pd(sent, timer)
                return await self._open(sent, timer)
            except REPLICA_LOST as e:
                if attempt == OPEN_ATTEMPTS:
                    raise
                logger.warning(
                    "request %s: replica lost before its first output (%s); resending",
                    req.rid,
                    type(e).__name__,
                )
        raise AssertionError("unreachable")

    async def _open(
        self, req: GenerateRequest, timer: RequestTimer, pool: DeploymentHandle | None = None
    ) -> ReplicaCall:
        """`req` served whole by one replica of `pool` (the engine pool by default), whose
        request router applies the routing policy to its prompt (router/routing/request_router.py)."""
        call = ReplicaCall(pool or self.replicas, "generate", req, timer=timer)
        await call.admit()
        return call

    async def _open_pd(self, req: GenerateRequest, timer: RequestTimer) -> Stream:
        """A PD request: prefilled in the prefill pool, its KV moved to a decode replica; or, when
        its prompt is at most `pd_local_prefill_tokens` long, served whole by a decode replica
        (a short prefill costs its decode batch less than the round trip and the transfer cost
        the request). A request for no new tokens has nothing to decode: a prefill replica serves
        it whole (and keeps its prompt in its cache), as a unified replica would."""
        assert self.decode is not None
        if req.sampling_params.max_new_tokens == 0:
            return await self._open(req, timer, self.replicas)
        if len(req.input_ids) <= self.config.pd_local_prefill_tokens:
            return await self._open(req, timer, self.decode)
        stream = PDStream(
            req,
            self.replicas,
            self.decode,
            timer,
            self.config.pd_on_failure,
            self.config.pd_reserve_wait_s,
            self.pools[1][1],
            self.held,
        )
        await stream.open()
        return stream

    async def _broadcast(self, method: str, *args: Any, timeout_s: float = CONTROL_TIMEOUT_S) -> list[Any]:
        """`method` on every replica of every pool; the answers of those that answered (one that
        just died is left out, not an error: Serve replaces it)."""
        out: list[Any] = []
        for handle, _ in self.pools:
            out += await self._broadcast_to(handle, method, *args, timeout_s=timeout_s)
        return out

    async def _broadcast_to(
        self, handle: DeploymentHandle, method: str, *args: Any, timeout_s: float = CONTROL_TIMEOUT_S
    ) -> list[Any]:
        results = await handle.broadcast(method, *args).results_async(
            timeout_s=timeout_s, return_exceptions=True
        )
        return [r for r in results if not isinstance(r, BaseException)]

    async def replica_stats(self, timeout_s: float = CONTROL_TIMEOUT_S) -> list[ReplicaStats]:
        stats = [ReplicaStats.from_dict(r) for r in await self._broadcast("stats", timeout_s=timeout_s)]
        return sorted(stats, key=lambda s: s.replica_id)

    async def engine_stats(self) -> list[dict[str, Any]]:
        return sorted(await self._broadcast("engine_stats"), key=lambda r: r["replica_id"])

    async def flush_cache(self) -> bool:
        results = await self._broadcast("flush_cache")
        flushed = bool(results) and all(results)
        if flushed:  # the tree must not send prefixes after caches that are gone
            await self.sync_routing()
        return flushed

    async def abort(self, rid: str) -> bool:
        return any(await self._broadcast("abort", rid))

    async def drain(self) -> int:
        """Stop taking requests: from now on this replica answers new HTTP requests with 503
        `shutting_down`. Returns how many it still serves; once that is 0 it stays 0.
        `radixserve serve` calls it on every ingress replica before it stops the application."""
        self.draining = True
        return self.in_flight


# Replica count, CPUs and requests in flight are set by cluster/app.py.
IngressDeployment = serve.deployment(name="Ingress")(serve.ingress()(Ingress))
