"""Routing policies: which replica serves a request. Plain classes, no Ray.

The ingress calls, per request (all methods are thread-safe; each takes the policy's lock once):

    decision = policy.route(token_ids, policy.loads(replica_ids, reports), namespace)
    ... send to decision.replica_id ...
    policy.on_complete(decision.replica_id, token_ids, output_ids, namespace)

`namespace` is the request's cache namespace (its tenant; None: the shared one). Prefixes are
matched and recorded per namespace, as the replicas cache them: one tenant's prompts never
attract another tenant's requests.

`choose` alone decides without recording (for a caller that may still fail to dispatch);
`on_dispatch` then records the request. Replicas' own reports correct the prefix tree through
`on_replica_events` / `on_replica_summary`; a dead or scaled-away replica is dropped with
`on_replica_removed`. `snapshot()` returns the counters for metrics.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.router.routing.prefix_tree import DEFAULT_MAX_TOKENS, Namespace, PrefixTree
from radixserve.workers.protocol import LoRARef

POLICY_NAMES = ("cache_aware", "kv_aware", "round_robin", "power_of_two", "random")


@dataclass(frozen=True)
class PolicyConfig:
    """Router policy knobs: the one home of their defaults (the server's RouterConfig derives
    its own from these). cache_threshold and the balance thresholds follow SGLang's router
    (sgl-router RouterArgs); min_match_tokens and load_cost_tokens are CacheAwarePolicy's
    guards against affinity that does not pay (see there). Chat templates put 20 to 40 equal
    tokens (role headers, a default system line; SmolLM2's: 24) in front of unrelated prompts:
    min_match_tokens = 64 leaves them out with a margin. load_cost_tokens = 64 prices a request
    of extra load like one such minimal match: a 300-token prefix keeps its replica while that
    replica carries at most 4 requests more than the least loaded one; past that, the prefix
    is computed once more on another replica rather than queued behind the others."""

    policy: str = "cache_aware"
    cache_threshold: float = 0.3  # match rate (matched / prompt length) that earns affinity ...
    min_match_tokens: int = 64  # ... for a match at least this long
    load_cost_tokens: int = 64  # matched tokens that pay for one request of extra load
    balance_abs_threshold: int = 64  # imbalanced if max_load - min_load > this ...
    balance_rel_threshold: float = 1.5  # ... and max_load > min_load * this
    max_tree_tokens: int = DEFAULT_MAX_TOKENS  # token ids stored in the prefix tree, all replicas
    max_tokens_per_replica: int | None = None  # None: only the total bound applies
    # A prefix a replica holds in its host or disk cache tier is worth this share of one on its
    # device (it is copied back, not recomputed, but the copy and the device room cost).
    lower_tier_weight: float = 0.5
    # A replica with the request's LoRA adapter in memory is preferred, on a cache miss, over one
    # without it while it carries at most this many requests more (the other would read the
    # adapter first, and take a batch slot from its own adapters).
    lora_affinity_load: int = 2
    seed: int | None = None  # for power_of_two / random

    def __post_init__(self):
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown router policy {self.policy!r}; choose from {POLICY_NAMES}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be within [0, 1]")
        if self.min_match_tokens < 0 or self.load_cost_tokens < 0:
            raise ValueError("min_match_tokens and load_cost_tokens must be >= 0")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if not 0.0 <= self.lower_tier_weight <= 1.0:
            raise ValueError("lower_tier_weight must be within [0, 1]")
        if self.lora_affinity_load < 0:
            raise ValueError("lora_affinity_load must be >= 0")
        if self.max_tree_tokens <= 0:
            raise ValueError("max_tree_tokens must be positive")


@dataclass(frozen=True)
class ReplicaLoad:
    """One candidate replica as the policy sees it when choosing.

    `in_flight` counts this ingress's requests sent and not finished (exact, but blind to other
    ingresses); `running` + `queued` are what the replica last reported (all ingresses, but
    stale). The load is the larger of the two views.
    """

    replica_id: str
    in_flight: int = 0
    running: int = 0
    queued: int = 0
    # KV slots the replica could give a new request (free + evictable) as of its last report;
    # None without a report.
    kv_room: int | None = None
    # The LoRA adapters the replica holds in memory, as of its last report.
    adapters: frozenset[str] = frozenset()

    @property
    def load(self) -> int:
        return max(self.in_flight, self.running + self.queued)


def _kv_room(report: Any) -> int | None:
    if not getattr(report, "kv_total", 0):  # no report, or one without a KV pool's figures
        return None
    return report.kv_free + report.kv_evictable


@dataclass(frozen=True)
class Decision:
    replica_id: str
    matched_tokens: int  # the prefix the tree believes this replica holds (0 if no tree)
    reason: str  # cache_hit | cache_miss | imbalance | kv_room | round_robin | power_of_two | random


class NoReplicaAvailable(RuntimeError):
    pass


class RoutingPolicy:
    """Shared bookkeeping: in-flight counts, counters, the lock. Subclasses implement `_choose`."""

    name = "base"

    def __init__(self, config: PolicyConfig | None = None):
        self.config = config or PolicyConfig(policy=self.name)
        self._lock = threading.Lock()
        self._rng = random.Random(self.config.seed)
        self._in_flight: dict[str, int] = {}
        self._in_flight_tokens: dict[str, int] = {}
        self._counters = dict.fromkeys(
            ("requests_total", "prefix_hits", "prefix_misses", "imbalance_fallbacks", "matched_tokens_total"),
            0,
        )

    # ---- per request ----------------------------------------------------------------------

    def loads(
        self, replica_ids: Iterable[str], reports: Mapping[str, Any] | None = None
    ) -> list[ReplicaLoad]:
        """Build the candidates from this policy's in-flight counts and optional replica
        reports (objects with `running` and `queued`, e.g. workers.protocol.ReplicaStats)."""
        reports = reports or {}
        with self._lock:
            return [self._load_of(r, reports.get(r)) for r in replica_ids]

    def choose(
        self, token_ids: Sequence[int], replicas: Sequence[ReplicaLoad], namespace: Namespace = None
    ) -> Decision:
        """Pick a replica for a prompt; records nothing but the decision counters."""
        with self._lock:
            return self._decide(token_ids, replicas, namespace)

    def on_dispatch(self, token_ids: Sequence[int], replica_id: str, namespace: Namespace = None) -> None:
        """The request was sent: count it in flight and record its prefix for that replica."""
        with self._lock:
            self._dispatch(token_ids, replica_id, namespace)

    def route(
        self, token_ids: Sequence[int], replicas: Sequence[ReplicaLoad], namespace: Namespace = None
    ) -> Decision:
        """`choose` then `on_dispatch` atomically (concurrent equal prompts see each other)."""
        with self._lock:
            decision = self._decide(token_ids, replicas, namespace)
            self._dispatch(token_ids, decision.replica_id, namespace)
            return decision

    def on_complete(
        self,
        replica_id: str,
        token_ids: Sequence[int] | None = None,
        output_ids: Sequence[int] = (),
        namespace: Namespace = None,
    ) -> None:
        """The request finished (or was aborted). Given the prompt, the replica's cache now holds
        prompt + output (the engine inserts finished sequences), which is recorded and touched.
        Completions from a replica already removed are ignored."""
        with self._lock:
            if replica_id not in self._in_flight:
                return
            self._in_flight[replica_id] = max(0, self._in_flight[replica_id] - 1)
            if token_ids is not None:
                left = self._in_flight_tokens[replica_id] - len(token_ids)
                self._in_flight_tokens[replica_id] = max(0, left)
                self._record([*token_ids, *output_ids], replica_id, namespace)

    def on_cancel(self, replica_id: str, token_ids: Sequence[int]) -> None:
        """Undo a dispatch that never reached the replica (it went elsewhere, or nowhere): only
        the in-flight counts; the tree keeps the claim until the replica's next summary."""
        with self._lock:
            if replica_id not in self._in_flight:
                return
            self._in_flight[replica_id] = max(0, self._in_flight[replica_id] - 1)
            left = self._in_flight_tokens[replica_id] - len(token_ids)
            self._in_flight_tokens[replica_id] = max(0, left)

    # ---- replica lifecycle and corrections ------------------------------------------------

    def on_replica_removed(self, replica_id: str) -> None:
        with self._lock:
            self._in_flight.pop(replica_id, None)
            self._in_flight_tokens.pop(replica_id, None)
            self._forget(replica_id)

    def on_replica_events(self, replica_id, inserted=(), evicted=(), namespace=None) -> None:
        """A replica's cache changes in one namespace; see PrefixTree.apply_replica_events."""

    def on_replica_summary(self, replica_id, summary, keep_newer_than=None, lower=None) -> None:
        """A replica's full cache report, (namespace, tokens) pairs; see PrefixTree.sync_replica.
        `lower`: the prefixes it holds in its host or disk tier (None: not reported)."""

    def sync_point(self) -> int:
        """Read before asking a replica for its summary; pass back as `keep_newer_than`."""
        return 0

    def set_replica_capacity(self, replica_id: str, tokens: int | None) -> None:
        """Bound what the tree believes one replica holds (e.g. its KV pool size)."""

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "policy": self.name,
                **self._counters,
                **self._tree_stats(),
                "in_flight": dict(self._in_flight),
                "in_flight_tokens": dict(self._in_flight_tokens),
            }

    # ---- internals (called with the lock held) --------------------------------------------

    def _load_of(self, replica_id: str, report: Any) -> ReplicaLoad:
        return ReplicaLoad(
            replica_id,
            in_flight=self._in_flight.get(replica_id, 0),
            running=getattr(report, "running", 0),
            queued=getattr(report, "queued", 0),
            kv_room=_kv_room(report),
            adapters=frozenset(getattr(report, "lora_loaded", ())),
        )

    def _decide(
        self, token_ids: Sequence[int], replicas: Sequence[ReplicaLoad], namespace: Namespace
    ) -> Decision:
        if not replicas:
            raise NoReplicaAvailable("no replica is available to serve the request")
        decision = self._choose(token_ids, replicas, namespace)
        self._counters["requests_total"] += 1
        self._counters["matched_tokens_total"] += decision.matched_tokens
        counter = {
            "cache_hit": "prefix_hits",
            "cache_miss": "prefix_misses",
            "imbalance": "imbalance_fallbacks",
        }.get(decision.reason)
        if counter:
            self._counters[counter] += 1
        return decision

    def _dispatch(self, token_ids: Sequence[int], replica_id: str, namespace: Namespace) -> None:
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1
        tokens = self._in_flight_tokens.get(replica_id, 0) + len(token_ids)
        self._in_flight_tokens[replica_id] = tokens
        self._record(token_ids, replica_id, namespace)

    def _choose(
        self, token_ids: Sequence[int], replicas: Sequence[ReplicaLoad], namespace: Namespace
    ) -> Decision:
        raise NotImplementedError

    def _record(self, token_ids: Sequence[int], replica_id: str, namespace: Namespace) -> None:
        """Learn that the replica will cache these tokens (policies without a tree ignore it)."""

    def _forget(self, replica_id: str) -> None:
        pass

    def _tree_stats(self) -> dict[str, Any]:
        return {"tree_tokens": 0, "tree_nodes": 0, "tree_tokens_by_replica": {}}


