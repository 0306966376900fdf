"""RoutingState (the ingress's routing view, no Ray) and the router flags: exact choices after
dispatches, completions, replica reports and removals."""

import pytest
from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest

from radixserve.cluster.config import ServerArgs, parse_cli
from radixserve.router.routing.policy import Decision, PolicyConfig
from radixserve.router.routing.request_router import Prompt, routed_prompt
from radixserve.router.routing.routing_state import PROVISIONAL_TTL_S, RoutingState, routing_state
from radixserve.workers.protocol import ReplicaStats

SYSTEM = list(range(1000, 1300))  # a 300-token shared prefix


def prompt(tail: int) -> list[int]:
    return SYSTEM + [tail, tail + 1, tail + 2]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_state(*replicas, clock=None) -> RoutingState:
    state = RoutingState(PolicyConfig(), clock=clock or Clock())
    state.set_replicas(replicas)
    return state


def test_dispatch_then_affinity_and_completion():
    state = make_state("a", "b")
    assert state.choose(prompt(1), ["a", "b"]) == Decision("a", 0, "cache_miss")
    state.on_dispatch("r1", prompt(1), "a")
    assert state.snapshot()["in_flight"] == {"a": 1}
    assert state.choose(prompt(9), ["a", "b"]) == Decision("a", 300, "cache_hit")
    state.on_complete("r1", "a")
    assert state.snapshot()["in_flight"] == {"a": 0}


def test_route_records_at_once_so_a_burst_stays_together():
    state = make_state("a", "b")
    # Two requests of a new prefix, routed before either replica accepted anything.
    assert state.route("r1", prompt(1), ["a", "b"]) == Decision("a", 0, "cache_miss")
    assert state.route("r2", prompt(2), ["a", "b"]) == Decision("a", 300, "cache_hit")
    assert state.snapshot()["in_flight"] == {"a": 2}
    state.on_dispatch("r1", prompt(1), "a")  # confirmations change nothing
    state.on_dispatch("r2", prompt(2), "a")
    assert state.snapshot()["in_flight"] == {"a": 2}


def test_dispatch_elsewhere_moves_the_record_and_a_retry_replaces_it():
    state = make_state("a", "b")
    state.route("r1", prompt(1), ["a", "b"])  # chose "a" ...
    state.on_dispatch("r1", prompt(1), "b")  # ... but Serve placed it on "b"
    assert state.snapshot()["in_flight"] == {"a": 0, "b": 1}
    state.on_complete("r1", "b")
    state.route("r2", [5] * 10, ["a"])
    state.route("r2", [5] * 10, ["b"])  # Serve asks again: the first record is undone
    assert state.snapshot()["in_flight"] == {"a": 0, "b": 1}


def test_unconfirmed_routes_expire():
    clock = Clock()
    state = make_state("a", "b", clock=clock)
    state.route("r1", prompt(1), ["a", "b"])  # cancelled before Serve placed it
    state.route("r2", [9] * 10, ["a", "b"])
    state.on_dispatch("r2", [9] * 10, "b")
    clock.now = PROVISIONAL_TTL_S + 1
    state.route("r3", [8] * 10, ["a", "b"])
    assert state.snapshot()["in_flight"] == {"a": 1, "b": 1}  # r3 on "a"; r1 forgotten


def test_end_of_a_refused_attempt_elsewhere_is_ignored():
    state = make_state("a", "b")
    state.on_dispatch("r1", prompt(1), "b")  # "a" refused it first; its end arrives late
    state.on_complete("r1", "a")
    assert state.snapshot()["in_flight"] == {"b": 1}
    state.on_complete("r1", "b")
    state.on_complete("r1", "b")  # exactly once
    assert state.snapshot()["in_flight"] == {"b": 0}


def test_summary_replaces_claims_but_keeps_running_prompts():
    state = make_state("a", "b")
    state.on_dispatch("r1", prompt(1), "a")
    state.on_complete("r1", "a")
    state.on_dispatch("r2", [7] * 80, "a")  # still running: the report predates its insert
    point = state.sync_point()
    other = list(range(5000, 5100))
    assert state.apply_report(ReplicaStats(replica_id="a", kv_total=4096), [(None, other)], point)
    # prompt(1) left "a"'s claims; "a" still runs r2, so the idle "b" takes the miss.
    assert state.choose(prompt(2), ["a", "b"]) == Decision("b", 0, "cache_miss")
    assert state.choose(other + [1], ["a", "b"]) == Decision("a", 100, "cache_hit")
    assert state.choose([7] * 80 + [1], ["a", "b"]) == Decision("a", 80, "cache_hit")
    assert state.snapshot()["summaries_applied_total"] == 1


def test_requests_and_reports_keep_their_namespaces():
    state = make_state("a", "b")
    assert state.route("r1", prompt(1), ["a", "b"], "acme") == Decision("a", 0, "cache_miss")
    state.on_dispatch("r1", prompt(1), "a", "acme")
    assert state.choose(prompt(2), ["a", "b"], "acme") == Decision("a", 300, "cache_hit")
    assert state.choose(prompt(2), ["a", "b"]) == Decision("b", 0, "cache_miss")
    # a's report lists a shared prefix only; the running acme prompt still counts as a's.
    point = state.sync_point()
    shared = list(range(7000, 7100))
    assert state.apply_report(ReplicaStats(replica_id="a"), [(None, shared)], point)
    assert state.choose(prompt(2), ["a", "b"], "acme") == Decision("a", 300, "cache_hit")
    assert state.choose(shared, ["a", "b"], "acme") == Decision("b", 0, "cache_miss")
    assert state.choose(shared, ["a", "b"]) == Decision("a", 100, "cache_hit")
    state.on_complete("r1", "a")  # recorded in acme's tree, where it ran
    state.apply_report(ReplicaStats(replica_id="a"), [(None, shared)], state.sync_point())
    assert state.choose(prompt(2), ["a", "b"], "acme") == Decision("b", 0, "cache_miss")


