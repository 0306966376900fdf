"""Prometheus metrics at /metrics: latency histograms the ingress observes per request,
counters / gauges read from every replica's `ReplicaStats` at scrape time (labels `replica` and
`role`), and the routing policy's counters (`radixserve:router_*`, this ingress replica's view).

Counters are the replicas' own monotonic totals, so `rate(radixserve:cached_tokens_total[1m]) /
rate(radixserve:prompt_tokens_total[1m])` is the cache hit rate, per replica or summed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from radixserve.workers.protocol import ReplicaStats

PREFIX = "radixserve:"
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
)

# (metric name without prefix/suffix, ReplicaStats field, help)
COUNTERS = (
    ("prompt_tokens", "prompt_tokens_total", "Prompt tokens of finished requests"),
    ("generation_tokens", "generation_tokens_total", "Generated tokens"),
    ("cached_tokens", "cached_tokens_total", "Prompt tokens served from the radix cache"),
    ("computed_tokens", "computed_tokens_total", "Prompt tokens prefilled (not cached)"),
    ("num_requests", "num_requests_total", "Finished requests"),
    ("num_aborted_requests", "num_aborted_total", "Aborted requests"),
    ("kv_transfer_sent_bytes", "pd_bytes_sent_total", "PD: K/V bytes sent to decode replicas"),
    ("kv_transfer_received_bytes", "pd_bytes_received_total", "PD: K/V bytes received from prefill replicas"),
    (
        "kv_transfer_saved_bytes",
        "pd_bytes_saved_total",
        "PD: K/V bytes not moved (the decode side held them)",
    ),
    ("cache_device_to_host_tokens", "tier_device_to_host_tokens", "Tiers: tokens evicted to host memory"),
    ("cache_host_to_disk_tokens", "tier_host_to_disk_tokens", "Tiers: tokens spilled from host to disk"),
    ("cache_tier_dropped_tokens", "tier_dropped_tokens", "Tiers: cached tokens that fell out of every tier"),
    ("cache_host_loaded_tokens", "tier_host_loaded_tokens", "Tiers: tokens loaded back from host memory"),
    ("cache_disk_loaded_tokens", "tier_disk_loaded_tokens", "Tiers: tokens loaded back from disk"),
    (
        "cache_disk_prefetched_tokens",
        "tier_disk_prefetched_tokens",
        "Tiers: tokens read from disk into host memory off the engine thread",
    ),
    ("cache_host_load_seconds", "tier_host_load_seconds", "Tiers: time spent loading from host memory"),
    ("cache_disk_load_seconds", "tier_disk_load_seconds", "Tiers: time spent loading from disk"),
    (
        "cache_disk_load_failures",
        "tier_disk_load_failures",
        "Tiers: disk files that failed their check (recomputed)",
    ),
    ("engine_steps", "step_steps", "Engine steps (forwards) run"),
    ("engine_step_schedule_seconds", "step_schedule_s", "Engine thread: scheduling and building tensors"),
    ("engine_step_forward_seconds", "step_forward_s", "Engine thread: the model's forwards"),
    ("engine_step_sample_seconds", "step_sample_s", "Engine thread: sampling"),
    ("engine_step_text_seconds", "step_text_s", "Engine thread: detokenizing and building chunks"),
)


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens", ITL_BUCKETS)
        self.e2e = hist(
            "e2e_request_latency_seconds", "Request latency, receipt to last token", LATENCY_BUCKETS
        )
        self.queue = hist(
            "queue_time_seconds", "Receipt at the ingress to admission by an engine replica", LATENCY_BUCKETS
        )
        self._replicas: list[ReplicaStats] = []
        self._router: dict[str, Any] = {}
        self.registry.register(_ReplicaCollector(self))
        self.registry.register(_RouterCollector(self))

    def set_replicas(self, stats: list[ReplicaStats]) -> None:
        self._replicas = sorted(stats, key=lambda s: s.replica_id)

    def set_router(self, snapshot: dict[str, Any]) -> None:
        """The routing state's snapshot (RoutingState.snapshot)."""
        self._router = snapshot

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Latencies of one request, observed as its chunks arrive at the ingress."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last_token: float | None = None
        self.labels = {"model_name": metrics.model_name}

    def admitted(self) -> None:
        self.metrics.queue.labels(**self.labels).observe(time.perf_counter() - self.start)

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        t = time.perf_counter()
        prev = self.last_token
        if prev is None:
            self.metrics.ttft.labels(**self.labels).observe(t - self.start)
            prev, count = t, count - 1  # the first token has no predecessor
        for _ in range(count):  # a chunk of k tokens after a gap g: k gaps of g / k
            self.metrics.itl.labels(**self.labels).observe((t - prev) / count)
        self.last_token = t

    def finished(self) -> None:
        self.metrics.e2e.labels(**self.labels).observe(time.perf_counter() - self.start)


