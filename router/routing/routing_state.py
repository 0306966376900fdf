"""RoutingState: one ingress process's view of one engine deployment, for choosing replicas.

It joins three sources that live on different threads of the ingress process:
- Serve's request router (router/routing/request_router.py, on Serve's router event loop) asks it to
  choose, tells it where requests went and when they finished, and which replicas exist;
- the ingress's correction loop (router/frontend/ingress.py) feeds it the replicas' own reports: their
  cached prefixes (which correct the prefix tree) and their load and pool size;
- /metrics and /get_server_info read its snapshot.

The policy serializes its own state with its lock; this class guards its small tables with one
more. Plain Python, no Ray: unit-testable.

States are shared per process and deployment (`routing_state(key, config)`), because Serve
builds the request router inside the handle, out of the ingress's reach: both sides meet here.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from radixserve.router.routing.policy import (
    Decision,
    PolicyConfig,
    ReplicaLoad,
    RoutingPolicy,
    policy_from_config,
)
from radixserve.router.routing.prefix_tree import Namespace
from radixserve.workers.protocol import ReplicaStats

REPORT_TTL_S = 30.0  # a replica's load report older than this no longer counts
PROVISIONAL_TTL_S = 60.0  # a routed request its replica never accepted stops counting


class RoutingState:
    def __init__(
        self,
        config: PolicyConfig,
        report_ttl_s: float = REPORT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.instance_id = uuid.uuid4().hex[:12]  # tells apart the ingresses' views of a deployment
        self.policy: RoutingPolicy = policy_from_config(config)
        self.report_ttl_s = report_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._replicas: set[str] = set()
        self._reports: dict[str, tuple[float, ReplicaStats]] = {}
        # request id -> (replica, namespace, prompt)
        self._live: dict[str, tuple[str, Namespace, list[int]]] = {}
        self._provisional: dict[str, float] = {}  # routed, not yet accepted: id -> when
        self._last_expiry = clock()
        self._removed_total = 0
        self._summaries_total = 0

    @property
    def uses_prefix_tree(self) -> bool:
        return self.config.policy == "cache_aware"

    # ---- replica set (from Serve's request router) ----------------------------------------

    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        """The replicas Serve routes to now; any other replica is forgotten."""
        new = set(replica_ids)
        with self._lock:
            gone = self._replicas - new
            self._replicas = new
        for replica_id in gone:
            self._forget(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        """A replica died (Serve saw its actor fail) or was scaled away."""
        with self._lock:
            known = replica_id in self._replicas
            self._replicas.discard(replica_id)
        if known:
            self._forget(replica_id)

    def replicas(self) -> list[str]:
        with self._lock:
            return sorted(self._replicas)

    def _forget(self, replica_id: str) -> None:
        with self._lock:
            self._reports.pop(replica_id, None)
            self._live = {k: v for k, v in self._live.items() if v[0] != replica_id}
            self._provisional = {k: t for k, t in self._provisional.items() if k in self._live}
            self._removed_total += 1
        self.policy.on_replica_removed(replica_id)

    # ---- per request ------------------------------------------------------------------------

    def loads(self, replica_ids: Sequence[str]) -> list[ReplicaLoad]:
        """Candidates with this process's in-flight counts and the replicas' fresh reports."""
        now = self._clock()
        with self._lock:
            reports = {r: s for r, (t, s) in self._reports.items() if now - t <= self.report_ttl_s}
        return self.policy.loads(replica_ids, reports)

    def choose(
        self, token_ids: Sequence[int], replica_ids: Sequence[str], namespace: Namespace = None
    ) -> Decision:
        """Decide without recording anything (a request that will not be tracked)."""
        return self.policy.choose(token_ids, self.loads(replica_ids), namespace)

    def route(
        self,
        request_id: str,
        token_ids: Sequence[int],
        replica_ids: Sequence[str],
        namespace: Namespace = None,
    ) -> Decision:
        """Decide and record the dispatch at once, so that the next request (a burst of equal
        prefixes) already sees this one, before the replica has even accepted it. The record is
        provisional until `on_dispatch` confirms or moves it; unconfirmed ones expire after
        PROVISIONAL_TTL_S (the request was cancelled while Serve was still placing it). Deciding
        again for the same request (Serve retries) replaces the earlier record."""
        self._expire_provisional()
        self._cancel(request_id)
        decision = self.policy.route(token_ids, self.loads(replica_ids), namespace)
        with self._lock:
            self._live[request_id] = (decision.replica_id, namespace, list(token_ids))
            self._provisional[request_id] = self._clock()
        return decision

    def on_dispatch(
        self, request_id: str, token_ids: Sequence[int], replica_id: str, namespace: Namespace = None
    ) -> None:
        """Request `request_id` was accepted by `replica_id`: confirms `route`'s record, or
        moves it there (Serve placed it elsewhere, e.g. the chosen replica was full)."""
        with self._lock:
            self._provisional.pop(request_id, None)
            live = self._live.get(request_id)
            if live is not None and live[0] == replica_id:
                return
        self._cancel(request_id)
        with self._lock:
            if replica_id not in self._replicas:  # a late dispatch must not resurrect a replica
                return
            self._live[request_id] = (replica_id, namespace, list(token_ids))
        self.policy.on_dispatch(token_ids, replica_id, namespace)

    def on_complete(self, request_id: str, replica_id: str) -> None:
        """Request `request_id` ended on `replica_id` (finished, failed or cancelled). Ends of
        attempts the replica refused (the request then went elsewhere) are ignored."""
        with self._lock:
            live = self._live.get(request_id)
            if live is None or live[0] != replica_id:
                return
            del self._live[request_id]
            self._provisional.pop(request_id, None)
        self.policy.on_complete(replica_id, live[2], namespace=live[1])

    def _cancel(self, request_id: str) -> None:
        with self._lock:
            live = self._live.pop(request_id, None)
            self._provisional.pop(request_id, None)
        if live is not None:
            self.policy.on_cancel(live[0], live[2])

    def _expire_provisional(self) -> None:
        now = self._clock()
        with self._lock:
            if now - self._last_expiry < PROVISIONAL_TTL_S / 4:
                return
            self._last_expiry = now
            stale = [r for r, t in self._provisional.items() if now - t > PROVISIONAL_TTL_S]
        for request_id in stale:
            self._cancel(request_id)

    # ---- corrections (from the ingress's loop) ------------------------------------------------

    def sync_point(self) -> int:
        """Read before asking the replicas for reports; pass back to `apply_report`."""
        return self.policy.sync_point()

    def apply_report(
        self,
        stats: ReplicaStats,
        prefixes: Sequence[tuple[Namespace, Sequence[int]]] | None,
        sync_point: int,
        lower: Sequence[tuple[Namespace, Sequence[int]]] | None = None,
    ) -> bool:
        """One replica's report: its load and pool size, and (when given) its cached prefixes as
        (namespace, tokens) pairs, least recently used first (`lower`: those that end in its host
        or disk tier). The prompts still running there count as its newest
        prefixes: the report may predate their insertion, and the replica will cache them.
        Reports of replicas Serve no longer routes to are dropped (returns False), so a report
        racing a removal cannot bring a dead replica back."""
        replica_id = stats.replica_id
        with self._lock:
            if replica_id not in self._replicas:
                return False
            self._reports[replica_id] = (self._clock(), stats)
            live = [(ns, t) for r, ns, t in self._live.values() if r == replica_id]
            if prefixes is not None:
                self._summaries_total += 1
        if stats.kv_total:
            self.policy.set_replica_capacity(replica_id, stats.kv_total)
        if prefixes is not None:
            self.policy.on_replica_summary(
                replica_id, [*prefixes, *live], keep_newer_than=sync_point, lower=lower
            )
        return True

    def snapshot(self) -> dict[str, Any]:
        snap = self.policy.snapshot()
        snap["instance_id"] = self.instance_id
        with self._lock:
            snap["replicas"] = sorted(self._replicas)
            snap["replicas_removed_total"] = self._removed_total
            snap["summaries_applied_total"] = self._summaries_total
        snap["config"] = {
            k: getattr(self.config, k)
            for k in (
                "cache_threshold",
                "min_match_tokens",
                "load_cost_tokens",
                "balance_abs_threshold",
                "balance_rel_threshold",
            )
        }
        return snap


_STATES: dict[str, RoutingState] = {}
_STATES_LOCK = threading.Lock()


def routing_state(key: str, config: PolicyConfig) -> RoutingState:
    """This process's state for deployment `key` ("app/deployment"); the first caller's config
    wins (the request router and the ingress build theirs from the same server arguments)."""
    with _STATES_LOCK:
        state = _STATES.get(key)
        if state is None:
            state = _STATES[key] = RoutingState(config)
        return state