def test_claims_made_after_the_sync_point_survive_the_report():
    state = make_state("a", "b")
    point = state.sync_point()
    state.on_dispatch("r1", prompt(1), "a")
    state.on_complete("r1", "a")
    state.apply_report(ReplicaStats(replica_id="a"), [], point)
    assert state.choose(prompt(2), ["a", "b"]) == Decision("a", 300, "cache_hit")


def test_report_capacity_bounds_the_tree():
    state = make_state("a")
    state.apply_report(ReplicaStats(replica_id="a", kv_total=200), None, state.sync_point())
    state.on_dispatch("r1", prompt(1), "a")
    assert state.snapshot()["tree_tokens_by_replica"] == {"a": 200}


def test_reports_count_as_load_until_they_expire():
    clock = Clock()
    state = make_state("a", "b", clock=clock)
    state.apply_report(ReplicaStats(replica_id="a", running=100, queued=20), None, 0)
    loads = {x.replica_id: x.load for x in state.loads(["a", "b"])}
    assert loads == {"a": 120, "b": 0}
    assert state.choose(prompt(1), ["a", "b"]) == Decision("b", 0, "imbalance")  # 120 - 0 > 64
    clock.now = state.report_ttl_s + 1
    assert {x.replica_id: x.load for x in state.loads(["a", "b"])} == {"a": 0, "b": 0}


def test_removed_replica_leaves_the_policy_and_cannot_come_back():
    state = make_state("a", "b")
    state.on_dispatch("r1", prompt(1), "a")
    state.on_dispatch("r2", prompt(2), "b")
    state.set_replicas(["b", "c"])  # Serve's update: "a" is gone, "c" is new
    snap = state.snapshot()
    assert snap["replicas"] == ["b", "c"] and snap["replicas_removed_total"] == 1
    assert "a" not in snap["in_flight"] and "a" not in snap["tree_tokens_by_replica"]
    # Late news about "a" changes nothing.
    state.on_complete("r1", "a")
    state.on_dispatch("r3", prompt(3), "a")
    assert not state.apply_report(ReplicaStats(replica_id="a"), [(None, prompt(1))], 0)
    assert "a" not in state.snapshot()["tree_tokens_by_replica"]
    state.remove_replica("b")  # Serve saw its actor die
    snap = state.snapshot()
    assert snap["replicas"] == ["c"] and snap["replicas_removed_total"] == 2
    assert state.choose(prompt(4), ["c"]) == Decision("c", 0, "cache_miss")


def test_states_are_shared_per_deployment_key():
    a = routing_state("test-app/EngineReplica", PolicyConfig(policy="round_robin"))
    assert routing_state("test-app/EngineReplica", PolicyConfig()) is a
    assert a.policy.name == "round_robin" and not a.uses_prefix_tree


def pending(method: str, *args, **kwargs) -> PendingRequest:
    return PendingRequest(list(args), kwargs, RequestMetadata("id", "internal", call_method=method))


async def test_routed_prompt_only_from_generate_calls():
    # Serve's PendingRequest makes an asyncio.Future: it lives on a running loop, as in Serve.
    assert routed_prompt(pending("generate", {"input_ids": [1, 2], "rid": "x"})) == Prompt(None, [1, 2])
    assert routed_prompt(pending("generate", request={"input_ids": [3]})) == Prompt(None, [3])
    tenant = {"input_ids": [4], "namespace": "acme"}
    assert routed_prompt(pending("generate", tenant)) == Prompt("acme", [4])
    assert routed_prompt(pending("generate", {"input_ids": [4], "namespace": 7})) == Prompt(None, [4])
    assert routed_prompt(pending("model_card")) is None
    assert routed_prompt(pending("generate", {"input_ids": []})) is None
    assert routed_prompt(None) is None


def test_router_flags():
    a = parse_cli(
        [
            "--dp",
            "2",
            "--router-policy",
            "power_of_two",
            "--cache-threshold",
            "0.5",
            "--min-match-tokens",
            "16",
            "--load-cost-tokens",
            "0",
            "--balance-abs-threshold",
            "8",
            "--balance-rel-threshold",
            "2",
            "--lower-tier-weight",
            "0.25",
            "--lora-affinity-load",
            "3",
            "--router-sync-interval-s",
            "2.5",
        ]
    )
    assert a.policy_kwargs() == {
        "policy": "power_of_two",
        "cache_threshold": 0.5,
        "min_match_tokens": 16,
        "load_cost_tokens": 0,
        "balance_abs_threshold": 8,
        "balance_rel_threshold": 2.0,
        "lower_tier_weight": 0.25,
        "lora_affinity_load": 3,
    }
    assert a.router.router_sync_interval_s == 2.5
    assert ServerArgs.from_dict({"dp": 2}).policy_kwargs()["policy"] == "cache_aware"
    assert ServerArgs.from_dict({"dp": 1}).policy_kwargs()["policy"] == "round_robin"
    with pytest.raises(ValueError, match="unknown router policy"):
        ServerArgs.from_dict({"router_policy": "fastest"})
    with pytest.raises(ValueError, match="cache_threshold"):
        ServerArgs.from_dict({"cache_threshold": 1.5})
    with pytest.raises(ValueError, match="min_match_tokens"):
        ServerArgs.from_dict({"min_match_tokens": -1})
    with pytest.raises(SystemExit):
        parse_cli(["--router-policy", "fastest"])