class RoundRobinPolicy(RoutingPolicy):
    """Candidates in the order given, one after another."""

    name = "round_robin"

    def __init__(self, config: PolicyConfig | None = None):
        super().__init__(config)
        self._next = 0

    def _choose(self, token_ids, replicas, namespace) -> Decision:
        chosen = replicas[self._next % len(replicas)]
        self._next += 1
        return Decision(chosen.replica_id, 0, self.name)


class PowerOfTwoPolicy(RoutingPolicy):
    """Two distinct random candidates; the less loaded wins (the first drawn on a tie)."""

    name = "power_of_two"

    def _choose(self, token_ids, replicas, namespace) -> Decision:
        if len(replicas) == 1:
            return Decision(replicas[0].replica_id, 0, self.name)
        first, second = self._rng.sample(list(replicas), 2)
        chosen = second if second.load < first.load else first
        return Decision(chosen.replica_id, 0, self.name)


class RandomPolicy(RoutingPolicy):
    name = "random"

    def _choose(self, token_ids, replicas, namespace) -> Decision:
        return Decision(self._rng.choice(list(replicas)).replica_id, 0, self.name)


class CacheAwarePolicy(RoutingPolicy):
    """SGLang's cache-aware policy over a token-id prefix tree, decided per request, with two
    guards against affinity that does not pay.

    Terms: load(r) is ReplicaLoad.load and `low` the lowest load among the candidates; match(r)
    is r's longest claimed prefix of the prompt in the request's namespace. A match *counts* when
    match >= min_match_tokens and match / prompt length > cache_threshold: the few dozen tokens a
    chat template puts in front of every prompt are not worth a replica's queue.

    1. Imbalanced (max_load - min_load > abs AND max_load > min_load * rel): among the replicas
       at `low`, the longest match; ties to the fewest claimed tokens, then the lowest id.
    2. Else the cache hit h: among replicas whose match counts, the highest
       match(h) - load_cost_tokens * load(h); ties to the lower load, then the lowest id. It wins
       iff match(h) >= load_cost_tokens * (load(h) - low): every request it carries beyond the
       least loaded replica must be paid for by load_cost_tokens matched tokens. (No other
       counting match can pass when h fails; load_cost_tokens = 0 is SGLang's rule.)
    3. Else the least loaded; ties to the fewest claimed tokens (spreads new prefixes), then
       the lowest id.
    """

    name = "cache_aware"

    def __init__(self, config: PolicyConfig | None = None):
        super().__init__(config)
        self._tree = PrefixTree(self.config.max_tree_tokens, self.config.max_tokens_per_replica)
        # What replicas hold in their lower cache tiers, from their reports only (a routed
        # request is computed on the device: it is recorded in `_tree`).
        self._lower = PrefixTree(self.config.max_tree_tokens)

    def _matches(self, token_ids, namespace) -> dict[str, int]:
        """Per replica, its device match plus lower_tier_weight of what its lower tiers hold
        beyond it: a host or disk hit counts below a device hit and above a miss."""
        matched = self._tree.match(token_ids, namespace)
        if self._lower.num_nodes:
            weight = self.config.lower_tier_weight
            for replica, n in self._lower.match(token_ids, namespace).items():
                extra = n - matched.get(replica, 0)
                if extra > 0:
                    matched[replica] = matched.get(replica, 0) + int(weight * extra)
        return matched

    def _choose(self, token_ids, replicas, namespace) -> Decision:
        matched = self._matches(token_ids, namespace)
        loads = [r.load for r in replicas]
        low, high = min(loads), max(loads)
        cfg = self.config
        cost = cfg.load_cost_tokens

        def match_of(r: ReplicaLoad) -> int:
            return matched.get(r.replica_id, 0)

        def claimed(r: ReplicaLoad) -> int:
            return self._tree.replica_tokens(r.replica_id)

        def counts(r: ReplicaLoad) -> bool:
            m = match_of(r)
            return m > 0 and m >= cfg.min_match_tokens and m / len(token_ids) > cfg.cache_threshold

        if high - low > cfg.balance_abs_threshold and high > low * cfg.balance_rel_threshold:
            pool = [r for r in replicas if r.load == low]
            best = min(pool, key=lambda r: (-match_of(r), claimed(r), r.replica_id))
            return Decision(best.replica_id, match_of(best), "imbalance")
        hits = [r for r in replicas if counts(r)]
        if hits:
            h = min(hits, key=lambda r: (cost * r.load - match_of(r), r.load, r.replica_id))
            if match_of(h) >= cost * (h.load - low):
                return Decision(h.replica_id, match_of(h), "cache_hit")
        adapter = LoRARef.name_in(namespace)

        def held(r: ReplicaLoad) -> int:
            return cfg.lora_affinity_load if adapter is not None and adapter in r.adapters else 0

        best = min(replicas, key=lambda r: (r.load - held(r), self._spread_key(r, claimed(r)), r.replica_id))
        return Decision(best.replica_id, match_of(best), "cache_miss")

    def _spread_key(self, r: ReplicaLoad, claimed: int) -> Any:
        """Among equally loaded replicas on a miss: the one claiming fewest tokens (it spreads
        new prefixes)."""
        return claimed

    def _record(self, token_ids, replica_id, namespace) -> None:
        self._tree.insert(token_ids, replica_id, namespace)

    def _forget(self, replica_id) -> None:
        self._tree.remove_replica(replica_id)
        self._lower.remove_replica(replica_id)

    def on_replica_events(self, replica_id, inserted=(), evicted=(), namespace=None) -> None:
        with self._lock:
            self._tree.apply_replica_events(replica_id, inserted, evicted, namespace)

    def on_replica_summary(self, replica_id, summary, keep_newer_than=None, lower=None) -> None:
        with self._lock:
            self._tree.sync_replica(replica_id, summary, keep_newer_than)
            if lower is not None:
                self._lower.sync_replica(replica_id, lower)

    def sync_point(self) -> int:
        with self._lock:
            return self._tree.clock

    def set_replica_capacity(self, replica_id, tokens) -> None:
        with self._lock:
            self._tree.set_replica_budget(replica_id, tokens)

    def _tree_stats(self) -> dict[str, Any]:
        return {
            "tree_tokens": self._tree.total_tokens,
            "tree_nodes": self._tree.num_nodes,
            "tree_tokens_by_replica": {r: self._tree.replica_tokens(r) for r in self._tree.replicas()},
            "lower_tree_tokens": self._lower.total_tokens,
        }