class _ReplicaCollector:
    """Renders the latest replica snapshots (set just before each scrape)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        # role: unified, or prefill / decode in PD mode (a pool's figures are its replicas' sum).
        labels = ["model_name", "replica", "role"]
        stats = self.metrics._replicas
        for name, attr, doc in COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for s in stats:
                c.add_metric([self.metrics.model_name, s.replica_id, s.role], getattr(s, attr))
            yield c
        gauges = (
            ("num_running_reqs", "Requests in the running batch", lambda s: s.running),
            ("num_queue_reqs", "Requests waiting to be scheduled", lambda s: s.queued),
            (
                "token_usage",
                "Share of KV slots held by live requests or locked prefixes",
                lambda s: (s.kv_total - s.kv_free - s.kv_evictable) / s.kv_total if s.kv_total else 0.0,
            ),
            ("cache_evictable_tokens", "Cached tokens that can be evicted", lambda s: s.kv_evictable),
            (
                "cache_protected_tokens",
                "Cached tokens locked by running requests (not evictable)",
                lambda s: s.kv_protected,
            ),
            ("kv_free_tokens", "KV slots free right now (evictable ones not counted)", lambda s: s.kv_free),
            ("kv_total_tokens", "KV pool size in tokens", lambda s: s.kv_total),
            (
                "cache_host_tokens",
                "Tiers: cached tokens whose KV is in host memory",
                lambda s: s.kv_host_cached_tokens,
            ),
            ("cache_host_capacity_tokens", "Tiers: host tier size in tokens", lambda s: s.kv_host_total),
            (
                "cache_disk_tokens",
                "Tiers: cached tokens whose KV is on disk",
                lambda s: s.kv_disk_cached_tokens,
            ),
            (
                "cache_disk_used_bytes",
                "Tiers: bytes of the disk tier's files",
                lambda s: s.kv_disk_used_bytes,
            ),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for s in stats:
                g.add_metric([self.metrics.model_name, s.replica_id, s.role], value(s))
            yield g


# (metric name without prefix/suffix, snapshot key, help)
ROUTER_COUNTERS = (
    ("router_requests", "requests_total", "Generate requests the routing policy placed"),
    (
        "router_prefix_hits",
        "prefix_hits",
        "Requests sent to the replica with the longest cached prefix (match rate over threshold)",
    ),
    (
        "router_prefix_misses",
        "prefix_misses",
        "Requests whose best prefix match was under the threshold (sent to the least loaded)",
    ),
    (
        "router_imbalance_fallbacks",
        "imbalance_fallbacks",
        "Requests sent among the least loaded replicas because the load was imbalanced",
    ),
    (
        "router_matched_tokens",
        "matched_tokens_total",
        "Prompt tokens the prefix tree expected the chosen replica to hold",
    ),
    (
        "router_replicas_removed",
        "replicas_removed_total",
        "Replicas removed from the policy (died or scaled away)",
    ),
)


class _RouterCollector:
    """Renders the routing state's latest snapshot (set just before each scrape)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        snap = self.metrics._router
        if not snap:
            return
        model = self.metrics.model_name
        labels = ["model_name", "policy"]
        key = [model, snap["policy"]]
        for name, field, doc in ROUTER_COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(key, snap[field])
            yield c
        for name, field, doc in (
            ("router_tree_tokens", "tree_tokens", "Tokens in the prefix tree"),
            ("router_tree_nodes", "tree_nodes", "Nodes in the prefix tree"),
        ):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(key, snap[field])
            yield g
        per_replica = (
            ("router_in_flight_requests", "in_flight", "Requests this ingress has in flight"),
            (
                "router_tree_replica_tokens",
                "tree_tokens_by_replica",
                "Tokens the prefix tree believes the replica caches",
            ),
        )
        for name, field, doc in per_replica:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "replica"])
            for replica in snap["replicas"]:
                g.add_metric([model, replica], snap[field].get(replica, 0))
            yield g