class KVAwarePolicy(CacheAwarePolicy):
    """The decode pool's policy in PD mode. A decode replica holds a request's KV from its
    reservation to its last token, so room comes first: replicas whose last report shows fewer
    free + evictable KV slots than the request needs there (its prompt, less the prefix the
    replica already holds) are left out while another has room; if none has, the one with the
    most room (it may free more by the time the KV arrives). Among the rest, the cache-aware
    choice: a follow-up turn goes to the decode replica that holds its conversation, so the
    transfer moves only the new pages, and the load guards spread everything else; equally
    loaded replicas on a miss go to the one with more room."""

    name = "kv_aware"

    def _choose(self, token_ids, replicas, namespace) -> Decision:
        matched = self._tree.match(token_ids, namespace)

        def need(r: ReplicaLoad) -> int:
            return len(token_ids) - matched.get(r.replica_id, 0)

        roomy = [r for r in replicas if r.kv_room is None or r.kv_room >= need(r)]
        if not roomy:
            best = max(replicas, key=lambda r: (r.kv_room or 0, r.replica_id))
            return Decision(best.replica_id, matched.get(best.replica_id, 0), "kv_room")
        return super()._choose(token_ids, roomy, namespace)

    def _spread_key(self, r: ReplicaLoad, claimed: int) -> Any:
        return (-(r.kv_room or 0), claimed)


_POLICIES = {
    cls.name: cls
    for cls in (CacheAwarePolicy, KVAwarePolicy, RoundRobinPolicy, PowerOfTwoPolicy, RandomPolicy)
}


def make_policy(name: str | None = None, **cfg: Any) -> RoutingPolicy:
    """Build a policy by name (`--router-policy`) with PolicyConfig fields as keywords."""
    name = name or cfg.pop("policy", "cache_aware")
    cfg.pop("policy", None)
    return policy_from_config(PolicyConfig(policy=name, **cfg))


def policy_from_config(config: PolicyConfig) -> RoutingPolicy:
    return _POLICIES[config.policy](config)
